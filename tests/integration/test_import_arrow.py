"""`kvdata import parquet|hf`: Parquet files written by pyarrow and datasets saved by Hugging Face
`datasets`, imported and compared record for record; bad input fails with one clear line and
leaves the dataset as it was. Also Store.set_extra, where the hf importer keeps split and features.
"""

from __future__ import annotations

import datetime
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata import format as fmt
from kvdata.errors import ConfigError, InvalidValueError

# ---------------------------------------------------------------- Store.set_extra


def test_set_extra_is_committed_kept_by_later_commits_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "ds"
    with kvdata.open(path, "a") as s:
        s.put("a", {"x": 1})
        s.set_extra("import", {"kind": "hf", "split": "train"})
        s.commit()
    with kvdata.open(path, "a") as s:
        assert s.manifest.extra == {"import": {"kind": "hf", "split": "train"}}
        s.put("b", {"x": 2})
        s.commit()  # a later writer that does not set it keeps it
        for name, value in (("count", 1), ("", 1), ("x", float("nan")), ("y", object()), ("z", [[[[[[[[[[[[[[[[
                [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]])):
            with pytest.raises(InvalidValueError, match="manifest key"):
                s.set_extra(name, value)
        s.set_extra("import", {"kind": "parquet"})
    assert json.loads((path / "manifest.json").read_text())["import"] == {"kind": "parquet"}
    with pytest.raises(RuntimeError), kvdata.open(path, "a") as s:  # an aborted writer drops it
        s.set_extra("import", {"kind": "other"})
        raise RuntimeError
    with kvdata.open(path) as r:
        assert r.manifest.extra == {"import": {"kind": "parquet"}} and len(r) == 2


# ---------------------------------------------------------------- inputs written by the real libraries

def _png(i: int, h: int = 6, w: int = 5) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(i)
    b = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8)).save(b, "PNG")
    return b.getvalue()


def _pixels(data: bytes, mode: str = "RGB") -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        a = np.asarray(im.convert(mode))
    return a if a.ndim == 3 else a[:, :, None]


def _table(n: int, start: int = 0) -> Any:
    """Every kind of column the importer keeps, nulls included."""
    pa = pytest.importorskip("pyarrow")
    rows = range(start, start + n)
    return pa.table({
        "id": [f"rec-{i}" for i in rows],
        "i8": pa.array([i % 100 - 50 for i in rows], pa.int8()),
        "u64": pa.array([(1 << 63) + i for i in rows], pa.uint64()),
        "i64": pa.array([None if i % 7 == 3 else -(i << 40) for i in rows], pa.int64()),
        "f16": pa.array([i / 4 for i in rows], pa.float16()),
        "f32": pa.array([i / 3 for i in rows], pa.float32()),
        "f64": [i * 1.5 for i in rows],
        "flag": [i % 3 == 0 for i in rows],
        "name": [None if i % 11 == 5 else f"name {i} ü" for i in rows],
        "cat": pa.array([["a", "b", "c"][i % 3] for i in rows]).dictionary_encode(),
        "raw": [bytes([i % 256]) * (i % 5) for i in rows],
        "vec": pa.array([None if i % 13 == 4 else [float(i)] * (i % 4) for i in rows], pa.list_(pa.float32())),
        "fix": pa.array([[i, i + 1, i + 2] for i in rows], pa.list_(pa.int16(), 3)),
        "mat": [[[i, -i], [i * 2, 7]] for i in rows],
        "day": pa.array([datetime.date(2024, 1, 1) + datetime.timedelta(days=i) for i in rows], pa.date32()),
        "y": pa.array([i % 4 for i in rows], pa.int32()),
        "png": [_png(i) for i in rows],
    })


def _expected(row: dict[str, Any]) -> dict[str, Any]:
    """A pyarrow row as the importer stores it with key="id", label="y" (images as their bytes):
    the key column is only the key, the label column is the field 'label' and the one image
    column the field 'image' (docs/CLI.md, "Field names and classes"), in column order."""
    names = {"y": "label", "png": "image"}
    out = {names.get(k, k): v for k, v in row.items() if k != "id"}
    out["day"] = row["day"].isoformat()
    for name, dtype in (("vec", np.float32), ("fix", np.int16), ("mat", np.int64)):
        out[name] = None if row[name] is None else np.asarray(row[name], dtype=dtype)
    return out


def _same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert list(got) == list(want), where
    for name, w in want.items():
        g = got[name]
        if isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray) and g.dtype == w.dtype and g.shape == w.shape, (where, name, g, w)
            assert np.array_equal(g, w), (where, name)
        elif isinstance(w, bytes):
            assert bytes(g) == w, (where, name)
        else:
            assert g == w and type(g) is type(w), (where, name, g, w)


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two Parquet files in a directory (the first in several row groups) and a stray text file."""
    pq = pytest.importorskip("pyarrow.parquet")
    d = tmp_path_factory.mktemp("parquet")
    pq.write_table(_table(300), d / "part-0.parquet", row_group_size=70)
    (d / "more").mkdir()
    pq.write_table(_table(40, start=300), d / "more" / "part-1.parquet")
    (d / "README.txt").write_text("not parquet")
    return d


def _rows(*paths: Path) -> list[dict[str, Any]]:
    pq = pytest.importorskip("pyarrow.parquet")
    return [r for p in paths for r in pq.read_table(p).to_pylist()]


def test_parquet_round_trip_record_for_record(parquet_dir: Path, tmp_path: Path) -> None:
    from kvdata.importers.arrow import import_parquet

    summary = import_parquet([parquet_dir], tmp_path / "ds", key="id", label="y", progress=False)
    want = _rows(parquet_dir / "more" / "part-1.parquet", parquet_dir / "part-0.parquet")  # sorted names: more/ first
    assert summary["imported"] == len(want) == 340 and summary["skipped"] == 0 and summary["bad"] == []
    assert summary["classes"] == 4 and summary["columns"]["image"] == "image" and summary["columns"]["mat"] == "array"
    assert summary["columns"]["label"] == "int" and not {"id", "y", "png"} & set(summary["columns"])
    with kvdata.open(tmp_path / "ds") as store:
        assert list(store.keys()) == [r["id"] for r in want]
        assert store.labels.tolist() == [r["y"] for r in want]
        for i, row in enumerate(want):
            _same(store[i], _expected(row), row["id"])
        assert store.fields["fix"] == {"type": "array", "dtype": "<i2", "shape": [3]}
        extra = store.manifest.extra["import"]
        assert extra["kind"] == "parquet" and extra["schema"]["fix"] == "fixed_size_list<element: int16>[3]"
        assert extra["rows"] == 340


def test_parquet_generated_keys_columns_subset_and_images_decoded(parquet_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdata.importers import arrow

    f = parquet_dir / "part-0.parquet"
    for name, workers, region in (("w0", 0, None), ("w2", 2, None), ("w2-pickled", 2, 256)):
        if region is not None:  # pixels that do not fit the workers' shared ring come back pickled
            monkeypatch.setattr(arrow, "REGION_BYTES", region)
        summary = arrow.import_parquet([f], tmp_path / name, columns=["png", "f32"], decode="rgb",
                                       workers=workers, progress=False)
        assert summary["imported"] == 300 and summary["key"] is None and summary["label"] is None
    want = _rows(f)
    with kvdata.open(tmp_path / "w0") as a, kvdata.open(tmp_path / "w2") as b, \
            kvdata.open(tmp_path / "w2-pickled") as c:
        assert list(a.keys()) == list(b.keys()) == list(c.keys()) == [f"part-0/{i:09d}" for i in range(300)]
        for i, row in enumerate(want):
            ra, rb, rc = a[i], b[i], c[i]
            assert list(ra) == ["image", "f32"] and ra["f32"] == row["f32"]  # in --columns order; png is 'image'
            assert np.array_equal(ra["image"], _pixels(row["png"]))
            assert np.array_equal(rb["image"], ra["image"]) and np.array_equal(rc["image"], ra["image"])
        assert (a.labels == fmt.NO_LABEL).all()


def test_struct_image_column_decoded_gray_and_path_only_image_is_bad(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from kvdata.importers.arrow import import_parquet

    images = [{"bytes": _png(i), "path": f"{i}.png"} for i in range(5)] + [None, {"bytes": None, "path": "/etc/passwd"}]
    pq.write_table(pa.table({"image": images, "k": list(range(7))}), tmp_path / "s.parquet")
    with pytest.raises(InvalidValueError, match=r"row 6 \(key 's/000000006'\): column 'image'.*only the path "
                       r"'/etc/passwd'.*--skip-bad"):
        import_parquet([tmp_path / "s.parquet"], tmp_path / "ds", decode="gray", progress=False)
    assert not (tmp_path / "ds").exists()
    summary = import_parquet([tmp_path / "s.parquet"], tmp_path / "ds", decode="gray", skip_bad=True, progress=False)
    assert summary["imported"] == 6 and summary["skipped"] == 1
    assert [b["key"] for b in summary["bad"]] == ["s/000000006"]
    with kvdata.open(tmp_path / "ds") as store:
        assert len(store) == 6 and store[5]["image"] is None and store[5]["k"] == 5
        for i in range(5):
            got = store[i]["image"]
            assert got.shape == (6, 5, 1) and np.array_equal(got, _pixels(images[i]["bytes"], "L"))


# ---------------------------------------------------------------- Hugging Face datasets (save_to_disk)

HF_CLASSES = ["cat", "dog", "bird"]


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A DatasetDict (train 150 rows, test 20) saved by `datasets` itself, and its features as JSON."""
    datasets = pytest.importorskip("datasets", reason="`datasets` is not installed: pip install 'kvdata[hf]'")
    d = tmp_path_factory.mktemp("hf")
    features = datasets.Features({
        "image": datasets.Image(),
        "label": datasets.ClassLabel(names=HF_CLASSES),
        "text": datasets.Value("string"),
        "score": datasets.Value("float32"),
        "tokens": datasets.Sequence(datasets.Value("int32")),
        "grid": datasets.Array2D(shape=(2, 3), dtype="int16"),
    })

    def split(n: int, start: int) -> Any:
        rows = range(start, start + n)
        return datasets.Dataset.from_dict({
            "image": [{"bytes": _png(i, 7, 4), "path": None} for i in rows],
            "label": [-1 if i % 17 == 16 else i % 3 for i in rows],
            "text": [f"sample {i}" for i in rows],
            "score": [i / 8 for i in rows],
            "tokens": [list(range(i % 5)) for i in rows],
            "grid": [np.full((2, 3), i, np.int16) for i in rows],
        }, features=features)

    dd = datasets.DatasetDict({"train": split(150, 0), "test": split(20, 1000)})
    dd.save_to_disk(str(d / "dd"), max_shard_size="20KB")  # several Arrow files per split
    dd["test"].save_to_disk(str(d / "single"))
    return d, features


def _hf_expected(i: int) -> tuple[dict[str, Any], int]:
    label = -1 if i % 17 == 16 else i % 3
    return {"image": _pixels(_png(i, 7, 4)), "label": label, "text": f"sample {i}", "score": float(np.float32(i / 8)),
            "tokens": np.arange(i % 5, dtype=np.int32), "grid": np.full((2, 3), i, np.int16)}, label


def test_hf_dataset_dict_split_round_trip(hf_saved: tuple[Path, Any], tmp_path: Path) -> None:
    import datasets

    from kvdata.importers.arrow import import_hf

    root, features = hf_saved
    assert len(list((root / "dd" / "train").glob("*.arrow"))) > 1
    with pytest.raises(ConfigError, match="holds the splits train, test; choose one with --split"):
        import_hf(root / "dd", tmp_path / "none", progress=False)
    assert not (tmp_path / "none").exists()
    summary = import_hf(root / "dd", tmp_path / "ds", split="train", decode="rgb", workers=2, progress=False)
    assert summary["imported"] == 150 and summary["label"] == "label" and summary["split"] == "train"
    assert summary["classes"] == 3
    with kvdata.open(tmp_path / "ds") as store:
        assert store.classes == HF_CLASSES and len(store) == 150
        assert list(store.keys()) == [f"train/{i:09d}" for i in range(150)]
        for i in range(150):
            want, label = _hf_expected(i)
            _same(store[i], want, f"row {i}")
            assert store.labels[i] == label  # a ClassLabel's -1 ("no label" in HF) stays -1
        extra = store.manifest.extra["import"]
        assert extra["kind"] == "hf" and extra["split"] == "train"
        assert datasets.Features.from_dict(json.loads(extra["features"])) == features  # `datasets` reads it back


def test_hf_single_dataset_kept_bytes_key_column_and_subset(hf_saved: tuple[Path, Any],
                                                            tmp_path: Path) -> None:
    from kvdata.importers.arrow import import_hf

    root, _features = hf_saved
    with pytest.raises(ConfigError, match="--key 'nope'.*has no such column"):
        import_hf(root / "single", tmp_path / "ds", key="nope", progress=False)
    summary = import_hf(root / "single", tmp_path / "ds", key="text", columns=["image", "label"], progress=False)
    assert summary["imported"] == 20 and summary["columns"] == {"image": "image", "label": "int"}
    with kvdata.open(tmp_path / "ds") as store:
        assert list(store.keys()) == [f"sample {i}" for i in range(1000, 1020)]
        r = store.get("sample 1003")
        assert list(r) == ["image", "label"] and bytes(r["image"]) == _png(1003, 7, 4) and r["label"] == 1003 % 3


def test_hf_folder_of_parquet_and_arrow_files_by_split(hf_saved: tuple[Path, Any], tmp_path: Path) -> None:
    """The Hub's layout: data/<split>-*.parquet (HF features in the schema metadata), here next
    to an Arrow IPC *file* (not the stream save_to_disk writes) holding more train rows."""
    import datasets
    import pyarrow as pa

    from kvdata.importers.arrow import import_hf

    root, features = hf_saved
    dd = datasets.load_from_disk(str(root / "dd"))
    (tmp_path / "hub" / "data").mkdir(parents=True)
    dd["train"].select(range(100)).to_parquet(str(tmp_path / "hub" / "data" / "train-00000-of-00002.parquet"))
    dd["test"].to_parquet(str(tmp_path / "hub" / "data" / "test-00000-of-00001.parquet"))
    table = dd["train"].select(range(100, 150)).data.table
    with pa.OSFile(str(tmp_path / "hub" / "data" / "train-00001-of-00002.arrow"), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=30)
    summary = import_hf(tmp_path / "hub", tmp_path / "ds", split="train", decode="rgb", progress=False)
    assert summary["imported"] == 150 and summary["label"] == "label"
    with kvdata.open(tmp_path / "ds") as store:
        assert store.classes == HF_CLASSES
        assert list(store.keys()) == [f"train/{i:09d}" for i in range(150)]
        for i in range(150):
            want, label = _hf_expected(i)
            _same(store[i], want, f"row {i}")
            assert store.labels[i] == label
        assert datasets.Features.from_dict(json.loads(store.manifest.extra["import"]["features"])) == features
    with pytest.raises(ConfigError, match="--split 'valid': no Parquet/Arrow file"):
        import_hf(tmp_path / "hub", tmp_path / "none", split="valid", progress=False)


# ---------------------------------------------------------------- bad input

def test_not_parquet_and_unsupported_column_fail_before_writing(parquet_dir: Path, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from kvdata.importers.arrow import import_parquet

    with pytest.raises(InvalidValueError, match=r"README.txt: not a readable Parquet file .*pass Parquet files only"):
        import_parquet([parquet_dir / "part-0.parquet", parquet_dir / "README.txt"], tmp_path / "ds", progress=False)
    pq.write_table(pa.table({"m": pa.array([{"a": 1}], pa.map_(pa.string(), pa.int64()))}), tmp_path / "m.parquet")
    with pytest.raises(ConfigError, match=r"column 'm' has type map<string, int64.*leave it out with --columns"):
        import_parquet([tmp_path / "m.parquet"], tmp_path / "ds", progress=False)
    pq.write_table(pa.table({"id": ["a"], "y": [1.5]}), tmp_path / "other.parquet")
    with pytest.raises(ConfigError, match=r"other.parquet: has no column 'i8' \(which .*part-0.parquet has\)"):
        import_parquet([parquet_dir / "part-0.parquet", tmp_path / "other.parquet"], tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds").exists()


def test_corrupt_image_fails_all_or_nothing_or_is_skipped_by_key(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from kvdata.importers.arrow import import_parquet

    images = [_png(i) for i in range(600)]
    images[450] = images[450][:40]  # a truncated PNG in the second batch
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(600)], "img": images}), tmp_path / "c.parquet")
    with kvdata.open(tmp_path / "ds", "a") as store:
        store.put("old", {"x": 1})
    for workers in (0, 2):  # (overwrites: their deletes of what the dataset held are discarded too)
        with pytest.raises(InvalidValueError, match=r"row 450 \(key 'k450'\): column 'img': Pillow cannot decode"):
            import_parquet([tmp_path / "c.parquet"], tmp_path / "ds", key="key", decode="rgb", workers=workers,
                           progress=False, existing="overwrite")
        with kvdata.open(tmp_path / "ds") as store:
            assert list(store.keys()) == ["old"]
    summary = import_parquet([tmp_path / "c.parquet"], tmp_path / "ds", key="key", decode="rgb", skip_bad=True,
                             workers=2, progress=False, existing="overwrite")
    assert summary["imported"] == 599 and summary["skipped"] == 1
    assert summary["added"] == 599 and summary["removed"] == 1 and summary["mode"] == "overwrite"
    assert summary["bad"][0]["key"] == "k450" and "Pillow" in summary["bad"][0]["error"]
    with kvdata.open(tmp_path / "ds") as store:  # 3 batches through the workers' two shared regions
        assert len(store) == 599 and "k450" not in store and "old" not in store
        for i in (*range(450), *range(451, 600)):
            assert np.array_equal(store.get(f"k{i}")["image"], _pixels(images[i])), i


def test_lists_with_nulls_inside_or_ragged_rows_are_bad_records(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from kvdata.importers.arrow import import_parquet

    pq.write_table(pa.table({
        "ints": pa.array([[1, 2], [3, None], [], None], pa.list_(pa.int64())),
        "nested": [[[1.0, 2.0]], [[1.0]], [[1.0], [2.0, 3.0]], [[None, 1.0]]],
    }), tmp_path / "n.parquet")
    with pytest.raises(InvalidValueError, match=r"row 1 \(key 'n/000000001'\): column 'ints': a null inside the list"):
        import_parquet([tmp_path / "n.parquet"], tmp_path / "ds", progress=False)
    summary = import_parquet([tmp_path / "n.parquet"], tmp_path / "ds", skip_bad=True, progress=False)
    assert [(b["key"], b["error"].split(":")[0]) for b in summary["bad"]] == [
        ("n/000000001", "column 'ints'"), ("n/000000002", "column 'nested'"), ("n/000000003", "column 'nested'")]
    with kvdata.open(tmp_path / "ds") as store:
        assert len(store) == 1 and store[0]["ints"].tolist() == [1, 2] and store[0]["nested"].shape == (1, 2)


# ---------------------------------------------------------------- the command line

def test_cli_parquet_and_hf_exit_codes_and_json(parquet_dir: Path, hf_saved: tuple[Path, Any],
                                                tmp_path: Path, cli: Any) -> None:
    import datasets

    f = parquet_dir / "part-0.parquet"
    out = cli.ok("import", "parquet", f, "ds", "--key", "id", "--label", "y", "--columns", "id,y,fix",
                 "--json").json()
    # the --label column is the field 'label'; the --key column is a field too only because --columns names it
    assert out["imported"] == 300 and out["columns"] == {"id": "str", "label": "int", "fix": "array"}
    assert out["writers"] == 1  # the folder importer's keys too (docs/CLI.md)
    line = cli.fail("import", "parquet", f, "ds2", "--key", "missing", names=["--key 'missing'", "no such column"])
    assert "Traceback" not in line and not (tmp_path / "ds2").exists()
    cli.fail("import", "parquet", parquet_dir / "README.txt", "ds2", names=["README.txt", "Parquet"])
    text = cli.ok("import", "parquet", f, "ds3", "--columns", "png").text
    assert text.startswith("imported 300 records into ds3")
    # hf through the CLI: a process that never imports `datasets` reads its Arrow files
    root, features = hf_saved
    out = cli.ok("import", "hf", root / "dd", "hf", "--split", "test", "--decode", "gray", "--json").json()
    assert out["imported"] == 20 and out["split"] == "test" and out["classes"] == 3
    with kvdata.open(tmp_path / "hf") as store:
        assert store.get("test/000000003")["image"].shape == (7, 4, 1)
        assert store.get("test/000000003")["grid"].tolist() == [[1003] * 3] * 2
        assert datasets.Features.from_dict(json.loads(store.manifest.extra["import"]["features"])) == features
    cli.fail("import", "hf", root / "dd", "hf2", "--split", "valid", names=["--split 'valid'", "train, test"])
    r = cli.run("import", "hf", root / "dd", "hf2")
    assert r.rc == 1 and r.err.startswith("kvdata: error:")


def test_missing_pyarrow_names_the_extra(tmp_path: Path) -> None:
    code = ("import sys\n"
            "sys.modules['pyarrow'] = None  # as if pyarrow were not installed\n"
            "from kvdata.importers.arrow import import_parquet, import_hf\n"
            "from kvdata.errors import KVDataError\n"
            "for run, extra in ((import_parquet, 'parquet'), (import_hf, 'hf')):\n"
            "    try:\n"
            f"        run([{str(tmp_path)!r}] if extra == 'parquet' else {str(tmp_path)!r}, {str(tmp_path / 'ds')!r})\n"
            "    except KVDataError as e:\n"
            "        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "pip install 'kvdata[parquet]'" in out and "pip install 'kvdata[hf]'" in out
    assert not (tmp_path / "ds").exists()
    subprocess.run([sys.executable, "-c", "import sys, kvdata.cli\nassert 'pyarrow' not in sys.modules"], check=True)
