"""Importing into a dataset that exists is explicit (issue 27, item 6).

`kvdata import <kind> SRC DATASET` refuses, in one line naming DATASET and both options, when
DATASET holds a dataset; `--append` writes only the keys it lacks (keys it has are kept as
they are, and records must have the fields its records have); `--overwrite` replaces its
contents (fields, classes and order those of the new import alone). Summaries count keys
added, overwritten, kept and removed. A key deleted with `kvdata rm` comes back only when the
source holds it, and is then "added". Run as the installed script, for the folder importer
and for parquet, wds and caffe.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

import kvdata
from kvdata.errors import ConfigError
from kvdata.importers.folder import import_folder

from helpers.cli import Cli
from helpers.wire import datum_bytes, write_caffe_lmdb


def _png(path: Path, seed: int, size: tuple[int, int] = (8, 6)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    px = np.random.default_rng(seed).integers(0, 255, size=(size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(px).save(path)


def _tree(root: Path, names: list[str]) -> Path:
    for i, name in enumerate(names):
        _png(root / name, i)
    return root


NAMES = ["cat/0.png", "cat/1.png", "cat/2.png", "dog/0.png", "dog/1.png", "dog/2.png"]


def _records(ds: Path) -> dict[str, dict[str, Any]]:
    with kvdata.open(ds) as store:
        return {k: {f: np.asarray(v).copy() if isinstance(v, np.ndarray) else v for f, v in store[k].items()}
                for k in store.keys()}


def _info(cli: Cli, ds: Path) -> dict[str, Any]:
    return cli.ok("info", ds, "--json").json()


def _snapshot(ds: Path) -> dict[str, tuple[int | None, bytes | None]]:
    """Every file of the dataset: its size (but the open tail's: an LMDB file keeps the pages a
    write that was rolled back grew it by) and manifest.json's bytes; after a first read made
    the reader registry's lock file."""
    with kvdata.open(ds) as store:
        len(store)
    return {str(p.relative_to(ds)): (None if p.name.startswith("tail-") else p.stat().st_size,
                                     p.read_bytes() if p.name == "manifest.json" else None)
            for p in sorted(ds.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- refused without a mode


KINDS: dict[str, list[str]] = {
    "folder": ["import", "folder", "{dir}", "{ds}"],
    "listfile": ["import", "listfile", "{file}", "{ds}", "--root", "{dir}"],
    "caffe": ["import", "caffe", "{dir}", "{ds}"],
    "hf": ["import", "hf", "{dir}", "{ds}"],
    "parquet": ["import", "parquet", "{file}", "{ds}"],
    "wds": ["import", "wds", "{file}", "{ds}"],
    "tfrecord": ["import", "tfrecord", "{file}", "{ds}"],
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_importer_refuses_an_existing_dataset_in_one_line(cli: Cli, tmp_path: Path, kind: str) -> None:
    ds = tmp_path / "data.kv"
    (tmp_path / "a.bin").write_bytes(b"alpha")
    cli.ok("put", ds, tmp_path / "a.bin")
    before = _snapshot(ds)
    (tmp_path / "src").mkdir()
    (tmp_path / "src.file").write_bytes(b"")  # refused before the source is read
    argv = [a.format(dir=tmp_path / "src", file=tmp_path / "src.file", ds=ds) for a in KINDS[kind]]
    line = cli.fail(*argv, names=[str(ds), "already holds a dataset", "--append", "--overwrite"])
    assert line.count("kvdata: error:") == 1
    assert _snapshot(ds) == before


def test_the_issue_s_plain_reimport_is_refused(cli: Cli, tmp_path: Path) -> None:
    """A plain `import folder` over a `--decode rgb --resize` import: refused, nothing changed,
    and the key removed with `kvdata rm` stays removed."""
    src = _tree(tmp_path / "src", NAMES)
    ds = tmp_path / "ds"
    cli.ok("import", "folder", src, ds, "--decode", "rgb", "--resize", "4x4")
    cli.ok("rm", ds, "cat/1.png")
    before = _snapshot(ds)
    cli.fail("import", "folder", src, ds, names=[str(ds), "--append", "--overwrite"])
    cli.fail("import", "folder", src, ds, "--workers", "2", names=[str(ds), "--append", "--overwrite"])
    assert _snapshot(ds) == before
    assert "cat/1.png" not in cli.ok("ls", ds).lines()


def test_python_api_refuses_too_and_checks_the_setting(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src", NAMES[:2])
    import_folder(src, tmp_path / "ds", progress=False)
    with pytest.raises(ConfigError, match="already holds a dataset"):
        import_folder(src, tmp_path / "ds", progress=False)
    with pytest.raises(ConfigError, match="existing: must be"):
        import_folder(src, tmp_path / "ds", progress=False, existing="replace")
    s = import_folder(src, tmp_path / "ds", progress=False, existing="overwrite")
    assert (s["mode"], s["added"], s["overwritten"], s["removed"]) == ("overwrite", 0, 2, 0)


def test_append_and_overwrite_exclude_each_other(cli: Cli, tmp_path: Path) -> None:
    src = _tree(tmp_path / "src", NAMES[:1])
    r = cli.run("import", "folder", src, tmp_path / "ds", "--append", "--overwrite")
    assert r.rc == 2 and "--append and --overwrite exclude each other" in r.err, str(r)
    assert not (tmp_path / "ds").exists()


def test_a_mode_into_a_new_dataset_makes_it(cli: Cli, tmp_path: Path) -> None:
    src = _tree(tmp_path / "src", NAMES)
    for mode, workers in (("--append", "0"), ("--overwrite", "2")):
        ds = tmp_path / f"new{mode}"
        s = cli.ok("import", "folder", src, ds, mode, "--workers", workers, "--json").json()
        assert (s["mode"], s["imported"], s["added"], s["overwritten"], s["kept"], s["removed"]) == \
            ("new", 6, 6, 0, 0, 0)
        assert s["writers"] == int(workers) or (s["writers"] == 1 and workers == "0")


# ---------------------------------------------------------------- --append


@pytest.mark.parametrize("workers", ["0", "2"])
def test_append_adds_only_the_new_keys_and_keeps_the_rest_as_they_are(cli: Cli, tmp_path: Path, workers: str) -> None:
    src = _tree(tmp_path / "src", NAMES)
    ds = tmp_path / "ds"
    opts = ["--decode", "rgb", "--resize", "4x4"]
    cli.ok("import", "folder", src, ds, *opts)
    old = _records(ds)
    _png(src / "cat" / "0.png", 99)  # changed since: an append leaves the record as it was
    _png(src / "dog" / "3.png", 100)  # new
    _png(src / "loose.png", 101)  # new, unlabelled: fields {image}, a subset of the dataset's
    s = cli.ok("import", "folder", src, ds, *opts, "--append", "--workers", workers, "--json").json()
    assert (s["mode"], s["imported"], s["added"], s["overwritten"], s["kept"], s["removed"]) == \
        ("append", 2, 2, 0, 6, 0)
    assert s["writers"] == 1  # into a dataset that has records: one writer
    new = _records(ds)
    assert list(new)[:6] == list(old) and sorted(list(new)[6:]) == ["dog/3.png", "loose.png"]
    for k in old:
        assert new[k].keys() == old[k].keys()
        for f in old[k]:
            np.testing.assert_array_equal(new[k][f], old[k][f], err_msg=k)
    assert new["dog/3.png"]["label"] == 1 and "label" not in new["loose.png"]
    assert cli.ok("verify", ds, "--json").json()["ok"]
    again = cli.ok("import", "folder", src, ds, *opts, "--append").text
    assert again.startswith(f"imported 0 images into {ds} (0 added, 0 overwritten, 8 already there kept;"), again


def test_append_refuses_records_with_other_fields_before_writing(cli: Cli, tmp_path: Path) -> None:
    src = _tree(tmp_path / "src", NAMES)
    ds = tmp_path / "ds"
    cli.ok("import", "folder", src, ds, "--decode", "rgb", "--resize", "4x4")
    _png(src / "dog" / "3.png", 100)
    before = _snapshot(ds)
    # the issue's mix: PNG bytes beside decoded arrays
    cli.fail("import", "folder", src, ds, "--append", names=[str(ds), "'dog/3.png'", "image: bytes",
                                                             "image: |u1 array 3-d", "--overwrite"])
    assert _snapshot(ds) == before
    classes = tmp_path / "other"
    _tree(classes, ["bird/0.png"])  # other class folders: refused too
    cli.fail("import", "folder", classes, ds, "--decode", "rgb", "--append", names=[str(ds), "classes"])
    assert _snapshot(ds) == before


def test_a_removed_key_comes_back_only_from_the_source_and_is_counted_as_added(cli: Cli, tmp_path: Path) -> None:
    src = _tree(tmp_path / "src", NAMES)
    ds = tmp_path / "ds"
    cli.ok("import", "folder", src, ds, "--no-shuffle")
    cli.ok("rm", ds, "cat/1.png", "dog/2.png")
    (src / "dog" / "2.png").unlink()  # gone from the source too: stays gone
    s = cli.ok("import", "folder", src, ds, "--append", "--json").json()
    assert (s["added"], s["overwritten"], s["kept"]) == (1, 0, 4)
    keys = cli.ok("ls", ds).lines()
    assert "dog/2.png" not in keys and keys[-1] == "cat/1.png" and len(keys) == 5
    text = cli.ok("import", "folder", src, ds, "--append").text  # nothing left to add
    assert "0 added, 0 overwritten, 5 already there kept" in text


# ---------------------------------------------------------------- --overwrite


def test_overwrite_replaces_contents_fields_classes_and_order(cli: Cli, tmp_path: Path) -> None:
    src = _tree(tmp_path / "src", NAMES)
    ds = tmp_path / "ds"
    cli.ok("import", "folder", src, ds, "--decode", "rgb", "--resize", "4x4")
    (src / "cat" / "2.png").unlink()
    _png(src / "cow" / "0.png", 50)
    s = cli.ok("import", "folder", src, ds, "--overwrite", "--seed", "3", "--json").json()
    assert (s["mode"], s["imported"], s["added"], s["overwritten"], s["kept"], s["removed"]) == \
        ("overwrite", 6, 1, 5, 0, 1)
    fresh = tmp_path / "fresh"
    cli.ok("import", "folder", src, fresh, "--seed", "3")
    assert cli.ok("ls", ds, "-l").lines() != [] and cli.ok("ls", ds).lines() == cli.ok("ls", fresh).lines()
    info, want = _info(cli, ds), _info(cli, fresh)
    assert info["fields"] == want["fields"] == {"image": {"type": "bytes"}, "label": {"type": "int"}}
    assert info["classes"] == 3 and info["samples"] == 6
    with kvdata.open(ds) as a, kvdata.open(fresh) as b:
        assert a.classes == b.classes == ["cat", "cow", "dog"]
        assert a.labels.tolist() == b.labels.tolist()
        for k in b.keys():
            assert bytes(a[k]["image"]) == bytes(b[k]["image"]) and a[k]["label"] == b[k]["label"]
    assert cli.ok("verify", ds, "--json").json()["ok"]
    text = cli.ok("import", "folder", src, ds, "--overwrite").text
    assert text.startswith(f"imported 6 images into {ds} (0 added, 6 overwritten; 3 classes"), text


@pytest.mark.parametrize("mode", ["--overwrite", "--append"])
def test_an_import_that_fails_leaves_the_dataset_as_it_was(cli: Cli, tmp_path: Path, mode: str) -> None:
    """Not a file more or less: also the shards it sealed (small shards) and the tails it started."""
    src = _tree(tmp_path / "src", NAMES)
    ds = tmp_path / "ds"
    cli.ok("import", "folder", src, ds, "--decode", "rgb")
    for i in range(30):
        _png(src / "dog" / f"5{i:02d}.png", 200 + i, size=(32, 32))
    (src / "dog" / "9.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")  # last in key order
    before, records = _snapshot(ds), _records(ds)
    cli.fail("import", "folder", src, ds, "--decode", "rgb", mode, "--no-shuffle", "--shard-size", "16KB",
             names=["9.png"])
    assert _snapshot(ds) == before
    after = _records(ds)
    assert list(after) == list(records)
    for k in records:
        np.testing.assert_array_equal(after[k]["image"], records[k]["image"])
    assert not (ds / "lost+found").exists()
    assert cli.ok("verify", ds, "--json").json()["ok"]


# ---------------------------------------------------------------- other importers


def _parquet(path: Path, keys: list[str], x: Any) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"key": keys, "x": x, "blob": [k.encode() * 3 for k in keys]}), path)
    return path


def test_parquet_refuses_appends_and_overwrites(cli: Cli, tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    first = _parquet(tmp_path / "a.parquet", ["k0", "k1", "k2"], [0, 1, 2])
    cli.ok("import", "parquet", first, ds, "--key", "key")
    cli.ok("rm", ds, "k1")
    more = _parquet(tmp_path / "b.parquet", ["k1", "k2", "k3"], [10, 20, 30])
    cli.fail("import", "parquet", more, ds, "--key", "key", names=[str(ds), "--append", "--overwrite"])
    s = cli.ok("import", "parquet", more, ds, "--key", "key", "--append", "--json").json()
    assert (s["mode"], s["imported"], s["added"], s["overwritten"], s["kept"]) == ("append", 2, 2, 0, 1)
    got = _records(ds)
    assert list(got) == ["k0", "k2", "k1", "k3"]
    assert [got[k]["x"] for k in got] == [0, 2, 10, 30]  # k2 kept as it was, k1 back from the source
    floats = _parquet(tmp_path / "c.parquet", ["k9"], [1.5])  # x: double, not int64
    before = _snapshot(ds)
    cli.fail("import", "parquet", floats, ds, "--key", "key", "--append", names=[str(ds), "'k9'", "x: float"])
    assert _snapshot(ds) == before
    s = cli.ok("import", "parquet", floats, ds, "--key", "key", "--overwrite", "--json").json()
    assert (s["mode"], s["added"], s["overwritten"], s["removed"]) == ("overwrite", 1, 0, 4)
    assert _records(ds) == {"k9": {"x": 1.5, "blob": b"k9k9k9"}}  # the --key column is only the key
    assert _info(cli, ds)["fields"]["x"] == {"type": "float"}
    line = cli.ok("import", "parquet", floats, ds, "--key", "key", "--overwrite").text
    assert "(0 added, 1 overwritten; " in line


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_wds_appends_and_overwrites(cli: Cli, tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    one = _tar(tmp_path / "one.tar", {"a.txt": b"A", "a.cls": b"1", "b.txt": b"B", "b.cls": b"2"})
    cli.ok("import", "wds", one, ds)
    two = _tar(tmp_path / "two.tar", {"b.txt": b"B2", "b.cls": b"5", "c.txt": b"C", "c.cls": b"3"})
    cli.fail("import", "wds", two, ds, names=[str(ds), "--append", "--overwrite"])
    r = cli.ok("import", "wds", two, ds, "--append")
    # cls is the field label; the classes are numbered "0".."3" once label 3 is appended
    assert "(1 added, 0 overwritten, 1 already there kept; 4 classes, 0 skipped)" in r.text, r.text
    assert {k: (v["txt"], v["label"]) for k, v in _records(ds).items()} == {"a": ("A", 1), "b": ("B", 2), "c": ("C", 3)}
    assert _info(cli, ds)["classes"] == 4
    other = _tar(tmp_path / "other.tar", {"d.json": b"{}"})
    cli.fail("import", "wds", other, ds, "--append", names=[str(ds), "'d'", "json: str"])
    s = cli.ok("import", "wds", two, ds, "--overwrite", "--json").json()
    assert (s["added"], s["overwritten"], s["removed"]) == (0, 2, 1)
    assert {k: v["txt"] for k, v in _records(ds).items()} == {"b": "B2", "c": "C"}


def test_caffe_appends_and_overwrites(cli: Cli, tmp_path: Path) -> None:
    pytest.importorskip("lmdb")

    def raw(i: int) -> bytes:
        px = np.full((3, 2, 2), i, np.uint8)  # CHW
        return datum_bytes(channels=3, height=2, width=2, data=px.tobytes(), label=i, encoded=False)

    write_caffe_lmdb(tmp_path / "one", [("a.jpg", raw(1)), ("b.jpg", raw(2))])
    write_caffe_lmdb(tmp_path / "two", [("a.jpg", raw(7)), ("c.jpg", raw(3))])  # keys 00000000_a.jpg, 00000001_c.jpg
    ds = tmp_path / "ds"
    cli.ok("import", "caffe", tmp_path / "one", ds)
    cli.fail("import", "caffe", tmp_path / "two", ds, names=[str(ds), "--append", "--overwrite"])
    s = cli.ok("import", "caffe", tmp_path / "two", ds, "--append", "--json").json()
    assert (s["added"], s["overwritten"], s["kept"]) == (1, 0, 1)
    got = _records(ds)
    assert [int(v["label"]) for v in got.values()] == [1, 2, 3]
    s = cli.ok("import", "caffe", tmp_path / "two", ds, "--overwrite", "--json").json()
    assert (s["added"], s["overwritten"], s["removed"]) == (0, 2, 1)
    assert [int(v["label"]) for v in _records(ds).values()] == [7, 3]
