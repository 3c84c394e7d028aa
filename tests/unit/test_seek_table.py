"""The framed cold copy (kvdata/format/frames.py, codec.compress_file): the seek table's
encoding and its decoder on hostile input (only CorruptDatasetError), the LMDB value walk
against the shard scan, and where frames are cut."""

from __future__ import annotations

import hashlib
import io
import struct
from pathlib import Path

import numpy as np
import pytest
import zstandard

import kvdata
from kvdata.errors import CorruptDatasetError
from kvdata.format import frames
from kvdata.format.codec import compress_file, zst_copy, zst_copy_of
from kvdata.store.shard_rows import scan

HEAD = 8 + 32   # skippable frame header + table header


def table(total: int = 1000, sizes: tuple[tuple[int, int], ...] = ((10, 600), (20, 400)),
          slots: list[tuple[int, int]] | None = None) -> bytes:
    fr = [(c, u, hashlib.sha256(bytes([i])).digest()) for i, (c, u) in enumerate(sizes)]
    sl = None
    if slots is not None:
        sl = np.zeros(len(slots), frames.SLOT_DTYPE)
        sl["offset"] = [a for a, _ in slots]
        sl["size"] = [b for _, b in slots]
    return frames.encode_seek_table(total, fr, sl)


def decode(blob: bytes, zst_bytes: int | None = None, total: int = 1000, records: int | None = None) -> frames.SeekTable:
    csum = 30
    return frames.decode_seek_table(blob, zst_bytes=csum + len(blob) if zst_bytes is None else zst_bytes,
                                    shard_bytes=total, records=records, where="s3://b/ds/shards/000000.mdb.zst")


def test_round_trip() -> None:
    blob = table(slots=[(0, 100), (550, 100), (999, 1)])
    t = decode(blob, records=3)
    assert t.frames == 2 and t.total == 1000
    assert t.c_off.tolist() == [0, 10, 30] and t.u_off.tolist() == [0, 600, 1000]
    assert t.slot_off is not None and t.slot_size is not None
    assert t.slot_off.tolist() == [0, 550, 999] and t.slot_size.tolist() == [100, 100, 1]
    assert list(t.frames_of(0, 100)) == [0]
    assert list(t.frames_of(550, 650)) == [0, 1]
    assert list(t.frames_of(600, 601)) == [1]
    assert list(t.frames_of(999, 1000)) == [1]
    assert t.digests[1].tobytes() == hashlib.sha256(b"\x01").digest()[:16]
    assert len(blob) == HEAD + 2 * 24 + 3 * 12 + 12
    assert frames.table_size_from_trailer(blob[-frames.TRAILER:]) == len(blob)
    assert decode(table()).slot_off is None


def test_the_table_is_a_skippable_frame() -> None:
    data = b"shard bytes " * 1000
    z = zstandard.ZstdCompressor(write_checksum=True).compress(data) + table(total=len(data), sizes=((1, len(data)),))
    assert zstandard.ZstdDecompressor().stream_reader(io.BytesIO(z), read_across_frames=True).read() == data


@pytest.mark.parametrize("cut", [0, 1, 7, 8, 39, 40, 41, 60, -13, -12, -1])
def test_a_truncated_table_is_corrupt(cut: int) -> None:
    blob = table(slots=[(0, 10)])
    with pytest.raises(CorruptDatasetError, match="seek table is damaged"):
        decode(blob[:cut] if cut else b"")


def _with(blob: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(blob)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


@pytest.mark.parametrize("name,mutate", [
    ("huge frame count", lambda b: _with(b, 16, "<I", 0xFFFFFFFF)),
    ("huge slot count", lambda b: _with(b, 20, "<I", 0xFFFFFFFF)),
    ("frames past the end", lambda b: _with(b, 16, "<I", 3)),
    ("bad magic", lambda b: _with(b, 8, "<I", 0)),
    ("bad skippable magic", lambda b: _with(b, 0, "<I", 0x184D2A50 + 0x100)),
    ("bad skippable length", lambda b: _with(b, 4, "<I", 12)),
    ("unknown flags", lambda b: _with(b, 24, "<I", 6)),
    ("other total", lambda b: _with(b, 32, "<Q", 999)),
    ("huge total", lambda b: _with(b, 32, "<Q", 2 ** 64 - 1)),
    ("zero-size frame", lambda b: _with(b, HEAD, "<I", 0)),
    ("frames miss bytes", lambda b: _with(b, HEAD + 4, "<I", 599)),
    ("frames past the uncompressed end", lambda b: _with(b, HEAD + 4, "<I", 0xFFFFFFFF)),
    ("compressed sizes past the copy", lambda b: _with(b, HEAD, "<I", 0xFFFFFFFF)),
    ("slot offset past the end", lambda b: _with(b, HEAD + 48, "<Q", 1001)),
    ("slot offset at 2**64-1", lambda b: _with(b, HEAD + 48, "<Q", 2 ** 64 - 1)),
    ("slot end past the end", lambda b: _with(b, HEAD + 48 + 8, "<I", 1001)),
    ("slot end past the end by its size", lambda b: _with(_with(b, HEAD + 48, "<Q", 999), HEAD + 56, "<I", 0xFFFFFFFF)),
    ("bad trailer length", lambda b: b[:-12] + struct.pack("<I8s", len(b) + 1, b"KVSEEK01")),
])
def test_hostile_tables_are_corrupt(name: str, mutate: object) -> None:
    blob = table(slots=[(0, 10)])
    decode(blob)
    with pytest.raises(CorruptDatasetError) as e:
        decode(mutate(blob))  # type: ignore[operator]
    assert "\n" not in str(e.value) and "000000.mdb.zst" in str(e.value)


def test_table_against_the_manifest() -> None:
    blob = table(slots=[(0, 10)])
    with pytest.raises(CorruptDatasetError, match="slots, the shard has"):
        decode(blob, records=2)
    with pytest.raises(CorruptDatasetError):
        decode(blob, zst_bytes=len(blob) - 1)
    with pytest.raises(CorruptDatasetError):
        decode(blob, total=1001)


def test_random_mutations_raise_only_corrupt_dataset_error() -> None:
    import random

    rng = random.Random(12)
    blob = table(slots=[(0, 10), (5, 995)])
    for _ in range(3000):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.6 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op < 0.8 and b:
                del b[rng.randrange(len(b)):]
            else:
                b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 30)))
        try:
            decode(bytes(b), records=rng.choice([None, 2]))
        except CorruptDatasetError:
            pass


# ---------------------------------------------------------------- shards: values and cuts


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("frames")
    out = []
    rng = np.random.default_rng(5)
    for name, n, make in [
        ("small", 3000, lambda i: rng.bytes(20 + i % 700)),
        ("large", 40, lambda i: {"image": rng.integers(0, 255, size=90_000 + 977 * i, dtype=np.uint8), "label": i}),
        ("mixed", 400, lambda i: rng.bytes(50 if i % 3 else 30_000 + i)),
    ]:
        p = root / f"{name}.kv"
        with kvdata.open(p, "w", shard_size="64MB") as s:
            for i in range(n):
                s.put(f"k{i}", make(i))
            s.seal()
        out.append(p / "shards" / "000000.mdb")
    return out


def test_lmdb_values_match_the_shard_scan(shards: list[Path]) -> None:
    for path in shards:
        rows = scan(path)
        got = frames.lmdb_values(path.read_bytes())
        assert got is not None, path
        assert got["offset"].tolist() == rows["offset"].tolist()
        assert got["size"].tolist() == ((rows["head_kind"] & 0xFFFFFF) + rows["size"]).tolist()


def test_lmdb_values_of_a_file_with_free_pages(tmp_path: Path) -> None:
    """A shard that is not a compacted copy (a tail sealed in place) holds free pages with
    stale nodes: only the B-tree says which values are live."""
    import lmdb

    from kvdata.format import record as rec

    path = tmp_path / "tail.mdb"
    env = lmdb.open(str(path), subdir=False, map_size=64 << 20)
    rng = np.random.default_rng(9)
    for i in range(400):  # one transaction per record: every commit frees the pages it copied
        with env.begin(write=True) as txn:
            txn.put(rec.slot_key(i), rec.encode_record(f"k{i}", rng.bytes(30 + (i * 37) % 9000))[0], append=True)
    env.sync(True)
    env.close()
    lock = path.with_name(path.name + "-lock")
    lock.unlink()
    rows = scan(path)
    got = frames.lmdb_values(path.read_bytes())
    assert got is not None
    assert got["offset"].tolist() == rows["offset"].tolist()
    assert got["size"].tolist() == ((rows["head_kind"] & 0xFFFFFF) + rows["size"]).tolist()


def test_lmdb_values_of_garbage_is_none() -> None:
    import random

    rng = random.Random(3)
    assert frames.lmdb_values(b"") is None
    assert frames.lmdb_values(bytes(8192)) is None
    for _ in range(200):
        assert frames.lmdb_values(rng.randbytes(rng.choice([100, 1024, 8192, 20000]))) is None


def test_frames_never_cut_a_record(shards: list[Path]) -> None:
    for path in shards:
        data = path.read_bytes()
        sl = frames.lmdb_values(data)
        assert sl is not None
        cuts = frames.frame_cuts(len(data), sl, 4096, 64 << 10)
        assert cuts[0][0] == 0 and cuts[-1][1] == len(data)
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
        starts = np.array([a for a, _ in cuts])
        for off, size in zip(sl["offset"].tolist(), sl["size"].tolist()):
            f = int(np.searchsorted(starts, off, "right")) - 1
            assert off + size <= cuts[f][1], (path.name, off, size, cuts[f])
        for a, b in cuts:
            inside = sl[(sl["offset"] >= a) & (sl["offset"] < b)]
            if b - a > 64 << 10:  # only a frame holding one large value may exceed the target ...
                assert len(inside) == 1 and (a, b) == (int(inside["offset"][0]), int(inside["offset"][0] + inside["size"][0])), \
                    (path.name, a, b)  # ... and it is exactly that value: a record read fetches no page padding


def test_a_large_value_is_a_frame_of_exactly_its_bytes() -> None:
    sl = np.zeros(2, dtype=frames.SLOT_DTYPE)
    sl["offset"], sl["size"] = [4096 * 3 + 16, 4096 * 60 + 16], [150_000, 1000]
    cuts = frames.frame_cuts(4096 * 61, sl, 4096, 64 << 10)
    assert (4096 * 3 + 16, 4096 * 3 + 16 + 150_000) in cuts
    assert cuts[0][0] == 0 and cuts[-1][1] == 4096 * 61 and all(x[1] == y[0] for x, y in zip(cuts, cuts[1:]))


def test_compress_file_frames_and_round_trips(shards: list[Path], tmp_path: Path) -> None:
    for path in shards:
        data = path.read_bytes()
        buf = io.BytesIO()
        res = compress_file(path, buf)
        z = buf.getvalue()
        size, sha = res
        assert (size, sha) == (len(z), hashlib.sha256(z).hexdigest())
        assert zstandard.ZstdDecompressor().stream_reader(io.BytesIO(z), read_across_frames=True).read() == data
        t = frames.decode_seek_table(z[-res.seek_bytes:], zst_bytes=len(z), shard_bytes=len(data),
                                     records=len(scan(path)), where=str(path))
        assert t.frames == res.frames > 1 and t.slot_off is not None
        for f in range(t.frames):
            frame = z[int(t.c_off[f]):int(t.c_off[f + 1])]
            assert frames.frame_digest(frame) == t.digests[f].tobytes()
            assert zstandard.ZstdDecompressor().decompress(frame) == data[int(t.u_off[f]):int(t.u_off[f + 1])]
        # the side-index rows give the same copy as the walk over the file
        rows_buf = io.BytesIO()
        assert tuple(compress_file(path, rows_buf, records=scan(path))) == (size, sha)
        # the manifest entry, from the result or from the file
        zpath = tmp_path / (path.name + ".zst")
        zpath.write_bytes(z)
        assert zst_copy_of(zpath) == zst_copy(zpath.name, res)
        assert zst_copy(zpath.name, res).seek_sha256 == hashlib.sha256(z[-res.seek_bytes:]).hexdigest()


def test_a_file_that_is_not_a_shard_is_framed_without_slots(tmp_path: Path) -> None:
    p = tmp_path / "x.mdb"
    p.write_bytes(np.random.default_rng(1).bytes(1 << 20))
    buf = io.BytesIO()
    res = compress_file(p, buf)
    z = buf.getvalue()
    t = frames.decode_seek_table(z[-res.seek_bytes:], zst_bytes=len(z), shard_bytes=1 << 20, records=None, where="x")
    assert t.slot_off is None and t.frames == 8
    assert zstandard.ZstdDecompressor().stream_reader(io.BytesIO(z), read_across_frames=True).read() == p.read_bytes()


def test_record_reads_coalesce_wanted_frames_across_small_gaps() -> None:
    from types import SimpleNamespace

    from kvdata.tiers.records import GAP_BYTES, MAX_RUN, _runs

    # frames: value 0 (150 KB), gap (2 KB), value 1, gap, value 2, a gap too large, value 3
    sizes = [150_000, 2_000, 150_000, 2_000, 150_000, GAP_BYTES + 1, 150_000]
    t = SimpleNamespace(c_off=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
    assert _runs([0, 2, 4, 6], t) == [(0, 5), (6, 7)]   # the gaps ride along; the large one does not
    assert _runs([0, 4], t) == [(0, 1), (4, 5)]         # a wanted frame between is not a gap
    big = SimpleNamespace(c_off=np.arange(0, 12 * (MAX_RUN // 4), MAX_RUN // 4, dtype=np.int64))
    assert all(big.c_off[hi] - big.c_off[lo] <= MAX_RUN for lo, hi in _runs(list(range(10)), big))
