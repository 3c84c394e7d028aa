"""The machinery under kvdata.Loader and kvdata.BatchReader: threads that fill batches, in
order, into a ring of buffers allocated once and reused (numpy only: BatchReader needs no torch).

Batches are numbered on across iterations. Batch k is filled into slot k % size; asking for
batch k hands back batch k - prefetch, so with 2 * prefetch slots the threads run up to
`prefetch` batches ahead while the loop keeps the last `prefetch` it got. The indices of a
batch are taken from the order under the ring's lock, so batch k always holds the k-th
run of indices whatever thread fills it; an error in a thread stops the others and is
raised in the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

END = object()  # what RingRun.next answers after the last batch

#: alloc(shape, dtype) -> (numpy array to fill, the object handed out for it, e.g. a tensor over it)
Alloc = Callable[[tuple[int, ...], np.dtype], tuple[np.ndarray, Any]]


def numpy_alloc(shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, Any]:
    a = np.empty(shape, dtype=dtype)
    return a, a


class Slot:
    """One batch buffer: per field an array of `rows` rows, allocated on first use and kept
    while the field's row shape and dtype stay the same (fresh=True: a new one every batch)."""

    def __init__(self, rows: int, alloc: Alloc, fresh: bool = False) -> None:
        self.rows, self.alloc, self.fresh = rows, alloc, fresh
        self.arrays: dict[str, np.ndarray] = {}
        self.handles: dict[str, Any] = {}
        self.event: Any = None     # set by a wrapper: wait on it before refilling (a device copy)
        self.allocations = 0

    def array(self, name: str, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """The (rows, *shape) array of field `name`."""
        dtype = np.dtype(dtype)
        a = self.arrays.get(name)
        if self.fresh or a is None or a.shape[1:] != shape or a.dtype != dtype:
            a, handle = self.alloc((self.rows, *shape), dtype)
            self.arrays[name], self.handles[name] = a, handle
            self.allocations += 1
        return a

    def handle(self, name: str, n: int) -> Any:
        """The first n rows of field `name`, as the wrapper hands them out."""
        return self.handles[name][:n]


class Ring:
    """Slots that outlive iterations, and the number of the next batch handed out."""

    def __init__(self, batch_size: int, prefetch: int, alloc: Alloc = numpy_alloc, fresh: bool = False) -> None:
        self.batch_size, self.prefetch = batch_size, prefetch
        self.slots = [Slot(batch_size, alloc, fresh) for _ in range(2 * prefetch)]
        self.serial = 0

    @property
    def allocations(self) -> int:
        return sum(s.allocations for s in self.slots)

    def run(self, indices: Iterator[int], fill: Callable[[Slot, int, list[int]], Any], threads: int,
            drop_last: bool = False, name: str = "kvdata-ring") -> RingRun:
        """Start filling batches of `indices`: fill(slot, batch number, indices) -> batch."""
        return RingRun(self, indices, fill, threads, drop_last, name)


class RingRun:
    """One pass over an order: the filling threads and the consumer's side."""

    def __init__(self, ring: Ring, indices: Iterator[int], fill: Callable[[Slot, int, list[int]], Any],
                 threads: int, drop_last: bool, name: str) -> None:
        self.ring, self.indices, self.fill, self.drop_last = ring, indices, fill, drop_last
        self.size = len(ring.slots)
        self.cond = threading.Condition()
        self.next_fill = ring.serial                          # the next batch number a thread takes
        self.asked = ring.serial                              # the batch the consumer asks for next
        self.released = ring.serial - 1 - ring.prefetch       # batches up to this one may be overwritten
        self.ready: dict[int, Any] = {}
        self.end: int | None = None                           # the number of the first batch not there
        self.stop = False
        self.failure: BaseException | None = None
        self.threads = [threading.Thread(target=self._fill_loop, name=f"{name}-{i}", daemon=True)
                        for i in range(threads)]
        for t in self.threads:
            t.start()

    def _take(self) -> tuple[int, list[int]] | None:
        """The next batch number and its indices (taken in order under the lock), once its
        slot is free; None when there is nothing more to fill."""
        bs = self.ring.batch_size
        with self.cond:
            while not self.stop and self.end is None and self.next_fill - self.released > self.size:
                self.cond.wait()
            if self.stop or self.end is not None:
                return None
            j = self.next_fill
            idx: list[int] = []
            for i in self.indices:
                idx.append(int(i))
                if len(idx) == bs:
                    break
            if not idx or (self.drop_last and len(idx) < bs):
                self.end = j
                self.cond.notify_all()
                return None
            self.next_fill += 1
            return j, idx

    def _fill_loop(self) -> None:
        try:
            while True:
                got = self._take()
                if got is None:
                    return
                j, idx = got
                batch = self.fill(self.ring.slots[j % self.size], j, idx)
                with self.cond:
                    self.ready[j] = batch
                    self.cond.notify_all()
        except BaseException as e:  # handed to the consumer, never swallowed
            with self.cond:
                if self.failure is None:
                    self.failure = e
                self.stop = True
                self.cond.notify_all()

    def next(self) -> tuple[int, Any]:
        """(batch number, batch) of the next batch once filled; (n, END) after the last one.
        A filling thread's error is raised here."""
        j = self.asked
        with self.cond:
            # asking for batch j hands back batch j - prefetch: its buffer may be refilled
            self.released = max(self.released, j - self.ring.prefetch)
            self.cond.notify_all()
            while j not in self.ready and not (self.end is not None and j >= self.end) and not self.stop:
                self.cond.wait()
            item = self.ready.pop(j, END)
            failure = self.failure
        if failure is not None:
            self.close()
            raise failure
        if item is not END:
            self.asked = j + 1
        return j, item

    def close(self) -> None:
        """Stop the threads (a batch being filled is finished first); the ring goes on from
        the last batch handed out. Idempotent."""
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        me = threading.current_thread()
        for t in self.threads:
            if t is not me:
                t.join()
        self.ring.serial = max(self.ring.serial, self.asked)
