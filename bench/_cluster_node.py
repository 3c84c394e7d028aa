"""One node of the cluster simulation: its tiers, its kvdata staging engines, its link, and the
GPUs reading from them, stepped in ticks of `dt` seconds.

What to stage, what to evict and what to read by record is decided by the real
kvdata.tiers.policy, called as kvdata.tiers.staging.Engine calls it (nothing of the policy is
re-implemented here):

- at every announce (an epoch start) and every `keep_ttl` seconds of a pass (Engine.keep_set's
  KEEP_TTL): `policy.keep_for_next_pass(demands, sizes, room, shard, resident=, held=,
  reading=KEEP_READING, admitted=)` -- the shards worth a whole copy at this moment of the pass;
  an announced shard outside that set is *bypassed*: read record by record from S3, never staged
  (Engine.keep_set/_bypass);
- every tick in which a reader moved or a copy landed: `policy.plan_tier(budget, sizes,
  resident, demands, in_use=held, lookahead=policy.prefetch_depth(...))`, and the engine's own
  loop over its stage list (skip bypassed and in-flight shards, at most 2 x workers jobs queued
  or running: Engine._plan_pass);
- when a staging job starts and the tier is full: `policy.plan_eviction(budget - in flight,
  resident, demands, incoming, in_use=held)` (TierStager.evict_until_fits walks the same order);
  no room at all: a shard a reader waits for becomes a private copy (fetched, not kept), a
  prefetch is dropped (Engine._stage_now / NoRoomError).

What the simulation models itself (the parts that are physics, not kvdata's decisions):

- a reader (one GPU's rank) consumes `gpu_rate` samples/s from its row of virtual samples
  (_cluster_plan); a slot is readable when its shard is resident (a hit), bypassed (read by
  record: `record_gets_per_sample` GETs per sample plus each shard's seek table once per
  DataLoader worker, at most IN_FLIGHT GETs in flight per process), or a private copy; the first
  slot that is none of these blocks the reader (stall) and asks for its shard now, with the
  other shards of the next batch (Engine.start_many), behind the jobs already queued (the
  engine's thread pool is FIFO);
- a staging job is one whole shard: ceil(compressed / part_bytes) ranged GETs, `parts_in_flight`
  of them in flight, each paying `latency` and at most `conn_bps`; at most `verify_bps` of
  decompression + sha256 per job; `workers` jobs at once per engine;
- the node's link (`link_bps`) and its share of S3's request rate (`prefixes` x `get_limit` /
  nodes GET/s: S3 throttles every node alike) are shared per tick: record reads first (a GPU
  waits on them), staging jobs with the rest.

Modes: `daemon` = one kvdatad per node: one Engine (its `workers`) plans for all the node's
ranks over one tier of the node's budget. `shared` = no daemon, the standard config: every rank's
process has its own in-process Engine (its own `workers`, planning for its own order) over the
node's shared tier directories (flocked budget, orders published in the tiers: kvdata.tiers.orders,
so eviction and the keep set see every rank's order; one copy per shard, the per-shard staging
lock keeps two engines from fetching it twice). `private` = no daemon and a tier per rank (budget
/ ranks per node): what separate tier directories per process (another uid, a container per rank)
give -- each rank keeps only what it read itself.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
from _cluster_plan import RankEpoch

from kvdata.tiers import policy
from kvdata.tiers.records import IN_FLIGHT
from kvdata.tiers.source import MAX_OPEN, max_open_within
from kvdata.tiers.staging.keep_set import KEEP_READING, KEEP_TTL

MODES = ("daemon", "shared", "private")
INF = float("inf")


@dataclass(frozen=True)
class Params:
    """Everything the simulation assumes; cluster_sim.py documents each default and its source."""

    nodes: int = 8
    gpus: int = 8                     # ranks (GPUs) per node
    dataset_bytes: float = 100e12
    shard_bytes: float = 256e6        # uncompressed shard (.mdb), what a tier holds
    sample_bytes: float = 110e3
    compression: float = 1.0          # .mdb bytes / .mdb.zst bytes (JPEG payloads: ~1.0)
    tier_bytes: float = 4.34e12       # per node: NVMe 3.84 TB + RAM 0.5 TB
    link_bps: float = 100e9           # per node, bits/s
    gpu_rate: float = 2500.0          # samples/s per GPU; 0: as fast as the data comes (read_rate)
    read_rate: float = 20000.0        # samples/s a rank reads from a tier when gpu_rate is 0
    start_s: float = 0.0              # s from an epoch's start to a rank's first read (DataLoader workers
                                      # started per epoch, the barrier); staging runs meanwhile
    keep_ttl: float = KEEP_TTL        # s the keep set is trusted before it is taken again (Engine.keep_set)
    keep_ticks: int = 1               # ... and at least this many ticks (a coarser, cheaper simulation)
    server_bps: float = 0.0           # bytes/s the S3 server sends to all nodes together (0: no limit;
                                      # a test server on a shared machine has one); an even share per node
    batch_size: int = 256
    num_workers: int = 8              # DataLoader worker processes per rank (record-read pools)
    get_limit: float = 5500.0         # GET/s per partitioned S3 prefix
    prefixes: int = 1                 # partitions serving the dataset; 0: S3 never throttles
    latency: float = 0.030            # s to the first byte of a GET
    conn_bps: float = 90e6            # bytes/s of one connection
    part_bytes: float = 8 << 20       # ranged GET size of whole-shard staging (Engine part_size)
    parts_in_flight: int = 8          # per staging job (Engine parts_in_flight)
    workers: int = 3                  # staging jobs at once per Engine (Engine workers)
    verify_bps: float = 1e9           # bytes/s one staging job decompresses and hashes
    record_gets_per_sample: float = 1.0
    bypass_whole: bool = False        # what-if, NOT kvdata today: bypassed shards streamed whole, not by record
    lookahead: int = 16               # Engine lookahead (shards ahead of a reader)
    window: int = 8                   # ShardShuffleSampler window
    exchange: float = 0.1             # ShardShuffleSampler exchange (locality)
    seed: int = 0
    epochs: int = 3
    slots: int = 16                   # virtual samples per shard (at most the real ones)
    scale: int = 1                    # simulate 1/scale of the shards (and of the tiers)
    detail: int = 4                   # nodes simulated; the others are taken to be alike
    lockstep: bool = True             # every GPU takes its next batch together (DDP); False: ranks run free
    dt: float = 0.25                  # tick, seconds

    # ---- derived
    @property
    def shards_total(self) -> int:
        return max(1, round(self.dataset_bytes / self.shard_bytes))

    @property
    def sim_shards(self) -> int:
        return max(1, self.shards_total // self.scale)

    @property
    def samples_per_shard(self) -> float:
        return self.shard_bytes / self.sample_bytes

    @property
    def sim_slots(self) -> int:
        return max(1, min(self.slots, int(round(self.samples_per_shard))))

    @property
    def samples_per_slot(self) -> float:
        return self.samples_per_shard / self.sim_slots

    @property
    def zst_shard(self) -> float:
        return self.shard_bytes / self.compression

    @property
    def sim_tier_bytes(self) -> float:
        return self.tier_bytes / self.scale


class Job:
    """One whole-shard fetch (a staging job, or a private copy for a reader that waits)."""

    __slots__ = ("shard", "need_now", "rank", "private", "left", "gets_per_byte", "delay", "size", "budget")

    def __init__(self, p: Params, shard: int, need_now: bool, rank: int | None) -> None:
        self.shard, self.need_now, self.rank, self.private = shard, need_now, rank, False
        self.left = p.zst_shard
        self.gets_per_byte = math.ceil(p.zst_shard / p.part_bytes) / p.zst_shard
        self.delay = p.latency
        self.size = int(p.shard_bytes)
        self.budget = 0.0                  # seconds of the current tick it may still use


@dataclass
class Tier:
    """A node's tier (or a rank's, mode private): its budget, whole copies, jobs in flight."""

    budget: float
    is_res: np.ndarray
    bypass: np.ndarray
    resident: dict[int, int] = field(default_factory=dict)
    used: int = 0                 # resident bytes + room reserved by jobs in flight
    reserved: int = 0
    inflight: dict[int, Job] = field(default_factory=dict)
    readers: list[Reader] = field(default_factory=list)
    keep_at: float = -INF         # when the keep set is taken again (Engine.keep_set's cache)
    keep_basis: tuple = ()        # what the last keep set was taken from (the same: the same set)
    version: int = 0              # bumped when a copy lands or goes
    admitted: tuple[int, set[int] | None] = (0, None)   # (the orders, the set their readers went by)

    def add(self, shard: int, size: int) -> None:
        self.resident[shard] = size
        self.is_res[shard] = True
        self.version += 1

    def evict(self, shard: int) -> None:
        self.used -= self.resident.pop(shard)
        self.is_res[shard] = False
        self.version += 1

    def demands(self) -> list[policy.Demand]:
        """Every order announced into this tier (kvdata.tiers.orders: the engines of the other
        processes publish theirs there; through the daemon they are all its own)."""
        return [r.demand() for r in self.readers]

    def held(self, max_open: int) -> set[int]:
        """Copies readers have mapped (flock-held, never evicted): each reader's last max_open
        shards touched."""
        out: set[int] = set()
        for r in self.readers:
            f = r.ep.furthest(r.cursor) if r.ep is not None else -1
            if f >= 0:
                out.update(r.ep.seq[max(0, f + 1 - max_open):f + 1].tolist())
        return {s for s in out if s in self.resident}


@dataclass
class Engine:
    """One kvdata Engine: plans for its readers' orders, runs `workers` jobs, FIFO queue."""

    tier: Tier
    readers: list[Reader]
    workers: int
    queue: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    dirty: bool = True

    def busy(self) -> int:
        return len(self.queue) + len(self.running)


class Reader:
    """One rank: its row for the epoch, where it is, and what it waited."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.ep: RankEpoch | None = None
        self.announced: tuple[int, ...] = ()
        self.next_start: int | None = None
        self.cursor = 0
        self.carry = 0.0
        self.done = True
        self.private: set[int] = set()
        self.tables: set[int] = set()
        self.credit = 0.0          # record-read slots allowed but not yet whole
        self.tier: Tier
        self.engine: Engine
        self._demand: policy.Demand | None = None
        self.reset_epoch(0.0)

    def reset_epoch(self, t0: float) -> None:
        self.t0 = t0
        self.stall = 0.0             # seconds this GPU waited for its own data
        self.waited = 0.0            # seconds it waited in step with another GPU that waited (DDP)
        self.ttfb: float | None = None
        self.stall0 = self.waited0 = 0.0     # stall and waited up to the first batch
        self.finish: float | None = None
        self.hits = 0
        self.records = 0

    def demand(self) -> policy.Demand:
        pos = self.ep.position(self.cursor) if self.ep is not None else 0
        if self._demand is None or self._demand.position != pos:
            self._demand = policy.Demand(self.announced, pos, self.next_start)
        return self._demand


@dataclass
class TickLog:
    """Per tick of one node: S3 GETs and bytes (record reads + staging), whole-copy bytes."""

    t: list[float] = field(default_factory=list)
    gets: list[float] = field(default_factory=list)
    s3_bytes: list[float] = field(default_factory=list)
    staged: list[float] = field(default_factory=list)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(getattr(self, k), dtype=np.float64) for k in ("t", "gets", "s3_bytes", "staged")}


def ep_moved(ep: RankEpoch | None, a: int, b: int) -> bool:
    return ep is not None and ep.position(a) != ep.position(b)


class Node:
    """A node: readers, tiers and engines as the mode lays them out."""

    def __init__(self, p: Params, mode: str, sizes: Mapping[int, int]) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        self.p, self.mode, self.sizes = p, mode, sizes
        n = p.sim_shards
        self.readers = [Reader(i) for i in range(p.gpus)]
        budgets = [p.sim_tier_bytes / p.gpus] * p.gpus if mode == "private" else [p.sim_tier_bytes]
        self.tiers = [Tier(b, np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)) for b in budgets]
        for i, r in enumerate(self.readers):
            r.tier = self.tiers[i if mode == "private" else 0]
            r.tier.readers.append(r)
        if mode == "daemon":
            self.engines = [Engine(self.tiers[0], list(self.readers), p.workers)]
        else:
            self.engines = [Engine(r.tier, [r], p.workers) for r in self.readers]
        for e in self.engines:
            for r in e.readers:
                r.engine = e
        shard = SimpleNamespace(bytes=int(p.shard_bytes))
        # shards a reader keeps mapped: at most 1/8 of its tier (EngineSource.max_open_for)
        self.max_open = {id(t): max_open_within(int(t.budget), [shard], MAX_OPEN) for t in self.tiers}
        self.depth = {id(t): policy.prefetch_depth(p.lookahead, int(t.budget), p.shard_bytes) for t in self.tiers}
        rate = p.gpu_rate if p.gpu_rate > 0 else p.read_rate
        self.rate_slots = rate / p.samples_per_slot
        self.batch_slots = max(1, math.ceil(p.batch_size / p.samples_per_slot))
        per_get = p.latency + p.sample_bytes / p.compression / p.conn_bps
        self.rec_cap_slots = max(1, p.num_workers) * IN_FLIGHT / per_get / p.samples_per_slot
        self.gets_per_slot = p.samples_per_slot * p.record_gets_per_sample
        self.bytes_per_slot = p.samples_per_slot * p.sample_bytes / p.compression
        self.table_gets = max(1, p.num_workers)     # each DataLoader worker process loads a shard's seek table
        if p.bypass_whole:   # what-if: a bypassed shard streamed whole into memory, its GETs spread over its slots
            self.gets_per_slot = math.ceil(p.zst_shard / p.part_bytes) / p.sim_slots
            self.bytes_per_slot = p.zst_shard / p.sim_slots
            self.rec_cap_slots = p.parts_in_flight * p.part_bytes / (p.latency + p.part_bytes / p.conn_bps) \
                * max(1, p.num_workers) / self.bytes_per_slot
            self.table_gets = 0
        self.job_rate = min(p.parts_in_flight * p.part_bytes / (p.latency + p.part_bytes / p.conn_bps),
                            p.verify_bps / p.compression)
        self.get_share = p.prefixes * p.get_limit / p.nodes if p.prefixes > 0 else INF
        self.node_bps = min(p.link_bps / 8, p.server_bps / p.nodes) if p.server_bps > 0 else p.link_bps / 8
        self.tokens_left = 0.0
        self._t = self._dt = self._link = self._tokens = 0.0
        self._cands: list[list] = []
        self.log = TickLog()
        self.evictions = 0
        self.private_copies = 0
        self.whole_bytes = 0.0    # compressed bytes fetched for whole copies (this epoch)
        self.record_bytes = 0.0
        self.gets = 0.0

    # ------------------------------------------------------------ epochs

    def start_epoch(self, t0: float, this: list[RankEpoch], following: list[np.ndarray]) -> None:
        """Every rank announces this epoch's shards then its plan of the next epoch's
        (ShardShuffleSampler; _cluster_plan.announced_next)."""
        for r, ep, nxt in zip(self.readers, this, following):
            r.ep = ep
            r.announced = tuple(ep.seq.tolist() + nxt.tolist())
            r.next_start = len(ep.seq)             # ShardShuffleSampler says where the next epoch starts
            r._demand = None
            r.cursor, r.carry, r.done = 0, 0.0, len(ep.shards) == 0
            r.private.clear()
            r.tables.clear()
            r.reset_epoch(t0)
        for t in self.tiers:
            t.keep_at = t0 + self.p.keep_ttl
            t.keep_basis = ()               # new orders: taken anew
            self._keep(t)
        for e in self.engines:
            e.dirty = True
        self.whole_bytes = self.record_bytes = self.gets = 0.0
        self.evictions = self.private_copies = 0

    def _keep(self, tier: Tier) -> None:
        """policy.keep_for_next_pass over the orders announced into the tier, with what the tier
        holds and what readers map, as Engine.keep_set takes it (every keep_ttl seconds)."""
        p = self.p
        demands = tier.demands()
        # keep_for_next_pass is a pure function of the orders, their positions, what is
        # resident and what readers hold (the furthest shard each touched): when none of
        # these moved since the last call, the set is the same -- not taken again (the
        # simulation's own saving: the engine recomputes it every KEEP_TTL regardless)
        reach = tuple(r.ep.furthest(r.cursor) if r.ep is not None else -1 for r in tier.readers)
        now = (tuple(id(d.sequence) for d in demands), tuple(d.position for d in demands), reach, tier.version)
        if now == tier.keep_basis:
            return
        tier.keep_basis = now
        room = int(tier.budget)
        held = tier.held(self.max_open[id(tier)])
        basis = hash(tuple(d.sequence for d in demands))
        admitted = tier.admitted[1] if tier.admitted[0] == basis else None
        keep = policy.keep_for_next_pass(demands, self.sizes, room, int(p.shard_bytes), resident=tier.resident,
                                         held=held, reading=KEEP_READING, admitted=admitted)
        tier.admitted = (basis, keep)
        tier.bypass[:] = False
        if keep is not None:
            announced = np.unique(np.concatenate([np.asarray(d.sequence, dtype=np.int64) for d in demands]))
            tier.bypass[announced] = True
            if keep:
                tier.bypass[np.fromiter(keep, dtype=np.int64, count=len(keep))] = False

    def done(self) -> bool:
        return all(r.done for r in self.readers)

    # ------------------------------------------------------------ one tick

    def tick(self, t: float, dt: float, common: int | None = None) -> None:
        """One tick on its own (ranks not in step with other nodes): propose, then advance."""
        self.propose(t, dt)
        self.advance(common)

    def propose(self, t: float, dt: float) -> int:
        """Phase 1 of a tick: how far each reader could read (what is resident, bypassed within
        its process's GETs in flight and the node's link and S3 share, or a private copy); the
        smallest of these over the readers still reading (a large number when none is)."""
        self._t, self._dt = t, dt
        self._link = self.node_bps * dt
        for tier in self.tiers:
            if t >= tier.keep_at:          # Engine.keep_set: taken again once its KEEP_TTL is out
                tier.keep_at = t + max(self.p.keep_ttl, self.p.keep_ticks * dt - 1e-9)
                self._keep(tier)
        self._tokens = self.get_share * dt + self.tokens_left
        cands = []
        for r in self.readers:
            if r.done or r.ep is None or t < r.t0 + self.p.start_s - 1e-12:
                continue
            ep = r.ep
            want = self.rate_slots * dt + r.carry
            m = min(int(want), len(ep.shards) - r.cursor)
            k, blocked = self._readable(r, m)
            seg = ep.shards[r.cursor:r.cursor + k]
            res = r.tier.is_res[seg]
            if r.private:
                res = res | np.isin(seg, np.fromiter(r.private, dtype=np.int64))
            rec_cum = np.cumsum(~res)
            need = int(rec_cum[-1]) if k else 0
            cands.append([r, want, m, k, seg, res, rec_cum, blocked, min(need, self.rec_cap_slots * dt)])
        total = sum(c[8] for c in cands)
        f = 1.0
        if total:
            f = min(1.0, self._link / (total * self.bytes_per_slot), self._tokens / (total * self.gets_per_slot))
        for c in cands:
            r, k, rec_cum, lim = c[0], c[3], c[6], c[8]
            limited = bool(k) and (lim < rec_cum[-1] or f < 1.0)
            if limited:
                # limited by the process's GETs in flight or by the node's link and S3 share: the
                # share granted is spent whole slots at a time (a slot is many samples), the
                # fraction kept for the next tick
                allowed = min(r.credit + f * lim, self.rec_cap_slots * dt + 1.0)
                k = min(k, int(np.searchsorted(rec_cum, math.floor(allowed), side="right")))
            c.extend([k, limited, f * lim])
        self._cands = cands
        return min((c[9] for c in cands), default=1 << 62)

    def advance(self, common: int | None = None) -> None:
        """Phase 2: every reader reads what it proposed -- or, in step with the others (DDP:
        every GPU takes its next batch together), `common` slots at most -- then the staging
        jobs run with what is left of the link and of the node's S3 share (unused share
        carries over, up to one second's worth)."""
        t, dt = self._t, self._dt
        rec_bytes = rec_gets = granted = table_gets = 0.0
        for c in self._cands:
            r, want, m, _k, seg, res, rec_cum, blocked, _lim, own, limited, grant = c
            k = own if common is None else min(own, common)
            used = int(rec_cum[k - 1]) if k else 0
            if limited and k == own:
                r.credit = min(r.credit + grant, self.rec_cap_slots * dt + 1.0) - used
                granted += grant
            elif limited:                  # held back by a GPU that waited: it asked only for what it read
                granted += max(0.0, used - r.credit)
                r.credit = max(0.0, r.credit - used)
            else:
                granted += used
            if used:
                fresh = set(np.unique(seg[:k][~res[:k]]).tolist()) - r.tables
                r.tables |= fresh
                tables = len(fresh) * self.table_gets
                table_gets += tables
                rec_gets += used * self.gets_per_slot + tables
                rec_bytes += used * self.bytes_per_slot
            r.records += used
            r.hits += k - used
            before = r.cursor
            r.cursor += k
            assert r.ep is not None
            if k and ep_moved(r.ep, before, r.cursor):
                r.engine.dirty = True        # the sampler reports progress: the engine replans
            if r.ttfb is None and r.cursor >= min(self.batch_slots, len(r.ep.shards)):
                r.ttfb = t - r.t0 + max(0, self.batch_slots - before) / self.rate_slots
                r.stall0, r.waited0 = r.stall, r.waited    # what it waited for its first batch
            if r.cursor >= len(r.ep.shards):
                r.done = True
                r.finish = t - r.t0 + k / self.rate_slots
                r.carry = 0.0
            elif k == m and m == int(want):
                r.carry = want - m
            else:
                r.carry = 0.0
                if own < m:
                    r.stall += (want - own) / self.rate_slots               # its own data was not there
                r.waited += max(0, own - k) / self.rate_slots                # in step with a GPU that waited
                if blocked is not None:
                    self._need(r, r.ep.block_shards(blocked))
        self.record_bytes += rec_bytes
        self.gets += rec_gets
        self.log.t.append(t)
        self.log.gets.append(rec_gets)
        self.log.s3_bytes.append(rec_bytes)
        self.log.staged.append(0.0)
        taken = granted * self.gets_per_slot + table_gets    # the S3 share the readers took
        left = max(0.0, self._tokens - taken)
        used_s = self._stage(dt, max(0.0, self._link - rec_bytes), left)
        self.tokens_left = min(max(0.0, left - used_s), self.get_share)
        self._cands = []

    def _readable(self, r: Reader, m: int) -> tuple[int, int | None]:
        """How many of the next m slots the reader can read: up to the first block (window)
        with a shard that is neither resident, bypassed (read by record) nor a private copy;
        (count, that block or None)."""
        ep = r.ep
        assert ep is not None
        if m <= 0:
            return 0, None
        tier = r.tier
        b = int(ep.block_of[r.cursor])
        end = r.cursor + m
        while True:
            sb = ep.block_shards(b)
            ok = tier.is_res[sb] | tier.bypass[sb]
            if not bool(ok.all()) and not all(int(s) in r.private for s in sb[~ok]):
                return max(0, int(ep.block_start[b]) - r.cursor), b
            b += 1
            if b >= len(ep.block_start) or int(ep.block_start[b]) >= end:
                return m, None

    def _need(self, r: Reader, upcoming: np.ndarray) -> None:
        """A reader waits: stage now every shard of its batch (its window) that is nowhere
        yet (Engine.start_many), queued behind the engine's jobs (its pool is FIFO)."""
        tier = r.tier
        for s in dict.fromkeys(upcoming.tolist()):
            if tier.is_res[s] or tier.bypass[s] or s in tier.inflight or s in r.private:
                continue
            job = Job(self.p, s, True, r.index)
            tier.inflight[s] = job
            r.engine.queue.append(job)

    # ------------------------------------------------------------ staging

    def _stage(self, dt: float, link: float, tokens: float) -> float:
        """Plan, start jobs, move them on; the GETs they used. A worker whose job ends inside
        the tick starts the next one with the rest of the tick (Engine._done replans)."""
        got = g_used = 0.0
        spare: dict[int, list[float]] = {}
        for e in self.engines:
            for j in e.running:
                j.budget = dt
            spare[id(e)] = [dt] * max(0, e.workers - len(e.running))
        for _round in range(4 * max(e.workers for e in self.engines) + 1):
            for e in self.engines:
                if e.dirty:
                    self._plan(e)
                self._start(e, spare[id(e)])
            active = [(e, j) for e in self.engines for j in e.running if j.budget > 1e-9]
            if not active:
                break
            wants = []
            for _e, j in active:
                d = min(j.delay, j.budget)
                j.delay -= d
                j.budget -= d
                wants.append(min(j.left, self.job_rate * j.budget))
            total = sum(wants)
            gets = sum(w * j.gets_per_byte for w, (_e, j) in zip(wants, active))
            f = 1.0
            if total > 0:
                f = min(1.0, max(0.0, link) / total, max(0.0, tokens) / gets if gets else 1.0)
            freed = False
            for w, (e, j) in zip(wants, active):
                x = w * f
                j.left -= x
                got += x
                g_used += x * j.gets_per_byte
                if j.left <= 1e-6:
                    used = x / (self.job_rate * f) if f > 0 else j.budget
                    spare[id(e)].append(max(0.0, j.budget - used))
                    self._finish(e, j)
                    freed = True
                j.budget = 0.0
            link -= total * f
            tokens -= gets * f
            if not freed or f < 1.0:
                break
        self.whole_bytes += got
        self.gets += g_used
        self.log.gets[-1] += g_used
        self.log.s3_bytes[-1] += got
        self.log.staged[-1] += got
        return g_used

    def _plan(self, e: Engine) -> None:
        """Engine._plan_pass: policy.plan_tier, then stage what is not bypassed or in flight,
        at most 2 x workers jobs queued or running."""
        tier = e.tier
        demands = [r.demand() for r in e.readers]
        plan = policy.plan_tier(int(tier.budget), self.sizes, tier.resident, demands,
                                in_use=tier.held(self.max_open[id(tier)]), lookahead=self.depth[id(tier)])
        busy = e.busy()
        for s in plan.stage:
            if busy >= 2 * e.workers:
                break
            if tier.bypass[s] or s in tier.inflight:
                continue
            job = Job(self.p, s, False, None)
            tier.inflight[s] = job
            e.queue.append(job)
            busy += 1
        e.dirty = False

    def _start(self, e: Engine, spare: list[float]) -> None:
        """Free workers take queued jobs (FIFO), each with the time its worker has left in the tick."""
        tier = e.tier
        while len(e.running) < e.workers and e.queue and spare:
            j = e.queue.popleft()
            if tier.is_res[j.shard]:
                tier.inflight.pop(j.shard, None)
                continue
            if self._room(tier, j.size):
                tier.reserved += j.size
                tier.used += j.size
            elif j.need_now:
                j.private = True           # no tier has room: a private copy for the reader that waits
                self.private_copies += 1
            else:
                tier.inflight.pop(j.shard, None)   # a prefetch with no room is dropped
                continue
            j.budget = spare.pop()
            e.running.append(j)

    def _room(self, tier: Tier, size: int) -> bool:
        """TierStager.evict_until_fits: victims in policy order (policy.plan_eviction), never a
        copy a reader holds; whether `size` more bytes then fit."""
        if tier.used + size <= tier.budget:
            return True
        victims = policy.plan_eviction(int(tier.budget - tier.reserved), tier.resident, tier.demands(), size,
                                       in_use=tier.held(self.max_open[id(tier)]))
        for v in victims:
            tier.evict(v)
            self.evictions += 1
        return tier.used + size <= tier.budget

    def _finish(self, e: Engine, j: Job) -> None:
        e.running.remove(j)
        tier = e.tier
        tier.inflight.pop(j.shard, None)
        if j.private:                      # others that wait for it ask again: a private copy is one reader's
            if j.rank is not None:
                self.readers[j.rank].private.add(j.shard)
        else:
            tier.reserved -= j.size
            tier.add(j.shard, j.size)
        e.dirty = True
