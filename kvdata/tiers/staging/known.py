"""The shards a staging engine has been asked about (kvdata.tiers.staging): the home each comes
from and its manifest entry, learned as readers locate, stage and announce them, so the planner
can stage a shard of an announced order and the keep set knows its size and home."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ...format import ShardEntry
from ...homes import Home


@dataclass
class Known:
    home: Home
    entry: ShardEntry


class KnownShards:
    """sha256 -> Known, for every shard a reader named; a home that can supply a shard is kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # writers and snapshots; a lookup needs none
        self._known: dict[str, Known] = {}

    def learn(self, home: Home, entry: ShardEntry) -> None:
        """The shard's home, unless one is known already (checked first: no object per read)."""
        if entry.sha256 not in self._known:
            with self._lock:
                self._known.setdefault(entry.sha256, Known(home, entry))

    def offer(self, home: Home, entry: ShardEntry) -> None:
        """An announced order reads the shard from `home`: it replaces a known home that cannot
        supply the shard now (a PassedFiles that holds no descriptor of it)."""
        k = self._known.get(entry.sha256)
        if k is None or not k.home.can_stage(entry.sha256):
            with self._lock:
                self._known[entry.sha256] = Known(home, entry)

    def get(self, sha: str) -> Known | None:
        return self._known.get(sha)

    def sizes(self) -> dict[str, int]:
        """sha256 -> bytes of every known shard."""
        with self._lock:
            return {sha: k.entry.bytes for sha, k in self._known.items()}
