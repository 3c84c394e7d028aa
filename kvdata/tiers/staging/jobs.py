"""A staging engine's jobs (kvdata.tiers.staging): copies into tiers run by a pool of worker
threads, at most one in flight per (tier, shard) -- a second ask for it gets the same Future."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ...errors import StagingAbortedError
from ...format import ShardEntry
from ...homes import Home
from .tier_stager import TierStager


class Jobs:
    """The copies in flight, by (tier, shard); `on_done` is called with each finished one."""

    def __init__(self, workers: int, closing: threading.Event, on_done: Callable[[Future[Path]], None]) -> None:
        """closing: set when the engine closes (no job is started after it)."""
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvdata-stage")
        self._closing = closing
        self._on_done = on_done
        self._lock = threading.RLock()  # (a job done before add_done_callback runs _done in this thread)
        self._inflight: dict[tuple[str, str], Future[Path]] = {}
        self._need_now: weakref.WeakSet[Future[Path]] = weakref.WeakSet()  # jobs that waited for room

    def submit(self, stager: TierStager, home: Home, entry: ShardEntry, need_now: bool) -> Future[Path]:
        """The job copying the shard into the stager's tier: the one in flight, or a new one."""
        key = (stager.tier.name, entry.sha256)
        with self._lock:
            fut = self._inflight.get(key)
            if fut is None:
                if self._closing.is_set():
                    raise StagingAbortedError(f"shard {entry.name}: the staging engine is closing")
                fut = self._pool.submit(stager.stage, home, entry, need_now)
                self._inflight[key] = fut
                if need_now:
                    self._need_now.add(fut)
                fut.add_done_callback(functools.partial(self._done, key))
        return fut

    def _done(self, key: tuple[str, str], fut: Future[Path]) -> None:
        with self._lock:
            self._inflight.pop(key, None)
        self._on_done(fut)

    def waited(self, fut: Future[Path]) -> bool:
        """Whether the job was a need-now one (it waited for room already)."""
        return fut in self._need_now

    def running(self, tier: str, sha: str) -> bool:
        with self._lock:
            return (tier, sha) in self._inflight

    def in_flight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def cancel(self) -> None:
        """Drop the queued jobs now; running ones go on (until the fetcher's abort stops them)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Drop the queued jobs and wait for the running ones."""
        self._pool.shutdown(wait=True, cancel_futures=True)
