"""Every use of torch's private API in kvdata, behind one seam, and the self-check that decides,
once per process, whether the zero-copy collate works on the installed torch.

Why one module: kvdata asks for `torch>=2.1`, not one release, and nothing promises that a
private name (a leading underscore, `torch._C`) keeps its meaning from one release to the next.
Here is all of it, each use with its reason and a way out where one exists; every other module
uses only the public functions and classes below:

- the zero-copy rows (`column_rows`: `BatchRow`, `LeasedBatch`) answer the
  `_typed_storage()._new_shared(...)` call that torch's `default_collate` (collate_tensor_fn)
  makes on row 0 in a DataLoader worker, build a `torch.TypedStorage(..., _internal=True)`,
  and use `torch._C._disabled_torch_function_impl` and `torch._C.DisableTorchFunctionSubclass`
  to keep tensor-subclass dispatch off everything but `torch.stack`;
- `shared_storage` (the worker ring's batch buffers) calls `torch.UntypedStorage._new_shared`,
  falling back to public calls (one extra pass over the new pages) when it is gone;
- `StorageRef` (the main process's side of the ring's return channel) wraps
  `torch.multiprocessing.reductions.StorageWeakRef`; without it a reference never expires, so a
  worker never reuses a buffer the main process may still hold (it allocates new ones instead).

The zero-copy rows -- why: `Dataset.__getitems__` already assembles a whole batch (one copy per
sample, straight from the page cache, into a reused shared-memory buffer inside a worker).
Handed to `default_collate` as plain per-sample rows, the batch was copied a second time, into a
fresh shared-memory segment that `torch.UntypedStorage._new_shared` allocates and zero-fills
for every batch (4-5 ms per 39 MB batch on the 2-core VM): 0.36x the speed of `kvdata.collate`.
So each array column's rows are views of the batch tensor, and row 0 is a `BatchRow`: a tensor
subclass that knows the other rows and the batch. collate_tensor_fn calls
`torch.stack(rows, 0, out=out)`; when `rows` are exactly this batch's rows, in order, the stack
*is* the batch, so it is returned as it is (with `out` None), or `out` is returned when it is
the batch's own memory. In a worker, collate_tensor_fn first asks row 0's storage for a new
shared storage of the batch's size to stack into: `BatchRow._typed_storage` answers with the
batch's own (ring) storage, so nothing is allocated. Any other stack (a subset, another order,
a foreign tensor) runs torch's own code and copies, as before. Only row 0 is a subclass (torch
consults `__torch_function__` if any tensor of the list has one), so the other rows cost nothing
per operation; operations on row 0 return plain tensors. A batch that leaves a worker carries
its ring slot's lease (worker_ring.Lease, a `Carrier` here) in its pickle, whatever container
holds it: row 0 and the stacked batch reduce to plain tensors plus the lease.

The self-check -- why: all of the above leans on how one torch release's collate_tensor_fn and
tensor subclasses behave; a release that changes them could make the rows copy, fail, or (the
worst case) stack the wrong memory, silently. So before a process hands out zero-copy rows,
`zero_copy_collate_works()` runs a tiny batch through `torch.utils.data.default_collate` the way
this process will call it (in a worker, with the batch in shared memory, so the `_new_shared`
path is taken; in the main process torch just stacks), with and without a lease, and checks that
the result equals the batch, is the batch's own memory, and that a partial stack still copies.
Any exception or missing attribute counts as a failure. On failure the Dataset hands out plain
tensor rows (correct; default_collate copies them once more, as it would anyone's), and a
`ZeroCopyCollateWarning` says so once per process, naming the torch version and the fast options
(`kvdata.collate`, `kvdata.Loader`); nothing raises. The verdict is kept per process (a forked
worker inherits the parent's, sees another pid and checks again: its collate takes the worker
path).

KVDATA_ZERO_COPY_COLLATE=off (a test and diagnostic switch, not a tuning knob): the self-check
still runs but its verdict is "does not work", so the fallback and its warning are the real ones.
Set in the environment, it reaches DataLoader workers, forked or spawned. Any other value, or
none, leaves the verdict to the self-check. It is read each time a verdict is asked for, and a
change (only tests change it within a process) is judged again.
"""

from __future__ import annotations

import copy
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.utils.data

try:  # private: the main process's weak reference to a storage shared by a worker
    from torch.multiprocessing.reductions import StorageWeakRef as _StorageWeakRef
except ImportError:  # pragma: no cover - not on any torch this project has seen
    _StorageWeakRef = None  # type: ignore[assignment,misc]

ENV = "KVDATA_ZERO_COPY_COLLATE"
_OFF = "off"

# private: a __torch_function__ that turns dispatch off for a subclass (plain tensor semantics,
# no cost per operation); None if this torch has none (the self-check then fails)
_DISABLED_IMPL: Any = getattr(torch._C, "_disabled_torch_function_impl", None)


class ZeroCopyCollateWarning(UserWarning):
    """torch's default_collate cannot take kvdata.Dataset's rows without a copy on this torch
    (the self-check of kvdata/reader/torch_seam.py failed): batches are correct, one copy slower.
    Silence it with warnings.filterwarnings("ignore", category=kvdata.reader.torch_seam.ZeroCopyCollateWarning)."""


# ---------------------------------------------------------------- the worker ring's storage calls

def shared_storage(nbytes: int) -> torch.UntypedStorage:
    """A new CPU storage of `nbytes` in shared memory (it crosses to another process as a file
    descriptor, no copy). torch's own `UntypedStorage._new_shared` maps it without touching the
    pages; without it, `share_memory_` of a new tensor moves it there (one pass more)."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is not None:
        try:
            return new_shared(nbytes)
        except TypeError:  # another signature: the public way below
            pass
    return torch.empty(nbytes, dtype=torch.uint8).share_memory_().untyped_storage()


class StorageRef:
    """A weak reference to the memory (storage) behind a tensor: expired once no tensor of this
    process uses it any more, whichever view or Python object held it. Without torch's
    StorageWeakRef it never expires: the memory is then taken to be in use for good (safe: a
    worker never reuses a buffer that is still referenced; it allocates another)."""

    __slots__ = ("_ref",)

    def __init__(self, t: torch.Tensor) -> None:
        self._ref: Any = None
        if _StorageWeakRef is not None:
            try:
                self._ref = _StorageWeakRef(t.untyped_storage())
            except Exception:  # another torch: never expires (see above)
                self._ref = None

    def expired(self) -> bool:
        return self._ref is not None and bool(self._ref.expired())


# ---------------------------------------------------------------- the zero-copy rows

class Carrier(Protocol):
    """What rides along in a batch's pickle (worker_ring.Lease): `reduce(plain)` gives the
    (callable, args) that rebuild `plain` on the other side and report its arrival there."""

    def reduce(self, plain: torch.Tensor) -> tuple[Callable[..., Any], tuple[Any, ...]]: ...


class LeasedBatch(torch.Tensor):
    """A whole batch column in a worker's ring slot: pickled, it brings the slot's lease along."""

    # plain tensor semantics, no dispatch cost (private; a torch without it fails the self-check)
    __torch_function__ = _DISABLED_IMPL if _DISABLED_IMPL is not None else torch.Tensor.__torch_function__
    _kv_lease: Carrier | None

    def __reduce_ex__(self, proto: Any) -> Any:
        return _reduce(self, getattr(self, "_kv_lease", None))

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return copy.deepcopy(self.as_subclass(torch.Tensor), memo)


class BatchRow(torch.Tensor):
    """Row 0 of a batch column: `torch.stack` of exactly this batch's rows returns the batch."""

    _kv_rest: tuple[torch.Tensor, ...]   # rows 1..n-1 (row 0 is self; no reference cycle)
    _kv_batch: torch.Tensor              # the column, rows stacked
    _kv_lease: Carrier | None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.stack:
            whole = _whole_batch(args, kwargs)
            if whole is not None:
                return whole
        with torch._C.DisableTorchFunctionSubclass():  # private: torch's own op, plain results
            return func(*args, **kwargs)

    def _typed_storage(self) -> Any:
        """Private torch API, answered: what collate_tensor_fn asks for a new shared storage to
        stack into (in a worker); its `_new_shared` of the batch's size is the batch's storage."""
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


def _carrier(t: torch.Tensor, lease: Carrier | None) -> torch.Tensor:
    if lease is None:
        return t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t
    out = t.as_subclass(LeasedBatch)
    out._kv_lease = lease
    return out


def _reduce(t: torch.Tensor, lease: Carrier | None) -> Any:
    plain = t.as_subclass(torch.Tensor)
    if lease is None:
        return (_plain, (plain,))
    return lease.reduce(plain)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t


def column_rows(column: torch.Tensor, n: int, lease: Carrier | None) -> list[torch.Tensor]:
    """The n rows of a batch column, row 0 a BatchRow that stacks back to `column[:n]`.
    Hand them out only where zero_copy_collate_works() says so (else: plain rows)."""
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


# ---------------------------------------------------------------- the self-check

class _CheckLease:
    """The self-check's lease: counts the pickles that carried it."""

    def __init__(self) -> None:
        self.carried = 0

    def reduce(self, plain: torch.Tensor) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        self.carried += 1
        return (_plain, (plain,))


def _collate_check() -> str | None:
    """Run a tiny batch through default_collate as this process will: None if the result is the
    batch itself (values and memory), else why not. Never raises."""
    try:
        if _DISABLED_IMPL is None:
            return "torch._C._disabled_torch_function_impl is missing"
        n, width = 3, 5
        in_worker = torch.utils.data.get_worker_info() is not None
        if in_worker:  # collate_tensor_fn asks row 0 for a new shared storage: the batch's, if shared
            column = torch.empty(0, dtype=torch.int64).set_(shared_storage(n * width * 8), 0, (n, width))  # type: ignore[call-overload]
        else:
            column = torch.empty((n, width), dtype=torch.int64)
        expect = torch.arange(n * width, dtype=torch.int64).reshape(n, width)
        column.copy_(expect)
        for lease in (None, _CheckLease()):
            rows = column_rows(column, n, lease)
            got = torch.utils.data.default_collate([{"x": r, "i": i} for i, r in enumerate(rows)])["x"]
            if not isinstance(got, torch.Tensor) or type(got) not in (torch.Tensor, LeasedBatch):
                return f"default_collate returned a {type(got).__name__}"
            if got.shape != expect.shape or got.dtype != expect.dtype or not torch.equal(got, expect):
                return "default_collate returned other values than the batch's"
            if got.data_ptr() != column.data_ptr():
                return f"default_collate copied the batch ({'worker' if in_worker else 'main process'} path)"
            if type(got + 0) is not torch.Tensor or type(rows[0][1:]) is not torch.Tensor:
                return "operations on the rows do not return plain tensors"
            part = torch.stack(rows[::-1])
            if part.data_ptr() == column.data_ptr() or not torch.equal(part, expect.flip(0)):
                return "a stack of other rows than the batch's is not torch's own"
            if isinstance(lease, _CheckLease):
                back = pickle.loads(pickle.dumps((got, rows[0])))
                if lease.carried != 2 or not torch.equal(back[0], expect) or not torch.equal(back[1], expect[0]):
                    return "the batch's lease does not travel in its pickle"
    except Exception as e:  # a missing attribute, another signature: the zero-copy path does not work
        return f"{type(e).__name__}: {e}"
    return None


class ZeroCopyCheck:
    """This process's verdict on the zero-copy rows: the self-check's, once per process (and per
    value of KVDATA_ZERO_COPY_COLLATE), with its one warning when they do not work.

    The state is (pid, setting, verdict) in one attribute, replaced whole: a forked child reads
    its parent's, sees another pid and checks again; the lock, remade in a forked child, only
    keeps two threads from checking (and warning) at once."""

    def __init__(self) -> None:
        self._state: tuple[int, str, bool] | None = None
        self._lock = threading.Lock()
        self.reason: str | None = None  # why the last check failed (None: it passed)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def works(self) -> bool:
        setting = os.environ.get(ENV, "").strip().lower()
        state = self._state
        pid = os.getpid()
        if state is not None and state[0] == pid and state[1] == setting:
            return state[2]
        with self._lock:
            state = self._state
            if state is not None and state[0] == pid and state[1] == setting:
                return state[2]
            reason = _collate_check()
            if reason is None and setting == _OFF:
                reason = f"{ENV}=off"
            self.reason = reason
            self._state = (pid, setting, reason is None)
        if reason is not None:
            warnings.warn(
                f"kvdata: torch {torch.__version__} failed kvdata's zero-copy collate self-check ({reason}); "
                "kvdata.Dataset now hands out plain tensor rows, which torch's default_collate copies once more "
                "per batch (correct, slower). DataLoader(ds, collate_fn=kvdata.collate, ...) and kvdata.Loader "
                "keep the one-copy path. Silence this with warnings.filterwarnings('ignore', "
                "category=kvdata.reader.torch_seam.ZeroCopyCollateWarning).", ZeroCopyCollateWarning, stacklevel=4)
        return reason is None


ZERO_COPY = ZeroCopyCheck()
os.register_at_fork(after_in_child=ZERO_COPY._after_fork)


def zero_copy_collate_works() -> bool:
    """Whether this process may hand out zero-copy rows (column_rows): the self-check's verdict,
    decided at the first call in each process (a warning, once, when it fails)."""
    return ZERO_COPY.works()
