"""The daemon's state and request handling, without sockets.

`Service` owns the staging engine (kvdata.tiers.engine), the datasets clients opened,
the readers' announced orders, and the counters `kvdata status` shows. Every client
input is validated here (or in Service's parts, datasets.py and passed.py) before it
reaches the engine, and every request is answered for the peer the kernel names
(SO_PEERCRED, see trust.py), following docs/SECURITY.md:

- Datasets are absolute paths without '..' or NUL, or s3:// / http(s):// URLs. A URL is
  fetched only if it lies under `[daemon] allow_homes` (NotAllowed otherwise: the reader
  stages it itself). A local path is opened by the daemon only for a privileged peer
  (root or the daemon's own uid, who could open it themselves); any other uid passes the
  descriptors it opened -- the manifest with `open`, each shard file with `need`/`want`/
  `announce`/`stage` -- and the daemon reads only those (kvdata.tiers.homes.PassedFiles),
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
Residency is never cached: the tier directories on disk are the truth, so a restarted
daemon serves what an earlier one staged.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvdata._util.digest import is_sha256
from kvdata.config import Config
from kvdata.errors import BadRequest, NotAllowed, RemoteError, StaleManifest
from kvdata.protocol import PROTOCOL_VERSION
from kvdata.tiers import ShardEntry
from kvdata.tiers.homes import Home, PassedFiles
from kvdata.tiers.mirror import manifest_from_fd, open_mirror_files
from kvdata.tiers.staging import Engine

from .datasets import Datasets, is_url, passed_key
from .passed import Passed, PassedDescriptors, close_when_done
from .service_state import INTERNAL, ClientState, OpenDataset
from .trust import Peer, secure_tiers

MAX_READER = 256
MAX_CATCH_UP = 64         # reader positions one need/want may carry
MAX_WANT = 4096          # shards one `want` may name
UID_DATASETS = 32        # datasets one unprivileged uid has open from passed manifests (least recent dropped)
OPEN_ATTEMPTS = 3        # a staged copy may be evicted between locate and open


class Service(PassedDescriptors, Datasets):
    """Request handlers; thread-safe (the socket loop runs blocking ones in a pool). Its parts,
    mixins over service_state.ServiceState: datasets.Datasets (the datasets open, and for whom),
    passed.PassedDescriptors (the files clients pass)."""

    def __init__(self, config: Config) -> None:
        secure_tiers(config)
        self.config = config
        self.engine = Engine(config, verify_content=True, probe_open=True)  # (it never forks)
        self._lock = threading.RLock()
        self.datasets: dict[str, OpenDataset] = {}
        self.clients: dict[int, ClientState] = {}
        self.started = time.time()
        self.requests = 0
        self.bad_requests = 0
        self.closed_stall_seconds = 0.0  # stall reported by clients that have gone (a counter with the live ones)
        self.max_held_fds = 4096  # descriptors clients passed that the daemon keeps, over all connections
        self._proofs: OrderedDict[tuple[int, int], tuple[int, int, int, str, str]] = OrderedDict()

    # ------------------------------------------------------------ clients

    def connect(self, cid: int, peer: Peer = INTERNAL) -> None:
        with self._lock:
            self.clients[cid] = ClientState(cid, peer, peer.pid or None)

    def disconnect(self, cid: int) -> None:
        """Socket closed = every claim of that client released, every descriptor it passed closed."""
        with self._lock:
            st = self.clients.pop(cid, None)
            if st is not None:
                self.closed_stall_seconds += st.stall_seconds
        if st is not None:
            for r in st.readers:
                self.engine.release(r)
            for home in st.passed.values():
                home.close()
            with self._lock:
                still = {k for c in self.clients.values() for k in c.using}
            for key in st.using - still:  # nobody reads it now: its resident set is not kept any more
                self.engine.modes.deactivate(key)

    def peer(self, cid: int | None) -> Peer:
        return self._client(cid).peer

    # ------------------------------------------------------------ copies handed back

    def _open_copy(self, home: Home, entry: ShardEntry) -> tuple[Path, bool, int]:
        """(path, staged, a read-only descriptor of it) -- locating again if it was evicted meanwhile."""
        for attempt in range(OPEN_ATTEMPTS):
            path, staged = self.engine.locate(home, entry)
            if not isinstance(path, Path):  # no tier had room: a private copy in memory, sealed against writes
                return Path(path.where), False, path.fd
            try:
                return path, staged, os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                if attempt == OPEN_ATTEMPTS - 1:
                    raise RemoteError(f"shard {entry.id}'s copy keeps vanishing; try again") from None
        raise AssertionError("unreachable")

    # ------------------------------------------------------------ handlers

    def hello(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        pid = msg.get("pid")
        st = self._client(cid)
        with self._lock:
            if st.pid is None and isinstance(pid, int) and not isinstance(pid, bool):
                st.pid = pid
        if msg.get("version") != PROTOCOL_VERSION:
            raise BadRequest(f"protocol version {msg.get('version')!r} is not {PROTOCOL_VERSION}; upgrade kvdata")
        return {"version": PROTOCOL_VERSION, "pid": os.getpid(), "uid": st.peer.uid, "paths": st.peer.privileged}

    def open(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        loc = self._location(msg.get("dataset"))
        st = self._client(cid)
        passed: Passed = msg["_fds"]
        if not is_url(loc) and not st.peer.privileged:
            if len(passed) != 1:
                raise NotAllowed(f"kvdatad reads a local dataset only from descriptors its reader passes "
                                 f"(docs/SECURITY.md): pass {loc}/manifest.json with open")
            fd = passed.take()
            try:
                m = manifest_from_fd(fd, f"{loc}/manifest.json (passed by uid {st.peer.uid})")
            finally:
                os.close(fd)
            self.engine.check_budgets(list(m.shards))
            key = passed_key(st.peer.uid, loc)
            ds = OpenDataset(loc, PassedFiles(loc), Path(loc), m, owner=st.peer.uid, users={st.peer.uid},
                             key=self.engine.open_dataset(m.shards, label=loc))
            with self._lock:
                self.datasets.pop(key, None)
                self.datasets[key] = ds  # most recent last
                mine = [k for k, d in self.datasets.items() if d.owner == st.peer.uid]
                for old in mine[: max(0, len(mine) - UID_DATASETS)]:  # a uid cannot grow the daemon without bound
                    del self.datasets[old]
            return {"root": loc, "generation": m.generation, "shards": len(m.shards)}
        ds = self._shared(loc, st.peer.uid)
        reply: dict[str, Any] = {"root": str(ds.root), "generation": ds.manifest.generation,
                                 "shards": len(ds.manifest.shards)}
        if ds.home.local_path("") is None:  # a remote dataset's mirror, for a reader who cannot read the tier
            files = open_mirror_files(ds.root)
            reply["files"] = [name for name, _fd in files]
            reply["_fds"] = [fd for _name, fd in files]
        return reply

    def announce(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        ds, home = self._dataset(cid, msg.get("dataset"))
        reader = self._reader(cid, msg.get("reader"))
        shards = msg.get("shards")
        if not isinstance(shards, list):
            raise BadRequest("shards must be a list of integer shard ids")
        entries = [self._entry(ds, s) for s in shards]
        position = self._position(msg.get("position", 0))
        next_start = msg.get("next_start")
        if next_start is not None and (type(next_start) is not int or not 0 <= next_start <= len(entries)):
            raise BadRequest(f"next_start must be an integer index into shards (0..{len(entries)}), "
                             f"not {next_start!r}")
        self._take_files(cid, ds, home, msg)
        with self._lock:
            self._client(cid).readers.add(reader)
        self.engine.announce(reader, home, entries, position, next_start)
        return {}

    def progress(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        reader = self._reader(cid, msg.get("reader"))
        position = self._position(msg.get("position", 0))
        if msg.get("ahead") is not None:  # the next shards' files, for prefetching (run off the loop)
            ds, home = self._dataset(cid, msg.get("dataset"))
            self._take_files(cid, ds, home, msg)
        self.engine.progress(reader, position)
        stall = msg.get("stall")
        if isinstance(stall, (int, float)) and not isinstance(stall, bool) and 0 <= stall < 1e9:
            with self._lock:  # a client's stall only grows (it reports its total): keeps the sum a counter
                c = self._client(cid)
                c.stall_seconds = max(c.stall_seconds, float(stall))
        return {}

    def _catch_up(self, cid: int, value: Any) -> None:
        """Positions a need/want carries ([[reader, position], ...]: progress the client held
        back), applied before the shard is located, so eviction goes by where readers are."""
        if value is None:
            return
        if not isinstance(value, list) or len(value) > MAX_CATCH_UP:
            raise BadRequest(f"progress must be a list of at most {MAX_CATCH_UP} [reader, position] pairs")
        moves = []
        for item in value:
            if not isinstance(item, list) or len(item) != 2:
                raise BadRequest("progress must be a list of [reader, position] pairs")
            moves.append((self._reader(cid, item[0]), self._position(item[1])))
        for reader, position in moves:
            self.engine.progress(reader, position)

    def release(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        reader = self._reader(cid, msg.get("reader"))
        with self._lock:
            self._client(cid).readers.discard(reader)
        self.engine.release(reader)
        return {}

    def need(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        """Blocking: returns once a verified copy exists (run it off the socket loop), with a
        read-only descriptor of it.

        The client names the shard by id and by the sha256 its manifest has: if the
        daemon's view of the dataset is older or newer than the client's, it re-reads
        the home (or, for a dataset read from passed descriptors, asks the client to open
        it again); it never serves a copy with another checksum."""
        ds, home = self._dataset(cid, msg.get("dataset"))
        self._catch_up(cid, msg.get("progress"))
        want = msg.get("sha256")
        if want is not None and not is_sha256(want):
            raise BadRequest("sha256 must be 64 lowercase hex digits")
        shard = msg.get("shard")
        known = isinstance(shard, int) and not isinstance(shard, bool) and 0 <= shard < len(ds.manifest.shards)
        if want is not None and (not known or ds.manifest.shards[shard].sha256 != want):  # type: ignore[index]
            if isinstance(home, PassedFiles):
                raise StaleManifest(f"shard {shard} of {ds.location} is not in the manifest this reader passed "
                                    f"(generation {ds.manifest.generation}); open the dataset again")
            ds = self.open_dataset(ds.location, refresh=True)
            match = [e for e in ds.manifest.shards if e.sha256 == want]
            if not match:
                raise BadRequest(f"shard {shard} of {ds.location} is not at the home any more (generation "
                                 f"{ds.manifest.generation}); reopen the dataset")
            entry = match[0]
        else:
            entry = self._entry(ds, shard)
        if isinstance(home, PassedFiles):
            passed: Passed = msg["_fds"]
            if len(passed) == 1:
                self._hold(cid, home, entry, passed.take(), msg.get("kind", "mdb"))
            if not home.has(entry.sha256):
                raise NotAllowed(f"shard {entry.id} of {ds.location}: pass the shard's file with need")
        path, staged, fd = self._open_copy(home, entry)
        # the copy is open here and about to be passed: probe_open keeps it from eviction while any
        # process has it open or mapped, so the pin that covered staging-to-open can go (else every
        # shard needed lately stays pinned PIN_SECONDS, and a full tier has nothing to evict)
        self.engine.unpin(entry.sha256)
        try:
            if isinstance(home, PassedFiles):
                self._prove(home, entry)
        except BaseException:
            os.close(fd)
            raise
        reply: dict[str, Any] = {"path": str(path), "staged": staged, "_fds": [fd]}
        if not staged and self.engine.congested():  # ask the read mode again (see _mode)
            reply["congested"] = True
        return reply

    def want(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        """A reader's batch needs these shards now: start staging them together (not awaited;
        its `need`s then wait for the slowest, not the sum)."""
        ds, home = self._dataset(cid, msg.get("dataset"))
        self._catch_up(cid, msg.get("progress"))
        shards = msg.get("shards")
        if not isinstance(shards, list) or len(shards) > MAX_WANT:
            raise BadRequest("shards must be a list of [id, sha256] pairs")
        kinds = msg.get("kinds")
        passed: Passed = msg["_fds"]
        if kinds is not None and (not isinstance(kinds, list) or len(kinds) != len(passed) or len(kinds) > len(shards)):
            raise BadRequest("kinds must name the kind of each descriptor passed, in the order of shards")
        entries = []
        for i, item in enumerate(shards):
            if not isinstance(item, list) or len(item) != 2:
                raise BadRequest("shards must be a list of [id, sha256] pairs")
            e = self._entry(ds, item[0])
            if isinstance(home, PassedFiles) and kinds is not None and i < len(kinds):
                fd = passed.take()
                if e.sha256 != item[1]:
                    os.close(fd)
                    continue
                self._hold(cid, home, e, fd, kinds[i])
            if e.sha256 == item[1]:  # a stale id is left to `need`, which re-reads the home
                entries.append(e)
        if isinstance(home, PassedFiles):
            entries = [e for e in entries if home.has(e.sha256)]
        self.engine.start_many(home, entries)
        if not shards:  # an empty `want` asks how the dataset is read (DaemonStager.wants_whole)
            return {"started": 0, **self._mode(ds)}
        return {"started": len(entries)}

    def stage(self, cid: int, msg: dict[str, Any]) -> tuple[dict[str, Any], list[Future[Path]]]:
        ds, home = self._dataset(cid, msg.get("dataset"))
        tier = msg.get("tier")
        if tier is not None:
            if not isinstance(tier, str):
                raise BadRequest("tier must be a tier name")
            self.config.tier(tier)
        if isinstance(home, PassedFiles):
            # staged from the files this request passes; a home read from descriptors is not watched
            request_home = PassedFiles(ds.location)
            try:
                entries = self._take_files(cid, ds, request_home, msg)
            except BaseException:
                request_home.close()
                raise
            if not entries:
                request_home.close()
                raise NotAllowed(f"{ds.location}: pass the shard files to stage as ahead [[id, kind], ...] with descriptors")
            futures = [self.engine.stage(request_home, e, tier) for e in entries]
            close_when_done(request_home, futures)
        else:
            ds.staged_all = True
            futures = [self.engine.stage(home, e, tier) for e in ds.manifest.shards]
        return {"shards": len(futures), "queued": sum(not f.done() for f in futures)}, futures

    def evict(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        ds, _home = self._dataset(cid, msg.get("dataset"))
        tier = msg.get("tier")
        if tier is not None and not isinstance(tier, str):
            raise BadRequest("tier must be a tier name")
        if tier is not None:
            self.config.tier(tier)
        peer = self.peer(cid)
        entries = list(ds.manifest.shards)
        kept = 0
        if not peer.privileged:  # a uid evicts only copies no other uid's dataset names
            others = self._named_by_others(peer.uid)
            kept = sum(e.sha256 in others for e in entries)
            entries = [e for e in entries if e.sha256 not in others]
        with self._lock:
            if peer.privileged or ds.users <= {peer.uid}:
                ds.staged_all = False
        return {"evicted": self.engine.evict(entries, tier), "kept": kept}

    def _named_by_others(self, uid: int) -> set[str]:
        with self._lock:
            datasets = [d for d in self.datasets.values() if d.users - {uid}]
        return {e.sha256 for d in datasets for e in d.manifest.shards}

    def status(self, cid: int | None = None, msg: dict[str, Any] | None = None) -> dict[str, Any]:
        """The daemon's state; an unprivileged peer sees the tiers' totals but only its own
        clients and datasets (no other uid's paths, pids, readers or errors)."""
        peer = self.peer(cid)
        st = self.engine.status()
        with self._lock:
            clients: list[dict[str, Any]] = [
                {"id": c.id, "pid": c.pid, "uid": c.peer.uid, "readers": len(c.readers), "stall_seconds": c.stall_seconds}
                for c in self.clients.values() if peer.privileged or c.peer.uid == peer.uid]
            shown = [d for d in self.datasets.values() if peer.privileged or peer.uid in d.users]
            stall_total = self.closed_stall_seconds + sum(c.stall_seconds for c in self.clients.values())
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
        st.update({"pid": os.getpid(), "uptime_seconds": round(time.time() - self.started, 1),
                   "clients": clients, "connected_clients": len(clients), "datasets": datasets,
                   "queue_depth": st["in_flight"], "requests": self.requests, "bad_requests": self.bad_requests,
                   "reader_stall_seconds": round(sum(c["stall_seconds"] for c in clients), 3),
                   "reader_stall_seconds_total": round(stall_total, 3)})
        return st

    def reload(self, config: Config) -> dict[str, Any]:
        """New tiers and budgets, keeping clients, datasets and announced orders."""
        secure_tiers(config)
        self.config = config
        self.engine.reconfigure(config)
        return {"tiers": [t.name for t in self.engine.tiers]}

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _reader(cid: int, value: Any) -> str:
        if not isinstance(value, str) or not value or len(value) > MAX_READER or "\x00" in value:
            raise BadRequest("reader must be a short non-empty string")
        return f"{cid}:{value}"

    @staticmethod
    def _position(value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest("position must be a non-negative integer")
        return value

    def close(self) -> None:
        self.engine.close()

