"""One verified copy into one tier (kvdata.tiers.staging): TierStager, one per tier, owns the
tier's admission -- the per-shard staging lock, room reserved under the tier's budget lock
(abandoned temp files reclaimed, copies evicted in policy order until it fits) -- and the
verified fetch, fsync and rename; Pins, the copies just staged for a reader that has not mapped
them yet, which no stager evicts; and private_copy, where no tier has room: a sealed copy in
memory. The engine decides what to stage; a stager does it.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..._util.fsutil import fsync_dir
from ...errors import NoRoomError, TierFailedError
from ...format import ShardEntry
from ...homes import Home
from ...store.shards import OpenedCopy
from .. import policy
from ..claims import ReadModes
from ..fetch import Fetcher
from ..tier import PIN_SECONDS, TIER_ERRNOS, Reservation, Tier
from .counters import Counters
from .keep_set import KeepSet
from .planner import Planner

NEED_WAIT = 3.0  # how long a shard a reader needs now waits for room that is about to free up (copies in flight)
ROOM_POLL = 0.05
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


class Pins:
    """Copies staged for a reader that waits for them, kept from eviction until it has mapped
    (and reader-locked) them, or PIN_SECONDS at most."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}  # sha -> until when

    def pin(self, sha: str) -> None:
        with self._lock:
            self._until[sha] = time.monotonic() + PIN_SECONDS

    def unpin(self, sha: str) -> None:
        with self._lock:
            self._until.pop(sha, None)

    def now(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            for sha in [s for s, until in self._until.items() if until < now]:
                del self._until[sha]
            return set(self._until)


class TierStager:
    """Copies into one tier: admission (room reserved under the tier's budget lock), eviction
    in policy order, the verified copy and its rename."""

    def __init__(self, tier: Tier, *, fetcher: Fetcher, sources: Callable[[], list[Tier]], orders: Planner,
                 keep: KeepSet, modes: ReadModes, pins: Pins, stats: Counters, closing: threading.Event) -> None:
        """sources: the tiers a copy may come from (promotion) besides the home; orders: the
        announced orders eviction goes by; keep: the shards kept for the next pass, never evicted
        to make room; modes: random-order datasets' resident sets, never evicted either;
        closing: set when the engine closes (a reservation stops waiting for room)."""
        self.tier = tier
        self._fetcher = fetcher
        self._sources = sources
        self._orders = orders
        self._keep = keep
        self._modes = modes
        self._pins = pins
        self._stats = stats
        self._closing = closing

    def stage(self, home: Home, entry: ShardEntry, need_now: bool) -> Path:
        """A verified copy of the shard in this tier (staged now unless it is there): its path.
        NoRoomError if it does not fit, TierFailedError (and the tier marked failed) if the tier
        cannot be written."""
        tier = self.tier
        dest = tier.path(entry.sha256)
        if tier.has(entry.sha256):
            return dest
        if not tier.healthy():
            raise TierFailedError(f"tier {tier.name!r} is unusable: {tier.problem}")
        try:
            return self._stage_locked(home, entry, need_now)
        except OSError as e:
            if e.errno in TIER_ERRNOS:
                tier.fail(e.strerror or str(e))
                raise TierFailedError(f"tier {tier.name!r} failed: {e.strerror or e}") from None
            raise

    def _stage_locked(self, home: Home, entry: ShardEntry, need_now: bool) -> Path:
        tier = self.tier
        sha, size = entry.sha256, entry.bytes
        dest = tier.path(sha)
        with tier.staging_lock(sha):
            if tier.has(sha):
                return dest
            if tier.occupied(sha):  # another user's file holds the name in a shared tier
                raise NoRoomError(tier.name)
            res = self._reserve(sha, size, need_now)
            try:
                with res.file as f:
                    self._fetcher.copy_verified(self._sources(), home, entry, tier, f)
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
        self._stats.add("shards_staged", 1)
        self._stats.add("bytes_staged", size)
        self._modes.fetched(entry)
        return dest

    def _reserve(self, sha: str, size: int, need_now: bool) -> Reservation:
        """Room for `size` bytes, reserved under the tier's budget lock (every process of this
        uid staging into the tier takes it): abandoned temp files go, copies are evicted in
        policy order, and the temp file is created at full size before the lock is let go.
        A need-now shard waits a little for room that is about to free up (copies another
        process just staged, temp files in flight); NoRoomError if none comes."""
        tier = self.tier
        if size > tier.room():
            raise NoRoomError(tier.name)
        deadline = time.monotonic() + (NEED_WAIT if need_now else 0.0)
        while True:
            demands = self._orders.demands_in(tier)
            with tier.budget_lock():
                tier.reclaim_abandoned()
                fits, soon = self.evict_until_fits(size, demands, self._pins.now())
                if fits:
                    return tier.reserve(sha, size)
            if not soon or time.monotonic() >= deadline or self._closing.is_set():
                raise NoRoomError(tier.name)
            time.sleep(ROOM_POLL)

    def evict_until_fits(self, incoming: int, demands: list[policy.Demand], pinned: set[str]) -> tuple[bool, bool]:
        """Evict in policy order until `incoming` more bytes fit the budget, counting copies
        and temp files; (whether they fit, whether room may free up soon: a temp file of a
        copy in flight).

        Walks the whole candidate list: a victim a reader holds is skipped, the next one tried."""
        tier = self.tier
        resident = tier.resident()
        temps = tier.temps()
        used = sum(resident.values()) + sum(temps.values())
        room = tier.room()  # (the budget less the datasets' indexes kept in this tier)
        soon = bool(temps)
        keep = pinned | self._modes.protected(tier, resident)  # random-order datasets' resident sets stay
        if used + incoming > room:
            # the shards kept for the next pass stay: the keep set is planned to fit beside the copies
            # still in use, so whatever comes in (a keep shard, a prefetch) has room without them
            keep |= (self._keep.keep_set()[0] or set()) & resident.keys()
        for victim in policy.eviction_order(resident, demands, in_use=keep):
            if used + incoming <= room:
                break
            if tier.evict_one(victim) == "gone":
                self._stats.add("evictions", 1)
                used -= resident[victim]
        return used + incoming <= room, soon


def private_copy(fetcher: Fetcher, sources: list[Tier], home: Home, entry: ShardEntry) -> OpenedCopy:
    """The shard fetched and verified into memory of this process (a memfd, sealed against
    writes, so it can be handed to anyone): no tier's budget is exceeded for it."""
    fd = os.memfd_create(f"kvdata-{entry.sha256[:16]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            fetcher.copy_verified(sources, home, entry, None, f)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return OpenedCopy(fd, f"{home.where(f'shards/{entry.name}')} (a private copy in memory: no tier had room)")
