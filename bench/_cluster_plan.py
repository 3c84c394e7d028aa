"""What every rank of a multi-node job reads, from the real kvdata.order functions (numpy only).

ShardShuffleSampler's orders are per sample, and a 100 TB dataset of 110 KB samples has about
10^9 of them: too many to plan on one core for every epoch. The cluster simulation therefore
replays the sampler's own functions on a dataset of the same shards in which every shard holds
`slots` equal *virtual samples* (slots = the real samples per shard when that is small, as in
the calibration run; 16 at 100 TB). Everything the sampler decides at shard granularity is then
exactly what it decides for the real dataset -- the shard permutation (`blocked.shard_permutation`
inside `blocked.epoch_order`), the node partition and its exchange (`locality.node_of_shards` inside
`locality.locality_shares`), the node balancing (`locality.balance_nodes`) and the rank split
(`blocked.rank_share`) -- and what it decides inside a shard (the window shuffle, where a rank's
slice starts in a shard) is resolved to 1/slots of a shard: one slot stands for
samples_per_shard / slots real samples. Nothing here re-implements an order:

- `epoch_rows`: each rank's slots in read order = `ShardShuffleSampler(...).indices(epoch)` of
  the virtual dataset: `blocked.epoch_order` + `blocked.rank_share` (global), `locality.locality_shares`
  (locality=True) -- the calls the sampler makes, with its arguments;
- `RankEpoch.seq`: the shard sequence the sampler announces for the epoch it reads
  (`blocked.first_use_order`); `announced_next`: what it announces for the following epoch
  (`blocked.planned_shard_sequence` for the global order, the next epoch's `seq` for locality);
- `RankEpoch.position`: the progress it reports at a position of its iterator, as
  `ShardShuffleSampler._announce` computes it (running maximum of the first-use rank, less the
  window's lag). tests/unit/test_cluster_sim.py checks rows, sequences and positions against a
  real ShardShuffleSampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvdata.order import blocked, locality

SAMPLERS = ("global", "locality")


@dataclass(frozen=True)
class Layout:
    """The job: shards (each of `slots` virtual samples), nodes x ranks per node, sampler knobs."""

    shards: int
    slots: int
    nodes: int
    per_node: int
    window: int = 8
    seed: int = 0
    exchange: float = 0.1

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def groups(self) -> blocked.ShardGroups:
        """The virtual dataset as the sampler groups it: sample i lies in shard i // slots."""
        return blocked.group_by_shard(np.repeat(np.arange(self.shards, dtype=np.int64), self.slots))

    def shard_of(self, slots: np.ndarray) -> np.ndarray:
        return np.asarray(slots, dtype=np.int64) // self.slots


def epoch_rows(layout: Layout, groups: blocked.ShardGroups, sampler: str, epoch: int,
               ranks: Sequence[int]) -> dict[int, np.ndarray]:
    """The virtual samples each of `ranks` reads in `epoch`, in order: what
    ShardShuffleSampler(ds, seed, window, rank=r, world_size=world, locality=..., exchange=...,
    nodes=nodes).indices(epoch) returns for that dataset (drop_last=False)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r} is not one of {', '.join(SAMPLERS)}")
    if sampler == "locality":
        shares = locality.locality_shares(groups, layout.seed, epoch, layout.nodes, layout.world, layout.exchange,
                                          layout.window)
        return {r: shares[r] for r in ranks}
    full = blocked.epoch_order(groups, layout.seed, epoch, layout.window)
    return {r: blocked.rank_share(full, r, layout.world, False) for r in ranks}


def announced_next(layout: Layout, groups: blocked.ShardGroups, sampler: str, epoch: int, rank: int,
                   following: RankEpoch) -> np.ndarray:
    """The next epoch's part of what ShardShuffleSampler announces in `epoch` (`_planned_next`):
    the plan from the shard permutation for the global order, the exact sequence for locality."""
    if sampler == "locality":
        return following.seq
    return blocked.planned_shard_sequence(groups, layout.seed, epoch + 1, layout.window, rank, layout.world, False)


@dataclass
class RankEpoch:
    """One rank's epoch at shard granularity: the shard of every slot it reads (in order), the
    sequence its sampler announces, the sampler's running first-use rank per slot, and the
    rank's *blocks*: the windows its order reads together (maximal runs of slots closed under
    their shards). Inside a window the samples of its shards are shuffled together, so every
    batch of a real reader touches every shard of its window (a batch of 256 misses one of 8
    shards with probability (7/8)^256): a reader needs all of a block's shards to read any of
    its slots, whatever the number of virtual samples."""

    shards: np.ndarray       # shard of each slot, in read order
    seq: np.ndarray          # blocked.first_use_order(shards): what the sampler announces first
    reach: np.ndarray        # index into seq of the furthest shard touched up to each slot
    lag: int                 # window - 1: a window's shards are read together
    block_start: np.ndarray  # first slot of each block
    block_of: np.ndarray     # block of each slot
    block_seq: np.ndarray    # block b's shards are seq[block_seq[b]:block_seq[b + 1]]

    @classmethod
    def of(cls, layout: Layout, row: np.ndarray) -> RankEpoch:
        shards = layout.shard_of(row)
        n = len(shards)
        seq = blocked.first_use_order(shards)
        rank_of = np.zeros(layout.shards, dtype=np.int64)
        rank_of[seq] = np.arange(len(seq))
        if not n:
            z = np.zeros(0, dtype=np.int64)
            return cls(shards, seq, z, layout.window - 1, z, z, np.zeros(1, dtype=np.int64))
        reach = np.maximum.accumulate(rank_of[shards])
        last = np.zeros(layout.shards, dtype=np.int64)
        u, back = np.unique(shards[::-1], return_index=True)
        last[u] = n - 1 - back
        closes = np.maximum.accumulate(last[shards])            # the furthest slot a shard seen so far reaches
        new_block = np.zeros(n, dtype=bool)
        new_block[0] = True
        new_block[1:] = closes[:-1] < np.arange(1, n)
        block_start = np.flatnonzero(new_block)
        block_of = np.cumsum(new_block) - 1
        # shards are first used block by block, so a block's shards are a run of seq
        block_seq = np.append(np.concatenate([[0], reach[block_start[1:] - 1] + 1]), len(seq)).astype(np.int64)
        return cls(shards, seq, reach, layout.window - 1, block_start, block_of, block_seq)

    def block_shards(self, b: int) -> np.ndarray:
        return self.seq[self.block_seq[b]:self.block_seq[b + 1]]

    def position(self, cursor: int) -> int:
        """The progress the sampler reports when its iterator is at `cursor`."""
        if not len(self.reach):
            return 0
        return max(0, int(self.reach[min(cursor, len(self.reach) - 1)]) - self.lag)

    def furthest(self, cursor: int) -> int:
        """Index into seq of the furthest shard touched before `cursor` (-1: none yet)."""
        if cursor <= 0 or not len(self.reach):
            return -1
        return int(self.reach[min(cursor, len(self.reach)) - 1])
