"""A shard's record rows read from its LMDB pages (frames.lmdb_values, shard_rows): bounded on
crafted files, used by sealing and compaction, and a failed seal leaves no hash thread behind."""

from __future__ import annotations

import errno
import struct
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import kvdata
from kvdata.errors import CommitError, CorruptDatasetError
from kvdata.format import frames, names, raw_batch
from kvdata.reader.open import verify
from kvdata.store import open_tail as open_tail_mod
from kvdata.store import sealing, shard_rows
from kvdata.store.compact import compact

PS = 4096


def crafted_leaf_level(size: int) -> bytes:
    """An LMDB file whose meta claims size // 16 entries and whose leaf pages each hold 2,040
    pointers to one and the same node: the pointer count matches the entries exactly, so only
    the keys say it is not a tree (a node-by-node walk stopped at the second node)."""
    b = bytearray(size)
    npages = size // PS
    entries = size // 16
    per = (PS - 16) // 2
    full, rem = divmod(entries, per)
    leaves = list(range(3, 3 + full + (1 if rem else 0)))
    counts = [per] * full + ([rem] if rem else [])
    nxt = 3 + len(leaves)
    branches = []
    for i in range(0, len(leaves), 400):
        pg, nxt = nxt, nxt + 1
        kids = leaves[i:i + 400]
        struct.pack_into("<QHHHH", b, pg * PS, pg, 0, 1, 16 + 2 * len(kids), PS)
        for j, k in enumerate(kids):
            off = 16 + 2 * 400 + 8 * j
            struct.pack_into("<H", b, pg * PS + 16 + 2 * j, off)
            struct.pack_into("<HHHH", b, pg * PS + off, k & 0xFFFF, (k >> 16) & 0xFFFF, k >> 32, 0)
        branches.append(pg)
    struct.pack_into("<QHHHH", b, 2 * PS, 2, 0, 1, 16 + 2 * len(branches), PS)
    for j, k in enumerate(branches):
        off = 16 + 2 * 400 + 8 * j
        struct.pack_into("<H", b, 2 * PS + 16 + 2 * j, off)
        struct.pack_into("<HHHH", b, 2 * PS + off, k & 0xFFFF, (k >> 16) & 0xFFFF, k >> 32, 0)
    for pg, c in zip(leaves, counts):
        struct.pack_into("<QHHHH", b, pg * PS, pg, 0, 2, 16 + 2 * c, PS)
        b[pg * PS + 16:pg * PS + 16 + 2 * c] = struct.pack("<H", 16) * c
    for at, txn in ((0, 1), (PS, 2)):
        struct.pack_into("<QHHHH", b, at, at // PS, 0, 8, 0, 0)
        struct.pack_into("<II16xI76xQQQQ", b, at + 16, 0xBEEFC0DE, 1, PS, entries, 2, npages - 1, txn)
    assert nxt <= npages
    return bytes(b)


def test_a_crafted_leaf_level_is_refused_at_once_with_bounded_memory() -> None:
    buf = crafted_leaf_level(32 << 20)  # claims 2 million entries
    tracemalloc.start()
    try:
        t = time.perf_counter()
        assert frames.lmdb_values(buf) is None
        took = time.perf_counter() - t
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, f"the walk held {peak >> 20} MiB for a 32 MiB file"
    assert took < 5


def test_a_crafted_tail_is_a_clear_error_for_a_writer(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a") as s:
        s.put("a", b"1")
    with kvdata.open(p) as s:
        tail = p / names.SHARDS_DIR / s.manifest["tail"]["name"]
    tail.write_bytes(crafted_leaf_level(16 << 20))
    with pytest.raises(CorruptDatasetError, match="LMDB pages are damaged"):
        kvdata.open(p, "a")


def test_seal_and_compaction_read_rows_from_the_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[bool] = []
    real = shard_rows.rows_from_fd

    def spy(fd: int) -> Any:
        rows = real(fd)
        used.append(rows is not None)
        return rows

    monkeypatch.setattr(shard_rows, "rows_from_fd", spy)
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "w", shard_size="1MB") as s:
        s.put_many((f"k{i}", b"v" * 900) for i in range(5000))
    sealed = len(used)
    assert sealed >= 4 and all(used)  # every seal, and the seal at close
    with kvdata.open(p, "a") as s:
        for i in range(0, 5000, 2):
            s.delete(f"k{i}")
    compact(p)
    assert len(used) > sealed and all(used)  # every shard compaction wrote
    assert verify(p)["ok"]
    with kvdata.open(p) as s:
        assert len(s) == 2500 and bytes(s["k1"]) == b"v" * 900


def test_a_seal_that_fails_leaves_no_hash_thread_reading_the_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real_hash = sealing.mapped_file_sha256

    def slow(path: Path) -> Any:
        time.sleep(0.5)
        return real_hash(path)

    real_open = open_tail_mod.open_tail_for_write

    def full(path: Path, shard_size: int, check_pages: bool = False) -> Any:
        if names.parse_tail_name(path.name) == names.parse_tail_name(names.tail_name(1, 0)):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, shard_size, check_pages)

    monkeypatch.setattr(sealing, "mapped_file_sha256", slow)
    monkeypatch.setattr(open_tail_mod, "open_tail_for_write", full)
    p = tmp_path / "ds.kv"
    s = kvdata.open(p, "a", shard_size="64KB")
    with pytest.raises(CommitError, match="disk is full"):
        for i in range(200):
            s.put(f"k{i}", b"x" * 1000)
        s.commit()  # puts of raw bytes are written a chunk at a time: at the latest here
    assert not [t for t in threading.enumerate() if t.name == "kvdata-seal-sha256"]
    s.close()


def test_values_over_the_payload_limit_take_the_record_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """(4 GiB values are too large for a test: the limit is lowered to show the check.)"""
    monkeypatch.setattr(raw_batch, "MAX_PAYLOAD", 10)
    assert raw_batch.raw_values([b"x" * 10])
    assert not raw_batch.raw_values([b"x" * 11])
    assert raw_batch.raw_chunk_values([("a", b"x" * 11)], ["a"]) is None
