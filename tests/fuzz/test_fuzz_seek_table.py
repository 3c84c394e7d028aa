"""Fuzz the framed cold copy's decoders (kvdata/format/frames.py, kvdata/tiers/records.py):
seek tables and frames from a home are hostile input. decode_seek_table may raise only
CorruptDatasetError; a record read from a home that serves mutated bytes (with a manifest
entry that matches them, as a hostile home would) raises only KVDataError; the LMDB walk
that finds record boundaries never raises on a damaged file."""

from __future__ import annotations

import hashlib
import io
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvdata
from kvdata.errors import CorruptDatasetError, KVDataError
from kvdata.format import ShardEntry, ZstCopy, frames
from kvdata.format.codec import compress_file
from kvdata.homes import Home
from kvdata.tiers.records import RecordReader

import fuzzlib as fl
from fuzzlib import fuzz_settings


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes, Any]:
    """(shard bytes, its framed .zst, compress_file's result) of a small mixed shard."""
    p = tmp_path_factory.mktemp("fz") / "d.kv"
    rng = np.random.default_rng(2)
    with kvdata.open(p, "w") as s:
        for i in range(60):
            s.put(f"k{i}", rng.bytes(40 if i % 4 else 20_000 + 300 * i))
        s.seal()
    path = p / "shards" / "000000.mdb"
    buf = io.BytesIO()
    res = compress_file(path, buf, frame_size=16 << 10)
    return path.read_bytes(), buf.getvalue(), res


class MemHome(Home):
    url = "s3://fuzz/ds"

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    def size(self, name: str) -> int:
        return len(self.objects[name])

    def read_range(self, name: str, start: int, length: int) -> bytes:
        return self.objects[name][start:start + length]


def test_fuzz_seek_table_decoder(shard: tuple[bytes, bytes, Any]) -> None:
    data, z, res = shard
    table = z[-res.seek_bytes:]

    @fuzz_settings(1500)
    @given(st.randoms(use_true_random=False))
    def case(r: random.Random) -> None:
        blob = fl.mutate_bytes(r, table)
        zst_bytes = len(z) - len(table) + len(blob) if r.random() < 0.8 else r.randrange(0, 2 * len(z))
        try:
            t = frames.decode_seek_table(blob, zst_bytes=zst_bytes, shard_bytes=len(data),
                                         records=r.choice([None, 60, 61]), where="fuzz")
        except CorruptDatasetError:
            return
        assert int(t.u_off[-1]) == len(data) and int(t.c_off[-1]) == zst_bytes - len(blob)
        assert bool((np.diff(t.u_off) > 0).all()) and bool((np.diff(t.c_off) > 0).all())
        if t.slot_off is not None and t.slot_size is not None:
            assert bool((t.slot_off + t.slot_size <= len(data)).all())
    case()


def test_fuzz_record_reads_from_a_hostile_home(shard: tuple[bytes, bytes, Any]) -> None:
    data, z, res = shard
    records = 60

    @fuzz_settings(400)
    @given(st.randoms(use_true_random=False))
    def case(r: random.Random) -> None:
        if r.random() < 0.5:   # damage the frames (the table still vouches for the originals)
            bad = fl.mutate_bytes(r, z[:-res.seek_bytes]) + z[-res.seek_bytes:]
            seek = res.seek_bytes
        else:                  # damage the table too, and re-sign it in the manifest
            table = fl.mutate_bytes(r, z[-res.seek_bytes:])
            bad = z[:-res.seek_bytes] + table
            seek = len(table)
        zst = ZstCopy("000000.mdb.zst", len(bad), hashlib.sha256(bad).hexdigest(), seek,
                      hashlib.sha256(bad[len(bad) - seek:]).hexdigest())
        entry = ShardEntry(0, "000000.mdb", records, len(data), hashlib.sha256(data).hexdigest(), zst)
        reader = RecordReader(MemHome({"shards/000000.mdb.zst": bad}))
        slots = [r.randrange(records) for _ in range(r.randint(1, 6))]
        try:
            got = reader.read(entry, slots)
        except KVDataError:
            return
        assert got is None or len(got) == len(slots)
    case()


def test_fuzz_lmdb_walk_on_damaged_shards(shard: tuple[bytes, bytes, Any]) -> None:
    data = shard[0]

    @fuzz_settings(300)
    @given(st.randoms(use_true_random=False))
    def case(r: random.Random) -> None:
        b = bytearray(data)
        for _ in range(r.randint(1, 20)):
            at = r.randrange(len(b))
            b[at] = r.randrange(256)
        got = frames.lmdb_values(bytes(b))
        if got is not None:
            assert bool((got["offset"].astype(np.int64) + got["size"] <= len(b)).all())
            cuts = frames.frame_cuts(len(b), got, 4096)
            assert cuts[0][0] == 0 and cuts[-1][1] == len(b)
    case()


# ---------------------------------------------------------------- regressions


def _hostile_copy(frame: bytes, usize: int, slots: list[tuple[int, int]]) -> tuple[ShardEntry, MemHome]:
    """A home whose copy is one frame and a table that vouches for it, and a manifest entry
    that vouches for the table: everything consistent, as a hostile home can make it."""
    sl = np.zeros(len(slots), frames.SLOT_DTYPE)
    sl["offset"] = [a for a, _ in slots]
    sl["size"] = [b for _, b in slots]
    table = frames.encode_seek_table(usize, [(len(frame), usize, frames.frame_digest(frame))], sl)
    z = frame + table
    zst = ZstCopy("000000.mdb.zst", len(z), hashlib.sha256(z).hexdigest(), len(table), hashlib.sha256(table).hexdigest())
    entry = ShardEntry(0, "000000.mdb", len(slots), usize, "0" * 64, zst)
    return entry, MemHome({"shards/000000.mdb.zst": z})


def test_a_small_frame_that_expands_to_gigabytes_is_decompressed_only_as_far_as_needed() -> None:
    import tracemalloc

    import zstandard

    big = 256 << 20
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    chunks = cctx.compressobj(size=big)
    zero = bytes(1 << 20)
    frame = b"".join(chunks.compress(zero) for _ in range(big >> 20)) + chunks.flush()
    assert len(frame) < 64 << 10
    entry, home = _hostile_copy(frame, big, [(0, 100), (big - 100, 100)])
    tracemalloc.start()
    try:
        got = RecordReader(home).read(entry, [0])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == [bytes(100)]
    assert peak < 16 << 20, peak


def test_a_frame_that_declares_another_size_than_its_table_is_refused() -> None:
    import zstandard

    frame = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(5000))
    entry, home = _hostile_copy(frame, 4000, [(0, 100)])
    with pytest.raises(KVDataError, match="declares 5000 bytes"):
        RecordReader(home).read(entry, [0])
