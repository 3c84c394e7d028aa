"""Batch buffers of a DataLoader worker, reused once the main process has let go of them.

Why: a worker that puts each batch in a fresh shared-memory segment pays, per 39 MB batch of
256 images, for creating the segment and faulting in (zeroing) all of its pages before the
one copy that matters. Here each worker keeps a small ring of shared batch buffers and fills
the next free one.

When a buffer is free again -- the return channel: every batch that kvdata.collate hands
to the DataLoader queue carries a lease (the worker's flags tensor, in shared memory, the
slot and the slot's generation). Unpickled in the main process, the lease keeps weak
references to the batch's storages; whenever another batch arrives, leases whose storages
are all gone (the loop dropped the batch, every view of it included) write their
generation into the flags. The worker reuses a slot only when the flags say so, and
otherwise takes another slot, or allocates a one-off buffer when MAX_SLOTS are all out:
it never waits for the main process and never overwrites a batch still referenced there.
A batch collated by something else (torch's default_collate copies the rows) is never
sent, so its slot is free as soon as the worker's next batch starts.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._util.libc import MADV_POPULATE_WRITE, madvise

MAX_SLOTS = 8           # buffers per worker: the DataLoader's prefetch (2) + batches the loop holds
POPULATE_MIN = 1 << 20  # shared-memory buffers at least this large are faulted in with one madvise


def shared_tensor(shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
    """An empty tensor in torch shared memory, its pages populated up front: one madvise
    (MADV_POPULATE_WRITE, Linux 5.14+) instead of a page fault every 4 KiB."""
    tdtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    out = torch.empty(0, dtype=tdtype).set_(storage, 0, shape)  # type: ignore[call-overload]  # (stubs lack it)
    if nbytes >= POPULATE_MIN:
        madvise(out.data_ptr(), nbytes, MADV_POPULATE_WRITE)
    return out


class Lease:
    """A ring slot lent to the main process with one batch."""

    __slots__ = ("flags", "slot", "gen")

    def __init__(self, flags: torch.Tensor, slot: int, gen: int) -> None:
        self.flags, self.slot, self.gen = flags, slot, gen


class _Slot:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.gen = 0          # batches this slot has carried
        self.sent = False     # its current batch went to the main process (released through the flags)


class WorkerRing:
    """The ring of one worker process (made lazily in it; a fork gets its own)."""

    def __init__(self, max_slots: int = MAX_SLOTS) -> None:
        self.max_slots = max_slots
        self.flags = torch.zeros(max_slots, dtype=torch.int64).share_memory_()
        self.slots: list[_Slot] = []
        self.current: int | None = None   # the slot of the batch being assembled
        self.allocations = 0

    def begin(self) -> int | None:
        """Pick the slot for the next batch: one the main process has released (or whose
        last batch never left this process); None when all MAX_SLOTS are out."""
        released = self.flags.tolist()
        for i, s in enumerate(self.slots):
            if not s.sent or released[i] == s.gen:
                s.sent = False
                s.gen += 1
                self.current = i
                return i
        if len(self.slots) < self.max_slots:
            self.slots.append(_Slot())
            s = self.slots[-1]
            s.gen = 1
            self.current = len(self.slots) - 1
            return self.current
        self.current = None
        return None

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype, name: str) -> tuple[np.ndarray, torch.Tensor]:
        """A (rows, ...) buffer for field `name` of the current batch: the slot's own when it
        is large enough (rows beyond the batch unused), else a new one kept by the slot."""
        if self.current is None:
            one_off = shared_tensor(shape, dtype)
            self.allocations += 1
            return one_off.numpy(), one_off
        slot = self.slots[self.current]
        t = slot.tensors.get(name)
        tdtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        if t is None or t.dtype != tdtype or tuple(t.shape[1:]) != tuple(shape[1:]) or t.shape[0] < shape[0]:
            t = slot.tensors[name] = shared_tensor(shape, dtype)
            self.allocations += 1
        view = t[:shape[0]]
        return view.numpy(), view

    def lease(self) -> Lease | None:
        """The current batch goes to the main process: lend its slot."""
        if self.current is None:
            return None
        s = self.slots[self.current]
        s.sent = True
        return Lease(self.flags, self.current, s.gen)


# ---------------------------------------------------------------- the main process's side

# Leases of the batches the main process holds. Module-level because the hook that runs there
# is an unpickling function (Batch.__reduce__): no object of ours lives across batches in the
# main process to hang them on. Process-local, like torch's own shared-storage cache.
_PENDING: list[tuple[list[StorageWeakRef], torch.Tensor, int, int]] = []
_PENDING_LOCK = threading.Lock()


class Batch(dict):
    """kvdata.collate's batch from a worker: a dict of tensors that, unpickled in the main
    process, reports the worker's ring slot it occupies (see the module docstring)."""

    lease: Lease | None = None

    def __reduce__(self) -> Any:
        if self.lease is None:
            return (Batch, (dict(self),))
        return (_rebuild, (dict(self), self.lease.flags, self.lease.slot, self.lease.gen))


def _rebuild(items: dict[str, Any], flags: torch.Tensor, slot: int, gen: int) -> Batch:
    arrived([v for v in items.values() if isinstance(v, torch.Tensor)], Lease(flags, slot, gen))
    return Batch(items)


def arrived(tensors: list[torch.Tensor], lease: Lease) -> None:
    """A batch from a worker was unpickled here: track its storages, and release the slots
    of earlier batches whose storages are all gone."""
    refs = [StorageWeakRef(t.untyped_storage()) for t in tensors]
    with _PENDING_LOCK:
        keep = []
        for entry in _PENDING:
            srefs, flags, slot, gen = entry
            if all(r.expired() for r in srefs):
                flags[slot] = gen
            else:
                keep.append(entry)
        keep.append((refs, lease.flags, lease.slot, lease.gen))
        _PENDING[:] = keep
