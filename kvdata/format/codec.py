"""zstd frames for cold copies of sealed shards, streamed, and file digests."""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO

import zstandard

CHUNK = 4 << 20


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


def compress_file(src: str | os.PathLike[str], dst: BinaryIO, level: int = 3) -> tuple[int, str]:
    """Write a zstd frame of `src` into `dst`; return (compressed size, sha256)."""
    sink = _HashingWriter(dst)
    cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_content_size=True, write_checksum=True)
    with open(src, "rb") as f:
        cctx.copy_stream(f, sink, size=  # type: ignore[arg-type]  # any object with write() will do
                         os.fstat(f.fileno()).st_size, read_size=CHUNK, write_size=CHUNK)
    return sink.size, sink.sha.hexdigest()

