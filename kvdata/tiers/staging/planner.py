"""The orders announced to a staging engine, and its planner thread (kvdata.tiers.staging).

A reader announces its shard order for an epoch (and the next one's start); the planner keeps
them as policy.Demand, publishes them in every tier (kvdata.tiers.orders.SharedOrders) so other
processes' engines evict by them too, and reads theirs back. Announcements, progress and
finished jobs only wake the planner thread (coalesced), so readers' threads never plan or scan;
each pass it runs is the engine's, which asks `plan` what every tier should fetch (policy.plan_tier,
slow tiers first: filled from the home, then promoted) and stages it. The planner returns plans;
it never stages, evicts or calls back into staging.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence

from .. import policy
from ..claims import ReadModes
from ..orders import SharedOrders
from ..tier import Tier
from .counters import Counters


class Planner:
    """Announced orders (this engine's readers', and those other processes published in the
    tiers), the planner thread that runs `plan_pass` when woken, and the plan for each tier."""

    def __init__(self, plan_pass: Callable[[], None], modes: ReadModes, stats: Counters, *, lookahead: int,
                 lookahead_share: float) -> None:
        """plan_pass: one planning pass (the engine's: trim, `plan`, stage), run on the planner
        thread. lookahead: shards fetched ahead of a reader, at most `lookahead_share` of a tier
        (policy.prefetch_depth)."""
        self.lookahead, self.lookahead_share = lookahead, lookahead_share
        self._plan_pass = plan_pass
        self._modes = modes  # random-order datasets' resident sets are not the planner's to plan with
        self._stats = stats
        self._lock = threading.Lock()
        self._demands: dict[str, policy.Demand] = {}
        self._orders = SharedOrders()  # our readers' orders published in the tiers, and other processes'
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = -1
        self._closed = False

    # ------------------------------------------------------------ announced orders

    def announce(self, tiers: Sequence[Tier], reader: str, sequence: Sequence[str], position: int,
                 next_start: int | None) -> None:
        with self._lock:
            self._demands[reader] = policy.Demand(tuple(sequence), position, next_start)
        self._orders.publish(tiers, reader, list(sequence), position, next_start)

    def progress(self, reader: str, position: int) -> bool:
        """Whether the reader moved (an unknown reader, or one at `position` already, did not)."""
        with self._lock:
            d = self._demands.get(reader)
            if d is None or d.position == position:
                return False
            self._demands[reader] = policy.Demand(d.sequence, position, d.next_start)
        self._orders.move(reader, position)
        return True

    def release(self, reader: str) -> None:
        with self._lock:
            self._demands.pop(reader, None)
        self._orders.withdraw(reader)

    def demand(self, reader: str) -> policy.Demand | None:
        """What the reader announced, where it is now."""
        with self._lock:
            return self._demands.get(reader)

    def demands(self) -> list[policy.Demand]:
        """This engine's readers' orders."""
        with self._lock:
            return list(self._demands.values())

    def readers(self) -> int:
        with self._lock:
            return len(self._demands)

    def others(self, tier: Tier) -> list[policy.Demand]:
        """The orders other processes published in this tier."""
        return self._orders.others(tier)

    def demands_in(self, tier: Tier) -> list[policy.Demand]:
        """Every order that reads from this tier: ours, and those other processes published in it."""
        return self.demands() + self._orders.others(tier)

    # ------------------------------------------------------------ the plan

    def plan(self, tiers: Sequence[Tier], demands: list[policy.Demand], sizes: dict[str, int],
             pinned: set[str]) -> Iterator[tuple[Tier, str]]:
        """(tier, sha256) for each shard a tier should fetch ahead of `demands`, in the order to
        stage them: slow tiers first (filled from the home, then promoted), each tier planned
        (policy.plan_tier) only when the caller takes its first shard. `pinned`: copies no plan
        may evict (staged for a reader that has not mapped them yet)."""
        wanted = {sha for d in demands for sha in d.sequence}
        shard_bytes = sum(sizes.get(sha, 0) for sha in wanted) / max(1, len(wanted))
        for tier in reversed(tiers):
            if not tier.healthy():
                continue
            resident = tier.resident()
            kept = self._modes.protected(tier, resident)  # random-order resident sets: not ours to plan with
            in_use = pinned | tier.held(list(resident)) | kept
            room = tier.room() - sum(resident.get(s, 0) for s in kept)
            depth = policy.prefetch_depth(self.lookahead, room, shard_bytes, self.lookahead_share)
            for sha in policy.plan_tier(tier.room(), sizes, resident, demands, in_use=in_use, lookahead=depth).stage:
                yield tier, sha

    # ------------------------------------------------------------ the thread

    def wake(self) -> None:
        """Ask the planner thread for a pass (coalesced): readers' threads never plan or scan."""
        with self._lock:
            if self._closed:
                return
            if self._thread is None or self._pid != os.getpid():
                self._thread = threading.Thread(target=self._loop, name="kvdata-planner", daemon=True)
                self._pid = os.getpid()
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                self._plan_pass()
            except RuntimeError:  # the pools shut down meanwhile (engine or interpreter closing)
                return
            except Exception as e:  # keep planning; the reader path stages on demand anyway
                self._stats.error(f"planner: {e}")

    def close(self) -> None:
        """Stop the thread (after the pass it is running) and withdraw the published orders."""
        with self._lock:
            self._closed = True
        self._orders.close()
        self._wake.set()
        if self._thread is not None and self._pid == os.getpid():
            self._thread.join(timeout=10)
