"""The Engine's planner thread (kvdata.tiers.engine): announcements, progress and finished jobs
only wake it (coalesced), so readers' threads never plan or scan; each pass asks policy.plan_tier
what every tier should fetch ahead of the announced orders and submits those jobs (slow tiers
first, filled from the home, then promoted).
"""

from __future__ import annotations

import os
import threading

from . import policy
from .engine_state import EngineState


class Planner(EngineState):
    """Engine's order-aware prefetch planning (a part of kvdata.tiers.engine.Engine)."""

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
