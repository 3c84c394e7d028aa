"""kvdata.Dataset and kvdata.collate: the PyTorch side of the reader (the only module that imports torch).

The fast path is one copy per sample: `__getitems__` reads a whole batch with one
index lookup and copies each sample's bytes straight from the page cache into the
batch array -- allocated in shared memory when running in a DataLoader worker,
so the batch crosses to the main process without another copy -- and
`kvdata.collate` hands those arrays to torch without copying again.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.utils.data

from .._util.sizes import format_size
from ..homes import is_url
from ..store import Store
from ..store.stacking import Ragged, ragged
from ..tiers.policy import looks_random
from .open import open_dataset
from .torch_seam import column_rows, zero_copy_collate_works
from .worker_ring import Batch, Lease, WorkerRing, shared_tensor

DETECT_SAMPLES = 4096   # samples whose order a process looks at (at most) to tell a shard-grouped order from a random one
_warned = False         # RandomAccessWarning is given once per process


class RandomAccessWarning(UserWarning):
    """A kvdata.Dataset with cache tiers is read in a random order (not shard by shard): it works,
    but ShardShuffleSampler would move far less from the home. Silence it with
    warnings.filterwarnings("ignore", category=kvdata.reader.dataset.RandomAccessWarning)."""


class SampleBatch(list):
    """Per-sample dicts (rows of `stacked`) that kvdata.collate turns into tensors without copying.

    To every other consumer it is a plain list of samples whose array fields are tensor rows
    of the batch (reader/torch_seam.py), so torch's default_collate stacks them back into the
    batch without a copy too (plain rows where torch_seam's self-check fails: default_collate
    copies them). `tensors` holds the tensors behind `stacked`'s arrays (in workers,
    shared-memory ring buffers): handing those, not torch.from_numpy views, to the DataLoader
    queue is what lets the batch cross processes as a file descriptor instead of being copied
    again. `lease` is the worker ring slot they occupy (None outside a worker).
    """

    stacked: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    lease: Lease | None
    ring: WorkerRing | None

    def __reduce__(self) -> Any:
        """Pickled (a collate_fn that returns the samples themselves), it is the plain list: its
        rows carry the ring slot's lease (reader/torch_seam.py); the bookkeeping stays here."""
        return (list, (list(self),))


def _in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


class Dataset(torch.utils.data.Dataset):
    """Map-style dataset over a kvdata store.

    `ds[i]` is a dict of numpy arrays and Python scalars (byte records: bytes), or
    whatever `transform(sample)` returns. `fields` keeps only the named fields.
    The store is opened lazily in each process (after fork or spawn); pickling
    carries only the path and options. Without a transform, `__getitems__` (what a
    DataLoader calls) returns dicts whose array and number fields are writable torch
    tensors, rows of one batch tensor per field, so that torch's default_collate and
    kvdata.collate both return that batch without copying it; with a transform, the
    transform gets read-only zero-copy numpy views (copy before modifying in place).
    """

    def __init__(self, path: str | os.PathLike[str], transform: Callable[[Any], Any] | None = None,
                 fields: Sequence[str] | None = None) -> None:
        self.path = str(path)
        self.transform = transform
        self.fields = list(fields) if fields is not None else None
        self._store: Store | None = None
        self._pid = -1
        self._mirror: str | None = None
        self._seen: list[int] | None = []  # the first samples this process read (RandomAccessWarning)
        self._batch = 1
        self._len = len(self.store)

    # -- per-process store

    @property
    def store(self) -> Store:
        """This process's store: a local path read in place, or (URL / tiers configured)
        shards served from the fastest tier, staged on demand."""
        if self._store is None or self._pid != os.getpid():
            # in a worker the workers are the parallelism: copy with one thread
            self._store = open_dataset(self.path, copy_threads=1 if _in_worker() else None,
                                       mirror_root=self._mirror)
            self._pid = os.getpid()
            if self._mirror is None and is_url(self.path):
                self._mirror = str(self._store.root)  # workers reuse this verified index mirror
        return self._store

    @property
    def wants_orders(self) -> bool:
        """Whether a staging engine listens to announced orders (False: read in place)."""
        return self.store.source is not None

    def announce(self, reader: str, shard_ids: Sequence[int], position: int = 0,
                 next_start: int | None = None) -> None:
        """Tell the staging engine the order this reader will visit shards in, so it
        prefetches ahead and evicts what is needed last (no-op when read in place);
        `next_start`: where the next epoch's part of `shard_ids` begins, if it is there."""
        source = self.store.source
        if source is None:
            return
        entries = self.store.manifest.shards
        n = len(entries)
        seq = [entries[s] for s in shard_ids if s < n]  # the open tail is never staged
        if next_start is not None:  # the same boundary in the sequence without the tail
            if isinstance(next_start, bool) or not 0 <= int(next_start) <= len(shard_ids):
                raise ValueError(f"next_start must be an index into shard_ids (0..{len(shard_ids)}), "
                                 f"not {next_start!r}")
            next_start = sum(1 for s in shard_ids[:int(next_start)] if s < n)
        source.announce(reader, seq, position, next_start)

    def progress(self, reader: str, position: int) -> None:
        """How far (in shards of the announced sequence) the reader has got."""
        source = self.store.source
        if source is not None:
            source.progress(reader, position)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None
        state["_pid"] = -1
        state["_seen"] = []  # every process looks at its own reads
        state.pop("_ring", None)
        return state

    # -- telling the user (docs/RECIPES.md)

    def _observe(self, indices: Sequence[int]) -> None:
        """Look at the first DETECT_SAMPLES samples this process reads: when they come in a
        random order and the dataset is read through cache tiers, warn once per process."""
        seen = self._seen
        if seen is None:
            return
        if _warned:
            self._seen = None
            return
        self._batch = max(self._batch, len(indices))
        before = len(seen)
        last = min(DETECT_SAMPLES, max(8, self._len // 2))
        seen.extend(int(i) for i in list(indices)[:last - before])
        # judged at 512, 1024, ... samples: a large dataset needs a longer run to show its revisits
        if len(seen) < last and (len(seen) < 512 or len(seen).bit_length() == before.bit_length()):
            return
        try:
            msg = self._random_order_message(seen)
        except Exception:  # never let the advice break a read
            msg = None
        if msg is not None or len(seen) >= last:
            self._seen = None
        if msg is not None:
            _warn(msg)

    def _random_order_message(self, seen: list[int]) -> str | None:
        store = self.store
        if store.source is None:  # read in place: no cache to plan
            return None
        shards = store.manifest.shards
        sample_shards = np.asarray(store.sample_shards)
        hit = sample_shards[np.asarray(seen, dtype=np.int64)]
        hit = hit[hit < len(shards)]  # the open tail is read in place
        n_shards, n = len(shards), int((sample_shards < len(shards)).sum())
        if not n_shards or not looks_random(hit.tolist(), n_shards):
            return None
        total = sum(e.bytes for e in shards)
        try:
            tiers = store.engine.status().get("tiers", [])
            budget = sum(int(t["budget"]) for t in tiers)
        except Exception:
            budget = 0
        b = min(1.0, budget / total) if total else 1.0
        miss_bytes = (1 - b) * total
        per_batch = n_shards * (1 - (1 - 1 / n_shards) ** self._batch)
        whole = (1 - b) * (n / self._batch) * per_batch * total / n_shards
        single, aware = int(round((1 - b) * n)), max(1, int(round((1 - b) * n_shards)))
        fewer = f", {whole / miss_bytes:.0f}x fewer bytes" if miss_bytes and whole > 1.5 * miss_bytes else ""
        return (f"kvdata: {self.path} is read in a random order ({len(set(hit.tolist()))} of its {n_shards} shards in "
                f"the first {len(seen)} samples), not shard by shard. Its cache tiers ({format_size(budget)}, "
                f"{b:.0%} of the dataset's {format_size(total)}) then keep a fixed {b:.0%} of it, and per epoch about "
                f"{format_size(miss_bytes)} come from its home in {single:,} single-record reads (up to "
                f"{format_size(whole)} where records cannot be read one by one: a whole shard per batch). "
                f"kvdata.ShardShuffleSampler would read the same {format_size(miss_bytes)} in {aware:,} whole-shard "
                f"reads ({single / aware:.0f}x fewer requests{fewer}) "
                "and prefetch them ahead of the reader: DataLoader(ds, sampler=ShardShuffleSampler(ds), ...), see "
                "docs/RECIPES.md for Lightning and Hugging Face. Silence this with warnings.filterwarnings('ignore', "
                "category=kvdata.reader.dataset.RandomAccessWarning).")

    @property
    def sample_shards(self) -> np.ndarray:
        """Shard of every sample (what ShardShuffleSampler plans with)."""
        return self.store.sample_shards

    def __len__(self) -> int:
        return self._len

    def _select(self, rec: Any) -> Any:
        if self.fields is None or not isinstance(rec, dict):
            return rec
        return {f: rec[f] for f in self.fields}

    def __getitem__(self, index: int) -> Any:
        if self._seen is not None:
            self._observe([index])
        rec = self.store.get_one(index, copy=self.transform is None)
        rec = self._select(rec)
        if self.transform is not None:
            return self.transform(rec)
        return bytes(rec) if isinstance(rec, (memoryview, bytes)) else rec

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        if self._seen is not None:
            self._observe(indices)
        store = self.store
        if self.transform is not None:
            return [self.transform(self._select(r)) for r in store.get_many(indices)]
        tensors: dict[int, torch.Tensor] = {}
        ring = self._worker_ring() if _in_worker() else None
        alloc = None
        if ring is not None:  # a DataLoader worker: fill the next free buffer of this worker's ring
            ring.begin()
            fields_seen = [0]

            def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
                a, t = ring.alloc(shape, dtype, str(fields_seen[0]))
                fields_seen[0] += 1
                tensors[id(a)] = t
                return a

        batch = store.get_batch(indices, fields=self.fields, alloc=alloc)
        if isinstance(batch, list):  # byte records
            return batch
        # zero-copy rows where torch_seam's self-check passes in this process (decided once, at the
        # first batch with such a column); else plain rows, which carry no lease: the ring lets go
        # of this batch's buffers
        zero_copy = not any(_row_column(c) for c in batch.values()) or zero_copy_collate_works()
        if ring is not None and not zero_copy:
            ring.disown()
        lease = ring.lease() if ring is not None else None  # whatever is made of it may leave the worker
        out = _rows(batch, len(indices), {k: tensors[id(v)] for k, v in batch.items() if id(v) in tensors}, lease,
                    zero_copy)
        out.ring = ring
        return out

    def _worker_ring(self) -> WorkerRing:
        """This worker's ring of batch buffers (made in the worker; a fork gets its own)."""
        ring = self.__dict__.get("_ring")
        if ring is None or ring[0] != os.getpid():
            ring = self._ring = (os.getpid(), WorkerRing())
        return ring[1]


def _warn(msg: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(msg, RandomAccessWarning, stacklevel=4)


def _row_column(col: Any) -> bool:
    """Whether a batch column is handed out as tensor rows (a writable array of numbers)."""
    return isinstance(col, np.ndarray) and col.dtype.kind in "biuf" and col.flags.writeable


def _rows(batch: dict[str, Any], n: int, tensors: dict[str, torch.Tensor], lease: Lease | None,
          zero_copy: bool) -> SampleBatch:
    """Sample i = row i of every column: array and number columns give writable tensor rows
    of the batch tensor (zero_copy: reader/torch_seam.py's, stacked again without a copy; else
    plain views); a variable-length column's row is its slice of the flat values; other
    columns (str, bytes) their items."""
    cols: dict[str, Any] = {}
    for name, col in batch.items():
        if isinstance(col, Ragged):
            cols[name] = [col.values[a:b] for a, b in zip(col.offsets[:-1].tolist(), col.offsets[1:].tolist())]
        elif _row_column(col):
            t = tensors.get(name)
            if t is None:
                t = tensors[name] = torch.from_numpy(col)
            cols[name] = column_rows(t, n, lease) if zero_copy else list(t[:n].unbind(0))
        else:
            cols[name] = col
    names = list(cols)
    out = SampleBatch(dict(zip(names, row)) for row in zip(*(cols[k] for k in names)))
    if not names:
        out.extend({} for _ in range(n))
    out.stacked = batch
    out.tensors = tensors
    out.lease = lease
    out.ring = None
    return out


def collate(samples: Sequence[Any]) -> Any:
    """Collate a batch into torch tensors with at most one copy per sample.

    Use it as `DataLoader(..., collate_fn=kvdata.collate)` with kvdata.Dataset:
    batches that Dataset.__getitems__ already assembled (no transform) become
    tensors with no copy at all (in shared memory when built in a worker); other
    lists of dicts of numpy arrays/scalars are stacked into one preallocated
    tensor per field, which beats torch's default_collate (it converts each
    sample to a tensor first). Anything else falls back to default_collate.
    """
    stacked = getattr(samples, "stacked", None)
    if stacked is not None:
        tensors = getattr(samples, "tensors", {})
        lease = getattr(samples, "lease", None)
        cols = {k: tensors[k][:len(samples)] if k in tensors else _to_torch(v) for k, v in stacked.items()}
        if lease is None:
            return cols
        lent = Batch(cols)
        lent.lease = lease  # the buffers go to the main process: lent until it lets go
        return lent
    if not samples:
        return samples
    first = samples[0]
    if isinstance(first, dict) and all(isinstance(v, (np.ndarray, int, float, bool)) for v in first.values()):
        out = {}
        for name, v in first.items():
            col = [s[name] for s in samples]
            if isinstance(v, np.ndarray):
                out[name] = _stack_numpy(col)
            else:
                out[name] = torch.tensor(col)
        return out
    return torch.utils.data.default_collate(cast(list, samples))


def _to_torch(v: Any) -> Any:
    if isinstance(v, Ragged):
        return Ragged(_to_torch(v.values), torch.from_numpy(v.offsets))
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v) if v.flags.writeable else torch.from_numpy(v.copy())
    return v


def _stack_numpy(arrays: list[np.ndarray]) -> Any:
    a0 = arrays[0]
    if any(a.shape != a0.shape or a.dtype != a0.dtype for a in arrays):
        flat = ragged(arrays)
        return _to_torch(flat) if isinstance(flat, Ragged) else [torch.from_numpy(a) for a in flat]
    shape = (len(arrays),) + a0.shape
    if _in_worker():
        t = shared_tensor(shape, a0.dtype)
        out = t.numpy()
    else:
        out = np.empty(shape, dtype=a0.dtype)
        t = torch.from_numpy(out)
    for i, a in enumerate(arrays):
        out[i] = a
    return t
