"""BatchReader: Caffe's DataLayer semantics over a kvdata store, on kvdata.Loader's ring.

A sequential cursor that wraps around at the end (an infinite iterator that
counts epochs), rank striding as Caffe's multi-solver Skip() (record i goes to
rank i % world_size), Caffe's transformation parameters, and -- what Caffe never
had -- an optional seeded reshuffle of the shard order every epoch. No worker
processes: the threads of kvdata.reader.ring fill batches ahead, each sample copied
once from the page cache into its NCHW batch (numpy only; no torch needed).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .. import format as fmt
from ..errors import KVDataError
from ..order import blocked
from .open import open_dataset
from .ring import END, Ring, Slot


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
                 mirror: bool = False, crop_size: int = 0, train: bool = True, copy_threads: int | None = None,
                 reuse_buffers: bool = False) -> None:
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
        self.field = field or self._guess_field()
        self._groups = blocked.group_by_shard(np.asarray(self._store.sample_shards))
        self._per_epoch = len(self._epoch_indices(0))
        self.epoch = 0        # epochs completed by the cursor, as of the last batch returned
        self._store_lock = threading.Lock()
        threads = copy_threads if copy_threads is not None else min(2, len(os.sched_getaffinity(0)))
        # reuse_buffers: batches live in the ring (valid until `prefetch` more are asked for);
        # by default every batch is a fresh array the caller may keep
        self._ring = Ring(self.batch_size, prefetch, fresh=not reuse_buffers)
        self._run = self._ring.run(self._cursor(), self._make_batch, max(1, int(threads)), name="kvdata-batch-reader")
        self._closed = False

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
            full = blocked.epoch_order(self._groups, self.seed, epoch, window=1, shuffle=True, inner=False)
        else:
            full = np.arange(self._groups.num_samples)
        return full[self.rank::self.world_size]

    def _cursor(self) -> Iterator[int]:
        """This rank's records forever, epoch after epoch (consumed under the ring's lock)."""
        epoch = 0
        while True:
            yield from self._epoch_indices(epoch).tolist()
            epoch += 1

    def _make_batch(self, slot: Slot, j: int, indices: list[int]) -> Any:
        idx = np.asarray(indices, dtype=np.int64)
        with self._store_lock:
            recs = self._store.get_many(idx)
        if not isinstance(recs[0], dict) or self.field not in recs[0]:
            raise KVDataError(f"{self._store.root}: record {int(idx[0])} has no field {self.field!r}")
        # crops and flips from (seed, rank, batch number): the same batches whatever thread fills them
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.rank, 7, j]))
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
            ys = rng.integers(0, h - cs + 1, n)
            xs = rng.integers(0, w - cs + 1, n)
        else:
            ys = np.full(n, (h - oh) // 2)
            xs = np.full(n, (w - ow) // 2)
        flips = rng.random(n) < 0.5 if self.mirror and self.train else np.zeros(n, bool)
        as_float = self.scale is not None or self.mean is not None
        out = slot.array("images", (c, oh, ow), np.float32 if as_float else v0.dtype)[:n]
        mean = None if self.mean is None else np.broadcast_to(self.mean, (c,)).reshape(c, 1, 1)
        ys_l, xs_l, fl_l = ys.tolist(), xs.tolist(), flips.tolist()

        for i in range(n):
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
            out *= self.scale
        stored = self._store.labels[idx].astype(np.int64)
        labels = None if (stored == fmt.NO_LABEL).all() else stored
        epoch = (j + 1) * self.batch_size // self._per_epoch  # wraps the cursor made up to this batch
        if self.transform is not None:
            return self.transform(out, labels), epoch
        return (out, labels), epoch

    # ------------------------------------------------------------ consumer

    def __iter__(self) -> BatchReader:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            _j, item = self._run.next()
        except BaseException:
            self.close()
            raise
        if item is END:
            raise StopIteration
        batch, self.epoch = item
        return batch

    def close(self) -> None:
        """Stop the filling threads and release the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._run.close()
        self._store.close()

    def __enter__(self) -> BatchReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False:
            self.close()
