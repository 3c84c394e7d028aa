"""Stacking samples into batches: one copy per sample, straight into the batch array.

Array fields of equal shape go into one (N, ...) array copied once from each sample's
zero-copy view; variable-length arrays (equal but for the first dimension) into one flat
array plus offsets (Ragged); scalars become a 1-D array; other arrays (owned copies), bytes
and str stay lists.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

ArrayAlloc = Callable[[tuple, np.dtype], np.ndarray]  # (shape, dtype) -> the array a batch field is stacked into


class Ragged(NamedTuple):
    """A variable-length field of a batch: sample i is values[offsets[i]:offsets[i + 1]] --
    one flat array along the first axis (numpy, or torch tensors from the torch side), not a
    list of per-sample arrays."""

    values: Any
    offsets: Any


def ragged(arrays: Sequence[np.ndarray], alloc: ArrayAlloc | None = None) -> Any:
    """Arrays of one dtype that differ only in their first dimension as Ragged (values from
    `alloc` if given); anything else as a list of owned, writable copies."""
    a0 = arrays[0]
    if a0.ndim >= 1 and all(a.ndim == a0.ndim and a.dtype == a0.dtype and a.shape[1:] == a0.shape[1:]
                            for a in arrays):
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        values = (alloc or np.empty)((int(offsets[-1]), *a0.shape[1:]), a0.dtype)
        for a, lo, hi in zip(arrays, offsets[:-1].tolist(), offsets[1:].tolist()):
            values[lo:hi] = a
        return Ragged(values, offsets)
    return [np.array(a) for a in arrays]


class Copier:
    """Assembles batches, splitting large ones across a few threads.

    numpy releases the GIL while it copies, so on a machine with idle cores a
    39 MB batch of 256 images assembles ~1.6x faster with 2 threads. Small
    batches are copied inline (thread hand-off would cost more than it saves).
    Inside DataLoader workers use threads=1: the workers are the parallelism.
    """

    def __init__(self, threads: int | None = None, min_bytes: int = 8 << 20) -> None:
        if threads is None:
            threads = min(4, len(os.sched_getaffinity(0)))
        self.threads = max(1, int(threads))
        self.min_bytes = min_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():  # thread pools do not survive fork
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvdata-copy")
            self._pid = os.getpid()
        return self._pool

    def stack_arrays(self, arrays: Sequence[np.ndarray], out: np.ndarray | None = None,
                     alloc: ArrayAlloc | None = None) -> Any:
        """(N, ...) array of same-shape arrays (into `out`, or from `alloc`); Ragged (or a list
        of copies) if their shapes differ (see `ragged`)."""
        a0 = arrays[0]
        n = len(arrays)
        if any(a.shape != a0.shape or a.dtype != a0.dtype for a in arrays):
            return ragged(arrays, alloc)
        if out is None:
            out = (alloc or np.empty)((n,) + a0.shape, a0.dtype)
        if self.threads == 1 or a0.nbytes * n < self.min_bytes:
            for i, a in enumerate(arrays):
                out[i] = a
            return out
        step = -(-n // self.threads)

        def part(lo: int) -> None:
            for i in range(lo, min(n, lo + step)):
                out[i] = arrays[i]

        list(self._executor().map(part, range(0, n, step)))
        return out

    def run_parts(self, fn: Callable[[int, int], None], n: int, nbytes: int) -> None:
        """Run fn(lo, hi) over [0, n) in up to `threads` parts (inline when small);
        fn must only do GIL-releasing numpy work on disjoint rows to gain."""
        if self.threads == 1 or nbytes < self.min_bytes or n < 2:
            fn(0, n)
            return
        step = -(-n // self.threads)
        futures = [self._executor().submit(fn, lo, min(n, lo + step)) for lo in range(0, n, step)]
        for f in futures:
            f.result()

    def stack(self, samples: Sequence[Any], alloc: ArrayAlloc | None = None) -> Any:
        """Records (dicts) as batch columns, array fields assembled by stack_arrays (into
        arrays from `alloc(shape, dtype)` if given, e.g. shared memory); others as a list."""
        if not samples or not isinstance(samples[0], dict):
            return list(samples)
        out = {}
        for name, v in samples[0].items():
            if isinstance(v, np.ndarray):
                out[name] = self.stack_arrays([s[name] for s in samples], alloc=alloc)
            elif isinstance(v, (bool, int, float)):
                out[name] = np.array([s[name] for s in samples])
            else:
                out[name] = [s[name] for s in samples]
        return out

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=True)
        self._pool = None
