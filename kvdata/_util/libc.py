"""The few libc calls numpy and mmap do not expose (mincore, madvise on raw addresses)."""

from __future__ import annotations

import ctypes
import functools
import mmap
from typing import Any

PAGE_SIZE = mmap.PAGESIZE
PAGE_MASK = ~(PAGE_SIZE - 1)
# Linux madvise advice values mmap does not name on every Python version.
MADV_WILLNEED = 3
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in writable, in one call


@functools.lru_cache(maxsize=1)
def libc() -> Any:
    """The process's C library (loaded once; ctypes handles are thread-safe to call)."""
    return ctypes.CDLL(None, use_errno=True)


def pages_resident(base: int, offsets: tuple[int, ...]) -> bool:
    """Whether the pages holding each address `base + offset` are in the page cache (mincore)."""
    vec = ctypes.create_string_buffer(1)
    mincore = libc().mincore
    for off in offsets:
        page = (base + off) & PAGE_MASK
        if mincore(ctypes.c_void_p(page), ctypes.c_size_t(PAGE_SIZE), vec) != 0 or not vec.raw[0] & 1:
            return False
    return True


def madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) on a page-aligned range around [address, address + length); 0 or -1."""
    start = address & PAGE_MASK
    return int(libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length + (address - start)), advice))
