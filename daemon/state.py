"""The daemon's state and request handling, without sockets.

`Service` owns the staging engine (kvdata.engine), the datasets clients opened,
the readers' announced orders, and the counters `kvdata status` shows. Every
client input is validated here before it reaches the engine: datasets are
absolute paths without '..' or NUL, or s3:// / http(s):// URLs; shards are
integer ids into a manifest whose names are themselves checked, so nothing a
client sends can make the daemon read or write outside a dataset and its tiers.
Residency is never cached: the tier directories on disk are the truth, so a
restarted daemon serves what an earlier one staged.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdata._util.digest import is_sha256
from kvdata.config import Config
from kvdata.errors import BadRequest
from kvdata.protocol import PROTOCOL_VERSION
from kvdata.tiers import Manifest, ShardEntry
from kvdata.tiers.engine import Engine
from kvdata.tiers.homes import Home, open_home
from kvdata.tiers.mirror import cache_root, mirror, read_manifest

MAX_LOCATION = 4096
MAX_READER = 256
MAX_WANT = 4096  # shards one `want` may name


@dataclass
class OpenDataset:
    location: str
    home: Home
    root: Path
    manifest: Manifest
    staged_all: bool = False  # `kvdata stage` asked for it: keep new generations staged too


@dataclass
class ClientState:
    id: int
    pid: int | None = None
    readers: set[str] = field(default_factory=set)
    stall_seconds: float = 0.0


def check_location(value: Any) -> str:
    """A dataset location a client may name, or BadRequest."""
    if not isinstance(value, str) or not value or len(value) > MAX_LOCATION or "\x00" in value:
        raise BadRequest("dataset must be a non-empty string without NUL bytes")
    if value.startswith(("s3://", "http://", "https://")):
        if ".." in value.split("?")[0].split("/")[3:]:
            raise BadRequest(f"dataset URL {value!r} may not contain '..' segments")
        return value.rstrip("/")
    p = Path(value)
    if not p.is_absolute():
        raise BadRequest(f"dataset {value!r} must be an absolute path or an s3:// / http(s):// URL")
    if ".." in p.parts:
        raise BadRequest(f"dataset path {value!r} may not contain '..'")
    return str(p)


class Service:
    """Request handlers; thread-safe (the socket loop runs blocking ones in a pool)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.engine = Engine(config)
        self._lock = threading.RLock()
        self.datasets: dict[str, OpenDataset] = {}
        self.clients: dict[int, ClientState] = {}
        self.started = time.time()
        self.requests = 0
        self.bad_requests = 0

    # ------------------------------------------------------------ clients

    def connect(self, cid: int) -> None:
        with self._lock:
            self.clients[cid] = ClientState(cid)

    def disconnect(self, cid: int) -> None:
        """Socket closed = every claim of that client released."""
        with self._lock:
            st = self.clients.pop(cid, None)
        if st is not None:
            for r in st.readers:
                self.engine.release(r)

    # ------------------------------------------------------------ datasets

    def _dataset(self, value: Any) -> OpenDataset:
        loc = check_location(value)
        with self._lock:
            ds = self.datasets.get(loc)
        return ds if ds is not None else self.open_dataset(loc)

    def open_dataset(self, loc: str, refresh: bool = False) -> OpenDataset:
        with self._lock:
            old = self.datasets.get(loc)
        if old is not None and not refresh:
            return old
        home = old.home if old is not None else open_home(loc)
        if home.local_path("") is not None:
            root = Path(loc)
            m = read_manifest(root)
        else:
            root = mirror(home, cache_root(self.config))
            m = read_manifest(root)
        self.engine.check_budgets(list(m.shards))
        ds = OpenDataset(loc, home, root, m, staged_all=bool(old and old.staged_all))
        with self._lock:
            self.datasets[loc] = ds
        if ds.staged_all:
            for e in m.shards:
                self.engine.stage(home, e)
        return ds

    def _entry(self, ds: OpenDataset, shard: Any) -> ShardEntry:
        if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < len(ds.manifest.shards):
            raise BadRequest(f"shard must be an integer id in [0, {len(ds.manifest.shards)}) of {ds.location}")
        return ds.manifest.shards[shard]

    # ------------------------------------------------------------ handlers

    def hello(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        pid = msg.get("pid")
        with self._lock:
            if cid in self.clients and isinstance(pid, int):
                self.clients[cid].pid = pid
        if msg.get("version") != PROTOCOL_VERSION:
            raise BadRequest(f"protocol version {msg.get('version')!r} is not {PROTOCOL_VERSION}; upgrade kvdata")
        return {"version": PROTOCOL_VERSION, "pid": os.getpid()}

    def open(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        ds = self._dataset(msg.get("dataset"))
        return {"root": str(ds.root), "generation": ds.manifest.generation, "shards": len(ds.manifest.shards)}

    def announce(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        ds = self._dataset(msg.get("dataset"))
        reader = self._reader(cid, msg.get("reader"))
        shards = msg.get("shards")
        if not isinstance(shards, list):
            raise BadRequest("shards must be a list of integer shard ids")
        entries = [self._entry(ds, s) for s in shards]
        position = self._position(msg.get("position", 0))
        with self._lock:
            self.clients[cid].readers.add(reader)
        self.engine.announce(reader, ds.home, entries, position)
        return {}

    def progress(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        reader = self._reader(cid, msg.get("reader"))
        self.engine.progress(reader, self._position(msg.get("position", 0)))
        stall = msg.get("stall")
        if isinstance(stall, (int, float)) and not isinstance(stall, bool) and 0 <= stall < 1e9:
            with self._lock:
                self.clients[cid].stall_seconds = float(stall)
        return {}

    def release(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        reader = self._reader(cid, msg.get("reader"))
        with self._lock:
            self.clients[cid].readers.discard(reader)
        self.engine.release(reader)
        return {}

    def need(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        """Blocking: returns once a verified copy exists (run it off the socket loop).

        The client names the shard by id and by the sha256 its manifest has: if the
        daemon's view of the dataset is older or newer than the client's, it re-reads
        the home; it never serves a copy with another checksum."""
        ds = self._dataset(msg.get("dataset"))
        want = msg.get("sha256")
        if want is not None and not is_sha256(want):
            raise BadRequest("sha256 must be 64 lowercase hex digits")
        shard = msg.get("shard")
        known = isinstance(shard, int) and not isinstance(shard, bool) and 0 <= shard < len(ds.manifest.shards)
        if want is not None and (not known or ds.manifest.shards[shard].sha256 != want):  # type: ignore[index]
            ds = self.open_dataset(ds.location, refresh=True)
            match = [e for e in ds.manifest.shards if e.sha256 == want]
            if not match:
                raise BadRequest(f"shard {shard} of {ds.location} is not at the home any more (generation "
                                 f"{ds.manifest.generation}); reopen the dataset")
            entry = match[0]
        else:
            entry = self._entry(ds, shard)
        path, staged = self.engine.locate(ds.home, entry)
        return {"path": str(path), "staged": staged}

    def want(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        """A reader's batch needs these shards now: start staging them together (not awaited;
        its `need`s then wait for the slowest, not the sum)."""
        ds = self._dataset(msg.get("dataset"))
        shards = msg.get("shards")
        if not isinstance(shards, list) or len(shards) > MAX_WANT:
            raise BadRequest("shards must be a list of [id, sha256] pairs")
        entries = []
        for item in shards:
            if not isinstance(item, list) or len(item) != 2:
                raise BadRequest("shards must be a list of [id, sha256] pairs")
            e = self._entry(ds, item[0])
            if e.sha256 == item[1]:  # a stale id is left to `need`, which re-reads the home
                entries.append(e)
        self.engine.start_many(ds.home, entries)
        return {"started": len(entries)}

    def stage(self, cid: int, msg: dict[str, Any]) -> tuple[dict[str, Any], list[Future[Path]]]:
        ds = self._dataset(msg.get("dataset"))
        tier = msg.get("tier")
        if tier is not None:
            if not isinstance(tier, str):
                raise BadRequest("tier must be a tier name")
            self.config.tier(tier)
        ds.staged_all = True
        futures = [self.engine.stage(ds.home, e, tier) for e in ds.manifest.shards]
        return {"shards": len(futures), "queued": sum(not f.done() for f in futures)}, futures

    def evict(self, cid: int, msg: dict[str, Any]) -> dict[str, Any]:
        ds = self._dataset(msg.get("dataset"))
        tier = msg.get("tier")
        if tier is not None and not isinstance(tier, str):
            raise BadRequest("tier must be a tier name")
        if tier is not None:
            self.config.tier(tier)
        ds.staged_all = False
        return {"evicted": self.engine.evict(list(ds.manifest.shards), tier)}

    def status(self, cid: int | None = None, msg: dict[str, Any] | None = None) -> dict[str, Any]:
        st = self.engine.status()
        with self._lock:
            clients: list[dict[str, Any]] = [
                {"id": c.id, "pid": c.pid, "readers": len(c.readers), "stall_seconds": c.stall_seconds}
                for c in self.clients.values()]
            datasets = [{"dataset": d.location, "generation": d.manifest.generation,
                         "shards": len(d.manifest.shards)} for d in self.datasets.values()]
        st.update({"pid": os.getpid(), "uptime_seconds": round(time.time() - self.started, 1),
                   "clients": clients, "connected_clients": len(clients), "datasets": datasets,
                   "queue_depth": st["in_flight"], "requests": self.requests, "bad_requests": self.bad_requests,
                   "reader_stall_seconds": round(sum(c["stall_seconds"] for c in clients), 3)})
        return st

    def reload(self, config: Config) -> dict[str, Any]:
        """New tiers and budgets, keeping clients, datasets and announced orders."""
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

