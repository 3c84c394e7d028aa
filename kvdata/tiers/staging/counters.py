"""The staging engine's counters (kvdata.tiers.staging.engine.Engine.status, kvdatad's metrics):
bumped from the readers' threads, the staging jobs and the planner, each bump under the
counters' own lock (`+=` on an attribute is not atomic)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

KEEP_ERRORS = 20  # the last messages kept (status' "errors"); error_count counts every one


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
    errors: list[str] = field(default_factory=list)  # the last KEEP_ERRORS messages
    error_count: int = 0  # every error, for the daemon's kvdata_errors_total
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def add(self, name: str, amount: float) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def error(self, message: str) -> None:
        with self._lock:
            self.errors.append(message)
            del self.errors[:-KEEP_ERRORS]
            self.error_count += 1
