"""Which shards readers read through a whole copy and which record by record (kvdata.tiers.staging).

The keep set: when the announced orders are larger than the tiers, only the shards the next pass
reads early enough are worth a whole copy (policy.keep_for_next_pass, Belady with bypass); the
others are bypassed: read record by record from a remote home, in place from a local one. And
congestion: for CONGESTED_SECONDS after no tier had room for a shard a reader needed, shards not
staged are read by record rather than fetched whole only to be thrown away. This part decides;
the engine, its stagers and its planner act on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .. import policy
from ..claims import ReadModes
from ..tier import Tier
from .known import KnownShards
from .planner import Planner

KEEP_READING = 8  # shards past a reader's position it may be reading by record (a window of ShardShuffleSampler)
KEEP_TTL = 0.25  # seconds the set of shards worth a whole copy (policy.keep_for_next_pass) is trusted
CONGESTED_SECONDS = 10.0  # after no tier had room for a needed shard, unstaged shards are read by record this long


class KeepSet:
    """The keep set over the announced orders (recomputed at most every KEEP_TTL seconds), the
    set last admitted for the same orders, and the congestion timer."""

    def __init__(self, orders: Planner, known: KnownShards, modes: ReadModes, tiers: Callable[[], list[Tier]]) -> None:
        """orders: the announced orders; known: the shards' sizes and homes; modes: the
        random-order datasets' resident sets (not ours to plan with); tiers: the engine's tiers now."""
        self._orders = orders
        self._known = known
        self._modes = modes
        self._tiers = tiers
        self._cache: tuple[float, set[str] | None, frozenset[str]] = (0.0, None, frozenset())  # (until, keep, announced)
        self._admitted: tuple[int, set[str] | None] = (0, None)  # (the orders' hash, the keep set last given for them)
        self._congested_until = 0.0

    def whole_copy(self, sha: str, tiers: list[Tier]) -> bool:
        """Whether a shard of a remote home that `tiers` may keep is read through a whole copy
        (False: its records are read one by one)."""
        staged = any(t.has(sha) for t in tiers)
        if self.congested():
            return staged  # no room to keep it: read its records
        if not staged and self.bypassed(sha):
            return False  # read once this pass, not worth a place in the tiers: read its records
        return True

    def bypassed(self, sha: str) -> bool:
        """Whether an announced order reads this shard but its whole copy is not worth a place
        in the tiers (policy.keep_for_next_pass: the data is larger than the tiers, and the next
        pass does not read it early enough): its samples are then read record by record."""
        if not self.bypass(sha):
            return False
        known = self._known.get(sha)
        return known is not None and known.home.record_reads  # a local home's is read in place (Engine.locate)

    def bypass(self, sha: str) -> bool:
        """An announced order reads this shard, but its whole copy is not worth a place in the
        tiers: it is read by record (bypassed), in place (a local home) or into a private copy."""
        keep, announced = self.keep_set()
        return keep is not None and sha in announced and sha not in keep

    def keep_set(self) -> tuple[set[str] | None, frozenset[str]]:
        """(the shards worth a whole copy or None for all of them, every shard announced) over
        the orders of this engine's readers and those other processes published in the tiers
        (policy.keep_for_next_pass), recomputed at most every KEEP_TTL seconds."""
        now = time.monotonic()
        until, keep, announced = self._cache
        if now < until:
            return keep, announced
        demands = self._orders.demands()
        sizes = self._known.sizes()
        tiers = [t for t in self._tiers() if t.healthy()]
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
                protected = self._modes.protected(t, here)
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
        self._cache = (now + KEEP_TTL, keep, announced)
        return keep, announced

    def forget(self) -> None:
        """The orders changed: what is worth keeping is recomputed at the next ask."""
        self._cache = (0.0, None, frozenset())

    def congest(self) -> None:
        """No tier had room for a shard a reader needs now (the tiers are full of copies readers
        hold): for a while, shards not staged are read record by record (wants_whole) rather
        than fetched whole into private copies thrown away after use -- each worker fetching
        its own, again and again."""
        self._congested_until = time.monotonic() + CONGESTED_SECONDS

    def congested(self) -> bool:
        """Whether a shard a reader needed found no room in any tier within CONGESTED_SECONDS:
        shards not staged are then better read record by record than fetched whole only to be
        thrown away (kvdatad tells its clients, see daemon/state.py). Not while the orders
        announced are larger than the tiers: only the keep set is read whole then, and reading
        it by record would lose it for the next pass (keep_set)."""
        return time.monotonic() < self._congested_until and self.keep_set()[0] is None
