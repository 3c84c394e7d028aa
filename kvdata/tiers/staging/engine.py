"""The staging engine: verified copies of sealed shards into RAM/SSD/HDD tiers (kvdata.tiers.staging).

A staged copy is named by its shard's sha256 (content addressing): every job and
user reading the same shard shares one file, and a dataset rewritten at home can
never be served a stale copy. Staging fetches (concurrent ranged parts for remote
homes), decompresses the zstd stream, verifies the checksum, writes a temp name
in the target tier, fsyncs and renames: a partial or unverified file never has a
real name. Readers hold a shared flock on the copies they map, so eviction (which
needs an exclusive one) never takes a shard being read; on Linux an unlinked file
also stays readable through an existing map, so eviction never fails a read.

A tier's budget holds across every process staging into it: room is reserved under the
tier's budget lock before a byte is fetched (kvdata.tiers.tier: copies plus temp files in
flight, evicting to fit). A shard that no tier has room for -- larger than every budget,
or every tier full of copies that readers hold -- is not staged: it is read where it lies
(a local home), or fetched, verified, into a private sealed copy in memory that only this
reader maps; and for keep_set.CONGESTED_SECONDS after that, shards this engine finds unstaged
are read record by record (wants_whole), so readers that together need more shards at once
than the tier holds do not each fetch whole copies only to throw them away.

Which shards a tier holds is decided by kvdata.tiers.policy from the orders readers
announce: prefetch the next-needed shards that fit, evict the furthest.

**Unannounced orders.** A dataset read while nobody announced an order for it is read in
*random* mode (kvdata.tiers.claims.ReadModes): each tier keeps a fixed resident set of its whole
shards, never evicted while the dataset is read so; every other shard is not staged
(`wants_whole` says False, so the reader reads its records one by one; a reader that stages it
whole anyway gets a private copy in memory that no tier keeps).

Engine is a facade over parts that each own their state: a TierStager per tier (admission,
eviction, the copy), the KeepSet (whole copy or record reads), the Planner (announced orders,
the planner thread, the plan), Jobs (the copies in flight), Pins and KnownShards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..._util.sizes import format_size
from ...config import Config
from ...errors import ConfigError, KVDataError, NoRoomError, StagingAbortedError, TierFailedError
from ...format import ShardEntry
from ...homes import Home
from ...store.shards import OpenedCopy
from .. import policy
from ..claims import ORDER_PREFIX_SHARDS, ReadModes
from ..fetch import Fetcher
from ..tier import Tier
from .counters import Counters
from .jobs import Jobs
from .keep_set import KeepSet
from .known import KnownShards
from .planner import Planner
from .tier_stager import Pins, TierStager, private_copy


class Engine:
    """Stages shards into tiers on demand and ahead of announced orders; says which shards
    readers read whole (wants_whole); maintenance and status."""

    def __init__(self, config: Config, *, workers: int = 3, part_size: int = 8 << 20, parts_in_flight: int = 8,
                 prefetch: bool = True, lookahead: int = 16, lookahead_share: float = policy.LOOKAHEAD_SHARE,
                 verify_content: bool = False, probe_open: bool = False) -> None:
        """lookahead: shards fetched ahead of a reader (two windows of the default sampler), at
        most `lookahead_share` of a tier (policy.prefetch_depth);
        the rest of each budget keeps what is needed soonest, e.g. the next epoch's first shards.
        verify_content: hash every copy's decompressed bytes too (kvdatad: copies are shared
        by users who do not trust each other's homes, see fetch.Fetcher).
        probe_open: never evict a copy any process has open or mapped (Tier.probe_open; kvdatad)."""
        self.config = config
        self.probe_open = probe_open
        self.prefetch = prefetch
        self.tiers = self._open_tiers(config)
        for t in self.tiers:
            try:
                t.clean_partials()
            except OSError as e:
                t.fail(e.strerror or str(e))
        self.stats = Counters()
        self.modes = ReadModes(lambda: self.tiers)  # who reads which dataset how (shard-aware, random)
        self._closing = threading.Event()
        self._abort = threading.Event()
        self._parts = ThreadPoolExecutor(max(4, parts_in_flight * workers), thread_name_prefix="kvdata-part")
        self._fetcher = Fetcher(self._parts, part_size, parts_in_flight, self._abort,
                                lambda n: self.stats.add("bytes_from_home", n), verify_content)
        self._known = KnownShards()
        self._pins = Pins()
        self.planner = Planner(self._plan_pass, self.modes, self.stats, lookahead=lookahead,
                               lookahead_share=lookahead_share)
        self.keep = KeepSet(self.planner, self._known, self.modes, lambda: self.tiers)
        self._jobs = Jobs(workers, self._closing, self._done)
        self._stagers = [self._stager_for(t) for t in self.tiers]

    def _open_tiers(self, config: Config) -> list[Tier]:
        tiers = [Tier(t) for t in config.tiers]
        for t in tiers:
            t.probe_open = self.probe_open
            t.ensure()
        return tiers

    def _stager_for(self, tier: Tier) -> TierStager:
        return TierStager(tier, fetcher=self._fetcher, sources=lambda: self.tiers, orders=self.planner, keep=self.keep,
                          modes=self.modes, pins=self._pins, stats=self.stats, closing=self._closing)

    def _stager(self, tier: str) -> TierStager:
        stager = next((s for s in self._stagers if s.tier.name == tier), None)
        if stager is None:
            raise ConfigError(f"no tier named {tier!r}; tiers: {', '.join(t.name for t in self.tiers)}")
        return stager

    # ------------------------------------------------------------ budgets and lookup

    def check_budgets(self, entries: list[ShardEntry]) -> None:
        """Refuse tiers too small for the largest shard (a stager could never fit it); and
        learn the dataset's shard list (open_dataset), which every reader opens it through."""
        if not entries:
            return
        self.open_dataset(entries)
        largest = max(e.bytes for e in entries)
        for t in self.tiers:
            if t.budget < largest:
                raise ConfigError(f"tier {t.name!r} has a budget of {format_size(t.budget)}, smaller than the largest "
                                  f"shard ({format_size(largest)}); raise it to at least {largest} bytes")

    def fastest_copy(self, sha: str) -> Path | None:
        for t in self.tiers:
            if t.has(sha):
                return t.path(sha)
        return None

    def locate(self, home: Home, entry: ShardEntry) -> tuple[Path | OpenedCopy, bool]:
        """(a complete verified copy, whether it is a staged copy to hold a reader lock on) --
        staging it now if needed. The copy is a path, or (no tier had room) an open descriptor
        of a private sealed copy in memory, which the caller then owns."""
        sha = entry.sha256
        self._known.learn(home, entry)
        self._name(home, entry)
        tiers = self.modes.tiers_for(sha)
        # a random-order dataset's shard outside its resident set is not served from a tier even
        # when a copy lies there (left by a shard-aware phase): mapping it would keep it from eviction
        p = next((t.path(sha) for t in tiers if t.has(sha)), None)
        if p is not None:
            self.stats.add("hits", 1)
            return p, True
        local = home.local_path(f"shards/{entry.name}")
        if local is not None and not self.config.stage_local and local.exists():
            self.stats.add("home_reads", 1)
            self.modes.fetched(entry)
            return local, False
        self.stats.add("misses", 1)
        t0 = time.monotonic()
        try:
            if not tiers or self.keep.bypass(sha):  # random order, not resident; or read once this pass: never kept
                if not tiers:
                    self.stats.add("random_misses", 1)
                if local is not None and local.exists():  # a local (or NFS) home: read in place
                    self.stats.add("home_reads", 1)
                    self.modes.fetched(entry)
                    return local, False
                return self._private_copy(home, entry), False
            self._pins.pin(sha)  # kept from eviction until the reader has mapped (and locked) it
            return self._stage_now(home, entry, tiers)
        finally:
            self.stats.add("stall_seconds", time.monotonic() - t0)

    def start_many(self, home: Home, entries: list[ShardEntry]) -> None:
        """A batch needs these shards now: start staging every one that is not anywhere yet,
        concurrently, so the reader waits for the slowest instead of the sum."""
        tier = next((t for t in self.tiers if t.healthy()), None)
        if tier is None:
            return
        for e in entries:
            if self.fastest_copy(e.sha256) is None and (home.local_path("") is None or self.config.stage_local):
                target = next((t for t in self.modes.tiers_for(e.sha256) if t.healthy()), None)
                if target is None or self.keep.bypass(e.sha256):  # random order, not resident; or bypassed
                    continue
                self._pins.pin(e.sha256)
                self.stage(home, e, target.name, need_now=True)

    def _stage_now(self, home: Home, entry: ShardEntry, tiers: list[Tier]) -> tuple[Path | OpenedCopy, bool]:
        """Stage into the fastest healthy tier of `tiers` with room; a tier that fails is
        reported and skipped. No room anywhere: read the home in place, or a private copy in memory."""
        last: BaseException | None = None
        full = no_room = False
        for tier in tiers:
            if not tier.healthy():
                full = full or tier.untrusted() is not None  # skipped for its permissions: read around it
                continue
            try:
                fut = self.stage(home, entry, tier.name, need_now=True)
                try:
                    return fut.result(), True
                except NoRoomError:
                    if self._jobs.waited(fut):  # it waited for room already
                        raise
                    # we waited on a prefetch of this shard that gave up: a reader needs it now
                    return self._stager(tier.name).stage(home, entry, True), True
            except NoRoomError:
                full = no_room = True
            except TierFailedError as e:
                last = e
        local = home.local_path(f"shards/{entry.name}")
        if local is not None and local.exists():  # no tier can hold it: read the home in place
            self.stats.add("home_reads", 1)
            self.modes.fetched(entry)
            return local, False
        if full:
            if no_room:  # the tiers are full of copies readers hold: read what is not staged by record for a while
                self.keep.congest()
            return self._private_copy(home, entry), False
        raise last or KVDataError("no cache tier is usable (see `kvdata status`); fix the tier directories")

    def _private_copy(self, home: Home, entry: ShardEntry) -> OpenedCopy:
        copy = private_copy(self._fetcher, self.tiers, home, entry)
        self.stats.add("private_copies", 1)
        self.modes.fetched(entry)
        return copy

    def _name(self, home: Home, entry: ShardEntry) -> None:
        self.modes.name(str(getattr(home, "url", "") or ""), entry.sha256)

    # ------------------------------------------------------------ whole copies or record reads

    def wants_whole(self, home: Home, entry: ShardEntry) -> bool:
        """Whether a reader should read this shard through a whole copy: it is read in place,
        its dataset is read shard-aware (an announced order), or it is in its random-order
        dataset's resident set. False: read its samples record by record (a copy that a
        shard-aware phase left in a tier is not used: mapped, it could not be evicted)."""
        self._known.learn(home, entry)  # (a worker may not have seen it yet)
        self._name(home, entry)
        local = home.local_path(f"shards/{entry.name}")
        if local is not None and not self.config.stage_local and local.exists():
            return True
        tiers = self.modes.tiers_for(entry.sha256)
        if tiers and local is None:
            return self.keep.whole_copy(entry.sha256, tiers)
        return bool(tiers)

    def keep_set(self) -> tuple[set[str] | None, frozenset[str]]:
        """(the shards worth a whole copy or None for all of them, every shard announced): KeepSet.keep_set."""
        return self.keep.keep_set()

    def bypassed(self, sha: str) -> bool:
        """Whether an announced order reads this shard record by record (KeepSet.bypassed)."""
        return self.keep.bypassed(sha)

    def congested(self) -> bool:
        """Whether shards not staged are read record by record for now (KeepSet.congested)."""
        return self.keep.congested()

    # ------------------------------------------------------------ the policy for unannounced orders

    def open_dataset(self, entries: Sequence[ShardEntry], label: str | None = None) -> str:
        """Learn a dataset's shard list; its key (kvdata.tiers.claims.ReadModes)."""
        return self.modes.open_dataset(entries, label)

    def staged(self, shas: Sequence[str]) -> list[bool]:
        """Which of these shards have a copy in some healthy tier (one listing per tier)."""
        have: set[str] = set()
        for t in self.tiers:
            if t.healthy():
                have.update(t.resident())
        return [sha in have for sha in shas]

    def unpin(self, sha: str) -> None:
        """The reader has mapped (and reader-locked) the copy: the lock protects it now."""
        self._pins.unpin(sha)

    # ------------------------------------------------------------ staging

    def stage(self, home: Home, entry: ShardEntry, tier: str | None = None, need_now: bool = False) -> Future[Path]:
        """Copy one shard into a tier (default: the fastest); the Future gives its path."""
        stager = self._stagers[0] if tier is None else self._stager(tier)
        self._known.learn(home, entry)
        return self._jobs.submit(stager, home, entry, need_now)

    def _done(self, fut: Future[Path]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None and not isinstance(exc, (NoRoomError, StagingAbortedError, TierFailedError)):
            self.stats.error(str(exc))
        elif exc is None and self.prefetch and not self._closing.is_set():
            self.planner.wake()  # after a failure, wait for the next progress/announce to plan again

    # ------------------------------------------------------------ order-aware prefetch

    def announce(self, reader: str, home: Home, entries: list[ShardEntry], position: int = 0,
                 next_start: int | None = None) -> None:
        """A reader's shard sequence for its epoch (e.g. from ShardShuffleSampler.shard_order),
        and its next epoch's from `next_start` on when the reader knows it."""
        for e in entries:
            self._known.offer(home, e)  # keep a home that can supply it
        self.planner.announce(self.tiers, reader, [e.sha256 for e in entries], position, next_start)
        self.modes.announced(reader, [e.sha256 for e in entries[:ORDER_PREFIX_SHARDS]])
        self.keep.forget()  # a new order: what is worth keeping changes
        if self.prefetch:
            self.planner.wake()

    def progress(self, reader: str, position: int) -> None:
        if self.planner.progress(reader, position) and self.prefetch:
            self.planner.wake()

    def release(self, reader: str) -> None:
        self.planner.release(reader)
        self.modes.released(reader)
        self.keep.forget()

    def _plan_pass(self) -> None:
        """One pass of the planner thread: tiers a burst of need-now reads pushed over budget
        trimmed, then what the planner says each tier should fetch staged (a bounded number
        of jobs in flight), except what is read by record or in place when its turn comes."""
        demands = self.planner.demands()
        if self._closing.is_set() or not demands:
            return
        sizes = self._known.sizes()
        busy = self._jobs.in_flight()
        pinned = self._pins.now()
        self.trim(demands, pinned)
        for tier, sha in self.planner.plan(self.tiers, demands, sizes, pinned):
            if busy >= 2 * self._jobs.workers:
                return
            if self.keep.bypass(sha):  # read by record or in place when its turn comes, not staged
                continue
            k = self._known.get(sha)
            if k is None or self._jobs.running(tier.name, sha) or not k.home.can_stage(sha):
                continue
            self.stage(k.home, k.entry, tier.name)
            busy += 1

    # ------------------------------------------------------------ maintenance

    def reconfigure(self, config: Config) -> None:
        """Swap tiers/budgets (a daemon reload); in-flight jobs finish against the old ones."""
        tiers = self._open_tiers(config)
        stagers = [self._stager_for(t) for t in tiers]
        self.config, self.tiers, self._stagers = config, tiers, stagers
        if self.prefetch:
            self.planner.wake()

    def trim(self, demands: list[policy.Demand] | None = None, pinned: set[str] | None = None) -> None:
        """Bring tiers that a burst of need-now reads pushed over budget back under it."""
        demands = self.planner.demands() if demands is None else demands
        pinned = self._pins.now() if pinned is None else pinned
        for stager in self._stagers:
            stager.evict_until_fits(0, demands + self.planner.others(stager.tier), pinned)

    def evict(self, entries: list[ShardEntry], tier: str | None = None) -> int:
        """Drop staged copies of these shards (not ones being read); returns how many."""
        n = 0
        for t in self.tiers:
            if tier is not None and t.name != tier:
                continue
            for e in entries:
                if t.has(e.sha256) and t.try_evict(e.sha256, grace=0):
                    n += 1
                    self.stats.add("evictions", 1)
        return n

    def status(self) -> dict[str, Any]:
        tiers = []
        for t in self.tiers:
            ok = t.healthy()
            res = t.resident()
            metadata = t.metadata_bytes()  # remote datasets' indexes kept here count against the budget
            used = sum(res.values()) + sum(t.temps().values()) + metadata
            tiers.append({"name": t.name, "path": str(t.root), "budget": t.budget, "used": used,
                          "metadata": metadata, "shards": len(res), "ok": ok, "problem": t.problem})
        s = self.stats
        lookups = s.hits + s.misses
        datasets = self.modes.status(lambda sha: self.fastest_copy(sha) is not None)
        return {"tiers": tiers, "datasets": datasets, "random_misses": s.random_misses,
                "hits": s.hits, "misses": s.misses, "hit_rate": s.hits / lookups if lookups else None,
                "shards_staged": s.shards_staged, "bytes_staged": s.bytes_staged, "bytes_from_home": s.bytes_from_home,
                "evictions": s.evictions, "home_reads": s.home_reads, "private_copies": s.private_copies,
                "stall_seconds": round(s.stall_seconds, 3), "in_flight": self._jobs.in_flight(),
                "workers": self._jobs.workers, "readers": self.planner.readers(), "errors": list(s.errors),
                "error_count": s.error_count}

    def close(self, abort: bool = False) -> None:
        """Stop: queued jobs are dropped; running copies finish, or with abort=True stop at
        their next chunk (their temp files are removed; nothing partial gets a real name)."""
        self._closing.set()
        if abort:
            self._abort.set()
            # queued copies are dropped now, not after the planner stops (that can take seconds on
            # a busy machine, and kvdatad exits after a bound): running ones stop at their next chunk
            self._jobs.cancel()
        self.modes.close()
        self.planner.close()
        self._jobs.close()
        self._parts.shutdown(wait=True, cancel_futures=True)
