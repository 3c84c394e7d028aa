"""BatchReader: Caffe's DataLayer semantics over a kvdata store, with a prefetch thread.

A sequential cursor that wraps around at the end (an infinite iterator that
counts epochs), rank striding as Caffe's multi-solver Skip() (record i goes to
rank i % world_size), Caffe's transformation parameters, and -- what Caffe never
had -- an optional seeded reshuffle of the shard order every epoch. No worker
processes: a background thread fills a bounded queue of ready batches, copying
each sample once from the page cache into the NCHW batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import format as fmt
from .. import order as order_mod
from ..errors import KVDataError
from ..store.stacking import Copier
from .open import open_dataset

_STOP = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class BatchReader:
    """Yields (images, labels): images (N, C, H, W) (uint8, or float32 when `scale`/`mean`
    are set), labels (N,) int64 (None when the dataset has no labels).

    Transformation parameters follow Caffe's TransformationParameter: the output is
    (x - mean) * scale per channel; `mirror` flips horizontally at random and
    `crop_size` crops at random when `train`, at the center otherwise. `transform`,
    if given, is applied to (images, labels) last, in the prefetch thread.
    """

    def __init__(self, path: str, batch_size: int, prefetch: int = 4, rank: int = 0, world_size: int = 1,
                 shuffle_shards: bool = False, seed: int = 0,
                 transform: Callable[[np.ndarray, np.ndarray | None], Any] | None = None, *,
                 field: str | None = None, scale: float | None = None, mean: Sequence[float] | None = None,
                 mirror: bool = False, crop_size: int = 0, train: bool = True, copy_threads: int | None = None) -> None:
        if batch_size < 1 or prefetch < 1:
            raise ValueError("batch_size and prefetch must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.batch_size, self.rank, self.world_size = int(batch_size), int(rank), int(world_size)
        self.shuffle_shards, self.seed, self.transform = bool(shuffle_shards), int(seed), transform
        self.scale, self.mirror, self.crop_size, self.train = scale, bool(mirror), int(crop_size), bool(train)
        self.mean = None if mean is None else np.asarray(mean, dtype=np.float32)
        self._store = open_dataset(path, copy_threads=1)
        if len(self._store) < world_size:
            self._store.close()
            raise KVDataError(f"{path}: {len(self._store)} records cannot be split across {world_size} ranks")
        self._copier = Copier(copy_threads)
        self.field = field or self._guess_field()
        self._groups = order_mod.group_by_shard(np.asarray(self._store.sample_shards))
        self._rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.rank, 7]))
        self.epoch = 0        # epochs completed by the cursor, as of the last batch returned
        self._cursor_epoch = 0  # the producer's (runs ahead by up to `prefetch` batches)
        self._pos = 0
        self._mine = self._epoch_indices(0)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdata-batch-reader", daemon=True)
        self._thread.start()

    def _guess_field(self) -> str:
        fields = self._store.fields
        arrays = [n for n, spec in fields.items() if spec.get("type") == "array"]
        for preferred in ("image", "data"):
            if preferred in arrays:
                return preferred
        if len(arrays) == 1:
            return arrays[0]
        raise KVDataError(f"{self._store.root}: cannot tell which field holds images ({', '.join(fields) or 'none'}); "
                          "pass field=")

    def _epoch_indices(self, epoch: int) -> np.ndarray:
        if self.shuffle_shards:
            full = order_mod.epoch_order(self._groups, self.seed, epoch, window=1, shuffle=True, inner=False)
        else:
            full = np.arange(self._groups.num_samples)
        return full[self.rank::self.world_size]

    def _next_indices(self) -> np.ndarray:
        """The next batch_size records of this rank, wrapping into the next epoch as Caffe does."""
        parts = []
        need = self.batch_size
        while need:
            take = self._mine[self._pos:self._pos + need]
            parts.append(take)
            need -= len(take)
            self._pos += len(take)
            if self._pos >= len(self._mine):
                self._cursor_epoch += 1
                self._pos = 0
                self._mine = self._epoch_indices(self._cursor_epoch)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    # ------------------------------------------------------------ producer

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                idx = self._next_indices()
                item = (self._make_batch(idx), self._cursor_epoch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the consumer, never swallowed
            self._put_final(_Failure(e))
            return
        self._put_final(_STOP)

    def _put_final(self, item: Any) -> None:
        while True:
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                if self._stop.is_set():
                    return

    def _make_batch(self, idx: np.ndarray) -> Any:
        recs = self._store.get_many(idx)
        if not isinstance(recs[0], dict) or self.field not in recs[0]:
            raise KVDataError(f"{self._store.root}: record {int(idx[0])} has no field {self.field!r}")
        views = [r[self.field] for r in recs]
        v0 = views[0]
        if v0.ndim == 2:
            views = [v[:, :, None] for v in views]
            v0 = views[0]
        if v0.ndim != 3:
            raise KVDataError(f"{self._store.root}: field {self.field!r} has shape {v0.shape}; BatchReader wants HWC images")
        h, w, c = v0.shape
        cs = self.crop_size
        if cs and (cs > h or cs > w):
            raise KVDataError(f"crop_size {cs} is larger than the {h}x{w} images of {self._store.root}")
        oh, ow = (cs, cs) if cs else (h, w)
        n = len(views)
        if cs and self.train:
            ys = self._rng.integers(0, h - cs + 1, n)
            xs = self._rng.integers(0, w - cs + 1, n)
        else:
            ys = np.full(n, (h - oh) // 2)
            xs = np.full(n, (w - ow) // 2)
        flips = self._rng.random(n) < 0.5 if self.mirror and self.train else np.zeros(n, bool)
        as_float = self.scale is not None or self.mean is not None
        out = np.empty((n, c, oh, ow), dtype=np.float32 if as_float else v0.dtype)
        mean = None if self.mean is None else np.broadcast_to(self.mean, (c,)).reshape(c, 1, 1)
        ys_l, xs_l, fl_l = ys.tolist(), xs.tolist(), flips.tolist()

        def fill(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                v = views[i]
                if v.shape != (h, w, c):
                    raise KVDataError(f"{self._store.root}: record {int(idx[i])} has shape {v.shape}, "
                                      f"the batch started with {(h, w, c)}; BatchReader needs equal shapes")
                img = v[ys_l[i]:ys_l[i] + oh, xs_l[i]:xs_l[i] + ow]
                if fl_l[i]:
                    img = img[:, ::-1]
                chw = img.transpose(2, 0, 1)
                if mean is not None:
                    np.subtract(chw, mean, out=out[i], casting="unsafe")
                else:
                    out[i] = chw
            if self.scale is not None:
                out[lo:hi] *= self.scale

        self._copier.run_parts(fill, n, out.nbytes)
        labels = self._store.labels[idx].astype(np.int64)
        labels = None if (labels == fmt.NO_LABEL).all() else labels
        if self.transform is not None:
            return self.transform(out, labels)
        return out, labels

    # ------------------------------------------------------------ consumer

    def __iter__(self) -> BatchReader:
        return self

    def __next__(self) -> Any:
        if self._stop.is_set():
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        if item is _STOP:
            raise StopIteration
        batch, self.epoch = item
        return batch

    def close(self) -> None:
        """Stop the prefetch thread and release the store. Idempotent."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)
        self._copier.close()
        self._store.close()

    def __enter__(self) -> BatchReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None and not stop.is_set():
            self.close()
