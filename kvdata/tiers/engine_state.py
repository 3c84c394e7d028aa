"""What the staging Engine's parts share (kvdata.tiers.engine): its counters, the home a shard
comes from (Known), and EngineState -- the engine's shared attributes declared once (Engine.__init__
sets them) with the small helpers every part calls. The parts (keep_set.KeepSet,
tier_staging.TierStaging, planner.Planner) are mixins over EngineState, so none imports another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config
from ..format import ShardEntry
from . import policy
from .claims import ReadModes
from .fetch import Fetcher
from .homes import Home
from .orders import SharedOrders
from .tier import Tier


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
class Known:
    home: Home
    entry: ShardEntry


class EngineState:
    """The attributes of Engine its parts share (set by Engine.__init__), the helpers they all
    call, and the methods one part calls that another defines (declared, not defined, here)."""

    config: Config
    tiers: list[Tier]
    modes: ReadModes  # who reads which dataset how (shard-aware, random)
    stats: Counters
    lookahead: int
    lookahead_share: float
    _workers: int
    _lock: threading.RLock
    _stats_lock: threading.Lock
    _inflight: dict[tuple[str, str], Future[Path]]
    _demands: dict[str, policy.Demand]
    _known: dict[str, Known]
    _pinned: dict[str, float]  # sha -> until when: just staged for a waiting reader
    _closed: bool
    _abort: threading.Event
    _fetcher: Fetcher
    _orders: SharedOrders  # announced orders published in the tiers, ours and other processes'
    _plan_event: threading.Event
    _planner: threading.Thread | None
    _planner_pid: int
    _congested_until: float  # see keep_set.CONGESTED_SECONDS
    _keep_cache: tuple[float, set[str] | None, frozenset[str]]
    _admitted: tuple[int, set[str] | None]  # (the orders' hash, the keep set last given for them)

    # defined by one part, called by another: keep_set.KeepSet, engine.Engine
    keep_set: Callable[[], tuple[set[str] | None, frozenset[str]]]
    _bypass: Callable[[str], bool]
    stage: Callable[[Home, ShardEntry, str], Future[Path]]
    trim: Callable[[list[policy.Demand] | None, set[str] | None], None]

    def count(self, name: str, amount: float) -> None:
        """Counters are bumped from several staging threads: `+=` on them is not atomic."""
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + amount)

    def _pinned_now(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            for sha in [s for s, until in self._pinned.items() if until < now]:
                del self._pinned[sha]
            return set(self._pinned)

    def _name(self, home: Home, entry: ShardEntry) -> None:
        self.modes.name(str(getattr(home, "url", "") or ""), entry.sha256)

    def _fetched(self, entry: ShardEntry) -> None:
        self.modes.fetched(entry)

    def _tiers_for(self, entry: ShardEntry) -> list[Tier]:
        return self.modes.tiers_for(entry.sha256)
