"""Batch buffers of a DataLoader worker, reused once the main process has let go of them.

Why: a worker that puts each batch in a fresh shared-memory segment pays, per 39 MB batch of
256 images, for creating the segment and faulting in (zeroing) all of its pages before the
one copy that matters. Here each worker keeps a small ring of shared batch buffers and fills
the next free one.

When a buffer is free again -- the return channel: a batch's slot is lent (leased) as soon as
the batch is assembled, since anything made from it may leave the process. What carries the
lease in its pickle -- kvdata.collate's Batch, and the rows and stacked columns of
reader/torch_seam.py that torch's default_collate passes through -- reports to the main process,
where, unpickled, the lease keeps weak references to the batch's storages; whenever another
batch arrives, slots whose storages are all gone there (the loop dropped the batch, every view
of it included) get their generation written into the worker's shared flags. The worker
reuses a slot when the flags say so, or when nothing that carries its lease was ever pickled
and nothing in the worker refers to it any more (a collate_fn that copied the rows: nothing of
the slot left the process). Otherwise it takes another slot, or allocates a one-off buffer when
MAX_SLOTS are all out: it never waits for the main process and never overwrites a batch still
referenced there. (A collate_fn that sends, from a worker, views it cut from the rows itself,
without the rows or their stack, sends slot memory without the lease: copy those views.)
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import torch

from .._util.libc import MADV_POPULATE_WRITE, madvise
from .torch_seam import StorageRef, shared_storage

MAX_SLOTS = 8           # buffers per worker: the DataLoader's prefetch (2) + batches the loop holds
POPULATE_MIN = 1 << 20  # shared-memory buffers at least this large are faulted in with one madvise


def shared_tensor(shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
    """An empty tensor in torch shared memory, its pages populated up front: one madvise
    (MADV_POPULATE_WRITE, Linux 5.14+) instead of a page fault every 4 KiB."""
    tdtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    storage = shared_storage(max(nbytes, 1))
    out = torch.empty(0, dtype=tdtype).set_(storage, 0, shape)  # type: ignore[call-overload]  # (stubs lack it)
    if nbytes >= POPULATE_MIN:
        madvise(out.data_ptr(), nbytes, MADV_POPULATE_WRITE)
    return out


class _Slot:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.gen = 0          # batches this slot has carried
        self.sent = False     # its current batch is lent (released through the flags, or found unused)
        self.carried = False  # something carrying its lease was pickled (it may be in the main process)
        self.lease_ref: weakref.ref[Lease] | None = None  # alive while the worker still holds the batch


class Lease:
    """A ring slot lent with one batch: (flags, slot, generation) is what travels in a pickle."""

    __slots__ = ("flags", "slot", "gen", "_state", "__weakref__")

    def __init__(self, flags: torch.Tensor, slot: int, gen: int, state: _Slot | None = None) -> None:
        self.flags, self.slot, self.gen, self._state = flags, slot, gen, state

    def carry(self) -> tuple[torch.Tensor, int, int]:
        """What a pickle carries to the main process; the slot now waits for its release there."""
        if self._state is not None:
            self._state.carried = True
        return self.flags, self.slot, self.gen

    def reduce(self, plain: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        """How a tensor of the slot pickles with its lease (torch_seam.Carrier): rebuilt in the
        main process, it reports its arrival there."""
        return (_arrive, (plain, *self.carry()))


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
            if not s.sent or released[i] == s.gen or (
                    not s.carried and (s.lease_ref is None or s.lease_ref() is None)):
                s.sent = s.carried = False
                s.lease_ref = None
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

    def disown(self) -> None:
        """Give up the current slot's buffers: the batch in them is handed out in a way that does
        not carry the lease (plain rows), so they stay the batch's alone, one-off buffers freed
        with it; the slot gets new buffers next time. No lease follows (`lease` gives None)."""
        if self.current is not None:
            self.slots[self.current].tensors.clear()
            self.current = None

    def lease(self) -> Lease | None:
        """Lend the current batch's slot (None for a one-off buffer, never reused). The slot
        stays lent while the returned lease is alive in this process, and after that until the
        main process releases it if anything carrying the lease was pickled."""
        if self.current is None:
            return None
        s = self.slots[self.current]
        s.sent = True
        lease = Lease(self.flags, self.current, s.gen, s)
        s.lease_ref = weakref.ref(lease)
        return lease


# ---------------------------------------------------------------- the main process's side

# Leases of the batches the main process holds, by (worker flags, slot, generation): one batch
# may arrive as several pickled objects (the columns of a default_collate'd dict). Module-level
# because the hook that runs there is an unpickling function (Batch.__reduce__, Lease.reduce): no
# object of ours lives across batches in the main process to hang them on. Process-local, like
# torch's own shared-storage cache.
_PENDING: dict[tuple[int, int, int], tuple[list[StorageRef], torch.Tensor]] = {}
_PENDING_LOCK = threading.Lock()


class Batch(dict):
    """kvdata.collate's batch from a worker: a dict of tensors that, unpickled in the main
    process, reports the worker's ring slot it occupies (see the module docstring)."""

    lease: Lease | None = None

    def __reduce__(self) -> Any:
        if self.lease is None:
            return (Batch, (dict(self),))
        return (_rebuild, (dict(self), *self.lease.carry()))


def _rebuild(items: dict[str, Any], flags: torch.Tensor, slot: int, gen: int) -> Batch:
    arrived([v for v in items.values() if isinstance(v, torch.Tensor)], Lease(flags, slot, gen))
    return Batch(items)


def _arrive(t: torch.Tensor, flags: torch.Tensor, slot: int, gen: int) -> torch.Tensor:
    """Unpickled in the main process: a tensor (a row or column) that lives in a worker's ring slot."""
    arrived([t], Lease(flags, slot, gen))
    return t


def arrived(tensors: list[torch.Tensor], lease: Lease) -> None:
    """A batch from a worker was unpickled here: track its storages, and release the slots
    of earlier batches whose storages are all gone."""
    refs = [StorageRef(t) for t in tensors]
    key = (lease.flags.untyped_storage().data_ptr(), lease.slot, lease.gen)
    with _PENDING_LOCK:
        for k, (srefs, flags) in list(_PENDING.items()):
            if k != key and all(r.expired() for r in srefs):
                flags[k[1]] = k[2]
                del _PENDING[k]
        held = _PENDING.get(key)
        _PENDING[key] = ((held[0] if held else []) + refs, lease.flags)
