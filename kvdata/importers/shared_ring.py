"""Arrays from import workers to the one writer through an anonymous shared mapping.

Why: an import's workers decode images, but the one writer must get the pixels. Pickled
through the pool's pipe, every 196 KB image is written by the worker, read by the pool's
result thread in 64 KB pieces -- each winning the GIL back from the busy writer -- and
unpickled: measured with bench/imports.py, 2 workers then bought nothing over 1 (wds
0.85-1.15x, tfrecord 0.95-0.97x). Here a worker copies each array into a slice of a mapping
made before the fork and returns only (offset, shape, dtype); the writer reads it in place.

The mapping has no name (no /dev/shm entry: nothing can collide or be left behind) and goes
with the last process that maps it. Who may write where is the caller's protocol: a batch's
tasks each get their own [pos, pos + size) slice of one region, and a region is handed out
again only once the writer is done with the batch that used it (two regions: workers fill
one while the writer drains the other). An array that does not fit its slice, or any array
when there is no mapping (no fork on this platform), travels pickled as before.
"""

from __future__ import annotations

import mmap
from typing import Any, NamedTuple

import numpy as np


class InRing(NamedTuple):
    """An array a worker wrote into the shared mapping: where, its shape and dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


ALIGN = 64  # each array starts on a cache line

# The mapping a pool worker process inherited, set by the pool's initializer in that process only.
_worker_ring: mmap.mmap | None = None


def init_worker(ring: mmap.mmap | None) -> None:
    """The pool's initializer: remember the inherited mapping in this worker process."""
    global _worker_ring
    _worker_ring = ring


class Slice:
    """A worker's [pos, end) of the mapping: places arrays while they fit."""

    def __init__(self, pos: int, size: int) -> None:
        self.ring = _worker_ring
        self.pos, self.end = pos, pos + size

    def place(self, value: Any) -> Any:
        """`value` as an InRing if it is a plain array that fits, else `value` itself."""
        ring = self.ring
        if ring is None or not isinstance(value, np.ndarray) or value.dtype.hasobject:
            return value
        n = value.nbytes
        if self.pos + n > self.end:
            return value
        np.frombuffer(ring, np.uint8, n, self.pos)[:] = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        out = InRing(self.pos, tuple(value.shape), value.dtype.str)
        self.pos += -(-n // ALIGN) * ALIGN
        return out


def view(ring: mmap.mmap | None, value: Any) -> Any:
    """In the writer: an InRing as a read-only view of the mapping (valid until its region
    is handed out again), anything else as it is."""
    if ring is None or not isinstance(value, InRing):
        return value
    dtype = np.dtype(value.dtype)
    count = int(np.prod(value.shape, dtype=np.int64))
    a = np.frombuffer(ring, dtype, count, value.offset).reshape(value.shape)
    a.flags.writeable = False
    return a


def split(items: list[Any], chunks: int, base: int, region_bytes: int) -> list[tuple[int, int, list[Any]]]:
    """A batch's items cut into at most `chunks` runs, in order, each with its own slice
    (pos, size) of the region starting at `base`: [(pos, size, items), ...]."""
    if not items:
        return []
    per = -(-len(items) // max(1, chunks))
    parts = [items[j:j + per] for j in range(0, len(items), per)]
    size = (region_bytes // len(parts)) // ALIGN * ALIGN
    return [(base + j * size, size, part) for j, part in enumerate(parts)]


def make_ring(regions: int, region_bytes: int) -> mmap.mmap:
    """An anonymous shared mapping of `regions` x `region_bytes`, made before the fork."""
    return mmap.mmap(-1, regions * region_bytes)


def close_pool(pool: Any, ring: mmap.mmap | None) -> None:
    """End the worker pool (target.end_pool), then unmap the ring (unless a caller still holds
    a view of it: the mapping then goes with the last view)."""
    if pool is not None:
        from .target import end_pool

        end_pool(pool)
    if ring is not None:
        try:
            ring.close()
        except BufferError:
            pass
