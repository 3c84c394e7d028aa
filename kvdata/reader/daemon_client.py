"""DaemonStager: the ShardSource served by kvdatad over its socket.

One staged copy is shared by every job on the box. If the daemon goes away or
refuses mid-run, the stager falls back on an in-process engine: readers never stop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import DaemonError, DaemonUnavailable, KVDataError
from ..format import ShardEntry, names
from ..protocol import Client
from ..tiers.engine import Engine
from ..tiers.homes import Home

PROGRESS_INTERVAL = 0.05  # seconds between progress reports of one reader to kvdatad
MAX_OPEN = 8              # staged shards a reader keeps mapped through the daemon


class DaemonStager:
    """The ShardSource (and engine interface: announce/progress/status) served by kvdatad."""

    def __init__(self, client: Client | None, location: str, home: Home, config: Config) -> None:
        self.client, self.location, self.config = client, location, config
        self._home = home
        self.max_open = MAX_OPEN
        self._fallback: Engine | None = None
        self._pid = os.getpid()
        self._paths: dict[str, tuple[Path, bool]] = {}  # sha -> where the daemon last put it
        self._sent: dict[str, tuple[int, float]] = {}   # reader -> (position, when) last reported
        self.stall_seconds = 0.0  # time this process waited for shards: reported with progress

    @property
    def home(self) -> Home:
        return self._home

    @property
    def stager(self) -> DaemonStager:
        return self

    def _live(self) -> Client | None:
        if self.client is not None and os.getpid() != self._pid:  # after fork: a connection of our own
            try:
                self.client = Client(self.client.path)
            except KVDataError:
                self.client = None
            self._pid = os.getpid()
        return self.client

    def _engine(self) -> Engine:
        if self._fallback is None:
            self._fallback = Engine(self.config)
        return self._fallback

    def _call(self, t: str, **fields: Any) -> dict[str, Any] | None:
        """The daemon's reply, or None when it is gone or refuses (the caller then works in-process)."""
        client = self._live()
        if client is None:
            return None
        try:
            return client.request(t, dataset=self.location, **fields) if t != "progress" else \
                client.request(t, **fields)
        except DaemonUnavailable:
            self.client = None
            return None
        except DaemonError:
            return None

    def locate(self, entry: ShardEntry) -> tuple[Path, bool]:
        known = self._paths.get(entry.sha256)
        if known is not None and known[0].exists():  # still there: map it again without a round trip
            return known                             # (if it vanishes first, the store asks again)
        t0 = time.monotonic()
        reply = self._call("need", shard=entry.id, sha256=entry.sha256)
        self.stall_seconds += time.monotonic() - t0
        if reply is not None:
            path, staged = Path(reply["path"]), bool(reply["staged"])
            if not staged or path.name == names.staged_name(entry.sha256):  # the copy this manifest names
                self._paths[entry.sha256] = (path, staged)
                return path, staged
        return self._engine().locate(self._home, entry)

    def mapped(self, entry: ShardEntry) -> None:
        if self._fallback is not None:
            self._fallback.unpin(entry.sha256)

    def need(self, entries: Sequence[ShardEntry]) -> None:
        if self._call("want", shards=[[e.id, e.sha256] for e in entries]) is None:
            self._engine().start_many(self._home, list(entries))

    def announce(self, reader: str, entries: Sequence[ShardEntry], position: int = 0) -> None:
        if self._call("announce", reader=reader, shards=[e.id for e in entries], position=position) is None:
            self._engine().announce(reader, self._home, list(entries), position)

    def progress(self, reader: str, position: int) -> None:
        """Reported at most every PROGRESS_INTERVAL per reader (a socket round trip each)."""
        now = time.monotonic()
        last = self._sent.get(reader)
        if last is not None and now - last[1] < PROGRESS_INTERVAL:
            return
        self._sent[reader] = (position, now)
        stall = round(self.stall_seconds, 6)
        if self._call("progress", reader=reader, position=position, stall=stall) is None and self._fallback is not None:
            self._fallback.progress(reader, position)

    def status(self) -> dict[str, Any]:
        reply = self._call("status") if self.client is not None else None
        return dict(reply) if reply is not None else self._engine().status()

    def close(self) -> None:
        if self.client is not None and os.getpid() == self._pid:
            self.client.close()
        if self._fallback is not None:
            self._fallback.close()
        self._home.close()
