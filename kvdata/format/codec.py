"""Cold copies of sealed shards (zstd frames cut at record boundaries plus a seek table,
see kvdata.format.frames) and file digests."""

from __future__ import annotations

import hashlib
import mmap
import os
from typing import BinaryIO

import numpy as np
import zstandard

from . import frames
from .manifest import ZstCopy
from .record import MAX_HEAD, UNKNOWN_OFFSET

CHUNK = 4 << 20


def mapped_file_sha256(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size, hex sha256) of a file this process wrote and nobody else may change (a shard the
    writer just sealed), hashed from a read-only map: no read() copy of every byte into a
    buffer, which on 2 cores is CPU the writer wants while the next tail fills. Not for files
    from outside: a file truncated while mapped faults (SIGBUS) instead of raising."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0, hashlib.sha256().hexdigest()
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
            h = hashlib.sha256()
            mv = memoryview(mm)
            try:
                for at in range(0, size, CHUNK):  # hashlib releases the GIL for each chunk
                    h.update(mv[at:at + CHUNK])
            finally:
                mv.release()
    return size, h.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size, hex sha256) of a file, read in large chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        mv = memoryview(buf)
        while n := f.readinto(buf):
            h.update(mv[:n])
            size += n
    return size, h.hexdigest()


class _HashingWriter:
    """File-like sink that hashes and counts what passes through to `out`."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.out.write(data)


class Compressed(tuple[int, str]):
    """What compress_file returns: (compressed size, sha256) as always -- so `size, sha =
    compress_file(...)` keeps working -- plus the seek table's size and sha256, which the
    manifest's zst entry records (`zst_copy` builds that entry)."""

    seek_bytes: int
    seek_sha256: str | None
    frames: int

    def __new__(cls, size: int, sha256: str, seek_bytes: int = 0, seek_sha256: str | None = None,
                frames: int = 1) -> Compressed:
        obj = super().__new__(cls, (size, sha256))
        obj.seek_bytes, obj.seek_sha256, obj.frames = seek_bytes, seek_sha256, frames
        return obj


def compress_file(src: str | os.PathLike[str], dst: BinaryIO, level: int = 3, *,
                  records: np.ndarray | None = None, frame_size: int | None = None) -> Compressed:
    """Write the framed cold copy of the shard file `src` into `dst` (kvdata.format.frames:
    zstd frames cut at record boundaries, then the seek table); return (compressed size,
    sha256), with the table's size and sha256 as attributes (see `zst_copy`).

    records: the shard's side-index rows (RECORD_DTYPE), if the caller has them; otherwise
    the record boundaries are learned from the LMDB file itself. A file that is not a shard
    laid out as kvdata seals them is still framed (at page boundaries), without a slot
    directory: it can then only be staged whole.

    frame_size: uncompressed bytes per frame; by default it follows the records
    (`frames.frame_target`): a record read fetches its whole frame, so small records get
    small frames."""
    sink = _HashingWriter(dst)
    with open(src, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    try:
        buf = memoryview(mm) if mm is not None else memoryview(b"")
        try:
            slots = _slots_from_rows(records, size) if records is not None else None
            if slots is None and size:
                slots = frames.lmdb_values(buf)
            target = frame_size or frames.frame_target(slots)
            cuts = frames.frame_cuts(size, slots, frames.page_size(buf) if size else 4096, target)
            table: list[tuple[int, int, bytes]] = []
            cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
            for i in range(0, len(cuts), _BATCH):
                batch = cuts[i:i + _BATCH]
                out = _compress_many(cctx, [buf[a:b] for a, b in batch])
                for (a, b), z in zip(batch, out):
                    sink.write(z)
                    table.append((len(z), b - a, frames.frame_digest(z)))
        finally:
            buf.release()
    finally:
        if mm is not None:
            mm.close()
    blob = frames.encode_seek_table(size, table, slots)
    sink.write(blob)
    return Compressed(sink.size, sink.sha.hexdigest(), len(blob), hashlib.sha256(blob).hexdigest(), len(table))


_BATCH = 64  # frames compressed together (on several threads), so memory stays at a few MiB


def _compress_many(cctx: zstandard.ZstdCompressor, parts: list[memoryview]) -> list[bytes]:
    if len(parts) == 1 or sum(len(p) for p in parts) < (1 << 20):
        return [cctx.compress(p) for p in parts]
    res = cctx.multi_compress_to_buffer([bytes(p) for p in parts], threads=-1)
    return [res[i].tobytes() for i in range(len(res))]


def _slots_from_rows(records: np.ndarray, size: int) -> np.ndarray | None:
    """Value ranges (frames.SLOT_DTYPE) from side-index rows; None if any offset is unknown."""
    rows = np.asarray(records)
    if not len(rows) or bool((rows["offset"] == UNKNOWN_OFFSET).any()):
        return None
    out = np.zeros(len(rows), dtype=frames.SLOT_DTYPE)
    out["offset"] = rows["offset"]
    out["size"] = (rows["head_kind"] & MAX_HEAD).astype(np.uint64) + rows["size"].astype(np.uint64)
    end = out["offset"].astype(np.uint64) + out["size"].astype(np.uint64)
    if bool((end > np.uint64(size)).any()):
        return None
    return out


def zst_copy(name: str, compressed: tuple[int, str]) -> ZstCopy:
    """The manifest's entry for a cold copy compress_file wrote (the seek table included)."""
    size, sha = compressed
    seek_bytes = getattr(compressed, "seek_bytes", 0)
    seek_sha = getattr(compressed, "seek_sha256", None)
    return ZstCopy(name, size, sha, seek_bytes, seek_sha) if seek_sha else ZstCopy(name, size, sha)


def zst_copy_of(path: str | os.PathLike[str]) -> ZstCopy:
    """The manifest's entry for an existing .zst file: its size and sha256, and its seek
    table's if it ends with one (an older single-frame copy has none)."""
    size, sha = file_sha256(path)
    name = os.path.basename(os.fspath(path))
    with open(path, "rb") as f:
        if size < frames.MIN_TABLE:
            return ZstCopy(name, size, sha)
        f.seek(size - frames.TRAILER)
        n = frames.table_size_from_trailer(f.read(frames.TRAILER))
        if n is None or n > size:
            return ZstCopy(name, size, sha)
        f.seek(size - n)
        blob = f.read(n)
    return ZstCopy(name, size, sha, n, hashlib.sha256(blob).hexdigest())
