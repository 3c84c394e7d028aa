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

import fcntl
import functools
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .._util.fsutil import fsync_dir
from .._util.sizes import format_size
from ..config import Config
from ..errors import ConfigError, KVDataError, NoRoomError, StagingAbortedError, TierFailedError
from ..format import ShardEntry
from ..store.shards import OpenedCopy
from . import policy
from .claims import ORDER_PREFIX_SHARDS, ReadModes
from .fetch import Fetcher
from .homes import Home
from .orders import SharedOrders
from .tier import PIN_SECONDS, TIER_ERRNOS, Reservation, Tier

NEED_WAIT = 3.0  # how long a shard a reader needs now waits for room that is about to free up (copies in flight)
ROOM_POLL = 0.05
KEEP_READING = 8  # shards past a reader's position it may be reading by record (a window of ShardShuffleSampler)
KEEP_TTL = 0.25  # seconds the set of shards worth a whole copy (policy.keep_for_next_pass) is trusted
CONGESTED_SECONDS = 10.0  # after no tier had room for a needed shard, unstaged shards are read by record this long
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    home_reads: int = 0
    shards_staged: int = 0
    bytes_staged: int = 0
    bytes_from_home: int = 0
    evictions: int = 0
    private_copies: int = 0  # shards no tier had room for, fetched into a reader's own memory
    random_misses: int = 0   # shards of random-order datasets outside their resident sets, served unkept
    stall_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # the last 20 messages
    error_count: int = 0  # every error, for the daemon's kvdata_errors_total


@dataclass
class _Known:
    home: Home
    entry: ShardEntry




class Engine:
    """Stages shards into tiers on demand and ahead of announced orders."""

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
        self._known: dict[str, _Known] = {}
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
        self._known.setdefault(sha, _Known(home, entry))
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

    def wants_whole(self, home: Home, entry: ShardEntry) -> bool:
        """Whether a reader should read this shard through a whole copy: it is read in place,
        its dataset is read shard-aware (an announced order), or it is in its random-order
        dataset's resident set. False: read its samples record by record (a copy that a
        shard-aware phase left in a tier is not used: mapped, it could not be evicted)."""
        if entry.sha256 not in self._known:  # (a worker may not have seen it yet; no object per call)
            self._known[entry.sha256] = _Known(home, entry)
        self._name(home, entry)
        local = home.local_path(f"shards/{entry.name}")
        if local is not None and not self.config.stage_local and local.exists():
            return True
        tiers = self._tiers_for(entry)
        if tiers and local is None:
            staged = any(t.has(entry.sha256) for t in tiers)
            if self.congested():
                return staged  # no room to keep it: read its records
            if not staged and self.bypassed(entry.sha256):
                return False  # read once this pass, not worth a place in the tiers: read its records
        return bool(tiers)

    def bypassed(self, sha: str) -> bool:
        """Whether an announced order reads this shard but its whole copy is not worth a place
        in the tiers (policy.keep_for_next_pass: the data is larger than the tiers, and the next
        pass does not read it early enough): its samples are then read record by record."""
        if not self._bypass(sha):
            return False
        known = self._known.get(sha)
        return known is not None and known.home.record_reads  # a local home's is read in place (locate)

    def _bypass(self, sha: str) -> bool:
        """An announced order reads this shard, but its whole copy is not worth a place in the
        tiers: it is read by record (bypassed), in place (a local home) or into a private copy."""
        keep, announced = self.keep_set()
        return keep is not None and sha in announced and sha not in keep

    def keep_set(self) -> tuple[set[str] | None, frozenset[str]]:
        """(the shards worth a whole copy or None for all of them, every shard announced) over
        the orders of this engine's readers and those other processes published in the tiers
        (policy.keep_for_next_pass), recomputed at most every KEEP_TTL seconds."""
        now = time.monotonic()
        until, keep, announced = self._keep_cache
        if now < until:
            return keep, announced
        with self._lock:
            demands = list(self._demands.values())
            sizes = {sha: k.entry.bytes for sha, k in self._known.items()}
        tiers = [t for t in self.tiers if t.healthy()]
        for t in tiers:  # every publisher publishes in every tier it can: the first that answers will do
            others = self._orders.others(t)
            if others:
                demands += others
                break
        keep, announced = None, frozenset()
        if demands:
            announced = frozenset(s for d in demands for s in d.sequence)
            shard = sum(sizes.values()) // len(sizes) if sizes else 0
            kept = 0
            resident: dict[str, int] = {}
            held: set[str] = set()
            for t in tiers:  # random-order datasets' resident sets are not ours to plan with
                here = t.resident()
                protected = self.modes.protected(t, here)
                kept += sum(here.get(s, 0) for s in protected)
                here = {s: n for s, n in here.items() if s not in protected}
                resident.update(here)
                held |= t.held([s for s in here if s in announced])  # copies readers map: their room is not free yet
            room = sum(t.room() for t in tiers) - kept
            basis = hash(frozenset(d.sequence for d in demands))  # the same orders: readers went by the last set
            admitted = self._admitted[1] if self._admitted[0] == basis else None
            keep = policy.keep_for_next_pass(demands, {**resident, **sizes}, room, shard, resident=resident, held=held,
                                             reading=KEEP_READING, admitted=admitted)
            self._admitted = (basis, keep)
        self._keep_cache = (now + KEEP_TTL, keep, announced)
        return keep, announced

    def congested(self) -> bool:
        """Whether a shard a reader needed found no room in any tier within CONGESTED_SECONDS:
        shards not staged are then better read record by record than fetched whole only to be
        thrown away (kvdatad tells its clients, see daemon/state.py). Not while the orders
        announced are larger than the tiers: only the keep set is read whole then, and reading
        it by record would lose it for the next pass (keep_set)."""
        return time.monotonic() < self._congested_until and self.keep_set()[0] is None

    def staged(self, shas: Sequence[str]) -> list[bool]:
        """Which of these shards have a copy in some healthy tier (one listing per tier)."""
        have: set[str] = set()
        for t in self.tiers:
            if t.healthy():
                have.update(t.resident())
        return [sha in have for sha in shas]

    def _name(self, home: Home, entry: ShardEntry) -> None:
        self.modes.name(str(getattr(home, "url", "") or ""), entry.sha256)

    def _fetched(self, entry: ShardEntry) -> None:
        self.modes.fetched(entry)

    def _tiers_for(self, entry: ShardEntry) -> list[Tier]:
        return self.modes.tiers_for(entry.sha256)

    def _private_copy(self, home: Home, entry: ShardEntry) -> OpenedCopy:
        """The shard fetched and verified into memory of this process (a memfd, sealed against
        writes, so it can be handed to anyone): no tier's budget is exceeded for it."""
        fd = os.memfd_create(f"kvdata-{entry.sha256[:16]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            with os.fdopen(os.dup(fd), "wb") as f:
                self._copy_verified(home, entry, None, f)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(fd)
            raise
        self.count("private_copies", 1)
        self._fetched(entry)
        return OpenedCopy(fd, f"{home.where(f'shards/{entry.name}')} (a private copy in memory: no tier had room)")

    def count(self, name: str, amount: float) -> None:
        """Counters are bumped from several staging threads: `+=` on them is not atomic."""
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + amount)

    def unpin(self, sha: str) -> None:
        """The reader has mapped (and reader-locked) the copy: the lock protects it now."""
        with self._lock:
            self._pinned.pop(sha, None)

    def _pinned_now(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            for sha in [s for s, until in self._pinned.items() if until < now]:
                del self._pinned[sha]
            return set(self._pinned)

    # ------------------------------------------------------------ staging

    def stage(self, home: Home, entry: ShardEntry, tier: str | None = None, need_now: bool = False) -> Future[Path]:
        """Copy one shard into a tier (default: the fastest); the Future gives its path."""
        target = self.tiers[0] if tier is None else next((t for t in self.tiers if t.name == tier), None)
        if target is None:
            raise ConfigError(f"no tier named {tier!r}; tiers: {', '.join(t.name for t in self.tiers)}")
        sha = entry.sha256
        self._known.setdefault(sha, _Known(home, entry))
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

    def _stage_job(self, home: Home, entry: ShardEntry, tier: Tier, need_now: bool) -> Path:
        dest = tier.path(entry.sha256)
        if tier.has(entry.sha256):
            return dest
        if not tier.healthy():
            raise TierFailedError(f"tier {tier.name!r} is unusable: {tier.problem}")
        try:
            return self._stage_locked(home, entry, tier, need_now)
        except OSError as e:
            if e.errno in TIER_ERRNOS:
                tier.fail(e.strerror or str(e))
                raise TierFailedError(f"tier {tier.name!r} failed: {e.strerror or e}") from None
            raise

    def _stage_locked(self, home: Home, entry: ShardEntry, tier: Tier, need_now: bool) -> Path:
        sha, size = entry.sha256, entry.bytes
        dest = tier.path(sha)
        with tier.staging_lock(sha):
            if tier.has(sha):
                return dest
            if tier.occupied(sha):  # another user's file holds the name in a shared tier
                raise NoRoomError(tier.name)
            res = self._reserve(tier, sha, size, need_now)
            try:
                with res.file as f:
                    self._copy_verified(home, entry, tier, f)
                    f.flush()
                    os.fsync(f.fileno())
                    try:  # renamed while its temp is locked (never taken for abandoned), under the
                        with tier.budget_lock():  # budget lock (a count never misses it mid-rename)
                            os.replace(res.path, dest)
                    except PermissionError:
                        if tier.occupied(sha):  # planted meanwhile
                            raise NoRoomError(tier.name) from None
                        raise
                fsync_dir(tier.dir)
            except BaseException:
                res.discard()
                raise
        self.count("shards_staged", 1)
        self.count("bytes_staged", size)
        self._fetched(entry)
        return dest

    def _copy_verified(self, home: Home, entry: ShardEntry, target: Tier | None, out: BinaryIO) -> None:
        self._fetcher.copy_verified(self.tiers, home, entry, target, out)

    def _reserve(self, tier: Tier, sha: str, size: int, need_now: bool) -> Reservation:
        """Room for `size` bytes, reserved under the tier's budget lock (every process of this
        uid staging into the tier takes it): abandoned temp files go, copies are evicted in
        policy order, and the temp file is created at full size before the lock is let go.
        A need-now shard waits a little for room that is about to free up (copies another
        process just staged, temp files in flight); NoRoomError if none comes."""
        if size > tier.room():
            raise NoRoomError(tier.name)
        deadline = time.monotonic() + (NEED_WAIT if need_now else 0.0)
        while True:
            with self._lock:
                demands = list(self._demands.values())
            demands += self._orders.others(tier)
            with tier.budget_lock():
                tier.reclaim_abandoned()
                fits, soon = self._evict_until_fits(tier, size, demands, self._pinned_now())
                if fits:
                    return tier.reserve(sha, size)
            if not soon or time.monotonic() >= deadline or self._abort.is_set() or self._closed:
                raise NoRoomError(tier.name)
            time.sleep(ROOM_POLL)

    def _evict_until_fits(self, tier: Tier, incoming: int, demands: list[policy.Demand],
                          pinned: set[str]) -> tuple[bool, bool]:
        """Evict in policy order until `incoming` more bytes fit the budget, counting copies
        and temp files; (whether they fit, whether room may free up soon: a temp file of a
        copy in flight).

        Walks the whole candidate list: a victim a reader holds is skipped, the next one tried."""
        resident = tier.resident()
        temps = tier.temps()
        used = sum(resident.values()) + sum(temps.values())
        room = tier.room()  # (the budget less the datasets' indexes kept in this tier)
        soon = bool(temps)
        keep = pinned | self.modes.protected(tier, resident)  # random-order datasets' resident sets stay
        if used + incoming > room:
            # the shards kept for the next pass stay: the keep set is planned to fit beside the copies
            # still in use, so whatever comes in (a keep shard, a prefetch) has room without them
            keep |= (self.keep_set()[0] or set()) & resident.keys()
        for victim in policy.eviction_order(resident, demands, in_use=keep):
            if used + incoming <= room:
                break
            if tier.evict_one(victim) == "gone":
                self.count("evictions", 1)
                used -= resident[victim]
        return used + incoming <= room, soon

    # ------------------------------------------------------------ order-aware prefetch

    def announce(self, reader: str, home: Home, entries: list[ShardEntry], position: int = 0,
                 next_start: int | None = None) -> None:
        """A reader's shard sequence for its epoch (e.g. from ShardShuffleSampler.shard_order),
        and its next epoch's from `next_start` on when the reader knows it."""
        for e in entries:
            k = self._known.get(e.sha256)
            if k is None or not k.home.can_stage(e.sha256):  # keep a home that can supply it
                self._known[e.sha256] = _Known(home, e)
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

    def _replan(self) -> None:
        """Ask the planner thread to plan (coalesced): readers' threads never plan or scan."""
        with self._lock:
            if self._closed:
                return
            if self._planner is None or self._planner_pid != os.getpid():
                self._planner = threading.Thread(target=self._plan_loop, name="kvdata-planner", daemon=True)
                self._planner_pid = os.getpid()
                self._planner.start()
        self._plan_event.set()

    def _plan_loop(self) -> None:
        while not self._closed:
            self._plan_event.wait()
            self._plan_event.clear()
            if self._closed:
                return
            try:
                self._replan_once()
            except RuntimeError:  # the pools shut down meanwhile (engine or interpreter closing)
                return
            except Exception as e:  # keep planning; the reader path stages on demand anyway
                self.stats.errors.append(f"planner: {e}")
                del self.stats.errors[:-20]
                self.count("error_count", 1)

    def _replan_once(self) -> None:
        with self._lock:
            if self._closed or not self._demands:
                return
            demands = list(self._demands.values())
            sizes = {sha: k.entry.bytes for sha, k in self._known.items()}
            busy = len(self._inflight)
        wanted = {sha for d in demands for sha in d.sequence}
        shard_bytes = sum(sizes.get(sha, 0) for sha in wanted) / max(1, len(wanted))
        pinned = self._pinned_now()
        self.trim(demands, pinned)
        for tier in reversed(self.tiers):  # fill slow tiers from home first, then promote
            if not tier.healthy():
                continue
            resident = tier.resident()
            kept = self.modes.protected(tier, resident)  # random-order resident sets: not ours to plan with
            in_use = pinned | tier.held(list(resident)) | kept
            room = tier.room() - sum(resident.get(s, 0) for s in kept)
            depth = policy.prefetch_depth(self.lookahead, room, shard_bytes, self.lookahead_share)
            plan = policy.plan_tier(tier.room(), sizes, resident, demands, in_use=in_use, lookahead=depth)
            for sha in plan.stage:
                if busy >= 2 * self._workers:
                    return
                if self._bypass(sha):  # read by record or in place when its turn comes, not staged
                    continue
                k = self._known.get(sha)
                if k is None or (tier.name, sha) in self._inflight or not k.home.can_stage(sha):
                    continue
                self.stage(k.home, k.entry, tier.name)
                busy += 1

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
