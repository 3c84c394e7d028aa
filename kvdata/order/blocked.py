"""The seeded, shard-blocked epoch order (numpy only), shared by the sampler and the stager.

An epoch's order is a pure function of (seed, epoch): shards are permuted, then
samples are permuted within consecutive windows of `window` shards. A reader thus
works through a few shards at a time (what a cache can hold, and what the stager
prefetches), while batches still mix samples from `window` shards. Ranks take
contiguous slices of the epoch order, so each rank touches about 1/world of the
shards, and every rank gets the same number of samples.

Everything is vectorized except one small loop per window (thousands, not
millions, of iterations), so a 100M-sample epoch plans in seconds.

For many nodes, kvdata.order.locality gives each node a stable, slowly rotating part of the
shards instead of a fresh 1/nodes every epoch (docs/SHUFFLE.md); it builds on the shard
groups, the shard permutation and the rank counts here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardGroups:
    """Samples grouped by shard: the static part of every epoch's plan."""

    shard_ids: np.ndarray   # shards that hold samples, ascending
    starts: np.ndarray      # start of each shard's run in `by_shard`
    counts: np.ndarray      # samples per shard
    by_shard: np.ndarray    # sample indices sorted by shard (stable)

    @property
    def num_samples(self) -> int:
        return int(len(self.by_shard))


def index_dtype(n: int) -> np.dtype:
    return np.dtype(np.int32) if n < 2**31 else np.dtype(np.int64)


def group_by_shard(sample_shards: np.ndarray) -> ShardGroups:
    """Group sample indices by shard; O(n) when samples are already in shard order."""
    s = np.asarray(sample_shards)
    n = len(s)
    dt = index_dtype(n)
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return ShardGroups(z, z, z, np.zeros(0, dtype=dt))
    if bool(np.all(s[1:] >= s[:-1])):  # the common case: written in order, so no sort
        by_shard = np.arange(n, dtype=dt)
        sorted_s = s
    else:
        by_shard = np.argsort(s, kind="stable").astype(dt, copy=False)
        sorted_s = s[by_shard]
    change = np.ones(n, dtype=bool)
    change[1:] = sorted_s[1:] != sorted_s[:-1]
    starts = np.nonzero(change)[0]
    counts = np.diff(np.append(starts, n))
    return ShardGroups(sorted_s[starts].astype(np.int64), starts.astype(np.int64), counts.astype(np.int64), by_shard)


def epoch_rng(seed: int, epoch: int, salt: int = 0) -> np.random.Generator:
    """The generator of an epoch's draws: salt 0 permutes the shards, salt 1 shuffles the windows."""
    return np.random.default_rng(np.random.SeedSequence([int(seed) & (2**63 - 1), int(epoch), salt]))


def shard_permutation(groups: ShardGroups, seed: int, epoch: int) -> np.ndarray:
    """Positions into groups.shard_ids in this epoch's shard order."""
    return epoch_rng(seed, epoch).permutation(len(groups.shard_ids))


def epoch_order(groups: ShardGroups, seed: int, epoch: int, window: int = 8, shuffle: bool = True,
                inner: bool = True) -> np.ndarray:
    """Every sample index once, in this epoch's order (before splitting across ranks).

    inner=False keeps samples in stored order within each shard (only the shard order
    changes): BatchReader's per-epoch reshuffle of a sequential cursor.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    n = groups.num_samples
    if not shuffle:
        return np.arange(n, dtype=index_dtype(n))
    perm = shard_permutation(groups, seed, epoch)
    lengths = groups.counts[perm]
    ends = np.cumsum(lengths)
    # concatenate the runs of by_shard in permuted shard order, without a Python loop
    offsets = np.repeat(groups.starts[perm] - (ends - lengths), lengths)
    order = groups.by_shard[np.arange(n, dtype=np.int64) + offsets]
    if not inner:
        return order
    rng = epoch_rng(seed, epoch, 1)
    bounds = np.concatenate([[0], ends[window - 1::window]])
    if bounds[-1] != n:
        bounds = np.append(bounds, n)
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        rng.shuffle(order[a:b])
    return order


def rank_share(order: np.ndarray, rank: int, world_size: int, drop_last: bool) -> np.ndarray:
    """This rank's contiguous slice; all ranks get the same count (wrap-around padding
    like DistributedSampler, or dropping the remainder with drop_last)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    n = len(order)
    if drop_last:
        per = n // world_size
    else:
        per = -(-n // world_size)
        pad = per * world_size - n
        if pad and n:
            order = np.concatenate([order, np.resize(order, pad)])
    return order[rank * per:(rank + 1) * per]


def samples_per_rank(n: int, world_size: int, drop_last: bool) -> int:
    return n // world_size if drop_last else -(-n // world_size)


def first_use_order(shards_of_samples: np.ndarray) -> np.ndarray:
    """Shard ids in the order a reader first touches them."""
    s = np.asarray(shards_of_samples)
    if not len(s):
        return np.zeros(0, dtype=np.int64)
    if int(s.min()) < 0:
        raise ValueError("shard ids must be >= 0")
    # each shard's first position in O(n) (np.unique sorts all n samples: 10x slower at 1M)
    first = np.full(int(s.max()) + 1, len(s), dtype=np.int64)
    np.minimum.at(first, s, np.arange(len(s), dtype=np.int64))
    ids = np.nonzero(first < len(s))[0]
    return ids[np.argsort(first[ids], kind="stable")]


def planned_shard_sequence(groups: ShardGroups, seed: int, epoch: int, window: int, rank: int,
                           world_size: int, drop_last: bool) -> np.ndarray:
    """The shards a rank reads in an epoch, in reading order at window granularity, from the
    shard permutation alone (no per-sample order: O(shards), not O(samples)).

    What a stager needs to plan ahead (e.g. the next epoch's sequence announced with this
    one's): the shards of every window of `window` shards that the rank's contiguous slice of
    the epoch order overlaps, windows in order, shards in permuted order within a window. The
    windows cut at the slice's ends may hold shards whose samples all went to the neighbouring
    rank (the sample shuffle inside a window decides): those are listed too."""
    n = groups.num_samples
    if not n:
        return np.zeros(0, dtype=np.int64)
    perm = shard_permutation(groups, seed, epoch)
    lengths = groups.counts[perm]
    ends = np.cumsum(lengths)
    w_ends = ends[np.minimum(np.arange(window - 1, len(perm) + window - 1, window), len(perm) - 1)]
    w_starts = np.concatenate([[0], w_ends[:-1]])
    per = samples_per_rank(n, world_size, drop_last)
    lo, hi = rank * per, (rank + 1) * per
    spans = [(lo, min(hi, n))]
    if hi > n:  # wrap-around padding (rank_share): the slice goes on at the epoch's start
        spans.append((0, hi - n))
    seq: list[np.ndarray] = []
    for a, b in spans:
        if b <= a:
            continue
        hit = np.nonzero((w_starts < b) & (w_ends > a))[0]
        if len(hit):
            first, last = int(hit[0]) * window, min(len(perm), (int(hit[-1]) + 1) * window)
            seq.append(groups.shard_ids[perm[first:last]])
    if not seq:
        return np.zeros(0, dtype=np.int64)
    out = np.concatenate(seq).astype(np.int64)
    _, keep = np.unique(out, return_index=True)  # a shard listed twice (wrap-around) counts once, first
    return out[np.sort(keep)]
