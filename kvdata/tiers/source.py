"""EngineSource: the in-process ShardSource, an Engine staging one dataset's shards from its home."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..format import ShardEntry
from ..homes import Home
from ..store.shards import OpenedCopy
from .staging import Engine

MAX_OPEN = 16          # staged shards a reader keeps mapped, at most
TIER_SHARE = 8          # ... and at most 1/TIER_SHARE of the fastest tier, so prefetching and keeping have room


def max_open_for(engine: Engine, shards: Sequence[ShardEntry]) -> int:
    """Shards a reader keeps mapped (and so un-evictable): at most a third of the fastest
    tier, so prefetching always has room."""
    return max_open_within(engine.tiers[0].budget, shards, MAX_OPEN)


def max_open_within(budget: int, shards: Sequence[ShardEntry], cap: int) -> int:
    """At most `cap` shards mapped, and at most 1/TIER_SHARE of a tier of `budget` bytes: a
    mapped copy cannot be evicted, so a reader holding more would leave the tier no room to
    keep what the next epoch reads first (every process reading the dataset holds its own)."""
    largest = max((e.bytes for e in shards), default=1)
    return max(1, min(cap, budget // max(largest, 1) // TIER_SHARE))


class EngineSource:
    """Shards of one dataset through an in-process Engine (owned, or shared by the caller)."""

    def __init__(self, engine: Engine, home: Home, shards: Sequence[ShardEntry], *, own_engine: bool,
                 tables: Path | None = None) -> None:
        """tables: where seek tables of the home's cold copies are kept (kvdata.tiers.records)."""
        self.engine = engine
        self._home = home
        self._own = own_engine
        self._tables = tables
        self.max_open = max_open_for(engine, shards)

    @property
    def home(self) -> Home:
        return self._home

    @property
    def stager(self) -> Engine:
        return self.engine

    def locate(self, entry: ShardEntry) -> tuple[Path | OpenedCopy, bool]:
        return self.engine.locate(self._home, entry)

    def mapped(self, entry: ShardEntry) -> None:
        self.engine.unpin(entry.sha256)

    def wants_whole(self, entry: ShardEntry) -> bool:
        return self.engine.wants_whole(self._home, entry)  # the policy for unannounced orders (staging/engine.py)

    def read_records(self, requests: Sequence[tuple[ShardEntry, Sequence[int]]]) -> list[list[bytes] | None]:
        """From the home's framed cold copies (kvdata.tiers.records); None for a shard of a
        local home (read in place) or a copy without a seek table (staged whole)."""
        from .records import reader_for

        engine = self.engine
        return reader_for(self._home, lambda n: engine.stats.add("bytes_from_home", n), self._tables).read_many(requests)

    def need(self, entries: Sequence[ShardEntry]) -> None:
        self.engine.start_many(self._home, list(entries))

    def announce(self, reader: str, entries: Sequence[ShardEntry], position: int = 0,
                 next_start: int | None = None) -> None:
        self.engine.announce(reader, self._home, list(entries), position, next_start)

    def progress(self, reader: str, position: int) -> None:
        self.engine.progress(reader, position)

    def close(self) -> None:
        if self._own:
            self.engine.close()
        self._home.close()
