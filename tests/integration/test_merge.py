"""`kvdata merge PARTS... DATASET` (kvdata.store.merge): parts written apart read exactly like
one dataset written in one go, shards are shared by hard link, and nothing half-made is ever
left: duplicate keys, a busy destination, a tail, and a SIGKILL at any moment of the merge."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.errors import (
    CorruptDatasetError,
    InvalidKeyError,
    InvalidValueError,
    KVDataError,
    NotADatasetError,
    WriterLockedError,
)
from kvdata.format import names
from kvdata.reader.open import verify
from kvdata.store.lock import WriterLock
from kvdata.store.merge import STAGING, merge

from helpers.cli import Cli
from helpers.forked import run_forked
from helpers.parts import CLASSES, records, same, write_part


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three sealed parts (the first with overwrites and deletes) and nothing else; tests copy
    them when they change them."""
    d = tmp_path_factory.mktemp("parts")
    out = []
    for i, n in enumerate((300, 1, 250)):
        p = d / f"p{i}.kv"
        write_part(p, records(i, n), deletes=20 if i == 0 else 0)
        out.append(p)
    return out


def _manifest(path: Path) -> Any:
    with kvdata.open(path) as s:
        return s.manifest


def _count(path: Path) -> int:
    with kvdata.open(path) as s:
        return len(s)


def _snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """(inode, size) of every file of a dataset: a part that was not modified keeps them all."""
    return {str(p.relative_to(path)): (p.stat().st_ino, p.stat().st_size) for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != names.LOCK and names.parse_reader_pin_name(p.name) is None}


def test_merged_reads_like_one_dataset_written_in_one_go(parts: list[Path], tmp_path: Path) -> None:
    before = [_snapshot(p) for p in parts]
    whole = tmp_path / "whole.kv"
    write_part(whole, [r for i in range(3) for r in records(i, (300, 1, 250)[i])])
    out = tmp_path / "merged.kv"
    summary = merge(parts, out)
    assert summary["samples"] == 551 and summary["bytes_copied"] == 0
    assert summary["bytes_linked"] == summary["bytes"] > 0

    with kvdata.open(whole) as w, kvdata.open(out) as m:
        assert len(m) == len(w) == 551
        assert m.classes == CLASSES and m.fields == w.fields
        assert (m.labels == w.labels).all()
        assert list(m.keys()) == list(w.keys())
        for i in range(len(w)):
            assert same(m[i], w[i]), i
        for k in list(w.keys())[::7] + ["part1/00000", "part2/00249"]:
            assert m.find(k) == w.find(k) and same(m[k], w[k]), k
        assert "part0/00001-gone" not in m and m.find("nope") is None
        batch_w, batch_m = w.get_batch([0, 1, 300, 302]), m.get_batch([0, 1, 300, 302])
        assert batch_w.keys() == batch_m.keys() and all(same(batch_w[k], batch_m[k]) for k in batch_w)
        n_shards = len(m.manifest.shards)
    assert n_shards == sum(len(_manifest(p).shards) for p in parts) == summary["shards"]
    assert verify(out, progress=False)["ok"]

    # every shard is the part's own file under a new name (same inode), ids renumbered in order
    merged_shards = sorted(p for p in (out / names.SHARDS_DIR).iterdir() if names.parse_shard_name(p.name))
    part_shards = [p / names.SHARDS_DIR / e.name for p in parts for e in _manifest(p).shards]
    assert [p.name for p in merged_shards] == [names.shard_name(i) for i in range(n_shards)]
    assert [p.stat().st_ino for p in merged_shards] == [p.stat().st_ino for p in part_shards]
    assert sorted(os.listdir(out)) == sorted([names.LOCK, names.MANIFEST, names.SHARDS_DIR, names.INDEX_DIR,
                                              names.reader_pin_name(0)])  # (its readers' registry: store.pins)
    assert [_snapshot(p) for p in parts] == before  # parts untouched, and still read
    assert all(verify(p, progress=False)["ok"] for p in parts)

    # the merged dataset is an ordinary one: appends, deletes, and reindex agree with its index
    with kvdata.open(out, "a") as s:
        s.put("after", {"image": np.ones((2, 5, 3), np.uint8)}, label=1)
        s.delete("part1/00000")
    with kvdata.open(out) as m:
        keys = list(m.keys())
        assert len(m) == 551 and keys[-1] == "after" and "part1/00000" not in m
    shutil.rmtree(out / names.INDEX_DIR)
    (out / names.INDEX_DIR).mkdir()
    kvdata_cli(tmp_path, "reindex", out)
    with kvdata.open(out) as m:
        assert list(m.keys()) == keys
    assert verify(out, progress=False)["ok"]


def kvdata_cli(cwd: Path, *args: Any) -> Any:
    return Cli(cwd).ok(*args)


def test_duplicate_keys_are_named_and_nothing_is_written(parts: list[Path], tmp_path: Path) -> None:
    dup = tmp_path / "dup.kv"
    write_part(dup, [("z/only-here", b"z", None), ("part2/00007", b"again", None), ("part0/00011", b"again", None)])
    out = tmp_path / "out.kv"
    with pytest.raises(InvalidKeyError) as e:
        merge([*parts, dup], out)
    assert "'part2/00007'" in str(e.value) and "'part0/00011'" in str(e.value) and str(dup) in str(e.value)
    assert not out.exists()
    line = Cli(tmp_path).fail("merge", *parts, dup, out, names=["duplicate", "part2/00007", str(dup)])
    assert "nothing was written" in line and not out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    Cli(tmp_path).fail("merge", parts[0], dup, parts[2], empty, names=["part2/00007"])
    assert os.listdir(empty) == []  # an empty destination stays exactly as it was


def test_destination_must_be_new_or_empty(parts: list[Path], tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(NotADatasetError, match="not empty.*notes.txt"):
        merge(parts, busy)
    assert os.listdir(busy) == ["notes.txt"]
    with pytest.raises(NotADatasetError, match="already a dataset"):
        merge(parts[:2], parts[2])
    with pytest.raises(KVDataError, match="outside every part"):
        merge(parts, parts[0] / "inside")
    with pytest.raises(TypeError, match="list of dataset paths"):
        merge(str(parts[0]), tmp_path / "x")  # type: ignore[arg-type]
    with pytest.raises(KVDataError, match="given twice"):
        merge([parts[0], parts[0]], tmp_path / "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADatasetError, match="not a directory"):
        merge(parts, tmp_path / "file")
    busy_merge = tmp_path / "being-merged"
    busy_merge.mkdir()
    other = WriterLock(busy_merge)  # another merge into it, in progress
    try:
        with pytest.raises(WriterLockedError, match="open for writing by another process"):
            merge(parts, busy_merge)
        assert os.listdir(busy_merge) == [names.LOCK]
    finally:
        other.release()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert merge(parts, empty)["samples"] == 551  # an empty directory is fine
    assert verify(empty, progress=False)["ok"]


def test_part_with_an_open_tail_is_refused_or_sealed(parts: list[Path], tmp_path: Path) -> None:
    tailed = tmp_path / "tailed.kv"
    write_part(tailed, [("t/1", b"one", 1), ("t/2", {"image": np.zeros((3, 5, 3), np.uint8)}, 2)], seal=False)
    assert _manifest(tailed).tail.records == 2
    before = _snapshot(tailed)
    out = tmp_path / "out.kv"
    line = Cli(tmp_path).fail("merge", parts[0], tailed, out, names=[str(tailed), f"kvdata seal {tailed}", "--seal"])
    assert "2 record(s)" in line and not out.exists() and _snapshot(tailed) == before
    summary = merge([parts[0], tailed], out, seal=True)
    assert summary["sealed_parts"] == [str(tailed)] and summary["samples"] == 302
    with kvdata.open(out) as m, kvdata.open(tailed) as t:
        assert t.manifest.tail.records == 0 and len(t) == 2  # the part is sealed, same records
        assert bytes(m["t/1"]) == b"one" and m.labels[-1] == 2 and m.find("t/2") == 301
    assert verify(out, progress=False)["ok"] and verify(tailed, progress=False)["ok"]


def test_a_refused_merge_seals_nothing(parts: list[Path], tmp_path: Path) -> None:
    tailed = tmp_path / "tailed.kv"
    write_part(tailed, [("t/1", b"one", 1), ("part0/00003", b"dup", None)], seal=False)
    before = _snapshot(tailed)
    with pytest.raises(InvalidKeyError, match="part0/00003"):
        merge([parts[0], tailed], tmp_path / "out.kv", seal=True)
    assert _snapshot(tailed) == before and _manifest(tailed).tail.records == 2


def test_a_key_deleted_in_a_later_part_is_refused_reindex_would_drop_it(tmp_path: Path) -> None:
    """A later part's delete of a key an earlier part holds: reindex replays shards in order and
    would delete it, so that order is refused; the other order is the same data, and is fine."""
    live, deleted = tmp_path / "live.kv", tmp_path / "deleted.kv"
    write_part(live, [("a", b"A", 0), ("shared", b"kept", 1)])
    with kvdata.open(deleted, "a") as s:
        s.put("b", b"B", label=2)
        s.put("shared", b"old")
        s.commit()
        s.delete("shared")
        s.seal()
        s.commit()
    with pytest.raises(InvalidKeyError, match=f"'shared' is in {live} and deleted in {deleted}"):
        merge([live, deleted], tmp_path / "out.kv")
    assert not (tmp_path / "out.kv").exists()
    out = tmp_path / "ok.kv"
    merge([deleted, live], out)
    with kvdata.open(out) as m:
        assert list(m.keys()) == ["b", "a", "shared"] and bytes(m["shared"]) == b"kept"
    shutil.rmtree(out / names.INDEX_DIR)
    (out / names.INDEX_DIR).mkdir()
    kvdata_cli(tmp_path, "reindex", out)
    with kvdata.open(out) as m:
        assert list(m.keys()) == ["b", "a", "shared"] and bytes(m["shared"]) == b"kept"


def test_extras_the_parts_agree_on_are_kept(tmp_path: Path) -> None:
    a, b = tmp_path / "a.kv", tmp_path / "b.kv"
    for p, n in ((a, 1), (b, 2)):
        with kvdata.open(p, "w") as s:
            s.put(f"k{n}", b"v")
            s.set_extra("source", {"importer": "folder"})
            s.set_extra("part", n)
    merge([a, b], tmp_path / "out.kv", seal=True)  # a small "w" dataset keeps its tail: sealed here
    assert _manifest(tmp_path / "out.kv").extra == {"source": {"importer": "folder"}}


def test_classes_that_disagree_are_refused_a_prefix_is_not(parts: list[Path], tmp_path: Path) -> None:
    other = tmp_path / "other.kv"
    write_part(other, [("o/1", b"1", 0)], classes=["cat", "cow"])
    with pytest.raises(InvalidValueError, match="label 1 is 'cow' here and 'dog' there"):
        merge([parts[0], other], tmp_path / "out.kv")
    assert not (tmp_path / "out.kv").exists()
    fewer, none = tmp_path / "fewer.kv", tmp_path / "none.kv"
    write_part(fewer, [("f/1", b"1", 0)], classes=["cat", "dog"])
    write_part(none, [("n/1", b"1", None)], classes=None)
    merge([none, fewer, parts[1]], tmp_path / "ok.kv")
    with kvdata.open(tmp_path / "ok.kv") as m:
        assert m.classes == CLASSES and len(m) == 3


def test_move_removes_the_parts_after_the_commit(parts: list[Path], tmp_path: Path) -> None:
    copies = []
    for p in parts:
        shutil.copytree(p, tmp_path / p.name)
        copies.append(tmp_path / p.name)
    (copies[1] / "lost+found").mkdir()
    (copies[1] / "lost+found" / "keep-me").write_text("recovery put me here")
    inodes = [(c / names.SHARDS_DIR / "000000.mdb").stat().st_ino for c in copies]
    out = tmp_path / "moved.kv"
    summary = merge(copies, out, move=True)
    assert summary["moved"] and summary["left_in_parts"] == {str(copies[1]): ["lost+found"]}
    assert not copies[0].exists() and not copies[2].exists()
    assert os.listdir(copies[1]) == ["lost+found"]  # what the part's manifest did not name stays
    first = [0, len(_manifest(parts[0]).shards), len(_manifest(parts[0]).shards) + 1]
    assert [(out / names.SHARDS_DIR / names.shard_name(i)).stat().st_ino for i in first] == inodes
    assert verify(out, progress=False)["ok"] and _count(out) == 551


def test_across_filesystems_shards_are_copied_and_checked(parts: list[Path], tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's temp directory")
    shm = Path(tempfile.mkdtemp(prefix="kvmerge-", dir="/dev/shm"))
    try:
        part = shm / "p1.kv"
        shutil.copytree(parts[1], part)
        r = Cli(tmp_path).ok("merge", parts[0], part, tmp_path / "out.kv")
        assert "copied (no hard links across filesystems)" in r.text
        r = Cli(tmp_path).ok("merge", parts[0], part, tmp_path / "out2.kv", "--json").json()
        assert r["bytes_copied"] == sum(e.bytes for e in _manifest(part).shards) > 0
        assert r["bytes_linked"] == sum(e.bytes for e in _manifest(parts[0]).shards)
        assert verify(tmp_path / "out2.kv", progress=False)["ok"]
        # a copied shard whose bytes do not match its manifest is refused, nothing is left
        shard = part / names.SHARDS_DIR / "000000.mdb"
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.raises(CorruptDatasetError, match="sha256"):
            merge([parts[0], part], tmp_path / "bad.kv")
        assert not (tmp_path / "bad.kv").exists()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_cli_json_errors_and_exit_codes(parts: list[Path], tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    r = cli.ok("merge", *parts, "m.kv", "--json").json()
    assert {"dataset", "parts", "samples", "shards", "bytes", "bytes_linked", "bytes_copied", "sealed_parts",
            "moved", "seconds", "generation"} <= r.keys()
    assert r["samples"] == 551 and r["bytes_copied"] == 0 and r["parts"] == [str(p) for p in parts]
    assert cli.ok("verify", "m.kv").text.startswith("ok: ")
    assert "merged 3 parts into m2.kv: 551 samples" in cli.ok("merge", *parts, "m2.kv").text
    assert cli.run("merge", parts[0]).rc == 2  # usage: a part and a destination at least
    assert cli.ok("merge", "--help").text.startswith("Usage: kvdata merge [OPTIONS] PARTS... DATASET")
    cli.fail("merge", *parts, "m.kv", names=["m.kv", "already a dataset"])
    cli.fail("merge", tmp_path / "nope.kv", parts[0], "m3.kv", names=["nope.kv"])
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a").write_text("")
    cli.fail("merge", parts[0], tmp_path / "junk", "m4.kv", names=["junk"])
    assert not (tmp_path / "m3.kv").exists() and not (tmp_path / "m4.kv").exists()


# ---------------------------------------------------------------- SIGKILL during a merge

KILLS = 10


def _fork_merge(args: list[Path], dest: Path, delay: float | None) -> float | None:
    """Merge in a forked child; with `delay`, SIGKILL it that long after it starts merging,
    else return how long the merge took."""
    return run_forked(lambda: merge(args, dest), delay)


@pytest.mark.timeout(120)
def test_sigkill_during_merge_leaves_no_dataset_or_a_complete_one(parts: list[Path], tmp_path: Path) -> None:
    more = tmp_path / "more.kv"  # more samples: sorting and writing the index take a while too
    write_part(more, [(f"more/{j}", b"", j % 4) for j in range(8000)])
    args = [*parts, more]
    expect = sum(_count(p) for p in args)
    before = [_snapshot(p) for p in args]
    took = _fork_merge(args, tmp_path / "timing.kv", None)
    assert took is not None
    seen = {"absent": 0, "staged": 0, "complete": 0}
    for i in range(KILLS):
        dest = tmp_path / f"k{i}.kv"
        _fork_merge(args, dest, took * (i + 0.5) / KILLS)
        if not dest.exists():
            seen["absent"] += 1
            continue
        try:
            store = kvdata.open(dest)
        except (NotADatasetError, CorruptDatasetError):
            seen["staged"] += 1
            if (dest / names.SHARDS_DIR).exists():  # killed between the commit's renames:
                staged = json.loads((dest / STAGING / names.MANIFEST).read_text())  # every shard is there
                assert all((dest / names.SHARDS_DIR / e["name"]).is_file() for e in staged["shards"])
                continue
            assert set(os.listdir(dest)) <= {names.LOCK, STAGING}
            assert merge(args, dest)["samples"] == expect  # a new merge clears what the killed one left
        else:
            with store:
                assert len(store) == expect
            seen["complete"] += 1
        assert verify(dest, progress=False)["ok"] and _count(dest) == expect
    assert [_snapshot(p) for p in args] == before
    assert seen["staged"] + seen["absent"] >= 1, seen  # some kills landed before the commit
    print(f"\nmerge took {took * 1000:.0f} ms; outcomes of {KILLS} kills: {json.dumps(seen)}")
