"""Every `kvdata` command, run as the installed console script: what it prints, what it stores.

stdout and stderr are pipes here, so every successful put/import/verify/reindex
must leave stderr empty (no progress bar in scripts); `--json` must parse.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata

from helpers.cli import Cli

COMMANDS = [
    [], ["put"], ["get"], ["ls"], ["info"], ["rm"], ["verify"], ["reindex"],
    ["import"], ["import", "folder"], ["import", "listfile"], ["demo"],
]


def _write(path: Path, n: int, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def _contents(ds: Path) -> dict[str, bytes]:
    """key -> bytes of every (byte) record, in sample order, through the Python API."""
    with kvdata.open(ds) as store:
        return {k: bytes(store[k]) for k in store.keys()}


def _keys(cli: Cli, ds: Path) -> list[str]:
    return cli.ok("ls", ds).lines()


# ---------------------------------------------------------------- help


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: "-".join(c) or "main")
def test_every_command_has_help(cli: Cli, cmd: list[str]) -> None:
    r = cli.ok(*cmd, "--help")
    assert r.text.startswith(f"Usage: kvdata {' '.join(cmd)}".rstrip())
    assert "-h, --help" in r.text


def test_short_help_and_version(cli: Cli) -> None:
    assert cli.ok("-h").out == cli.ok("--help").out
    assert kvdata.__version__ in cli.ok("--version").text


# ---------------------------------------------------------------- put / get


def test_put_files_keys_are_file_names_and_get_returns_the_bytes(cli: Cli, tmp_path: Path) -> None:
    a = _write(tmp_path / "in" / "a.bin", 5000, 1)
    b = _write(tmp_path / "in" / "b.dat", 1, 2)
    ds = tmp_path / "ds"
    r = cli.ok("put", ds, tmp_path / "in" / "a.bin", tmp_path / "in" / "b.dat")
    assert r.text == f"put 2 records into {ds} (generation 1)\n"  # what it wrote; no progress bar in scripts
    assert cli.ok("put", ds, tmp_path / "in" / "a.bin", "--quiet").out == b""
    assert list(_contents(ds)) == ["a.bin", "b.dat"]
    assert cli.ok("get", ds, "a.bin").out == a
    assert cli.ok("get", ds, "b.dat").out == b
    out = tmp_path / "out" / "copy.bin"
    out.parent.mkdir()
    r = cli.ok("get", ds, "a.bin", "-o", out)
    assert r.out == b"" and out.read_bytes() == a
    assert sorted(p.name for p in out.parent.iterdir()) == ["copy.bin"]  # no temp file left


def test_put_directory_recursively_keys_are_relative_paths(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "src"
    want = {key: _write(src / key, 100 + i, i) for i, key in enumerate(["a.txt", "sub/b.txt", "sub/deeper/c.bin"])}
    ds = tmp_path / "ds"
    cli.ok("put", ds, src)
    assert _keys(cli, ds) == ["a.txt", "sub/b.txt", "sub/deeper/c.bin"]
    assert _contents(ds) == want
    assert cli.ok("get", ds, "sub/deeper/c.bin").out == want["sub/deeper/c.bin"]


def test_put_stdin_with_key_and_label_and_get_json(cli: Cli, tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    _write(tmp_path / "first.bin", 10, 0)
    cli.ok("put", ds, tmp_path / "first.bin")
    payload = b"from stdin \x00\xff bytes"
    r = cli.ok("put", ds, "-", "--key", "piped/key", "--label", "7", "--json", input=payload)
    summary = r.json()
    assert summary["put"] == 1 and summary["generation"] == 2 and summary["dataset"] == str(ds)
    assert cli.ok("get", ds, "piped/key").out == payload
    meta = cli.ok("get", ds, "piped/key", "--json").json()
    assert meta["key"] == "piped/key" and meta["index"] == 1 and meta["label"] == 7
    assert meta["shard"] == 0 and meta["size"] == len(payload)
    cli.ok("put", ds, "-", "-k", "neg", "-l", "-3", input=b"x")
    rows = cli.ok("ls", ds, "--json").json()
    assert [(r["key"], r["label"]) for r in rows] == [("first.bin", None), ("piped/key", 7), ("neg", -3)]


def test_put_creates_the_dataset_with_the_given_shard_size(cli: Cli, tmp_path: Path) -> None:
    files = [tmp_path / f"f{i}.bin" for i in range(5)]
    want = {f.name: _write(f, 30_000, i) for i, f in enumerate(files)}
    ds = tmp_path / "new" / "ds"  # parents are created too
    cli.ok("put", ds, *files, "--shard-size", "64KB")
    info = cli.ok("info", ds, "--json").json()
    assert info["shard_size"] == 64_000
    assert info["sealed_shards"] == 2 and info["tail_records"] == 1 and info["samples"] == 5
    assert (ds / "shards" / "000000.mdb").is_file() and (ds / "shards" / "000001.mdb").is_file()
    rows = cli.ok("ls", ds, "--json").json()
    assert [r["shard"] for r in rows] == [0, 0, 1, 1, 2]
    assert _contents(ds) == want
    assert cli.ok("verify", ds).rc == 0


def test_get_field_of_a_dict_record(cli: Cli, tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    with kvdata.open(ds, "a") as store:
        store.put("k", {"image": image, "label": 3})
        store.put("s", {"name": "héllo", "raw": b"\x01\x02", "x": np.ones(3, "<f4")})
    assert cli.ok("get", ds, "k", "--field", "image").out == image.tobytes()
    assert cli.ok("get", ds, "k", "-f", "label").out == b"3"
    assert cli.ok("get", ds, "s", "--field", "name").out == "héllo".encode()
    meta = cli.ok("get", ds, "k", "--json").json()
    assert meta["key"] == "k" and meta["index"] == 0 and meta["shard"] == 0 and meta["label"] == 3
    assert meta["kind"] == "fields"
    assert meta["fields"]["image"] == {"type": "array", "dtype": "|u1", "shape": [2, 2, 3], "nbytes": 12}
    out = tmp_path / "img.raw"
    cli.ok("get", ds, "k", "-o", out)  # the only array/bytes field is the default
    assert out.read_bytes() == image.tobytes()


# ---------------------------------------------------------------- ls / info


def test_ls_plain_long_limit_json_in_insertion_order(cli: Cli, tmp_path: Path) -> None:
    names = ["zeta.bin", "alpha.bin", "mid.bin"]
    sizes = [300, 10, 77]
    for i, (n, s) in enumerate(zip(names, sizes)):
        _write(tmp_path / n, s, i)
    ds = tmp_path / "ds"
    cli.ok("put", ds, *(tmp_path / n for n in names[:2]), "--label", "4")
    cli.ok("put", ds, tmp_path / names[2])
    assert cli.ok("ls", ds).lines() == names
    assert cli.ok("ls", ds, "--limit", "2").lines() == names[:2]
    long_rows = [line.split() for line in cli.ok("ls", ds, "--long").lines()]
    assert [r[0] for r in long_rows] == ["0", "1", "2"]
    assert [r[-1] for r in long_rows] == names
    assert [int(r[-2]) for r in long_rows] == sizes
    assert [r[2] for r in long_rows] == ["4", "4", "-"]
    assert all(r[1] == f"0:{i}" for i, r in enumerate(long_rows))
    rows = cli.ok("ls", ds, "--json").json()
    assert isinstance(rows, list)
    assert [r["key"] for r in rows] == names
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["label"] for r in rows] == [4, 4, None]
    assert [r["bytes"] for r in rows] == sizes
    assert [r["key"] for r in cli.ok("ls", ds, "--json", "--limit", "1").json()] == names[:1]


def test_info_plain_and_json(cli: Cli, tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "a", shard_size="1MB") as store:
        for i in range(3):
            store.put(f"k{i}", {"image": np.full((4, 5, 3), i, np.uint8), "label": i % 2})
        store.seal()
    with kvdata.open(ds, "a") as store:
        store.put("k3", {"image": np.zeros((4, 5, 3), np.uint8), "label": 1})
    d = cli.ok("info", ds, "--json").json()
    assert d["samples"] == 4 and d["sealed_shards"] == 1 and d["tail_records"] == 1
    assert d["generation"] == 2 and d["format_version"] == 1 and d["shard_size"] == 1_000_000
    assert d["fields"] == {"image": {"type": "array", "dtype": "|u1", "shape": [4, 5, 3]}, "label": {"type": "int"}}
    on_disk = sum(f.stat().st_size for f in ds.rglob("*") if f.is_file())
    assert d["bytes_on_disk"] == on_disk
    assert d["labelled"] is True and d["dataset"] == str(ds)
    text = cli.ok("info", ds).text
    assert "samples      4" in text
    assert "1 sealed + tail (1 records)" in text
    assert "generation   2 (format 1)" in text
    assert "field        image: |u1 4x5x3" in text
    assert "field        label: int" in text


# ---------------------------------------------------------------- rm


def test_rm_then_get_fails(cli: Cli, tmp_path: Path) -> None:
    want = {n: _write(tmp_path / n, 50, i) for i, n in enumerate(["a", "b", "c", "d"])}
    ds = tmp_path / "ds"
    cli.ok("put", ds, *(tmp_path / n for n in want))
    cli.ok("rm", ds, "a", "c")
    cli.fail("get", ds, "a", names=["'a'", str(ds)])
    assert _keys(cli, ds) == ["b", "d"]
    assert _contents(ds) == {"b": want["b"], "d": want["d"]}
    cli.ok("verify", ds)
    # a deleted key can come back, at the end of the sample order
    cli.ok("put", ds, tmp_path / "a")
    assert list(_contents(ds)) == ["b", "d", "a"]


def test_rm_missing_key_deletes_nothing_even_with_existing_keys(cli: Cli, tmp_path: Path) -> None:
    want = {n: _write(tmp_path / n, 50, i) for i, n in enumerate(["a", "b", "c"])}
    ds = tmp_path / "ds"
    cli.ok("put", ds, *(tmp_path / n for n in want))
    with kvdata.open(ds) as store:
        gen = store.generation
    cli.fail("rm", ds, "nope", names=["'nope'", "nothing was deleted"])
    cli.fail("rm", ds, "a", "nope", "c", names=["'nope'", "nothing was deleted"])
    assert _contents(ds) == want
    with kvdata.open(ds) as store:
        assert store.generation == gen
    cli.ok("verify", ds)


def test_rm_same_key_twice_deletes_it(cli: Cli, tmp_path: Path) -> None:
    """Regression: the second copy of the key used to fail with "'a' is not in ds"."""
    _write(tmp_path / "a", 10, 0)
    _write(tmp_path / "b", 10, 1)
    ds = tmp_path / "ds"
    cli.ok("put", ds, tmp_path / "a", tmp_path / "b")
    cli.ok("rm", ds, "a", "a")
    assert _keys(cli, ds) == ["b"]


# ---------------------------------------------------------------- verify / reindex


def test_verify_ok_and_json(cli: Cli, tmp_path: Path) -> None:
    files = [tmp_path / f"f{i}" for i in range(3)]
    for i, f in enumerate(files):
        _write(f, 30_000, i)
    ds = tmp_path / "ds"
    cli.ok("put", ds, *files, "--shard-size", "64KB")
    r = cli.ok("verify", ds)
    assert r.text.startswith("ok: 3 records in 2 shards, 3 samples, generation 1")
    report = cli.ok("verify", ds, "--json").json()
    assert report["ok"] is True and report["records_checked"] == 3 and report["samples"] == 3
    assert report["bad_shards"] == [] and report["bad_records"] == [] and report["index_problems"] == []


def _mixed_dataset(tmp_path: Path) -> Path:
    """Sealed shards, a tail, a deleted key, an overwritten key and labelled records."""
    ds = tmp_path / "ds"
    rng = np.random.default_rng(0)
    with kvdata.open(ds, "a", shard_size="64KB") as store:
        for i in range(5):
            store.put(f"f{i}.bin", rng.integers(0, 256, 30_000, dtype=np.uint8).tobytes(), label=2)
        store.commit()
        store.delete("f1.bin")
        store.commit()
        store.put("f3.bin", b"overwritten")
        store.put("small", b"tiny", label=9)
    return ds


@pytest.mark.parametrize("lose", ["index", "manifest"])
def test_reindex_restores_keys_and_values(cli: Cli, tmp_path: Path, lose: str) -> None:
    ds = _mixed_dataset(tmp_path)
    before = _contents(ds)
    listing = cli.ok("ls", ds, "--json").json()
    assert list(before) == ["f0.bin", "f2.bin", "f3.bin", "f4.bin", "small"]
    assert before["f3.bin"] == b"overwritten"
    with kvdata.open(ds) as store:
        gen = store.generation
    if lose == "index":
        bins = list((ds / "index").glob("*.bin"))
        assert bins
        for p in bins:
            p.unlink()
    else:
        (ds / "manifest.json").unlink()
    cli.fail("ls", ds, names=["kvdata reindex"])
    r = cli.ok("reindex", ds)
    assert r.text.startswith("reindexed 5 samples")
    assert _contents(ds) == before
    assert cli.ok("ls", ds, "--json").json() == listing
    cli.ok("verify", ds)
    summary = cli.ok("reindex", ds, "--json").json()
    assert summary["samples"] == 5 and summary["manifest_rebuilt"] is False and summary["generation"] > gen + 1
    assert _contents(ds) == before


# ---------------------------------------------------------------- import / demo


def _pillow() -> Any:
    """PIL.Image, or a skip where Pillow is not installed (the core-only run of .ci/lowest-versions)."""
    return pytest.importorskip("PIL.Image", reason="needs Pillow (pip install 'kvdata[images]')")


def _image_tree(root: Path) -> dict[str, np.ndarray]:
    """root/<class>/<i>.png: 2 classes x 2 tiny distinct PNGs; returns key -> pixels."""
    Image = _pillow()
    out = {}
    for c, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        for i in range(2):
            px = np.random.default_rng(10 * c + i).integers(0, 256, (3, 4, 3), dtype=np.uint8)
            Image.fromarray(px).save(root / name / f"{i}.png")
            out[f"{name}/{i}.png"] = px
    return out


def test_import_folder(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "images"
    pixels = _image_tree(src)
    (src / "cat" / "notes.txt").write_text("skipped")
    ds = tmp_path / "ds"
    summary = cli.ok("import", "folder", src, ds, "--json").json()
    assert summary["imported"] == 4 and summary["classes"] == 2 and summary["skipped"] == 1
    rows = cli.ok("ls", ds, "--json").json()
    assert sorted(r["key"] for r in rows) == sorted(pixels)
    assert all(r["label"] == (0 if r["key"].startswith("cat/") else 1) for r in rows)
    assert cli.ok("get", ds, "dog/1.png", "--field", "image").out == (src / "dog/1.png").read_bytes()
    with kvdata.open(ds) as store:
        assert {k: bytes(store[k]["image"]) for k in store.keys()} == {k: (src / k).read_bytes() for k in pixels}
    info = cli.ok("info", ds, "--json").json()
    assert info["classes"] == 2 and info["labelled"] is True and info["sealed_shards"] == 1
    # decoded pixels, in a second dataset
    ds2 = tmp_path / "ds2"
    r = cli.ok("import", "folder", src, ds2, "--decode", "rgb", "--no-shuffle")
    assert r.text.startswith("imported 4 images")
    assert cli.ok("get", ds2, "cat/1.png", "--field", "image").out == pixels["cat/1.png"].tobytes()
    with kvdata.open(ds2) as store:
        assert list(store.keys()) == sorted(pixels)
        for key, px in pixels.items():
            assert np.array_equal(store[key]["image"], px)


def test_import_listfile(cli: Cli, tmp_path: Path) -> None:
    root = tmp_path / "images"
    pixels = _image_tree(root)
    listed = {"dog/1.png": 5, "cat/0.png": 0, "cat/1.png": 5}
    listfile = tmp_path / "train.txt"
    listfile.write_text("".join(f"{k} {v}\n" for k, v in listed.items()))
    ds = tmp_path / "ds"
    summary = cli.ok("import", "listfile", listfile, ds, "--root", root, "--no-shuffle", "--json").json()
    assert summary["imported"] == 3 and summary["classes"] == 6  # labels 0 and 5: classes "0".."5"
    assert cli.ok("info", ds, "--json").json()["classes"] == 6
    rows = cli.ok("ls", ds, "--json").json()
    assert [(r["key"], r["label"]) for r in rows] == list(listed.items())
    assert cli.ok("get", ds, "dog/1.png", "--field", "image").out == (root / "dog/1.png").read_bytes()
    ds2 = tmp_path / "ds2"
    cli.ok("import", "listfile", listfile, ds2, "--root", root, "--decode", "rgb", "--resize", "2x2")
    meta = cli.ok("get", ds2, "cat/0.png", "--json").json()
    assert meta["fields"]["image"]["shape"] == [2, 2, 3] and meta["label"] == 0
    cli.ok("verify", ds2)
    with kvdata.open(ds2) as store:
        for key in listed:
            Image = _pillow()
            want = np.asarray(Image.fromarray(pixels[key]).resize((2, 2), Image.Resampling.BILINEAR))
            assert np.array_equal(store[key]["image"], want)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory,
             make_cli: Callable[[Path], Cli]) -> Iterator[tuple[Any, list[str]]]:
    """One `kvdata demo --json --dir DIR` run (about 5 s) shared by the demo tests:
    its JSON summary and what it left in DIR; DIR is removed afterwards (~300 MB)."""
    pytest.importorskip("sklearn", reason="the demo needs pip install 'kvdata[demo]'")
    base = tmp_path_factory.mktemp("demo")
    work = base / "work"
    r = make_cli(base).ok("demo", "--json", "--dir", work, quiet=False)
    left = sorted(p.name for p in work.iterdir())
    shutil.rmtree(work)
    yield json.loads(r.text), left


def test_demo_json(demo_run: tuple[Any, list[str]]) -> None:
    summary, _left = demo_run
    assert [x["dataset"] for x in summary["results"]] == ["digits", "photos"]
    for x in summary["results"]:
        assert x["ratio"] > 0 and x["kvdata_per_s"] > 0 and x["memmap_per_s"] > 0 and x["samples"] > 0
        assert x["reader"] in ("Loader", "get_batch")  # read the way the README recommends
        assert (x["why"] is None) == (x["ratio"] >= 1.0)  # a row below 1.0x says why
    assert summary["seconds"] > 0 and summary["dir"].endswith("work")


def test_demo_dir_without_keep_removes_its_datasets(demo_run: tuple[Any, list[str]]) -> None:
    """Regression: with --dir and no --keep the ~300 MB of datasets used to stay in DIR."""
    _summary, left = demo_run
    assert left == []
