"""The staging engine: verified copies of sealed shards into RAM/SSD/HDD tiers (kvdata.tiers).

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
reader maps; and for CONGESTED_SECONDS after that, shards this engine finds unstaged are read
record by record (wants_whole), so readers that together need more shards at once than the
tier holds do not each fetch whole copies only to throw them away.

Which shards a tier holds is decided by kvdata.policy from the orders readers
announce: prefetch the next-needed shards that fit, evict the furthest.

**Unannounced orders.** A dataset read while nobody announced an order for it is read in
*random* mode (kvdata.tiers.claims.ReadModes): each tier keeps a fixed resident set of its whole
shards, never evicted while the dataset is read so; every other shard is not staged
(`wants_whole` says False, so the reader reads its records one by one; a reader that stages it
whole anyway gets a private copy in memory that no tier keeps).
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .._util.sizes import format_size
from ..config import Config
from ..errors import ConfigError, KVDataError, NoRoomError, StagingAbortedError, TierFailedError
from ..format import ShardEntry
from ..store.shards import OpenedCopy
from . import policy
from .claims import ORDER_PREFIX_SHARDS, ReadModes
from .engine_state import Counters, Known
from .fetch import Fetcher
from .homes import Home
from .keep_set import CONGESTED_SECONDS, KeepSet
from .orders import SharedOrders
from .planner import Planner
from .tier import PIN_SECONDS, Tier
from .tier_staging import TierStaging


class Engine(Planner, TierStaging, KeepSet):
    """Stages shards into tiers on demand and ahead of announced orders. Its parts, each a
    mixin over engine_state.EngineState: keep_set.KeepSet (whole copy or record reads),
    tier_staging.TierStaging (one copy into one tier), planner.Planner (the planner thread)."""

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
        self.tiers = [Tier(t) for t in config.tiers]
        for t in self.tiers:
            t.probe_open = probe_open
            t.ensure()
            try:
                t.clean_partials()
            except OSError as e:
                t.fail(e.strerror or str(e))
        self.part_size, self.parts_in_flight, self.prefetch = part_size, parts_in_flight, prefetch
        self.lookahead, self.lookahead_share = lookahead, lookahead_share
        self._parts = ThreadPoolExecutor(max(4, parts_in_flight * workers), thread_name_prefix="kvdata-part")
        self._jobs = ThreadPoolExecutor(workers, thread_name_prefix="kvdata-stage")
        self._workers = workers
        self._lock = threading.RLock()
        self._inflight: dict[tuple[str, str], Future[Path]] = {}
        self._need_now: weakref.WeakSet[Future[Path]] = weakref.WeakSet()  # jobs that waited for room
        self._demands: dict[str, policy.Demand] = {}
        self._known: dict[str, Known] = {}
        self.stats = Counters()
        self._stats_lock = threading.Lock()
        self._pinned: dict[str, float] = {}  # sha -> until when: just staged for a waiting reader
        self._closed = False
        self._abort = threading.Event()
        self._fetcher = Fetcher(self._parts, part_size, parts_in_flight, self._abort,
                                lambda n: self.count("bytes_from_home", n), verify_content)
        self._plan_event = threading.Event()
        self._planner: threading.Thread | None = None
        self._planner_pid = -1
        self.modes = ReadModes(lambda: self.tiers)  # who reads which dataset how (shard-aware, random)
        self._congested_until = 0.0  # see CONGESTED_SECONDS
        self._keep_cache: tuple[float, set[str] | None, frozenset[str]] = (0.0, None, frozenset())
        self._admitted: tuple[int, set[str] | None] = (0, None)  # (the orders' hash, the keep set last given for them)
        self._orders = SharedOrders()  # announced orders published in the tiers, ours and other processes'

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
        self._known.setdefault(sha, Known(home, entry))
        self._name(home, entry)
        tiers = self._tiers_for(entry)
        # a random-order dataset's shard outside its resident set is not served from a tier even
        # when a copy lies there (left by a shard-aware phase): mapping it would keep it from eviction
        p = next((t.path(sha) for t in tiers if t.has(sha)), None)
        if p is not None:
            self.count("hits", 1)
            return p, True
        local = home.local_path(f"shards/{entry.name}")
        if local is not None and not self.config.stage_local and local.exists():
            self.count("home_reads", 1)
            self._fetched(entry)
            return local, False
        self.count("misses", 1)
        t0 = time.monotonic()
        try:
            if not tiers or self._bypass(sha):  # random order, not resident; or read once this pass: never kept
                if not tiers:
                    self.count("random_misses", 1)
                if local is not None and local.exists():  # a local (or NFS) home: read in place
                    self.count("home_reads", 1)
                    self._fetched(entry)
                    return local, False
                return self._private_copy(home, entry), False
            with self._lock:  # keep it from eviction until the reader has mapped (and locked) it
                self._pinned[sha] = time.monotonic() + PIN_SECONDS
            return self._stage_now(home, entry, tiers)
        finally:
            self.count("stall_seconds", time.monotonic() - t0)

    def start_many(self, home: Home, entries: list[ShardEntry]) -> None:
        """A batch needs these shards now: start staging every one that is not anywhere yet,
        concurrently, so the reader waits for the slowest instead of the sum."""
        tier = next((t for t in self.tiers if t.healthy()), None)
        if tier is None:
            return
        for e in entries:
            if self.fastest_copy(e.sha256) is None and (home.local_path("") is None or self.config.stage_local):
                target = next((t for t in self._tiers_for(e) if t.healthy()), None)
                if target is None or self._bypass(e.sha256):  # random order, not resident; or bypassed
                    continue
                with self._lock:
                    self._pinned[e.sha256] = time.monotonic() + PIN_SECONDS
                self.stage(home, e, target.name, need_now=True)

    def _stage_now(self, home: Home, entry: ShardEntry,
                   tiers: list[Tier] | None = None) -> tuple[Path | OpenedCopy, bool]:
        """Stage into the fastest healthy tier (of `tiers`) with room; a tier that fails is
        reported and skipped. No room anywhere: read the home in place, or a private copy in memory."""
        last: BaseException | None = None
        full = no_room = False
        for tier in self.tiers if tiers is None else tiers:
            if not tier.healthy():
                full = full or tier.untrusted() is not None  # skipped for its permissions: read around it
                continue
            try:
                fut = self.stage(home, entry, tier.name, need_now=True)
                try:
                    return fut.result(), True
                except NoRoomError:
                    if fut in self._need_now:  # it waited for room already
                        raise
                    # we waited on a prefetch of this shard that gave up: a reader needs it now
                    return self._stage_job(home, entry, tier, True), True
            except NoRoomError:
                full = no_room = True
            except TierFailedError as e:
                last = e
        local = home.local_path(f"shards/{entry.name}")
        if local is not None and local.exists():  # no tier can hold it: read the home in place
            self.count("home_reads", 1)
            self._fetched(entry)
            return local, False
        if full:
            if no_room:
                # the tiers are full of copies readers hold: for a while, shards not staged are read
                # record by record (wants_whole) rather than fetched whole into private copies that
                # are thrown away after use -- each worker fetching its own, again and again
                self._congested_until = time.monotonic() + CONGESTED_SECONDS
            return self._private_copy(home, entry), False
        raise last or KVDataError("no cache tier is usable (see `kvdata status`); fix the tier directories")

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
        with self._lock:
            self._pinned.pop(sha, None)

    # ------------------------------------------------------------ staging

    def stage(self, home: Home, entry: ShardEntry, tier: str | None = None, need_now: bool = False) -> Future[Path]:
        """Copy one shard into a tier (default: the fastest); the Future gives its path."""
        target = self.tiers[0] if tier is None else next((t for t in self.tiers if t.name == tier), None)
        if target is None:
            raise ConfigError(f"no tier named {tier!r}; tiers: {', '.join(t.name for t in self.tiers)}")
        sha = entry.sha256
        self._known.setdefault(sha, Known(home, entry))
        key = (target.name, sha)
        with self._lock:
            fut = self._inflight.get(key)
            if fut is None:
                if self._closed:
                    raise StagingAbortedError(f"shard {entry.name}: the staging engine is closing")
                fut = self._jobs.submit(self._stage_job, home, entry, target, need_now)
                self._inflight[key] = fut
                if need_now:
                    self._need_now.add(fut)
                fut.add_done_callback(functools.partial(self._done, key))
        return fut

    def _done(self, key: tuple[str, str], fut: Future[Path]) -> None:
        with self._lock:
            self._inflight.pop(key, None)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None and not isinstance(exc, (NoRoomError, StagingAbortedError, TierFailedError)):
            self.stats.errors.append(str(exc))
            del self.stats.errors[:-20]
            self.count("error_count", 1)
        elif exc is None and self.prefetch and not self._closed:
            self._replan()  # after a failure, wait for the next progress/announce to plan again

    # ------------------------------------------------------------ order-aware prefetch

    def announce(self, reader: str, home: Home, entries: list[ShardEntry], position: int = 0,
                 next_start: int | None = None) -> None:
        """A reader's shard sequence for its epoch (e.g. from ShardShuffleSampler.shard_order),
        and its next epoch's from `next_start` on when the reader knows it."""
        for e in entries:
            k = self._known.get(e.sha256)
            if k is None or not k.home.can_stage(e.sha256):  # keep a home that can supply it
                self._known[e.sha256] = Known(home, e)
        with self._lock:
            self._demands[reader] = policy.Demand(tuple(e.sha256 for e in entries), position, next_start)
        self.modes.announced(reader, [e.sha256 for e in entries[:ORDER_PREFIX_SHARDS]])
        self._orders.publish(self.tiers, reader, [e.sha256 for e in entries], position, next_start)
        self._keep_cache = (0.0, None, frozenset())  # a new order: what is worth keeping changes
        if self.prefetch:
            self._replan()

    def progress(self, reader: str, position: int) -> None:
        with self._lock:
            d = self._demands.get(reader)
            if d is None or d.position == position:
                return
            self._demands[reader] = policy.Demand(d.sequence, position, d.next_start)
        self._orders.move(reader, position)
        if self.prefetch:
            self._replan()

    def release(self, reader: str) -> None:
        with self._lock:
            self._demands.pop(reader, None)
        self._orders.withdraw(reader)
        self.modes.released(reader)
        self._keep_cache = (0.0, None, frozenset())

    # ------------------------------------------------------------ maintenance

    def reconfigure(self, config: Config) -> None:
        """Swap tiers/budgets (a daemon reload); in-flight jobs finish against the old ones."""
        tiers = [Tier(t) for t in config.tiers]
        for t in tiers:
            t.probe_open = self.probe_open
            t.ensure()
        with self._lock:
            self.config = config
            self.tiers = tiers
        if self.prefetch:
            self._replan()

    def trim(self, demands: list[policy.Demand] | None = None, pinned: set[str] | None = None) -> None:
        """Bring tiers that a burst of need-now reads pushed over budget back under it."""
        if demands is None:
            with self._lock:
                demands = list(self._demands.values())
        pinned = self._pinned_now() if pinned is None else pinned
        for tier in self.tiers:
            self._evict_until_fits(tier, 0, demands + self._orders.others(tier), pinned)

    def evict(self, entries: list[ShardEntry], tier: str | None = None) -> int:
        """Drop staged copies of these shards (not ones being read); returns how many."""
        n = 0
        for t in self.tiers:
            if tier is not None and t.name != tier:
                continue
            for e in entries:
                if t.has(e.sha256) and t.try_evict(e.sha256, grace=0):
                    n += 1
                    self.count("evictions", 1)
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
        with self._lock:
            inflight = len(self._inflight)
        datasets = self.modes.status(lambda sha: self.fastest_copy(sha) is not None)
        return {"tiers": tiers, "datasets": datasets, "random_misses": s.random_misses,
                "hits": s.hits, "misses": s.misses, "hit_rate": s.hits / lookups if lookups else None,
                "shards_staged": s.shards_staged, "bytes_staged": s.bytes_staged, "bytes_from_home": s.bytes_from_home,
                "evictions": s.evictions, "home_reads": s.home_reads, "private_copies": s.private_copies,
                "stall_seconds": round(s.stall_seconds, 3), "in_flight": inflight, "workers": self._workers,
                "readers": len(self._demands), "errors": list(s.errors), "error_count": s.error_count}

    def close(self, abort: bool = False) -> None:
        """Stop: queued jobs are dropped; running copies finish, or with abort=True stop at
        their next chunk (their temp files are removed; nothing partial gets a real name)."""
        self._closed = True
        if abort:
            self._abort.set()
            # queued copies are dropped now, not after the planner stops (that can take seconds on
            # a busy machine, and kvdatad exits after a bound): running ones stop at their next chunk
            self._jobs.shutdown(wait=False, cancel_futures=True)
        self._orders.close()
        self.modes.close()
        self._plan_event.set()
        if self._planner is not None and self._planner_pid == os.getpid():
            self._planner.join(timeout=10)
        self._jobs.shutdown(wait=True, cancel_futures=True)
        self._parts.shutdown(wait=True, cancel_futures=True)
