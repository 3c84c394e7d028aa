"""kvdatad's request handlers (Handlers): one method per request type, given the request as
messages.py decoded it and answering with a typed reply. Every request is answered for the peer
the kernel names (SO_PEERCRED, see trust.py), following docs/SECURITY.md:

- Datasets are absolute paths without '..' or NUL, or s3:// / http(s):// URLs. A URL is
  fetched only if it lies under `[daemon] allow_homes` (NotAllowed otherwise: the reader
  stages it itself). A local path is opened by the daemon only for a privileged peer
  (root or the daemon's own uid, who could open it themselves); any other uid passes the
  descriptors it opened -- the manifest with `open`, each shard file with `need`/`want`/
  `announce`/`stage` -- and the daemon reads only those (kvdata.homes.local.PassedFiles),
  under a name private to that uid.
- A copy staged from passed descriptors is verified by its full sha256; a copy that
  already exists is handed to an unprivileged peer only once that peer has proven it
  holds the same content (its passed file hashes to the shard's sha256; remembered per
  file identity), so knowing a shard's checksum never reveals its bytes.
- Copies go back as read-only descriptors (the tiers are 0700); `status` shows a uid
  only its own clients and datasets; `evict` by a uid keeps copies another uid's dataset
  names; readers are per connection, so only their connection releases them.

Shards are integer ids into a validated manifest, so nothing a client sends can make
the daemon read or write outside what it passed, its allowed homes and its tiers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdata.config import Config
from kvdata.errors import BadRequest, NotAllowed, RemoteError, StaleManifest
from kvdata.format import ShardEntry
from kvdata.homes import Home
from kvdata.homes.local import PassedFiles
from kvdata.protocol import PROTOCOL_VERSION, pack_flags
from kvdata.sync.mirror import manifest_from_fd, open_mirror_files
from kvdata.tiers import policy
from kvdata.tiers.staging import Engine

from .clients import Clients
from .datasets import Datasets, OpenDataset, passed_key
from .messages import (
    AnnounceRequest,
    Done,
    EvictReply,
    EvictRequest,
    HelloReply,
    HelloRequest,
    NeedReply,
    NeedRequest,
    OpenReply,
    OpenRequest,
    ProgressRequest,
    ReaderAt,
    ReadMode,
    ReleaseRequest,
    ReloadRequest,
    Reply,
    Request,
    StageReply,
    StageRequest,
    StatusReply,
    StatusRequest,
    WantReply,
    WantRequest,
    is_url,
)
from .passed import PassedDescriptors, close_when_done

OPEN_ATTEMPTS = 3        # a staged copy may be evicted between locate and open


@dataclass
class RequestCounts:
    """Requests the socket loop handled, and those it refused (status, metrics)."""

    requests: int = 0
    bad_requests: int = 0


def reader_key(cid: int, reader: str) -> str:
    """The engine's name of a connection's reader (readers are per connection)."""
    return f"{cid}:{reader}"


class Handlers:
    """The request handlers; thread-safe (the socket loop runs blocking ones in a pool). Each is
    given the connection id and its decoded request; `config` names the tiers a request may name."""

    def __init__(self, config: Config, engine: Engine, clients: Clients, datasets: Datasets,
                 passed: PassedDescriptors, counters: RequestCounts, started: float) -> None:
        self._config = config
        self._engine = engine
        self._clients = clients
        self._datasets = datasets
        self._passed = passed
        self._counters = counters
        self._started = started

    def reconfigure(self, config: Config) -> None:
        self._config = config

    def handle(self, cid: int, req: Request) -> Reply:
        match req:
            case HelloRequest():
                return self.hello(cid, req)
            case OpenRequest():
                return self.open(cid, req)
            case AnnounceRequest():
                return self.announce(cid, req)
            case ProgressRequest():
                return self.progress(cid, req)
            case NeedRequest():
                return self.need(cid, req)
            case WantRequest():
                return self.want(cid, req)
            case ReleaseRequest():
                return self.release(cid, req)
            case StageRequest():
                return self.stage(cid, req)
            case EvictRequest():
                return self.evict(cid, req)
            case StatusRequest():
                return self.status(cid)
            case ReloadRequest():
                raise BadRequest("this daemon cannot reload")  # (the server reloads a daemon that can)

    # ------------------------------------------------------------ handlers

    def hello(self, cid: int, req: HelloRequest) -> HelloReply:
        st = self._clients.get(cid)
        self._clients.said_pid(cid, req.pid)
        return HelloReply(PROTOCOL_VERSION, os.getpid(), st.peer.uid, st.peer.privileged)

    def open(self, cid: int, req: OpenRequest) -> OpenReply:
        loc = req.dataset
        self._datasets.check_allowed(loc)
        st = self._clients.get(cid)
        if not is_url(loc) and not st.peer.privileged:
            if len(req.fds) != 1:
                raise NotAllowed(f"kvdatad reads a local dataset only from descriptors its reader passes "
                                 f"(docs/SECURITY.md): pass {loc}/manifest.json with open")
            fd = req.fds.take()
            try:
                m = manifest_from_fd(fd, f"{loc}/manifest.json (passed by uid {st.peer.uid})")
            finally:
                os.close(fd)
            self._datasets.add_passed(loc, st.peer.uid, m)
            return OpenReply(loc, m.generation, len(m.shards))
        ds = self._datasets.shared(loc, st.peer.uid)
        files = None
        if ds.home.local_path("") is None:  # a remote dataset's mirror, for a reader who cannot read the tier
            files = tuple(open_mirror_files(ds.root))
        return OpenReply(str(ds.root), ds.manifest.generation, len(ds.manifest.shards), files)

    def announce(self, cid: int, req: AnnounceRequest) -> Done:
        ds, home = self._dataset(cid, req.dataset)
        reader = reader_key(cid, req.reader)
        entries = [ds.entry(s) for s in req.shards]
        self._passed.take_files(ds, home, req.ahead, req.fds)
        self._clients.add_reader(cid, reader)
        self._engine.announce(reader, home, entries, req.position, req.next_start)
        return Done()

    def progress(self, cid: int, req: ProgressRequest) -> Done:
        reader = reader_key(cid, req.reader)
        if req.prefetch is not None:  # the next shards' files, for prefetching (run off the loop)
            ds, home = self._dataset(cid, req.prefetch.dataset)
            self._passed.take_files(ds, home, req.prefetch.ahead, req.fds)
        self._engine.progress(reader, req.position)
        if req.stall is not None:
            self._clients.reported_stall(cid, req.stall)
        return Done()

    def release(self, cid: int, req: ReleaseRequest) -> Done:
        reader = reader_key(cid, req.reader)
        self._clients.drop_reader(cid, reader)
        self._engine.release(reader)
        return Done()

    def need(self, cid: int, req: NeedRequest) -> NeedReply:
        """Blocking: returns once a verified copy exists (run it off the socket loop), with a
        read-only descriptor of it.

        The client names the shard by id and by the sha256 its manifest has: if the
        daemon's view of the dataset is older or newer than the client's, it re-reads
        the home (or, for a dataset read from passed descriptors, asks the client to open
        it again); it never serves a copy with another checksum."""
        ds, home = self._dataset(cid, req.dataset)
        self._catch_up(cid, req.catch_up)
        shards, shard = ds.manifest.shards, req.shard
        if req.sha256 is not None and (shard is None or not 0 <= shard < len(shards)
                                       or shards[shard].sha256 != req.sha256):
            if isinstance(home, PassedFiles):
                raise StaleManifest(f"shard {req.shard_named} of {ds.location} is not in the manifest this reader "
                                    f"passed (generation {ds.manifest.generation}); open the dataset again")
            ds = self._datasets.open_dataset(ds.location, refresh=True)
            match = [e for e in ds.manifest.shards if e.sha256 == req.sha256]
            if not match:
                raise BadRequest(f"shard {req.shard_named} of {ds.location} is not at the home any more (generation "
                                 f"{ds.manifest.generation}); reopen the dataset")
            entry = match[0]
        else:
            entry = ds.entry(shard)
        if isinstance(home, PassedFiles):
            if len(req.fds) == 1:
                self._passed.hold(home, entry, req.fds.take(), req.kind)
            if not home.has(entry.sha256):
                raise NotAllowed(f"shard {entry.id} of {ds.location}: pass the shard's file with need")
        path, staged, fd = self._open_copy(home, entry)
        # the copy is open here and about to be passed: probe_open keeps it from eviction while any
        # process has it open or mapped, so the pin that covered staging-to-open can go (else every
        # shard needed lately stays pinned PIN_SECONDS, and a full tier has nothing to evict)
        self._engine.unpin(entry.sha256)
        try:
            if isinstance(home, PassedFiles):
                self._passed.prove(home, entry)
        except BaseException:
            os.close(fd)
            raise
        # a private copy while the tiers are congested: the reader asks how to read again (see _mode)
        return NeedReply(str(path), staged, fd, congested=not staged and self._engine.congested())

    def want(self, cid: int, req: WantRequest) -> WantReply:
        """A reader's batch needs these shards now: start staging them together (not awaited;
        its `need`s then wait for the slowest, not the sum)."""
        ds, home = self._dataset(cid, req.dataset)
        self._catch_up(cid, req.catch_up)
        entries = []
        for i, item in enumerate(req.shards):
            e = ds.entry(item.shard)
            if isinstance(home, PassedFiles) and req.kinds is not None and i < len(req.kinds):
                fd = req.fds.take()
                if e.sha256 != item.sha256:
                    os.close(fd)
                    continue
                self._passed.hold(home, e, fd, req.kinds[i])
            if e.sha256 == item.sha256:  # a stale id is left to `need`, which re-reads the home
                entries.append(e)
        if isinstance(home, PassedFiles):
            entries = [e for e in entries if home.has(e.sha256)]
        self._engine.start_many(home, entries)
        if not req.shards:  # an empty `want` asks how the dataset is read (DaemonStager.wants_whole)
            return WantReply(0, self._mode(ds))
        return WantReply(len(entries))

    def stage(self, cid: int, req: StageRequest) -> StageReply:
        ds, home = self._dataset(cid, req.dataset)
        if req.tier is not None:
            self._config.tier(req.tier)
        if isinstance(home, PassedFiles):
            # staged from the files this request passes; a home read from descriptors is not watched
            request_home = PassedFiles(ds.location)
            try:
                entries = self._passed.take_files(ds, request_home, req.ahead, req.fds)
            except BaseException:
                request_home.close()
                raise
            if not entries:
                request_home.close()
                raise NotAllowed(f"{ds.location}: pass the shard files to stage as ahead [[id, kind], ...] with descriptors")
            futures = [self._engine.stage(request_home, e, req.tier) for e in entries]
            close_when_done(request_home, futures)
        else:
            self._datasets.stage_all(ds)
            futures = [self._engine.stage(home, e, req.tier) for e in ds.manifest.shards]
        return StageReply(len(futures), sum(not f.done() for f in futures), tuple(futures))

    def evict(self, cid: int, req: EvictRequest) -> EvictReply:
        ds, _home = self._dataset(cid, req.dataset)
        if req.tier is not None:
            self._config.tier(req.tier)
        peer = self._clients.get(cid).peer
        entries = list(ds.manifest.shards)
        kept = 0
        if not peer.privileged:  # a uid evicts only copies no other uid's dataset names
            others = self._datasets.named_by_others(peer.uid)
            kept = sum(e.sha256 in others for e in entries)
            entries = [e for e in entries if e.sha256 not in others]
        self._datasets.unstage_all(ds, peer)
        return EvictReply(self._engine.evict(entries, req.tier), kept)

    def status(self, cid: int | None = None) -> StatusReply:
        """The daemon's state; an unprivileged peer sees the tiers' totals but only its own
        clients and datasets (no other uid's paths, pids, readers or errors)."""
        peer = self._clients.get(cid).peer
        st = self._engine.status()
        clients, stall_total = self._clients.shown_to(peer)
        shown = self._datasets.shown_to(peer)
        modes = {m["key"]: m for m in st.pop("datasets", [])}
        datasets = []
        for d in shown:
            row: dict[str, Any] = {"dataset": d.location, "key": d.key, "generation": d.manifest.generation,
                                   "shards": len(d.manifest.shards)}
            m = modes.get(d.key)  # read by a client now: how (policy for unannounced orders)
            row.update({k: v for k, v in m.items() if k not in ("dataset", "key", "shards")} if m is not None
                       else {"mode": None})
            datasets.append(row)
        if not peer.privileged:
            st["errors"] = []
        st.update({"pid": os.getpid(), "uptime_seconds": round(time.time() - self._started, 1),
                   "clients": clients, "connected_clients": len(clients), "datasets": datasets,
                   "queue_depth": st["in_flight"], "requests": self._counters.requests,
                   "bad_requests": self._counters.bad_requests,
                   "reader_stall_seconds": round(sum(c["stall_seconds"] for c in clients), 3),
                   "reader_stall_seconds_total": round(stall_total, 3)})
        return StatusReply(st)

    # ------------------------------------------------------------ helpers

    def _dataset(self, cid: int, location: str) -> tuple[OpenDataset, Home]:
        """The dataset a request names, as this peer sees it, and the home to stage its shards
        from for this connection: shared (an allowed URL, or a privileged peer's path) or read
        from the files this connection passed."""
        self._datasets.check_allowed(location)
        st = self._clients.get(cid)
        if is_url(location) or st.peer.privileged:
            shared = self._datasets.shared(location, st.peer.uid)
            self._clients.reads(st, shared.key)
            return shared, shared.home
        ds = self._datasets.passed(location, st.peer.uid)
        self._clients.reads(st, ds.key)
        return ds, self._clients.passed_home(st, passed_key(st.peer.uid, location), location)

    def _catch_up(self, cid: int, moves: tuple[ReaderAt, ...]) -> None:
        """Positions a need/want carries (progress the client held back), applied before the
        shard is located, so eviction goes by where readers are."""
        for m in moves:
            self._engine.progress(reader_key(cid, m.reader), m.position)

    def _mode(self, ds: OpenDataset) -> ReadMode:
        """How the dataset is read (reply fields of an empty `want`): "shard-aware", or
        "random" with the largest sha256 of its resident set (a shard with a sha256 <= it is
        kept whole; every other one is read record by record)."""
        modes = self._engine.modes
        modes.activate([ds.key])
        mode, below = modes.mode(ds.key), modes.resident_threshold(ds.key)
        shas = [e.sha256 for e in ds.manifest.shards]
        if self._engine.congested():  # no room for a needed shard lately: read what is not staged by record
            return ReadMode(mode, below, staged=pack_flags(self._engine.staged(shas)))
        if mode == policy.SHARD_AWARE and self._engine.keep_set()[0] is not None:
            # larger than the tiers: shards read once this pass are read by record (Engine.bypassed)
            staged = self._engine.staged(shas)
            return ReadMode(mode, below, whole=pack_flags([have or not self._engine.bypassed(sha)
                                                           for sha, have in zip(shas, staged)]))
        return ReadMode(mode, below)

    def _open_copy(self, home: Home, entry: ShardEntry) -> tuple[Path, bool, int]:
        """(path, staged, a read-only descriptor of it) -- locating again if it was evicted meanwhile."""
        for attempt in range(OPEN_ATTEMPTS):
            path, staged = self._engine.locate(home, entry)
            if not isinstance(path, Path):  # no tier had room: a private copy in memory, sealed against writes
                return Path(path.where), False, path.fd
            try:
                return path, staged, os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                if attempt == OPEN_ATTEMPTS - 1:
                    raise RemoteError(f"shard {entry.id}'s copy keeps vanishing; try again") from None
        raise AssertionError("unreachable")
