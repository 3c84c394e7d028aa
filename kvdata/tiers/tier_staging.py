"""One verified copy into one tier, for the Engine (kvdata.tiers.engine): the per-shard staging
lock, the room reserved under the tier's budget lock (abandoned temp files reclaimed, copies
evicted in policy order until it fits), the verified fetch, fsync and rename; or, where no tier
has room, a private sealed copy in memory. The engine decides what to stage; this part does it.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import BinaryIO

from .._util.fsutil import fsync_dir
from ..errors import NoRoomError, TierFailedError
from ..format import ShardEntry
from ..store.shards import OpenedCopy
from . import policy
from .engine_state import EngineState
from .homes import Home
from .tier import TIER_ERRNOS, Reservation, Tier

NEED_WAIT = 3.0  # how long a shard a reader needs now waits for room that is about to free up (copies in flight)
ROOM_POLL = 0.05
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


class TierStaging(EngineState):
    """Engine's staging of one copy into one tier (a part of kvdata.tiers.engine.Engine)."""

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
