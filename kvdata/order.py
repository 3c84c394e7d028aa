"""The seeded, shard-blocked epoch order (numpy only), shared by the sampler and the stager.

An epoch's order is a pure function of (seed, epoch): shards are permuted, then
samples are permuted within consecutive windows of `window` shards. A reader thus
works through a few shards at a time (what a cache can hold, and what the stager
prefetches), while batches still mix samples from `window` shards. Ranks take
contiguous slices of the epoch order, so each rank touches about 1/world of the
shards, and every rank gets the same number of samples.

Everything is vectorized except one small loop per window (thousands, not
millions, of iterations), so a 100M-sample epoch plans in seconds.

For many nodes, locality_shares gives each node a stable, slowly rotating part of the
shards instead of a fresh 1/nodes every epoch (see the section below and docs/SHUFFLE.md).
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


def _rng(seed: int, epoch: int, salt: int = 0) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) & (2**63 - 1), int(epoch), salt]))


def shard_permutation(groups: ShardGroups, seed: int, epoch: int) -> np.ndarray:
    """Positions into groups.shard_ids in this epoch's shard order."""
    return _rng(seed, epoch).permutation(len(groups.shard_ids))


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
    rng = _rng(seed, epoch, 1)
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


# ---------------------------------------------------------------- locality-aware orders
#
# With many nodes, a global order makes every node read a fresh 1/nodes of the shards every
# epoch, so a node's tier hits about as often as it holds the dataset. The locality order
# gives each node a stable part of the shards instead, and moves a fraction `exchange` of
# them to other nodes every epoch, so that over epochs every shard meets every other.
#
# How shards move, as a pure function of (seed, epoch, nodes) with no state carried between
# epochs: every shard has a phase phi in [0, 1) (stratified: the phases of the shards are
# evenly spread) and a rate r = exchange * nodes / (nodes - 1) (capped at 1: a re-drawn shard
# stays where it was with probability 1/nodes). Its *era* at epoch e is floor(e * r + phi);
# it is re-drawn at the epochs its era changes. The shards re-drawn at epoch e form the group
# of e, which is split over the nodes by a seeded random partition balanced by sample count.
# A shard's node at epoch e is thus its place in the partition of the group of the last epoch
# its era changed: about r * shards are re-drawn each epoch, and a node keeps about
# 1 - exchange of its shards from one epoch to the next. exchange=0 never re-draws.

_PHASE = 1 << 20  # phases and rates in integer units of 1/_PHASE: exact and platform-independent
_SALT_PHASE, _SALT_GROUP = 11, 12


def _seeded(seed: int, *words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) & (2**63 - 1),
                                                          *(int(w) & (2**64 - 1) for w in words)]))


def _check_locality(nodes: int, exchange: float) -> None:
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if not 0.0 <= exchange <= 1.0:
        raise ValueError(f"exchange must be in [0, 1] (the fraction of a node's shards moved per epoch), got {exchange}")


def exchange_rate(nodes: int, exchange: float) -> int:
    """Per-epoch re-draw rate of a shard in units of 1/2**20 (0: never, 2**20: every epoch)."""
    _check_locality(nodes, exchange)
    if nodes == 1 or exchange == 0:
        return 0
    return max(1, min(_PHASE, round(exchange * nodes / (nodes - 1) * _PHASE)))


def _striped_split(counts: np.ndarray, nodes: int, rng: np.random.Generator) -> np.ndarray:
    """The node of each shard of a group (given in the order they will leave it again),
    balanced by sample count in every prefix of that order, not just overall.

    The cumulative sample counts are cut into stripes of the mean shard count; each run of
    `nodes` stripes (from a random offset) goes to the nodes in a random permutation. A
    group's shards leave it (are re-drawn) first to last, so what is left of it stays
    spread evenly over the nodes: the partition stays balanced while groups dissolve.
    """
    g = len(counts)
    total = int(counts.sum())
    if g == 0 or total == 0:
        return np.zeros(g, dtype=np.int64)
    mid2 = 2 * np.cumsum(counts) - counts                       # twice each shard's midpoint, integer
    stripe = np.minimum(mid2 * g // (2 * total), g - 1) + int(rng.integers(nodes))
    blocks = rng.permuted(np.tile(np.arange(nodes, dtype=np.int64), (int(stripe[-1]) // nodes + 1, 1)), axis=1)
    return blocks[stripe // nodes, stripe % nodes]


def node_of_shards(groups: ShardGroups, seed: int, epoch: int, nodes: int, exchange: float) -> np.ndarray:
    """The node (0..nodes-1) of every shard of groups.shard_ids at this epoch."""
    rate = exchange_rate(nodes, exchange)
    k = len(groups.shard_ids)
    out = np.zeros(k, dtype=np.int64)
    if nodes == 1 or k == 0:
        return out
    phase = _seeded(seed, _SALT_PHASE).permutation(k).astype(np.int64) * _PHASE // k
    if rate == 0:
        last = np.zeros(k, dtype=np.int64)            # one group forever
    else:
        era = (int(epoch) * rate + phase) // _PHASE
        last = -((phase - era * _PHASE) // rate)      # first epoch of that era: ceil((era - phi) / r)
    # group by the epoch of the last re-draw (about 1/r + 1 groups). Each group is split as a
    # whole, as it was on the epoch it was drawn, and its members that have not been re-drawn
    # since keep their node from that split (re-splitting only the rest would move them all).
    # The group drawn at epoch d is the shards with (d * r + phase) mod 1 < r: an interval of
    # phases, found by bisection, so the work is linear in the shards whatever the rate
    by_phase = np.argsort(phase, kind="stable")
    sorted_phase = phase[by_phase]
    drawn = np.zeros(k, dtype=np.int64)
    by_last = np.argsort(last, kind="stable")
    cuts = np.flatnonzero(np.diff(last[by_last])) + 1
    for members in np.split(by_last, cuts):
        e_last = int(last[members[0]])
        if rate in (0, _PHASE):
            group = np.arange(k)
        else:
            lo = (-e_last * rate) % _PHASE
            spans = [(lo, min(lo + rate, _PHASE))] + ([(0, lo + rate - _PHASE)] if lo + rate > _PHASE else [])
            group = np.sort(np.concatenate([by_phase[np.searchsorted(sorted_phase, a):np.searchsorted(sorted_phase, b)]
                                            for a, b in spans]))
        # in the order the group's shards will be re-drawn again (the furthest into their era first)
        group = group[np.argsort(-((e_last * rate + phase[group]) % _PHASE), kind="stable")]
        drawn[group] = _striped_split(groups.counts[group], nodes, _seeded(seed, _SALT_GROUP, nodes, rate, e_last))
        out[members] = drawn[members]
    return out


def locality_node_orders(groups: ShardGroups, seed: int, epoch: int, nodes: int, exchange: float,
                         window: int = 8, shuffle: bool = True,
                         keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every sample once, node by node: (order, bounds) with node j's samples in
    order[bounds[j]:bounds[j + 1]].

    Inside a node: its shards in this epoch's shard permutation, samples shuffled within
    windows of `window` of the node's shards, as epoch_order (with nodes=1 it is
    epoch_order). shuffle=False: the node's shards in ascending order, stored order within.
    keep (a bool mask over samples) drops the samples it marks False (the rest of an epoch
    after a resume onto another world).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    n = groups.num_samples
    node = node_of_shards(groups, seed, epoch, nodes, exchange)
    perm = shard_permutation(groups, seed, epoch) if shuffle else np.arange(len(groups.shard_ids))
    seq = perm[np.argsort(node[perm], kind="stable")]    # the permutation, node by node
    lengths = groups.counts[seq]
    ends = np.cumsum(lengths)
    offsets = np.repeat(groups.starts[seq] - (ends - lengths), lengths)
    order = groups.by_shard[np.arange(n, dtype=np.int64) + offsets]
    node_seq = node[seq]
    per_node = np.bincount(node_seq, weights=lengths, minlength=nodes).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(per_node)])
    if shuffle and n:
        first = np.searchsorted(node_seq, node_seq, side="left")      # each shard's node's first shard
        at_window = (np.arange(len(seq)) - first) % window == 0
        wb = np.append((ends - lengths)[at_window], n)
        rng = _rng(seed, epoch, 1)
        for a, b in zip(wb[:-1].tolist(), wb[1:].tolist()):
            rng.shuffle(order[a:b])
    if keep is not None:
        kept = keep[order]
        ck = np.concatenate([[0], np.cumsum(kept)])
        order, bounds = order[kept], ck[bounds]
    return order, bounds


def balance_nodes(order: np.ndarray, bounds: np.ndarray, local_world: int, drop_last: bool) -> np.ndarray:
    """Rank shares (one row per rank, rank = node * local_world + local rank) of node orders
    of unequal lengths: every rank the same count, as rank_share over nodes * local_world.

    A node keeps the head of its order up to its quota; the tails of the nodes above it
    fill, in node order, the nodes below (at their end); what is still missing is the
    wrap-around padding (order[0], order[1], ...), or with drop_last the surplus is dropped.
    A node's ranks take contiguous slices of its quota.
    """
    nodes = len(bounds) - 1
    world = nodes * local_world
    n = len(order)
    per = samples_per_rank(n, world, drop_last)
    quota = per * local_world
    sizes = np.diff(bounds)
    spill = [order[int(bounds[j]) + quota:int(bounds[j + 1])] for j in range(nodes) if sizes[j] > quota]
    pad = nodes * quota - n
    if pad > 0 and n:
        spill.append(np.resize(order, pad))
    pool = np.concatenate(spill) if spill else order[:0]
    out = np.empty((nodes, quota), dtype=order.dtype)
    taken = 0
    for j in range(nodes):
        mine = min(int(sizes[j]), quota)
        out[j, :mine] = order[int(bounds[j]):int(bounds[j]) + mine]
        need = quota - mine
        out[j, mine:] = pool[taken:taken + need]
        taken += need
    return out.reshape(world, per)


def locality_shares(groups: ShardGroups, seed: int, epoch: int, nodes: int, world_size: int, exchange: float,
                    window: int = 8, shuffle: bool = True, drop_last: bool = False,
                    history: tuple[tuple[int, int, int], ...] = ()) -> np.ndarray:
    """Every rank's samples for an epoch of the locality order: shape (world_size, per rank).

    history: the (nodes, world_size, position) of earlier runs of this epoch on other
    worlds (each rank of such a run had read `position` samples of its share). Each run is
    planned over what the runs before it left, so the result holds every sample of the epoch
    not yet read exactly once (plus the padding or minus the drop_last remainder of fewer
    than world_size samples): elastic resume, derived from the history, not stored.
    """
    keep: np.ndarray | None = None
    for h_nodes, h_world, h_pos in history:
        shares = _one_world(groups, seed, epoch, h_nodes, h_world, exchange, window, shuffle, drop_last, keep)
        if not 0 <= h_pos <= shares.shape[1]:
            raise ValueError(f"position {h_pos} is outside [0, {shares.shape[1]}] for {h_nodes} nodes x "
                             f"{h_world // h_nodes} ranks")
        if keep is None:
            keep = np.ones(groups.num_samples, dtype=bool)
        keep[shares[:, :h_pos].ravel()] = False
    return _one_world(groups, seed, epoch, nodes, world_size, exchange, window, shuffle, drop_last, keep)


def _one_world(groups: ShardGroups, seed: int, epoch: int, nodes: int, world_size: int, exchange: float,
               window: int, shuffle: bool, drop_last: bool, keep: np.ndarray | None) -> np.ndarray:
    if world_size < 1 or world_size % nodes:
        raise ValueError(f"world_size {world_size} is not a multiple of nodes {nodes}")
    order, bounds = locality_node_orders(groups, seed, epoch, nodes, exchange, window, shuffle, keep)
    return balance_nodes(order, bounds, world_size // nodes, drop_last)
