"""kvdata.Loader: batches filled by threads into a ring of buffers allocated once and reused.

Why not a DataLoader: once reading a sample is a memory copy (kvdata's sealed shards are
mapped, a record is its bytes), what costs is everything around the copy -- a fresh batch
array per batch (allocated and page-faulted every time: 39 MB for 256 images), worker
processes handing each batch over through a new shared-memory segment, a per-sample
collate. Here a few threads copy samples straight from the page cache into batch buffers
that are allocated once (pinned, if asked) and reused round-robin; numpy releases the GIL
while it copies, so threads are enough. FFCV's Loader showed the way (pre-allocated pages,
threads, pinned memory).

Validity: a batch handed out lives in the ring. It stays valid until the loop has asked for
`prefetch` more batches; then its buffer is refilled. Keep a batch longer with
`copy=True` (every batch an owned copy) or `.clone()`. With `device=`, the batch is on the
device and owns its memory; the host buffer is refilled only after its copy finished.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any

import numpy as np
import torch

from ..errors import KVDataError
from ..store.stacking import Ragged, ragged
from .dataset import Dataset
from .ring import END, Ring, RingRun, Slot


def _torch_dtype(dtype: np.dtype) -> torch.dtype | None:
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except (TypeError, ValueError):
        return None


def _tensor_alloc(pin: bool, as_torch: bool) -> Any:
    """The ring's allocator: torch tensors (pinned if asked) where torch has the dtype."""

    def alloc(shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, Any]:
        tdtype = _torch_dtype(dtype) if (as_torch or pin) else None
        if tdtype is None:
            a = np.empty(shape, dtype=dtype)
            return a, (torch.from_numpy(a) if as_torch and _torch_dtype(dtype) is not None else a)
        t = torch.empty(shape, dtype=tdtype, pin_memory=pin)
        return t.numpy(), (t if as_torch else t.numpy())

    return alloc


class Loader:
    """Iterate over batches of a kvdata dataset, filled by `threads` threads into a ring of
    2 * `prefetch` reused buffers.

    dataset: a kvdata.Dataset, or a path / URL (opened as kvdata.Dataset(path, fields=fields)).
    sampler: any iterable of sample indices (kvdata.ShardShuffleSampler, a torch sampler,
      DistributedSampler, a list); None reads 0 .. len-1 in order. Call `set_epoch(e)` to pass
      the epoch to a sampler that has set_epoch.
    Batches are dicts of tensors (`to="numpy"`: numpy arrays): array fields of one shape are
    (N, ...) arrays, numbers (N,), variable-length arrays a Ragged(values, offsets), bytes and
    str fields lists; a dataset of raw byte records gives lists of bytes.
    pin_memory: the ring is page-locked (needs an accelerator; without one, a warning and
      ordinary memory, as DataLoader does). device: each batch is copied there with
      non_blocking=True on a side stream, and the consumer's stream waits on an event.
    transform: a function of the whole batch (a dict), run in the filling threads on the CPU
      or, with `device`, on the device after the copy (e.g. uint8 HWC -> float NCHW, crops).
    copy: hand out owned copies instead of ring buffers (they stay valid forever).
    """

    def __init__(self, dataset: Dataset | str | os.PathLike[str], batch_size: int, *,
                 sampler: Iterable[int] | None = None, threads: int = 2, prefetch: int = 2,
                 pin_memory: bool = False, device: str | torch.device | None = None,
                 fields: Sequence[str] | None = None, drop_last: bool = False,
                 transform: Callable[[Any], Any] | None = None, to: str = "torch", copy: bool = False) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if int(threads) < 1 or int(prefetch) < 1:
            raise ValueError(f"threads and prefetch must be >= 1, got threads={threads}, prefetch={prefetch}")
        if to not in ("torch", "numpy"):
            raise ValueError(f"to must be 'torch' or 'numpy', got {to!r}")
        self.dataset = dataset if isinstance(dataset, Dataset) else Dataset(dataset, fields=fields)
        self.batch_size, self.threads, self.prefetch = int(batch_size), int(threads), int(prefetch)
        self.sampler = sampler
        self.fields = list(fields) if fields is not None else None
        self.drop_last, self.transform, self.to, self.copy = bool(drop_last), transform, to, bool(copy)
        self.device = torch.device(device) if device is not None else None
        if self.device is not None:
            if to != "torch":
                raise ValueError("device= hands out tensors on that device; it cannot be combined with to='numpy'")
            if self.device.type == "cuda" and not torch.cuda.is_available():
                raise KVDataError(f"Loader(device={str(device)!r}): torch.cuda is not available (a CPU-only torch "
                                  "build, or no GPU visible); leave device unset to get CPU tensors")
        self.pin_memory = bool(pin_memory)
        if self.pin_memory and not torch.cuda.is_available():
            warnings.warn("kvdata.Loader(pin_memory=True): no accelerator is available, so the batch buffers are "
                          "ordinary memory", stacklevel=2)
            self.pin_memory = False
        self.epoch = 0
        self._consumed = 0          # batches the loop has received this epoch
        self._start_at = 0          # where the next iteration starts (load_state_dict)
        self._skip = 0              # ... by skipping that many batches of a sampler without a state of its own
        self._finished = False      # the last iteration ran to its end: a state taken now starts epoch + 1
        self._run: RingRun | None = None
        self._store_lock = threading.Lock()   # the store's reader is used by one thread at a time
        # the ring outlives iterations: epochs reuse it, numbering batches on from the last one
        # handed out, so the last `prefetch` batches of an epoch stay valid into the next
        self._ring = Ring(self.batch_size, self.prefetch, _tensor_alloc(self.pin_memory, to == "torch"))
        self._stream = torch.cuda.Stream() if self.device is not None and self.device.type == "cuda" else None

    @property
    def allocations(self) -> int:
        """Buffers the ring has allocated so far (one per slot and field while shapes stay)."""
        return self._ring.allocations

    def __len__(self) -> int:
        sampler = self.sampler
        n = len(sampler) if isinstance(sampler, Sized) else len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (passed on to the sampler's set_epoch)."""
        self.epoch = int(epoch)
        self._finished = False
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self.epoch)

    # ------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is: the epoch and the batches it has received (not those filled
        ahead), and the sampler's own state at that point when it has one. Once an iteration
        has run to its end (and until set_epoch), it is the next epoch's start, {"epoch":
        epoch + 1, "batches": 0}: loading it never replays the finished epoch, and
        `range(loader.epoch, epochs)` after load_state_dict goes on with the right one."""
        if self._finished:
            return {"epoch": self.epoch + 1, "batches": 0, "batch_size": self.batch_size}
        state: dict[str, Any] = {"epoch": self.epoch, "batches": self._consumed, "batch_size": self.batch_size}
        sd = getattr(self.sampler, "state_dict", None)
        if sd is not None:
            consumed = self._consumed * self.batch_size
            if isinstance(self.sampler, Sized):  # the epoch's last batch may be short
                consumed = min(consumed, len(self.sampler))
            try:
                state["sampler"] = sd(consumed=consumed)
            except TypeError:
                state["sampler"] = sd()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration continues where `state` was taken: with a sampler that restores
        its own position (ShardShuffleSampler) through it, else by skipping the batches read."""
        if int(state.get("batch_size", self.batch_size)) != self.batch_size:
            raise ValueError(f"loader state has batch_size={state['batch_size']}, this loader {self.batch_size}; "
                             "resume with the same batch size")
        self.epoch = int(state["epoch"])
        self._finished = False
        batches = int(state["batches"])
        load = getattr(self.sampler, "load_state_dict", None)
        if "sampler" in state and load is not None:
            load(state["sampler"])
            self._skip = 0
        else:
            set_epoch = getattr(self.sampler, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(self.epoch)
            self._skip = batches
        self._start_at = batches

    # ------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        self.close()
        indices: Iterator[int] = iter(self.sampler) if self.sampler is not None else iter(range(len(self.dataset)))
        for _ in range(self._skip * self.batch_size):
            if next(indices, None) is None:
                break
        self._consumed, self._start_at, self._skip = self._start_at, 0, 0
        self._finished = False
        store = self.dataset.store
        run = self._run = self._ring.run(indices, lambda slot, _j, idx: self._fill(store, slot, idx),
                                         self.threads, self.drop_last, "kvdata-loader")
        try:
            while True:
                j, batch = run.next()
                if batch is END:
                    self._consumed = 0  # the epoch is done: a state taken now starts the next one
                    self._finished = True
                    return
                self._consumed += 1
                if self.device is not None:
                    batch = self._to_device(self._ring.slots[j % len(self._ring.slots)], batch)
                elif self.copy:
                    batch = _owned(batch)
                yield batch
        finally:
            run.close()
            if self._run is run:
                self._run = None

    # ------------------------------------------------------------ filling (in the ring's threads)

    def _fill(self, store: Any, slot: Slot, idx: list[int]) -> Any:
        ds = self.dataset
        if slot.event is not None:   # the device copy out of this buffer must be done
            slot.event.synchronize()
            slot.event = None
        with self._store_lock:
            recs = store.get_many(idx)
        keep = self.fields if self.fields is not None else ds.fields
        if keep is not None:
            recs = [{f: r[f] for f in keep} if isinstance(r, dict) else r for r in recs]
        if ds.transform is not None:
            recs = [ds.transform(r) for r in recs]
        n = len(recs)
        first = recs[0]
        if not isinstance(first, dict):
            return [bytes(r) if isinstance(r, memoryview) else r for r in recs]
        out: dict[str, Any] = {}
        for name, v in first.items():
            col = [r[name] for r in recs]
            if isinstance(v, np.ndarray) and all(isinstance(c, np.ndarray) and c.shape == v.shape
                                                 and c.dtype == v.dtype for c in col):
                dst = slot.array(name, v.shape, v.dtype)
                for i, c in enumerate(col):
                    dst[i] = c
                out[name] = slot.handle(name, n)
            elif isinstance(v, (bool, int, float, np.generic)) and not isinstance(v, (bytes, str)):
                arr = np.asarray(col)
                if arr.dtype == object or arr.ndim != 1:
                    out[name] = col
                    continue
                dst = slot.array(name, (), arr.dtype)
                dst[:n] = arr
                out[name] = slot.handle(name, n)
            elif isinstance(v, np.ndarray):
                out[name] = self._ragged(col)
            else:
                out[name] = [bytes(c) if isinstance(c, memoryview) else c for c in col]
        if self.transform is not None and self.device is None:
            return self.transform(out)
        return out

    def _ragged(self, col: list[Any]) -> Any:
        """Variable-length arrays: one flat array plus offsets (stacking.ragged), as tensors."""
        got = ragged(col)
        if isinstance(got, Ragged) and self.to == "torch" and _torch_dtype(got.values.dtype) is not None:
            return Ragged(torch.from_numpy(got.values), torch.from_numpy(got.offsets))
        return got

    # ------------------------------------------------------------ the device

    def _to_device(self, slot: Slot, batch: Any) -> Any:
        dev = self.device
        assert dev is not None
        if self._stream is None:  # a non-CUDA device: a plain copy
            out = _move(batch, dev, non_blocking=False)
            return self.transform(out) if self.transform is not None else out
        with torch.cuda.stream(self._stream):
            out = _move(batch, dev, non_blocking=True)
            if self.transform is not None:
                out = self.transform(out)
            event = torch.cuda.Event()
            event.record(self._stream)
        slot.event = event  # the ring waits for it before refilling this buffer
        torch.cuda.current_stream(dev).wait_event(event)
        return out

    def close(self) -> None:
        """Stop the filling threads of an iteration left unfinished. Idempotent."""
        run, self._run = self._run, None
        if run is not None:
            run.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _move(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, dict):
        return {k: _move(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Ragged):
        return Ragged(_move(batch.values, device, non_blocking), _move(batch.offsets, device, non_blocking))
    return batch


def _owned(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: _owned(v) for k, v in batch.items()}
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, np.ndarray):
        return batch.copy()
    return batch
