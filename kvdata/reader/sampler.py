"""ShardShuffleSampler: a deterministic, resumable, rank-aware shard-blocked shuffle.

The order comes from kvdata.order (numpy only), so the stager plans with exactly
the sequence this sampler yields. With locality=True each node keeps a stable part of
the shards (kvdata.order.locality.locality_shares), so its tier keeps serving it epoch after epoch.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.utils.data

from ..order import blocked
from ..order import locality as locality_order

STATE_VERSION = 1


def _takes_next_start(announce: Any) -> bool:
    """Whether a dataset's announce() takes `next_start` (kvdata.Dataset's does; a wrapper
    written against the older (reader, shard_ids, position) signature may not)."""
    try:
        params = inspect.signature(announce).parameters
    except (TypeError, ValueError):
        return False
    return "next_start" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


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
    - state_dict()/load_state_dict() resume mid-epoch exactly, through kvdata.Loader or
      torchdata's StatefulDataLoader (which saves this state with each batch it hands out and
      loads it before its next iterator draws an index; see state_dict);
    - shard_order(epoch) is the shard sequence this rank will read, for the stager.

    locality=True (for many nodes, each with its own tier): each node reads a stable part of
    the shards, and every epoch a fraction `exchange` of each node's shards moves to other
    nodes, so over epochs every sample meets every other (and a node's tier fetches about
    `exchange` of its part per epoch). The nodes are evened out in whole shards: a node's
    samples differ from another's by at most one, made of its whole shards and parts of at
    most two shards split with its neighbours. Inside a node the shard order and the window
    shuffle are as above, split across the node's ranks; every rank still gets len(self)
    samples (a node short of its ranks' count repeats the head of its own order). The
    partition is a pure function of (seed, epoch, nodes). `nodes` defaults to world_size //
    LOCAL_WORLD_SIZE (set by torchrun) when torch.distributed is initialized, else 1; a
    rank's node is rank // (world_size // nodes) (torchrun's layout) unless `node` says
    otherwise (its place inside the node is then LOCAL_RANK, or rank % ranks per node).
    Its state_dict() resumes onto a different world size too (docs/SHUFFLE.md).
    """

    def __init__(self, dataset: Any, seed: int = 0, window: int = 8, shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None, drop_last: bool = False,
                 locality: bool = False, exchange: float = 0.1, nodes: int | None = None,
                 node: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        distributed = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.seed, self.window, self.shuffle = int(seed), int(window), bool(shuffle)
        self.rank, self.world_size, self.drop_last = int(rank), int(world_size), bool(drop_last)
        self.locality, self.exchange = bool(locality), float(exchange)
        self.nodes, self.node, self._slot = 1, 0, self.rank   # the row of the plan this rank reads
        if self.locality:
            self.nodes, self.node, self._slot = _node_identity(self.rank, self.world_size, nodes, node, distributed)
            locality_order.exchange_rate(self.nodes, self.exchange)  # validates exchange
        shards = np.asarray(dataset.sample_shards)
        self._groups = blocked.group_by_shard(shards)
        self._shards = shards
        # the locality row is replayed epoch by epoch: remembering it makes the next epoch's cheap
        self._slots = locality_order.SlotCache(self._groups.counts, self.seed, self.exchange) if self.locality else None
        self.num_samples = blocked.samples_per_rank(len(shards), self.world_size, self.drop_last)
        self._dataset = dataset  # announce()/progress() feed the staging engine, if it has them
        self._reader = f"sampler-{os.getpid()}-{id(self):x}-rank{self.rank}"
        self.epoch = 0
        self._start = 0        # where the next __iter__ begins (set by load_state_dict)
        # position reached by the current iterator: a cell of its own per iterator, so an older
        # iterator (one a DataLoader dropped) never moves the newest one's position
        self._cursor = [0]
        # locality only: earlier runs of this epoch on other worlds, [(nodes, world_size, position)],
        # from load_state_dict; the next __iter__ reads what they left
        self._history: tuple[tuple[int, int, int], ...] = ()
        self._resuming = False  # load_state_dict set _start/_history for the next __iter__
        self._cache: list[tuple[tuple[int, tuple[tuple[int, int, int], ...]], np.ndarray]] = []

    def __len__(self) -> int:
        return self.num_samples

    @property
    def _yielded(self) -> int:
        """Position reached by the current iterator (what state_dict() saves by default)."""
        return self._cursor[0]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning (or, right after load_state_dict of that
        same epoch, from the saved position)."""
        if epoch != self.epoch:
            self._start, self._history, self._resuming = 0, (), False
        self.epoch = int(epoch)
        self._cursor = [self._start]

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's sample indices for an epoch, in order (numpy, computed once per epoch).
        After a resume onto another world: what this rank reads of the rest of that epoch."""
        e = self.epoch if epoch is None else int(epoch)
        return self._order_of(e, self._history if e == self.epoch else ())

    def _order_of(self, e: int, history: tuple[tuple[int, int, int], ...] = ()) -> np.ndarray:
        key = (e, history)
        for cached, mine in self._cache:
            if cached == key:
                return mine
        if self.locality:
            mine = locality_order.locality_shares(self._groups, self.seed, e, self.nodes, self.world_size, self.exchange,
                                                  self.window, self.shuffle, self.drop_last, history,
                                                  cache=self._slots)[self._slot]
        else:
            full = blocked.epoch_order(self._groups, self.seed, e, self.window, self.shuffle)
            mine = blocked.rank_share(full, self.rank, self.world_size, self.drop_last)
        self._cache = (self._cache + [(key, mine)])[-2:]  # this epoch and the next
        return mine

    def shard_order(self, epoch: int | None = None) -> np.ndarray:
        """Shard ids in the order this rank first reads them in an epoch."""
        idx = self.indices(epoch)
        return blocked.first_use_order(self._shards[idx])

    def __iter__(self) -> Iterator[int]:
        """The epoch's indices from where it stands. The iterator begins at its first next() (a
        set_epoch or load_state_dict before that still applies to it), but from iter() on,
        state_dict() says where it will begin: StatefulDataLoader takes one as it creates its
        iterator, before any index is drawn."""
        if not self._resuming:           # iterating an epoch again starts it from its beginning
            self._start, self._history = 0, ()
        self._cursor = [self._start]
        return self._iterate()

    def _iterate(self) -> Iterator[int]:
        if not self._resuming:
            self._start, self._history = 0, ()
        self._resuming = False
        mine = self.indices()
        start, self._start = self._start, 0
        cursor = self._cursor = [start]
        step = self._announce(mine, start)
        chunk = 256 if step is None else 32  # report progress often enough for the stager
        for chunk_start in range(start, len(mine), chunk):
            if step is not None:
                step(chunk_start)
            for i in mine[chunk_start:chunk_start + chunk].tolist():
                cursor[0] += 1
                yield i

    def _announce(self, mine: np.ndarray, start: int) -> Any:
        """Announce this epoch's shard sequence; return a callback reporting progress."""
        announce = getattr(self._dataset, "announce", None)
        report = getattr(self._dataset, "progress", None)
        if announce is None or not len(mine) or not getattr(self._dataset, "wants_orders", True):
            return None  # nothing listens (a dataset read in place): no order bookkeeping
        shards = self._shards[mine]
        seq = blocked.first_use_order(shards)
        rank_of = np.zeros(int(shards.max()) + 1, dtype=np.int64)
        rank_of[seq] = np.arange(len(seq))
        pos = np.maximum.accumulate(rank_of[shards])  # furthest shard reached so far
        lag = self.window - 1                        # a window's shards are read together

        def position(i: int) -> int:
            return max(0, int(pos[min(i, len(pos) - 1)]) - lag)

        # the next epoch's order is known too (a pure function of seed and epoch): announcing
        # it lets eviction keep what the next epoch reads first instead of flushing at the boundary
        following = self._planned_next() if self.shuffle else seq
        if _takes_next_start(announce):
            announce(self._reader, seq.tolist() + following.tolist(), position(start), next_start=len(seq))
        else:  # a dataset wrapper of the user's with the older signature
            announce(self._reader, seq.tolist() + following.tolist(), position(start))
        last = [position(start)]

        def step(i: int) -> None:
            p = position(i)
            if p != last[0] and report is not None:
                last[0] = p
                report(self._reader, p)

        return step

    def _planned_next(self) -> np.ndarray:
        """The next epoch's shard sequence for the stager's plan. Not the next epoch's whole
        order, which would cost as much again before this epoch's first index: the shard
        permutation at window granularity (blocked.planned_shard_sequence), or, for the locality
        order, the node's part of it."""
        if self.locality:
            return blocked.first_use_order(self._shards[self._order_of(self.epoch + 1)])
        return blocked.planned_shard_sequence(self._groups, self.seed, self.epoch + 1, self.window, self.rank,
                                              self.world_size, self.drop_last)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where to resume (plain ints, cheap: StatefulDataLoader asks for it at every batch).

        `consumed` = samples of this epoch the training loop has processed (e.g. batches_done
        * batch_size); by default the number the current iterator has yielded. That runs ahead
        of training when a DataLoader prefetches, except under torchdata's StatefulDataLoader:
        its worker processes get each batch's indices from the main process, which takes this
        state right after drawing them and hands it back with that batch, so the state it saves
        counts exactly the samples of the batches the loop has received (with num_workers=0
        nothing is drawn ahead). `end` is where this epoch ends for the rank (len(self), or
        less in an epoch resumed onto another world): a state at its end is a finished epoch.
        """
        pos = self._yielded if consumed is None else int(consumed)
        state: dict[str, Any] = {"version": STATE_VERSION, "epoch": self.epoch, "position": pos, "seed": self.seed,
                                 "window": self.window, "shuffle": self.shuffle, "world_size": self.world_size,
                                 "rank": self.rank, "drop_last": self.drop_last, "num_samples": self.num_samples,
                                 "dataset_size": int(len(self._shards)),
                                 "end": self.num_samples if not self._history else len(self.indices())}
        if self.locality:  # a few numbers whatever the dataset size: the rest is derived from them
            state.update(locality=True, exchange=self.exchange, nodes=self.nodes,
                         history=[list(h) for h in self._history])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the rest of the epoch is identical to an uninterrupted run.

        With locality=True the state may come from another world (more or fewer nodes or
        ranks; every rank loads rank 0's state): this world then reads every sample of the
        epoch the saved world had not read, exactly once (plus padding of fewer than
        world_size, or minus a drop_last remainder), in equal counts per rank, each node its
        own part of the shards. That epoch yields fewer than len(self) samples; the next is whole.

        A state taken at the end of its epoch (every sample of it yielded) loaded onto a sampler
        already set to a later epoch (set_epoch) leaves that epoch to start from its beginning:
        StatefulDataLoader loads its saved state when its next iterator is created, which is
        after the training loop's set_epoch(e + 1) when the checkpoint closed epoch e. Any other
        state sets the epoch and position it holds.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')} is not {STATE_VERSION}")
        if bool(state.get("locality", False)) != self.locality:
            raise ValueError(f"sampler state has locality={bool(state.get('locality', False))} but this sampler has "
                             f"locality={self.locality}; resume with the same settings")
        keys = ["seed", "window", "shuffle", "drop_last", "dataset_size"]
        keys += ["exchange"] if self.locality else ["world_size"]  # locality resumes onto any world
        for key in keys:
            mine = len(self._shards) if key == "dataset_size" else getattr(self, key)
            if state[key] != mine:
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has {mine!r}; "
                                 "resume with the same settings and dataset")
        pos = int(state["position"])
        history: tuple[tuple[int, int, int], ...] = _parse_history(state) if self.locality else ()
        s_world = int(state["world_size"])
        bound = blocked.samples_per_rank(len(self._shards), s_world, self.drop_last)  # len(self) unless locality
        if not 0 <= pos <= bound:
            raise ValueError(f"sampler state position {pos} is outside [0, {bound}]")
        if int(state["epoch"]) < self.epoch and pos >= int(state.get("end", bound)):
            self._start, self._history, self._resuming = 0, (), False   # that epoch is done: keep this one
            self._cursor = [0]
            return
        if self.locality:
            s_nodes = int(state["nodes"])
            if (s_nodes, s_world) != (self.nodes, self.world_size):
                # another world: this one reads what the saved run left of the epoch
                history, pos = history + ((s_nodes, s_world, pos),), 0
        self.epoch = int(state["epoch"])
        self._history = history
        self._start = pos
        self._cursor = [self._start]
        self._resuming = True


def _node_identity(rank: int, world_size: int, nodes: int | None, node: int | None,
                   distributed: bool) -> tuple[int, int, int]:
    """(nodes, this rank's node, this rank's row of the plan) for locality sampling."""
    if nodes is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "") if distributed else ""
        nodes = world_size // int(local) if local.isdigit() and int(local) > 0 and world_size % int(local) == 0 else 1
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"world_size {world_size} is not a multiple of nodes {nodes}: every node runs "
                         "the same number of ranks; pass nodes= (or set LOCAL_WORLD_SIZE)")
    per_node = world_size // nodes
    if node is None:
        return nodes, rank // per_node, rank
    if not 0 <= node < nodes:
        raise ValueError(f"node {node} is not in [0, {nodes})")
    local_rank = os.environ.get("LOCAL_RANK", "") if distributed else ""
    inside = int(local_rank) if local_rank.isdigit() and int(local_rank) < per_node else rank % per_node
    return nodes, node, node * per_node + inside


def _parse_history(state: dict[str, Any]) -> tuple[tuple[int, int, int], ...]:
    try:
        out = tuple((int(n), int(w), int(p)) for n, w, p in state.get("history", []))
    except (TypeError, ValueError):
        raise ValueError(f"sampler state history {state.get('history')!r} is not a list of "
                         "[nodes, world_size, position]") from None
    for n, w, p in out:
        if n < 1 or w < 1 or w % n or p < 0:
            raise ValueError(f"sampler state history entry {[n, w, p]} is not [nodes, world_size, position]")
    return out
