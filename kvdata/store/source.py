"""Where a reader's sealed shards come from when they are not read in place.

The store only needs a verified, complete file per shard; who stages it (an
in-process engine, or kvdatad through its socket) is behind this one protocol.
`kvdata.tiers.source.EngineSource` and `kvdata.reader.daemon_client.DaemonStager`
implement it; a Store opened without one reads the shards where they lie.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ..format import ShardEntry
from .shards import OpenedCopy


class ShardSource(Protocol):
    """Locates verified copies of sealed shards and learns what readers will need."""

    #: shards a reader keeps mapped at once (a mapped staged copy cannot be evicted)
    max_open: int

    @property
    def home(self) -> Any:
        """The dataset's home (kvdata.homes.Home)."""

    @property
    def stager(self) -> Any:
        """The object that stages, evicts and reports status (an Engine, or the daemon stager)."""

    def locate(self, entry: ShardEntry) -> tuple[Path | OpenedCopy, bool]:
        """(path of a complete copy -- or an open descriptor of one, which the caller then
        owns --, whether it is a staged copy to hold a reader lock on)."""

    def mapped(self, entry: ShardEntry) -> None:
        """The reader has mapped (and reader-locked) the copy."""

    def wants_whole(self, entry: ShardEntry) -> bool:
        """Whether this shard is read through a whole copy (staged, announced, resident, or
        read in place); False: its samples are read record by record (`read_records`)."""

    def read_records(self, requests: Sequence[tuple[ShardEntry, Sequence[int]]]) -> list[list[bytes] | None]:
        """For each (shard, slots): the stored record bytes (LMDB values) of those slots, each
        read on its own from the home and verified -- every shard of the call fetched at once;
        None for a shard this source cannot read so (the reader then stages it whole)."""

    def need(self, entries: Sequence[ShardEntry]) -> None:
        """A batch needs these unmapped shards now: start them all at once."""

    def announce(self, reader: str, entries: Sequence[ShardEntry], position: int = 0,
                 next_start: int | None = None) -> None:
        """A reader's shard order for its epoch (and the next, from `next_start` on)."""

    def progress(self, reader: str, position: int) -> None:
        """How far along its announced order a reader is."""

    def close(self) -> None:
        """Release what the source owns (engine threads, the daemon connection, the home)."""
