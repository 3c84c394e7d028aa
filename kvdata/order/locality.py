"""The locality-aware epoch order for many nodes (numpy only): each node reads a stable part of
the shards that moves a fraction `exchange` of them to other nodes every epoch.

Split from the shard-blocked order (kvdata.order.blocked), which it builds on: the same shard
groups, shard permutation, window shuffles and rank counts, with the shards first laid out in
a row cut between the nodes (the section below). ShardShuffleSampler(locality=True) yields
locality_shares; docs/SHUFFLE.md explains the layout and its measured churn.
"""

from __future__ import annotations

import numpy as np

from .blocked import ShardGroups, epoch_rng, samples_per_rank, shard_permutation

# ---------------------------------------------------------------- locality-aware orders
#
# With many nodes, a global order makes every node read a fresh 1/nodes of the shards every
# epoch, so a node's tier hits about as often as it holds the dataset. The locality order
# gives each node a stable part of the shards instead, and moves a fraction `exchange` of
# them to other nodes every epoch, so that over epochs every shard meets every other.
#
# The layout. The shards stand in a row: node 0's whole shards, then the shard split between
# nodes 0 and 1 (if any), node 1's whole shards, the split shard of 1 and 2, ... Node j reads
# the samples from cut j-1 to cut j of that row, where the cuts divide the samples as evenly
# as they go (node j gets n // nodes, plus one for the first n % nodes nodes). Every cut falls
# inside the split shard of its two nodes or on the edge between their whole shards, so a
# node reads its whole shards plus parts of at most two split shards, and each split shard
# goes to exactly two nodes (one per pair of neighbours, nodes - 1 at most). A shard's place
# is its *slot*: 2j for node j's whole shards, 2j + 1 for the split shard of j and j + 1;
# inside a slot the shards stand in phase order (below), so the slots say it all.
#
# How shards move. Every shard has a phase (a seeded permutation of the shards, spread evenly
# over [0, 1)) and a rate r = exchange * nodes / (nodes - 1) (capped at 1: a re-drawn shard
# lands on its own node again with probability about 1/nodes). Its *era* at epoch e is
# floor(e * r + phase); at the epochs its era changes it is re-drawn: taken out of the row
# and, with the other shards re-drawn that epoch (an interval of phases, about r * shards),
# put back in a seeded random order where the nodes are short of their cuts: the re-drawn
# shards are laid end to end and each goes to the node whose shortfall its middle falls in,
# the shortfalls measured so that each cut comes back to the middle of its split shard
# (or, where that shard was itself re-drawn, so that the re-drawn shard across the cut
# becomes the new split shard). Each node thus gets back about what it lost, in whole
# shards: no node is ever more than about half a shard from its cut, so nothing else has to
# move to even the nodes out, and a split shard stays split between the same two nodes
# until its own era ends. With equal shards the cuts always land inside the split shards
# (or exactly between shards, when the nodes' shares are whole shards: then none is split).
# With unequal shards a cut can miss its split shard (a re-drawn shard larger than the split
# one lies across it): the re-drawn shard becomes the split shard instead, the old one going
# whole to the node that read most of it (so split shards tend to be large ones, and misses
# grow rare); only where that does not fit either are the slots re-derived from the cuts
# (the shard a cut falls in becomes its split shard). A node keeps about 1 - exchange of its
# shards from one epoch to the next; exchange=0 never re-draws. Measured from the order alone
# by bench/locality_churn.py: 9.4-12.5% of the shards a node reads are new to it each epoch
# at exchange 0.1, for 2 to 64 nodes of 16 to 160 shards, equal or unequal.
#
# The row at epoch e depends on the row at e - 1, so shard_slots replays the re-draws from
# epoch 0 (from epoch e itself when every shard is re-drawn every epoch): a pure function of
# (seed, epoch, nodes, exchange, shard sizes), at a cost of a few numpy calls per epoch over
# the re-drawn shards (about 0.07 ms an epoch at 1,000 shards, 0.5 ms at 100,000). SlotCache
# remembers how far it got, so a sampler asking for epoch after epoch replays one each.

_PHASE = 1 << 20  # phases and rates in integer units of 1/_PHASE: exact and platform-independent
_SALT_PHASE, _SALT_FILL = 11, 13


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


def node_cuts(n: int, nodes: int) -> np.ndarray:
    """Where node j's samples end in the row (j < nodes - 1): shares as even as they go."""
    share = np.full(nodes, n // nodes, dtype=np.int64)
    share[:n % nodes] += 1
    return np.cumsum(share)[:-1]


def _phase_ranks(seed: int, k: int) -> np.ndarray:
    """Every shard's place on the phase circle: its phase is rank / k (rank * 2**20 // k in units)."""
    return _seeded(seed, _SALT_PHASE).permutation(k).astype(np.int64)


def shard_slots(counts: np.ndarray, seed: int, epoch: int, nodes: int, exchange: float) -> np.ndarray:
    """The slot of every shard at this epoch (counts: samples per shard, as ShardGroups.counts):
    2j for node j's whole shards, 2j + 1 for the shard split between nodes j and j + 1."""
    return SlotCache(counts, seed, exchange).slots(epoch, nodes)


class SlotCache:
    """shard_slots for one dataset, seed and exchange that remembers how far it replayed each
    node count: asking for epoch e after epoch e - 1 (or e itself) costs one epoch of replay
    instead of e. A sampler keeps one; the functions below take it as `cache`."""

    def __init__(self, counts: np.ndarray, seed: int, exchange: float) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.seed, self.exchange = int(seed), float(exchange)
        self._rows: dict[int, _Row] = {}

    def matches(self, counts: np.ndarray, seed: int, exchange: float) -> bool:
        return (int(seed) == self.seed and float(exchange) == self.exchange
                and (counts is self.counts or np.array_equal(counts, self.counts)))

    def slots(self, epoch: int, nodes: int) -> np.ndarray:
        rate = exchange_rate(nodes, self.exchange)
        k = len(self.counts)
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if nodes == 1 or k == 0:
            return np.zeros(k, dtype=np.int64)
        row = self._rows.get(nodes)
        if row is None or row.epoch > epoch or rate == _PHASE:
            # every shard re-drawn every epoch: nothing to replay, epoch e is drawn afresh
            row = self._rows[nodes] = _Row(self.counts, self.seed, nodes, rate, epoch if rate == _PHASE else 0)
        row.advance(epoch)
        return row.slot.copy()


class _Row:
    """The row of shards while it is replayed epoch by epoch: each shard's slot, the samples
    per slot and the split shard of each junction (the pair of nodes j, j + 1)."""

    def __init__(self, counts: np.ndarray, seed: int, nodes: int, rate: int, start: int) -> None:
        k = len(counts)
        self.counts, self.cuts, self.rank = counts, node_cuts(int(counts.sum()), nodes), _phase_ranks(seed, k)
        self.rate, self.epoch = rate, start
        self.rng = _seeded(seed, _SALT_FILL, nodes, rate, start)
        self.by_phase = np.argsort(self.rank)
        self.sorted_phase = np.arange(k, dtype=np.int64) * _PHASE // k   # the phase of by_phase[i]
        self.slot = np.full(k, -1, dtype=np.int64)
        self.per_slot = np.zeros(2 * nodes - 1, dtype=np.int64)
        self.split = np.full(nodes - 1, -1, dtype=np.int64)    # the split shard of junction j (-1: none)
        self.redraw(np.arange(k, dtype=np.int64))             # epoch `start` draws every shard

    def advance(self, epoch: int) -> None:
        """Replay the re-draws of the epochs after self.epoch up to `epoch`."""
        if not 0 < self.rate < _PHASE:
            self.epoch = max(self.epoch, epoch)
            return
        for d in range(self.epoch + 1, epoch + 1):
            lo = (-d * self.rate) % _PHASE    # re-drawn at d: (d * rate + phase) mod 1 < rate
            a = int(np.searchsorted(self.sorted_phase, lo))
            if lo + self.rate <= _PHASE:
                drawn = self.by_phase[a:int(np.searchsorted(self.sorted_phase, lo + self.rate))]
            else:
                hi = int(np.searchsorted(self.sorted_phase, lo + self.rate - _PHASE))
                drawn = np.concatenate([self.by_phase[a:], self.by_phase[:hi]])
            self.redraw(drawn)
        self.epoch = max(self.epoch, epoch)

    def _add(self, shards: np.ndarray, sign: int) -> None:
        w = np.bincount(self.slot[shards], weights=self.counts[shards], minlength=len(self.per_slot))
        self.per_slot += sign * w.astype(np.int64)

    def _through(self) -> np.ndarray:
        """Samples up to the end of node j's whole shards, for each junction j."""
        return np.cumsum(self.per_slot)[0:-1:2]

    def _missed(self) -> np.ndarray:
        """The junctions whose cut is not inside their split shard (or on the edge without one)."""
        through = self._through()
        return np.flatnonzero((through > self.cuts) | (self.cuts > through + self.per_slot[1::2]))

    def redraw(self, drawn: np.ndarray) -> None:
        """Take `drawn` out of the row and put it back in whole shards where the nodes fall short."""
        if not len(drawn):
            return
        # which side of each split shard read the most of it (where it goes if it stops being split)
        major_left = 2 * (self.cuts - self._through()) >= self.per_slot[1::2]
        placed = drawn[self.slot[drawn] >= 0]
        if len(placed):
            self._add(placed, -1)
        self.slot[drawn] = -1
        self.split[(self.split >= 0) & (self.slot[self.split] < 0)] = -1
        split_w = self.per_slot[1::2]
        reach2 = 2 * (self.cuts - self._through()) - split_w   # twice what the re-drawn shards must add before junction j
        order = self.rng.permutation(drawn)
        w = self.counts[order]
        end = np.cumsum(w)
        beg = end - w
        slot = 2 * np.searchsorted(np.maximum.accumulate(reach2), beg + end, side="right")
        # the re-drawn shard across each junction's reach (-1: the reach falls between shards)
        cross = np.minimum(np.searchsorted(2 * end, reach2, side="right"), len(order) - 1)
        cross[(2 * beg[cross] >= reach2) | (2 * end[cross] <= reach2)] = -1
        open_ = np.flatnonzero((split_w == 0) & (cross >= 0))   # no split shard: the one across the cut becomes it
        at, first = np.unique(cross[open_], return_index=True)   # one shard, one junction
        slot[at] = 2 * open_[first] + 1
        self.split[open_[first]] = order[at]
        self.slot[order] = slot
        self._add(order, 1)
        for j in self._missed().tolist():
            if cross[j] >= 0:
                self._swap_split(j, int(order[cross[j]]), bool(major_left[j]))
        if len(self._missed()):
            self.reslot()

    def _swap_split(self, j: int, g: int, major_left: bool) -> None:
        """A cut missed its split shard: let the re-drawn shard across it be the split shard
        instead (it moves anyway, so it is new to one side already), the old one going whole
        to the side that read most of it. A cut misses mostly where a re-drawn shard larger
        than the split shard lies across it, so split shards tend to be large ones and misses
        grow rare."""
        if self.slot[g] not in (2 * j, 2 * j + 2):
            return                                     # across another junction too: reslot
        b = int(self.split[j])
        wg, wb = int(self.counts[g]), (int(self.counts[b]) if b >= 0 else 0)
        base = int(self.per_slot[:2 * j + 1].sum()) - (wg if self.slot[g] == 2 * j else 0)
        cut = int(self.cuts[j])
        for left in ((major_left, not major_left) if b >= 0 else (False,)):
            lo = base + (wb if left else 0)
            if lo <= cut <= lo + wg:
                self.per_slot[self.slot[g]] -= wg
                self.slot[g] = 2 * j + 1
                if b >= 0:
                    self.slot[b] = 2 * j + (0 if left else 2)
                    self.per_slot[self.slot[b]] += wb
                self.per_slot[2 * j + 1] = wg
                self.split[j] = g
                return

    def reslot(self) -> None:
        """Derive the slots from the cuts (a cut missed its split shard): the shard a cut falls
        in becomes the split shard of its two nodes, every other shard a whole shard of its node."""
        k = len(self.counts)
        layout = np.argsort(self.slot * k + self.rank)
        w = self.counts[layout]
        end = np.cumsum(w)
        first = np.searchsorted(self.cuts, end - w, side="right")   # the node of its first sample
        last = np.searchsorted(self.cuts, end - 1, side="right")    # ... and of its last
        self.slot[layout] = 2 * first + (first != last)
        self.per_slot[:] = np.bincount(self.slot, weights=self.counts, minlength=len(self.per_slot)).astype(np.int64)
        odd = np.flatnonzero(self.slot % 2 == 1)
        self.split[:] = -1
        self.split[self.slot[odd] // 2] = odd


def _row_layout(groups: ShardGroups, seed: int, epoch: int, nodes: int, exchange: float,
                cache: SlotCache | None) -> np.ndarray:
    """Positions into groups.shard_ids in row order (whole shards of node 0, split shard, ...)."""
    k = len(groups.shard_ids)
    if nodes == 1 or k == 0:
        _check_locality(nodes, exchange)
        return np.arange(k, dtype=np.int64)
    if cache is None:
        cache = SlotCache(groups.counts, seed, exchange)
    elif not cache.matches(groups.counts, seed, exchange):
        raise ValueError(f"this SlotCache was made for another dataset, seed or exchange (seed {cache.seed}, "
                         f"exchange {cache.exchange}); make one per sampler")
    return np.argsort(cache.slots(epoch, nodes) * k + _phase_ranks(seed, k))


def node_of_shards(groups: ShardGroups, seed: int, epoch: int, nodes: int, exchange: float,
                   cache: SlotCache | None = None) -> np.ndarray:
    """The node (0..nodes-1) of every shard of groups.shard_ids at this epoch; a split shard
    counts as the node that reads its middle sample."""
    layout = _row_layout(groups, seed, epoch, nodes, exchange, cache)
    end = np.cumsum(groups.counts[layout])
    out = np.empty(len(layout), dtype=np.int64)
    out[layout] = np.searchsorted(node_cuts(groups.num_samples, nodes), end - (groups.counts[layout] + 1) // 2,
                                  side="right")
    return out


def locality_node_orders(groups: ShardGroups, seed: int, epoch: int, nodes: int, exchange: float,
                         window: int = 8, shuffle: bool = True, keep: np.ndarray | None = None,
                         cache: SlotCache | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every sample once, node by node: (order, bounds) with node j's samples in
    order[bounds[j]:bounds[j + 1]]; the nodes' counts differ by at most one.

    Node j reads the row (see above) from cut j - 1 to cut j: its whole shards and its parts
    of the split shards beside them. Inside a node: its shards (a part of a split shard counts
    as a shard) in this epoch's shard permutation, samples shuffled within windows of `window`
    of them, as epoch_order (with nodes=1 it is epoch_order). shuffle=False: the node's shards
    in ascending order, stored order within. keep (a bool mask over samples) drops the samples
    it marks False (the rest of an epoch after a resume onto another world) and cuts the row
    over what is left, so the counts stay even: a node then reads what the cuts give it of its
    neighbours' shards too, still one split shard per cut.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    k = len(groups.shard_ids)
    layout = _row_layout(groups, seed, epoch, nodes, exchange, cache)
    if keep is None:
        counts, starts, by = groups.counts, groups.starts, groups.by_shard
    else:
        kept = keep[groups.by_shard]
        by = groups.by_shard[kept]
        counts = np.add.reduceat(kept.astype(np.int64), groups.starts) if k else groups.counts
        starts = np.cumsum(counts) - counts
    n = int(counts.sum())
    cuts = node_cuts(n, nodes)
    w = counts[layout]
    end = np.cumsum(w)
    beg = end - w
    # the pieces: each shard's run in the row, cut where a node's samples end
    points = np.union1d(beg[w > 0], cuts[(cuts > 0) & (cuts < n)])
    plen = np.diff(np.append(points, n))
    at = np.searchsorted(end, points, side="right")
    shard = layout[at]
    node = np.searchsorted(cuts, points, side="right")
    src = starts[shard] + points - beg[at]
    perm = shard_permutation(groups, seed, epoch) if shuffle else np.arange(k)
    pos = np.empty(k, dtype=np.int64)
    pos[perm] = np.arange(k)
    seq = np.argsort(node * k + pos[shard], kind="stable")   # node by node, the permutation's order inside
    lengths = plen[seq]
    ends = np.cumsum(lengths)
    offsets = np.repeat(src[seq] - (ends - lengths), lengths)
    order = by[np.arange(n, dtype=np.int64) + offsets]
    node_seq = node[seq]
    per_node = np.bincount(node_seq, weights=lengths, minlength=nodes).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(per_node)])
    if shuffle and n:
        first = np.searchsorted(node_seq, node_seq, side="left")      # each piece's node's first piece
        at_window = (np.arange(len(seq)) - first) % window == 0
        wb = np.append((ends - lengths)[at_window], n)
        rng = epoch_rng(seed, epoch, 1)
        for a, b in zip(wb[:-1].tolist(), wb[1:].tolist()):
            rng.shuffle(order[a:b])
    return order, bounds


def balance_nodes(order: np.ndarray, bounds: np.ndarray, local_world: int, drop_last: bool) -> np.ndarray:
    """Rank shares (one row per rank, rank = node * local_world + local rank) of node orders
    whose lengths differ by at most one (locality_node_orders'): every rank the same count,
    as rank_share over nodes * local_world.

    A node's quota is its ranks' count: a node short of it repeats the head of its own order
    (wrap-around padding that stays on the node's shards; from the head of the whole order
    if the node has no samples), a node above it (drop_last) drops the tail of its order; in
    all fewer than nodes * local_world samples. A node's ranks take contiguous slices of it.
    """
    nodes = len(bounds) - 1
    world = nodes * local_world
    n = len(order)
    per = samples_per_rank(n, world, drop_last)
    quota = per * local_world
    out = np.empty((nodes, quota), dtype=order.dtype)
    for j in range(nodes):
        mine = order[int(bounds[j]):int(bounds[j + 1])]
        out[j] = np.resize(mine if len(mine) else order, quota) if quota else mine[:0]
    return out.reshape(world, per)


def locality_shares(groups: ShardGroups, seed: int, epoch: int, nodes: int, world_size: int, exchange: float,
                    window: int = 8, shuffle: bool = True, drop_last: bool = False,
                    history: tuple[tuple[int, int, int], ...] = (), cache: SlotCache | None = None) -> np.ndarray:
    """Every rank's samples for an epoch of the locality order: shape (world_size, per rank).

    history: the (nodes, world_size, position) of earlier runs of this epoch on other
    worlds (each rank of such a run had read `position` samples of its share). Each run is
    planned over what the runs before it left, so the result holds every sample of the epoch
    not yet read exactly once (plus the padding or minus the drop_last remainder of fewer
    than world_size samples): elastic resume, derived from the history, not stored.
    cache: a SlotCache of this dataset, seed and exchange, so consecutive epochs replay one.
    """
    if cache is None:
        cache = SlotCache(groups.counts, seed, exchange)   # one replay for every world of the history
    keep: np.ndarray | None = None
    for h_nodes, h_world, h_pos in history:
        shares = _one_world(groups, seed, epoch, h_nodes, h_world, exchange, window, shuffle, drop_last, keep, cache)
        if not 0 <= h_pos <= shares.shape[1]:
            raise ValueError(f"position {h_pos} is outside [0, {shares.shape[1]}] for {h_nodes} nodes x "
                             f"{h_world // h_nodes} ranks")
        if keep is None:
            keep = np.ones(groups.num_samples, dtype=bool)
        keep[shares[:, :h_pos].ravel()] = False
    return _one_world(groups, seed, epoch, nodes, world_size, exchange, window, shuffle, drop_last, keep, cache)


def _one_world(groups: ShardGroups, seed: int, epoch: int, nodes: int, world_size: int, exchange: float,
               window: int, shuffle: bool, drop_last: bool, keep: np.ndarray | None,
               cache: SlotCache | None) -> np.ndarray:
    _check_locality(nodes, exchange)
    if world_size < 1 or world_size % nodes:
        raise ValueError(f"world_size {world_size} is not a multiple of nodes {nodes}")
    order, bounds = locality_node_orders(groups, seed, epoch, nodes, exchange, window, shuffle, keep, cache)
    return balance_nodes(order, bounds, world_size // nodes, drop_last)
