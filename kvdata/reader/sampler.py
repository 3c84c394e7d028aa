"""ShardShuffleSampler: a deterministic, resumable, rank-aware shard-blocked shuffle.

The order comes from kvdata.order (numpy only), so the stager plans with exactly
the sequence this sampler yields.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.utils.data

from .. import order as order_mod

STATE_VERSION = 1


class ShardShuffleSampler(torch.utils.data.Sampler[int]):
    """Yields sample indices: shards in a seeded random order, samples shuffled within
    windows of `window` consecutive shards.

    Larger windows mix better (see docs/SHUFFLE.md for distinct classes per batch)
    at the cost of more shards in flight; shards written in random order (the
    default of `kvdata import`) give random-quality batches at window 2-4.

    - the epoch's order is a pure function of (seed, epoch); call set_epoch(e);
    - rank/world_size default to torch.distributed when it is initialized; every rank
      gets len(self) samples (wrap-around padding, or dropping with drop_last) from a
      contiguous slice of the epoch order, so a rank touches ~1/world of the shards;
    - state_dict()/load_state_dict() resume mid-epoch exactly;
    - shard_order(epoch) is the shard sequence this rank will read, for the stager.
    """

    def __init__(self, dataset: Any, seed: int = 0, window: int = 8, shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None, drop_last: bool = False) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.seed, self.window, self.shuffle = int(seed), int(window), bool(shuffle)
        self.rank, self.world_size, self.drop_last = int(rank), int(world_size), bool(drop_last)
        shards = np.asarray(dataset.sample_shards)
        self._groups = order_mod.group_by_shard(shards)
        self._shards = shards
        self.num_samples = order_mod.samples_per_rank(len(shards), self.world_size, self.drop_last)
        self._dataset = dataset  # announce()/progress() feed the staging engine, if it has them
        self._reader = f"sampler-{os.getpid()}-{id(self):x}-rank{self.rank}"
        self.epoch = 0
        self._start = 0        # where the next __iter__ begins (set by load_state_dict)
        self._yielded = 0      # position reached by the current iterator
        self._cache: list[tuple[int, np.ndarray]] = []

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning (or, right after load_state_dict of that
        same epoch, from the saved position)."""
        if epoch != self.epoch:
            self._start = 0
        self.epoch = int(epoch)
        self._yielded = self._start

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's sample indices for an epoch, in order (numpy, computed once per epoch)."""
        return self._order_of(self.epoch if epoch is None else int(epoch))

    def _order_of(self, e: int) -> np.ndarray:
        for cached_e, mine in self._cache:
            if cached_e == e:
                return mine
        full = order_mod.epoch_order(self._groups, self.seed, e, self.window, self.shuffle)
        mine = order_mod.rank_share(full, self.rank, self.world_size, self.drop_last)
        self._cache = (self._cache + [(e, mine)])[-2:]  # this epoch and the next
        return mine

    def shard_order(self, epoch: int | None = None) -> np.ndarray:
        """Shard ids in the order this rank first reads them in an epoch."""
        idx = self.indices(epoch)
        return order_mod.first_use_order(self._shards[idx])

    def __iter__(self) -> Iterator[int]:
        mine = self.indices()
        start, self._start = self._start, 0
        self._yielded = start
        step = self._announce(mine, start)
        chunk = 256 if step is None else 32  # report progress often enough for the stager
        for chunk_start in range(start, len(mine), chunk):
            if step is not None:
                step(chunk_start)
            for i in mine[chunk_start:chunk_start + chunk].tolist():
                self._yielded += 1
                yield i

    def _announce(self, mine: np.ndarray, start: int) -> Any:
        """Announce this epoch's shard sequence; return a callback reporting progress."""
        announce = getattr(self._dataset, "announce", None)
        report = getattr(self._dataset, "progress", None)
        if announce is None or not len(mine) or not getattr(self._dataset, "wants_orders", True):
            return None  # nothing listens (a dataset read in place): no order bookkeeping
        shards = self._shards[mine]
        seq = order_mod.first_use_order(shards)
        rank_of = np.zeros(int(shards.max()) + 1, dtype=np.int64)
        rank_of[seq] = np.arange(len(seq))
        pos = np.maximum.accumulate(rank_of[shards])  # furthest shard reached so far
        lag = self.window - 1                        # a window's shards are read together

        def position(i: int) -> int:
            return max(0, int(pos[min(i, len(pos) - 1)]) - lag)

        # the next epoch's order is known too (a pure function of seed and epoch): announcing
        # it lets eviction keep what the next epoch reads first instead of flushing at the boundary
        following = order_mod.first_use_order(self._shards[self._order_of(self.epoch + 1)]) if self.shuffle else seq
        announce(self._reader, seq.tolist() + following.tolist(), position(start))
        last = [position(start)]

        def step(i: int) -> None:
            p = position(i)
            if p != last[0] and report is not None:
                last[0] = p
                report(self._reader, p)

        return step

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where to resume. `consumed` = samples of this epoch the training loop has
        processed (e.g. batches_done * batch_size); by default the number this
        sampler has yielded, which runs ahead of training when a DataLoader prefetches."""
        pos = self._yielded if consumed is None else int(consumed)
        return {"version": STATE_VERSION, "epoch": self.epoch, "position": pos, "seed": self.seed,
                "window": self.window, "shuffle": self.shuffle, "world_size": self.world_size,
                "rank": self.rank, "drop_last": self.drop_last, "num_samples": self.num_samples,
                "dataset_size": int(len(self._shards))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the rest of the epoch is identical to an uninterrupted run."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')} is not {STATE_VERSION}")
        for key in ("seed", "window", "shuffle", "world_size", "drop_last", "dataset_size"):
            mine = len(self._shards) if key == "dataset_size" else getattr(self, key)
            if state[key] != mine:
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has {mine!r}; "
                                 "resume with the same settings and dataset")
        if not 0 <= int(state["position"]) <= self.num_samples:
            raise ValueError(f"sampler state position {state['position']} is outside [0, {self.num_samples}]")
        self.epoch = int(state["epoch"])
        self._start = int(state["position"])
        self._yielded = self._start
