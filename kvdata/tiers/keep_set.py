"""Which shards a reader reads through a whole copy and which record by record, for the Engine
(kvdata.tiers.engine): wants_whole, the keep set -- the shards worth a whole copy when the announced
orders are larger than the tiers (policy.keep_for_next_pass, Belady with bypass) -- and congestion
after no tier had room. Kept apart from staging: this part decides, the engine and its planner act.
"""

from __future__ import annotations

import time

from ..format import ShardEntry
from . import policy
from .engine_state import EngineState, Known
from .homes import Home

KEEP_READING = 8  # shards past a reader's position it may be reading by record (a window of ShardShuffleSampler)
KEEP_TTL = 0.25  # seconds the set of shards worth a whole copy (policy.keep_for_next_pass) is trusted
CONGESTED_SECONDS = 10.0  # after no tier had room for a needed shard, unstaged shards are read by record this long


class KeepSet(EngineState):
    """Engine's choice between a whole copy and record reads (a part of kvdata.tiers.engine.Engine)."""

    def wants_whole(self, home: Home, entry: ShardEntry) -> bool:
        """Whether a reader should read this shard through a whole copy: it is read in place,
        its dataset is read shard-aware (an announced order), or it is in its random-order
        dataset's resident set. False: read its samples record by record (a copy that a
        shard-aware phase left in a tier is not used: mapped, it could not be evicted)."""
        if entry.sha256 not in self._known:  # (a worker may not have seen it yet; no object per call)
            self._known[entry.sha256] = Known(home, entry)
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
