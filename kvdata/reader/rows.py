"""Rows of a batch that torch's default_collate stacks back into the batch without copying.

Why: `Dataset.__getitems__` already assembles a whole batch (one copy per sample, straight
from the page cache, into a reused shared-memory buffer inside a DataLoader worker). Handed
to torch's `default_collate` as plain per-sample rows, the batch was copied a second time, into
a fresh shared-memory segment that `torch.UntypedStorage._new_shared` allocates and zero-fills
for every batch (4-5 ms per 39 MB batch on the 2-core VM): 0.36x the speed of `kvdata.collate`.

So each array column's rows are views of the batch tensor, and row 0 is a `BatchRow`: a tensor
subclass that knows the other rows and the batch. `default_collate` (collate_tensor_fn) calls
`torch.stack(rows, 0, out=out)`; when `rows` are exactly this batch's rows, in order, the stack
*is* the batch, so it is returned as it is (with `out` None), or `out` is returned when it is
the batch's own memory. In a worker, collate_tensor_fn first asks row 0's storage for a new
shared storage of the batch's size to stack into: `BatchRow._typed_storage` answers with the
batch's own (ring) storage, so nothing is allocated. Any other stack (a subset, another order,
a foreign tensor) runs torch's own code and copies, as before.

Only row 0 is a subclass (torch consults `__torch_function__` if any tensor of the list has
one), so the other 255 rows cost nothing per operation. Operations on row 0 return plain
tensors. A batch that leaves a worker carries its ring slot's lease (worker_ring.Lease) in its
pickle, whatever container holds it: row 0 and the stacked batch reduce to plain tensors plus
the lease, and the main process reports the slot free once it lets go.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from .worker_ring import Lease, arrived


class LeasedBatch(torch.Tensor):
    """A whole batch column in a worker's ring slot: pickled, it brings the slot's lease along."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # plain tensor semantics, no dispatch cost
    _kv_lease: Lease | None

    def __reduce_ex__(self, proto: Any) -> Any:
        return _reduce(self, getattr(self, "_kv_lease", None))

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return copy.deepcopy(self.as_subclass(torch.Tensor), memo)


class BatchRow(torch.Tensor):
    """Row 0 of a batch column: `torch.stack` of exactly this batch's rows returns the batch."""

    _kv_rest: tuple[torch.Tensor, ...]   # rows 1..n-1 (row 0 is self; no reference cycle)
    _kv_batch: torch.Tensor              # the column, rows stacked
    _kv_lease: Lease | None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.stack:
            whole = _whole_batch(args, kwargs)
            if whole is not None:
                return whole
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _typed_storage(self) -> Any:
        """What collate_tensor_fn asks for a new shared storage to stack into (in a worker):
        answered with the batch's own storage when the size is the batch's."""
        return _BatchStorage(super()._typed_storage(), self._kv_batch)

    def __reduce_ex__(self, proto: Any) -> Any:
        return _reduce(self, getattr(self, "_kv_lease", None))

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return copy.deepcopy(self.as_subclass(torch.Tensor), memo)


class _BatchStorage:
    """Row 0's typed storage, whose `_new_shared` of the batch's size is the batch's storage."""

    def __init__(self, real: Any, batch: torch.Tensor) -> None:
        self._real, self._batch = real, batch

    def _new_shared(self, size: int, *, device: Any = None) -> Any:
        b = self._batch
        if (size == b.numel() and b.storage_offset() == 0 and b.is_contiguous()
                and b.untyped_storage().is_shared()):
            return torch.TypedStorage(wrap_storage=b.untyped_storage(), dtype=b.dtype, _internal=True)
        return self._real._new_shared(size, device=device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _whole_batch(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The batch when torch.stack(args, **kwargs) is exactly the stack of its rows, else None."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not tensors or dim != 0:
        return None
    first = tensors[0]
    if not isinstance(first, BatchRow):
        return None
    rest = first._kv_rest
    if len(tensors) != len(rest) + 1 or any(a is not b for a, b in zip(tensors[1:], rest)):
        return None
    batch = first._kv_batch
    out = kwargs.get("out")
    if out is not None:
        with torch._C.DisableTorchFunctionSubclass():
            same = (out.data_ptr() == batch.data_ptr() and out.shape == batch.shape
                    and out.dtype == batch.dtype and out.stride() == batch.stride())
        if not same:
            return None  # torch's own stack into the caller's buffer
        return _carrier(out, first._kv_lease)
    return _carrier(batch, first._kv_lease)


def _carrier(t: torch.Tensor, lease: Lease | None) -> torch.Tensor:
    if lease is None:
        return t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t
    out = t.as_subclass(LeasedBatch)
    out._kv_lease = lease
    return out


def _reduce(t: torch.Tensor, lease: Lease | None) -> Any:
    plain = t.as_subclass(torch.Tensor)
    if lease is None:
        return (_plain, (plain,))
    return (_arrive, (plain, *lease.carry()))


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t


def _arrive(t: torch.Tensor, flags: torch.Tensor, slot: int, gen: int) -> torch.Tensor:
    """Unpickled in the main process: the tensor lives in a worker's ring slot (see worker_ring)."""
    arrived([t], Lease(flags, slot, gen))
    return t


def column_rows(column: torch.Tensor, n: int, lease: Lease | None) -> list[torch.Tensor]:
    """The n rows of a batch column, row 0 a BatchRow that stacks back to `column[:n]`."""
    batch = column[:n]
    if n == 0:
        return []
    rows = list(batch.unbind(0))
    first = rows[0].as_subclass(BatchRow)
    first._kv_rest = tuple(rows[1:])
    first._kv_batch = batch
    first._kv_lease = lease
    rows[0] = first
    return rows
