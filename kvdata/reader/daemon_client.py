"""DaemonStager: the ShardSource served by kvdatad over its socket.

One staged copy is shared by every job on the box. The daemon hands each copy over as a
read-only file descriptor (its tiers are private to it); a reader whose uid may not name
local paths to the daemon (docs/SECURITY.md: any uid but root and the daemon's own)
passes the files of a local dataset it opened itself -- the manifest at open, each shard
file with the requests that stage it. If the daemon goes away or refuses anything
mid-run, the stager falls back on an in-process engine: readers never stop. The one-shot
requests (open, stage, evict, open_root) are in daemon_requests.py.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import DaemonError, DaemonUnavailable, KVDataError
from ..format import ShardEntry, names
from ..homes import Home
from ..protocol import MAX_FDS, Client, close_fds, flag_set
from ..store.shards import OpenedCopy
from ..tiers.staging import Engine
from ..tiers.staging.keep_set import KEEP_TTL
from .daemon_requests import open_request, shard_file

PROGRESS_INTERVAL = 0.05  # seconds between progress reports of one reader to kvdatad
MAX_OPEN = 8              # staged shards a reader keeps mapped through the daemon
# descriptors of staged copies kept (unmapped) to map again without a round trip: none. kvdatad
# never evicts a copy that any process has open (a tier never holds more than its budget, and an
# unlinked copy someone still holds would: Tier.probe_open), so kept descriptors would pin copies
# the reader no longer maps; giving them back costs one `need` round trip when it maps one again.
KEEP_COPIES = 0
AHEAD = 16                # shard files passed ahead of a reader (the daemon's prefetch lookahead)
MODE_INTERVAL = 1.0       # seconds a dataset's read mode (shard-aware / random + resident set) is trusted
# ... and the `whole` bits of a shard-aware dataset larger than the tiers: the keep set changes as the
# pass goes (kvdata.tiers.staging.keep_set), and a reader a second behind it read shards by record
# that the daemon then staged whole, or asked whole for shards it no longer keeps (private copies)
WHOLE_INTERVAL = KEEP_TTL
RETRY_CODES = ("StaleManifest", "NotAllowed")  # answered by opening the dataset again, once


@dataclass(frozen=True)
class _ReadMode:
    """How kvdatad said a dataset is read (the reply to an empty `want`)."""

    when: float           # time.monotonic() of the reply
    mode: str             # "shard-aware" or "random"
    resident_below: str   # random mode: shards with a sha256 <= this are resident (read whole)
    staged: bytes | None  # congested tiers: protocol.pack_flags of which shards have a copy; else None
    whole: bytes | None   # shard-aware, larger than the tiers: which shards to read whole (the rest by record)


class DaemonStager:
    """The ShardSource (and engine interface: announce/progress/status) served by kvdatad."""

    def __init__(self, client: Client | None, location: str, home: Home, config: Config,
                 tables: Path | None = None) -> None:
        """tables: where seek tables of the home's cold copies are kept (kvdata.tiers.records)."""
        self.client, self.location, self.config = client, location, config
        self._home = home
        self._tables = tables
        self.max_open = MAX_OPEN
        self._fallback: Engine | None = None
        self._pid = os.getpid()
        # descriptors of copies the daemon passed (unlocked: the mapped handle locks its own use)
        self._copies: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self._sent: dict[str, tuple[int, float]] = {}   # reader -> (position, when) last reported
        self._unsent: dict[str, int] = {}                # reader -> a position held back (PROGRESS_INTERVAL)
        self._orders: dict[str, list[ShardEntry]] = {}  # reader -> announced order (files passed ahead)
        self._ahead: dict[str, set[int]] = {}           # reader -> shard ids whose files went ahead
        self.stall_seconds = 0.0  # time this process waited for shards: reported with progress
        self._mode: _ReadMode | None = None  # what the daemon said of how the dataset is read

    @property
    def home(self) -> Home:
        return self._home

    @property
    def stager(self) -> DaemonStager:
        return self

    @property
    def _passing(self) -> bool:
        """Whether this reader passes its local dataset's files (the daemon does not open its paths)."""
        c = self.client
        return c is not None and not c.may_name_paths and self._home.local_path("") is not None

    def _live(self) -> Client | None:
        if self.client is not None and os.getpid() != self._pid:  # after fork: a connection of our own
            inherited = list(self._copies.values())
            self._copies.clear()
            close_fds([fd for fd, _where in inherited])
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

    def _request(self, t: str, fds: Sequence[int] = (), **fields: Any) -> tuple[dict[str, Any], list[int]] | None:
        """The daemon's reply and the descriptors it passed; None when it is gone or refuses
        (the caller then works in-process). A refusal that opening again may cure (the daemon
        restarted, the dataset moved to a new generation) is retried once after an `open`."""
        for attempt in range(2):
            client = self._live()
            if client is None:
                return None
            try:
                if t == "progress":
                    return client.request_fds(t, fds=fds, **fields)
                return client.request_fds(t, fds=fds, dataset=self.location, **fields)
            except DaemonUnavailable:
                self.client = None
                return None
            except DaemonError as e:
                if attempt or e.code not in RETRY_CODES or not self._passing:
                    return None
                try:
                    _reply, got = open_request(client, self.location)
                    close_fds(got)
                except KVDataError:
                    return None
        return None

    def _call(self, t: str, fds: Sequence[int] = (), **fields: Any) -> dict[str, Any] | None:
        got = self._request(t, fds, **fields)
        if got is None:
            return None
        close_fds(got[1])
        return got[0]

    # ------------------------------------------------------------ copies

    def _cached(self, sha: str) -> OpenedCopy | None:
        """A copy the daemon passed before and has not evicted since (still linked)."""
        self._drop_evicted()  # they hold tier space
        got = self._copies.get(sha)
        if got is None:
            return None
        self._copies.move_to_end(sha)
        return OpenedCopy(os.dup(got[0]), got[1])

    def _keep(self, sha: str, fd: int, where: str) -> None:
        old = self._copies.pop(sha, None)
        if old is not None:
            os.close(old[0])
        self._copies[sha] = (os.dup(fd), where)
        while len(self._copies) > KEEP_COPIES:
            _sha, (old_fd, _w) = self._copies.popitem(last=False)
            os.close(old_fd)

    def _files(self, entries: Sequence[ShardEntry]) -> tuple[list[int], list[list[Any]]]:
        """This reader's own descriptors of these shards' files, and [id, kind] of each."""
        fds: list[int] = []
        items: list[list[Any]] = []
        for e in entries[:MAX_FDS]:
            f = shard_file(self.location, e)
            if f is not None:
                fds.append(f[0])
                items.append([e.id, f[1]])
        return fds, items

    def locate(self, entry: ShardEntry) -> tuple[Path | OpenedCopy, bool]:
        if os.getpid() == self._pid and self._copies:
            self._drop_evicted()
        if os.getpid() == self._pid and (self._mode is None or self.wants_whole(entry)):
            known = self._cached(entry.sha256)
            if known is not None:  # still staged: map it again without a round trip
                return known, True
        t0 = time.monotonic()
        fds: list[int] = []
        fields: dict[str, Any] = {}
        if self._passing:
            f = shard_file(self.location, entry)
            if f is not None:
                fds, fields["kind"] = [f[0]], f[1]
        fields.update(self._catch_up())
        try:
            got = self._request("need", fds, shard=entry.id, sha256=entry.sha256, **fields)
        finally:
            close_fds(fds)
        self.stall_seconds += time.monotonic() - t0
        if got is not None:
            reply, passed = got
            if reply.get("congested") is True and self._mode is not None and self._mode.staged is None:
                self._mode = None  # the daemon found no room for it: ask how to read the next shards
            staged = bool(reply.get("staged"))
            path = Path(str(reply.get("path", "")))
            if staged and path.name != names.staged_name(entry.sha256):  # not the copy this manifest names
                close_fds(passed)
            elif passed:
                close_fds(passed[1:])
                if staged:
                    self._keep(entry.sha256, passed[0], str(path))
                return OpenedCopy(passed[0], str(path)), staged
            elif path.name:
                return path, staged
        return self._engine().locate(self._home, entry)

    def wants_whole(self, entry: ShardEntry) -> bool:
        """The daemon's policy for unannounced orders (kvdata.tiers.staging): a shard-aware
        dataset's shards, and a random-order one's resident set (sha256 <= the threshold the
        daemon reports), are read whole; the rest record by record. While the daemon's tiers
        are congested (a shard a reader needed found no room lately), only shards with a copy
        are read whole; a shard-aware dataset larger than the tiers is read whole only where
        the daemon says (`whole`: Engine.bypassed). Asked at most every MODE_INTERVAL seconds (an empty
        `want`; WHOLE_INTERVAL while it sends `whole`); without the daemon, the fallback engine decides."""
        now = time.monotonic()
        mode = self._mode
        if mode is None or now - mode.when >= (WHOLE_INTERVAL if mode.whole is not None else MODE_INTERVAL):
            reply = self._call("want", shards=[]) if self.client is not None else None
            if reply is None or not isinstance(reply.get("mode"), str):
                if self.client is None and self._fallback is not None:
                    return self._fallback.wants_whole(self._home, entry)
                return True
            self._note_mode(reply)
            self._drop_evicted()
        assert self._mode is not None
        mode = self._mode
        if mode.staged is not None:  # congested
            return entry.sha256 in self._copies or flag_set(mode.staged, entry.id)
        if mode.whole is not None:
            return entry.sha256 in self._copies or flag_set(mode.whole, entry.id)
        if self._orders:  # this process announced an order: shard-aware
            return True
        return mode.mode != "random" or entry.sha256 <= mode.resident_below

    def _note_mode(self, reply: dict[str, Any]) -> None:
        mode, below, staged = reply.get("mode"), reply.get("resident_below", ""), reply.get("staged")
        if not isinstance(mode, str) or not isinstance(below, str):
            return
        congested = reply.get("congested") is True and isinstance(staged, bytes)
        whole = reply.get("whole")
        self._mode = _ReadMode(time.monotonic(), mode, below, staged if congested else None,
                               whole if isinstance(whole, bytes) and not congested else None)
        if mode == "random" and not self._orders:  # copies left out of the resident set: give them back
            for sha in [s for s in self._copies if s > below]:
                os.close(self._copies.pop(sha)[0])

    def _drop_evicted(self) -> None:
        """Close kept descriptors of copies the daemon evicted: they would keep the bytes alive
        in its tier, uncounted, until closed."""
        for sha, (fd, _where) in list(self._copies.items()):
            try:
                gone = os.fstat(fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                del self._copies[sha]
                os.close(fd)

    def read_records(self, requests: Sequence[tuple[ShardEntry, Sequence[int]]]) -> list[list[bytes] | None]:
        """In-process, from the home's framed cold copies (kvdata.tiers.records), as EngineSource
        does; None for a shard of a local home (read in place) or a copy without a seek table."""
        from ..tiers.records import reader_for

        return reader_for(self._home, tables=self._tables).read_many(requests)

    def mapped(self, entry: ShardEntry) -> None:
        if self._fallback is not None:
            self._fallback.unpin(entry.sha256)

    # ------------------------------------------------------------ orders

    def need(self, entries: Sequence[ShardEntry]) -> None:
        fields: dict[str, Any] = {}
        fds: list[int] = []
        wanted = list(entries)
        if self._passing:
            fds, items = self._files(wanted)
            have = {i for i, _k in items}
            wanted = [e for e in wanted if e.id in have]
            fields["kinds"] = [k for _i, k in items]
        fields.update(self._catch_up())
        try:
            reply = self._call("want", fds, shards=[[e.id, e.sha256] for e in wanted], **fields)
        finally:
            close_fds(fds)
        if reply is None:
            self._engine().start_many(self._home, list(entries))

    def _window(self, reader: str, position: int) -> tuple[list[int], list[list[Any]]]:
        """Files of the next AHEAD shards of a reader's order not passed yet (prefetch)."""
        if not self._passing:
            return [], []
        order = self._orders.get(reader, [])
        sent = self._ahead.setdefault(reader, set())
        todo = [e for e in order[position:position + AHEAD] if e.id not in sent]
        fds, items = self._files(todo)
        sent.update(i for i, _k in items)
        return fds, items

    def announce(self, reader: str, entries: Sequence[ShardEntry], position: int = 0,
                 next_start: int | None = None) -> None:
        self._orders[reader] = list(entries)
        self._ahead[reader] = set()
        fds, items = self._window(reader, position)
        extra: dict[str, Any] = {"ahead": items} if fds else {}
        if next_start is not None:
            extra["next_start"] = next_start
        try:
            reply = self._call("announce", fds, reader=reader, shards=[e.id for e in entries], position=position, **extra)
        finally:
            close_fds(fds)
        if reply is None:
            self._engine().announce(reader, self._home, list(entries), position, next_start)

    def progress(self, reader: str, position: int) -> None:
        """Reported at most every PROGRESS_INTERVAL per reader (a socket round trip each)."""
        now = time.monotonic()
        last = self._sent.get(reader)
        if last is not None and now - last[1] < PROGRESS_INTERVAL:
            self._unsent[reader] = position  # goes with the next need/want (a reader that moves on needs shards)
            return
        self._unsent.pop(reader, None)
        self._sent[reader] = (position, now)
        stall = round(self.stall_seconds, 6)
        fds, items = self._window(reader, position)
        extra: dict[str, Any] = {"ahead": items, "dataset": self.location} if fds else {}
        try:
            reply = self._call("progress", fds, reader=reader, position=position, stall=stall, **extra)
        finally:
            close_fds(fds)
        if reply is None and self._fallback is not None:
            self._fallback.progress(reader, position)

    def _catch_up(self) -> dict[str, Any]:
        """Positions held back by PROGRESS_INTERVAL, for a need/want to carry: the daemon then
        evicts by where the readers are, not where they were 50 ms ago (a fast reader is
        many shards further on, and the shards it has finished look like the next ones)."""
        if not self._unsent:
            return {}
        now = time.monotonic()
        for reader, position in self._unsent.items():
            self._sent[reader] = (position, now)
        out = {"progress": [[r, p] for r, p in self._unsent.items()]}
        self._unsent.clear()
        return out

    def status(self) -> dict[str, Any]:
        reply = self._call("status") if self.client is not None else None
        return dict(reply) if reply is not None else self._engine().status()

    def close(self) -> None:
        if self.client is not None and os.getpid() == self._pid:
            self.client.close()
        copies = list(self._copies.values())
        self._copies.clear()
        close_fds([fd for fd, _where in copies])
        if self._fallback is not None:
            self._fallback.close()
        self._home.close()
