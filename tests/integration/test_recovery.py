"""Recovery never deletes what it cannot account for; one writer at a time even where flock lies.

Each test is named after the way main (63f9e78) lost or damaged data.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import kvdata
from kvdata.errors import CommitError, CorruptDatasetError, WriterLockedError
from kvdata.reader.open import verify


def _build(path: Path, n: int = 40, shard_size: str = "64KB") -> None:
    with kvdata.open(path, "a", shard_size=shard_size) as s:
        for i in range(n):
            s.put(f"k{i:03d}", bytes([i % 251]) * 3000)
        s.seal()


def _files(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}


def test_writer_without_manifest_refuses_and_keeps_every_shard(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    _build(ds)
    (ds / "manifest.json").unlink()
    before = _files(ds)
    with pytest.raises(CorruptDatasetError, match="kvdata reindex"):
        kvdata.open(ds, "a")
    assert _files(ds) == before
    from kvdata.store.rebuild import reindex

    reindex(ds)
    assert verify(ds)["ok"] and len(kvdata.open(ds)) == 40


def test_stale_manifest_moves_newer_shards_aside_instead_of_deleting(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "a", shard_size="64KB") as s:
        s.put("first", b"x" * 100)
        s.seal()
    stale = (ds / "manifest.json").read_bytes()  # one sealed shard, an empty tail
    _build(ds)  # more shards, newer generations
    newer = {p.name for p in (ds / "shards").iterdir() if p.name.endswith(".mdb") and not p.name.startswith("tail")}
    newer -= {"000000.mdb"}
    assert newer
    (ds / "manifest.json").write_bytes(stale)  # e.g. restored from an old backup
    before = _files(ds)
    with pytest.raises(CorruptDatasetError, match="reindex"):  # its key index was merged away since
        kvdata.open(ds, "a")
    assert _files(ds) == before  # refused before touching anything
    from kvdata.store.rebuild import reindex

    reindex(ds)  # rebuilds the index of what the manifest names
    with kvdata.open(ds, "a") as s:
        assert len(s) == 1
    kept = {p.name.split("-", 1)[1] for p in (ds / "lost+found").rglob("*") if p.is_file()}
    assert newer <= kept  # every newer shard is still on disk


def test_stale_manifest_naming_a_sealed_tail_refuses_before_touching_files(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "a", shard_size="64KB") as s:
        s.put("first", b"x" * 100)
    stale = (ds / "manifest.json").read_bytes()  # names tail-000000 with one record
    _build(ds)  # the tail is sealed and removed since
    (ds / "manifest.json").write_bytes(stale)
    before = _files(ds)
    with pytest.raises(CorruptDatasetError, match="missing"):
        kvdata.open(ds, "a")
    assert _files(ds) == before


def test_seal_then_failed_tail_open_leaves_the_dataset_consistent(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "a", shard_size="64KB") as s:
        s.put("a", b"a" * 1000)
    s = kvdata.open(ds, "a")
    (ds / "shards" / "tail-000001.mdb").mkdir()  # the next tail cannot be created
    s.put("b", b"b" * 1000)
    s.seal()
    with pytest.raises(CommitError):
        s.commit()
    s.close()
    st = kvdata.open(ds)
    assert len(st) == 1 and bytes(st["a"]) == b"a" * 1000
    assert verify(ds)["ok"]


def test_second_writer_detected_where_flock_does_not_exclude(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    _build(ds, n=5)
    # a writer on another host holds the dataset: its lock content is there, its flock is not
    (ds / ".lock").write_text("otherhost 4242 0123456789abcdef")
    with pytest.raises(WriterLockedError, match="otherhost"):
        kvdata.open(ds, "a")
    (ds / ".lock").write_text("")
    s = kvdata.open(ds, "a")
    s.put("mine", b"1")
    (ds / ".lock").write_text("otherhost 4242 0123456789abcdef")  # the other writer got in meanwhile
    gen = json.loads((ds / "manifest.json").read_text())["generation"]
    with pytest.raises(CommitError, match="another writer"):
        s.commit()
    assert json.loads((ds / "manifest.json").read_text())["generation"] == gen
    (ds / ".lock").write_text("")
    s.close()
    assert "mine" not in kvdata.open(ds) and verify(ds)["ok"]


def test_raising_shard_size_on_existing_dataset_does_not_fill_the_map(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "a", shard_size="8MB") as s:
        s.put("a", b"x")
    blob = os.urandom(1 << 20)
    with kvdata.open(ds, "a", shard_size="256MB") as s:
        for i in range(100):  # 100 MB into one tail: past the old map (2 x 8 MB + 64 MB)
            s.put(f"k{i}", blob)
    st = kvdata.open(ds)
    assert len(st) == 101 and bytes(st["k99"]) == blob


def test_crashed_writer_files_are_tidied_without_loss(tmp_path: Path) -> None:
    """Leftovers a writer can account for (its temp files, older index files) go; nothing else."""
    ds = tmp_path / "ds"
    _build(ds)
    (ds / "shards" / "000000.mdb.tmp").write_bytes(b"partial")
    (ds / "index" / "keys-00000000-05.bin").write_bytes(b"old generation")
    (ds / "shards" / "notes.txt").write_text("mine")
    with kvdata.open(ds, "a") as s:
        assert len(s) == 40
    assert not (ds / "shards" / "000000.mdb.tmp").exists() and not (ds / "index" / "keys-00000000-05.bin").exists()
    assert not (ds / "shards" / "notes.txt").exists()
    assert any(p.name.endswith("notes.txt") for p in (ds / "lost+found").rglob("*"))
