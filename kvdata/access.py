"""Opening a dataset wherever it lives, and pushing one to a remote home.

`open_dataset(location)` is what `kvdata.open`, `kvdata.Dataset` and the CLI call:
- a local path with no tier config: the Store reads it in place (embedded default);
- a local path with tiers configured: sealed shards are served from the fastest
  tier holding a verified copy, staged from the path on demand or ahead of time;
- s3:// or http(s)://: the manifest and index are mirrored (verified) into the
  cache, and shards are staged into the tiers.

A remote home holds: manifest.json (written last by push), index files trimmed to
their committed rows with sha256s in the manifest, and sealed shards as .mdb.zst.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from . import format as fmt
from .codec import compress_file, file_sha256
from .config import Config, load_config
from .errors import CorruptDatasetError, KVDataError, ReadOnlyError
from .fsutil import atomic_write
from .progress import progress as make_progress
from .remote import Home, RemoteError, is_url, open_home
from .store import Store
from .engine import Engine

PROGRESS_INTERVAL = 0.05  # seconds between progress reports of one reader to kvdatad


def cache_root(config: Config) -> Path:
    """Where mirrored manifests/indexes of remote datasets live: the largest (last) tier."""
    return config.tiers[-1].path / "datasets"


def open_dataset(location: str | os.PathLike[str], mode: str = "r", *, shard_size: int | str | None = None,
                 compress: bool = True, copy_threads: int | None = None, config: Config | None = None,
                 engine: Engine | None = None, use_daemon: bool = True, mirror_root: str | None = None) -> Store:
    """Open a dataset by path or URL (see module docstring). When kvdatad answers on its
    socket, shards come through it (one staged copy for every job on the box).

    mirror_root: an index mirror of this URL that this job already verified (a Dataset hands
    it to its workers), so a worker opens without asking the home again."""
    loc = str(location)
    if mode != "r":
        if is_url(loc):
            raise ReadOnlyError(f"{loc}: remote datasets are read-only here; write a local one and `kvdata push` it")
        return Store(loc, mode, shard_size=shard_size, compress=compress, copy_threads=copy_threads)
    cfg = config if config is not None else load_config()
    if use_daemon and engine is None:
        store = _open_through_daemon(loc, cfg, copy_threads)
        if store is not None:
            return store
    if not is_url(loc) and not cfg.stage_local and engine is None:
        return Store(loc, "r", copy_threads=copy_threads)
    home = open_home(loc)
    own_engine = engine is None
    eng = engine if engine is not None else Engine(cfg)
    try:
        trusted = Path(mirror_root) if mirror_root and (Path(mirror_root) / "manifest.json").exists() else None
        root = (trusted or mirror(home, cache_root(cfg))) if is_url(loc) else Path(loc)
        store = Store(root, "r", copy_threads=copy_threads, shard_locator=lambda e: eng.locate(home, e),
                      max_open_shards=_max_open(eng, root), shard_mapped=lambda e: eng.unpin(e["sha256"]),
                      shards_needed=lambda es: eng.start_many(home, es))
    except BaseException:
        if own_engine:
            eng.close()
        raise
    try:
        eng.check_budgets(store.manifest["shards"])
    except BaseException:
        store.close()
        if own_engine:
            eng.close()
        raise
    store.home, store.engine = home, eng
    if own_engine:
        store.on_close(eng.close)
    store.on_close(home.close)
    return store


class DaemonStager:
    """The engine interface (locate/announce/progress) served by kvdatad, falling back to
    an in-process engine if the daemon goes away mid-run (readers never stop)."""

    def __init__(self, client: Any, location: str, home: Home, config: Config) -> None:
        self.client, self.location, self.home, self.config = client, location, home, config
        self._fallback: Engine | None = None
        self._pid = os.getpid()
        self._paths: dict[str, tuple[Path, bool]] = {}  # sha -> where the daemon last put it
        self._sent: dict[str, tuple[int, float]] = {}   # reader -> (position, when) last reported

    def _live(self) -> Any:
        from .protocol import Client

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
        from .protocol import DaemonError, DaemonUnavailable

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

    def locate(self, home: Home, entry: dict[str, Any]) -> tuple[Path, bool]:
        known = self._paths.get(entry["sha256"])
        if known is not None and known[0].exists():  # still there: map it again without a round trip
            return known                             # (if it vanishes first, the store asks again)
        reply = self._call("need", shard=int(entry["id"]), sha256=entry["sha256"])
        if reply is not None:
            path, staged = Path(reply["path"]), bool(reply["staged"])
            if not staged or path.name == f"{entry['sha256']}.mdb":  # the copy this manifest names
                self._paths[entry["sha256"]] = (path, staged)
                return path, staged
        return self._engine().locate(home, entry)

    def start_many(self, home: Home, entries: list[dict[str, Any]]) -> None:
        if self._call("want", shards=[[int(e["id"]), e["sha256"]] for e in entries]) is None:
            self._engine().start_many(home, entries)

    def announce(self, reader: str, home: Home, entries: list[dict[str, Any]], position: int = 0) -> None:
        if self._call("announce", reader=reader, shards=[int(e["id"]) for e in entries], position=position) is None:
            self._engine().announce(reader, home, entries, position)

    def progress(self, reader: str, position: int) -> None:
        """Reported at most every PROGRESS_INTERVAL per reader (a socket round trip each)."""
        now = time.monotonic()
        last = self._sent.get(reader)
        if last is not None and now - last[1] < PROGRESS_INTERVAL:
            return
        self._sent[reader] = (position, now)
        if self._call("progress", reader=reader, position=position) is None and self._fallback is not None:
            self._fallback.progress(reader, position)

    def unpin(self, sha: str) -> None:
        if self._fallback is not None:
            self._fallback.unpin(sha)

    def status(self) -> dict[str, Any]:
        reply = self._call("status") if self.client is not None else None
        return reply if reply is not None else self._engine().status()

    def close(self) -> None:
        if self.client is not None and os.getpid() == self._pid:
            self.client.close()
        if self._fallback is not None:
            self._fallback.close()


def _open_through_daemon(loc: str, cfg: Config, copy_threads: int | None) -> Store | None:
    from .protocol import DaemonError, connect

    client = connect(cfg.daemon.socket)
    if client is None:
        return None
    location = loc if is_url(loc) else str(Path(loc).resolve())
    try:
        reply = client.request("open", dataset=location)
    except DaemonError:
        client.close()
        raise
    home = open_home(location)
    stager = DaemonStager(client, location, home, cfg)
    try:
        store = Store(Path(reply["root"]), "r", copy_threads=copy_threads,
                      shard_locator=lambda e: stager.locate(home, e), max_open_shards=8,
                      shard_mapped=lambda e: stager.unpin(e["sha256"]),
                      shards_needed=lambda es: stager.start_many(home, es))
    except BaseException:
        stager.close()
        raise
    store.home, store.engine = home, stager
    store.on_close(stager.close)
    store.on_close(home.close)
    return store


def _max_open(eng: Engine, root: Path) -> int:
    """Shards a reader keeps mapped (and so un-evictable): at most a third of the fastest
    tier, so prefetching always has room."""
    try:
        m = fmt.parse_manifest((root / "manifest.json").read_bytes(), str(root))
        largest = max((int(e["bytes"]) for e in m["shards"]), default=1)
    except (OSError, KVDataError):
        return 4
    return max(1, min(16, eng.tiers[0].budget // max(largest, 1) // 3))


def mirror(home: Home, root: Path) -> Path:
    """Local copy of a remote dataset's manifest and index (content-checked); its directory."""
    local = root / hashlib.sha256(home.url.encode()).hexdigest()[:24]
    (local / "index").mkdir(parents=True, exist_ok=True)
    data = home.read("manifest.json")
    try:
        if (local / "manifest.json").read_bytes() == data:  # same generation, already verified
            return local
    except FileNotFoundError:
        pass
    m = fmt.parse_manifest(data, home.where("manifest.json"))
    if int(m["tail"]["records"]):
        raise CorruptDatasetError(f"{home.where('manifest.json')}: the dataset has unsealed records; push it again")
    sums = m.get("index_sha256") or {}
    idx = m["index"]
    names = [n for n in (idx["samples"], idx["records"]) if n] + [r["name"] for r in idx["keys"]]
    for name in names:
        dest = local / "index" / name
        want = sums.get(name)
        if dest.exists() and want and file_sha256(dest)[1] == want:
            continue
        blob = home.read(f"index/{name}")
        if want and hashlib.sha256(blob).hexdigest() != want:
            raise CorruptDatasetError(f"{home.where('index/' + name)} does not match its checksum; push the dataset again")
        atomic_write(dest, blob)
    (local / "shards").mkdir(exist_ok=True)
    (local / "source.json").write_text(json.dumps({"url": home.url}))
    atomic_write(local / "manifest.json", data)
    return local


def push(dataset: str | os.PathLike[str], url: str, *, show: bool | None = None) -> dict[str, Any]:
    """Upload a local, fully sealed dataset: shards (.zst), index, then the manifest last,
    so a half-pushed dataset is never visible. Objects already there with the right size
    are skipped, so an interrupted push resumes."""
    src = Path(dataset)
    store = Store(src, "r")
    try:
        m = json.loads(json.dumps(store.manifest))
    finally:
        store.close()
    if int(m["tail"]["records"]):
        raise KVDataError(f"{src} has {m['tail']['records']} unsealed records; run `kvdata seal {src}` before pushing")
    home = open_home(url)
    if not home.writable:
        raise ReadOnlyError(f"{url} is read-only; push to a local path or s3://")
    uploaded = skipped = 0
    bar = make_progress(len(m["shards"]) + 3, "push", show)
    try:
        with tempfile.TemporaryDirectory(prefix="kvdata-push-") as tmpd:
            for e in m["shards"]:
                if not e.get("zst"):
                    e["zst"] = _compress(src / "shards" / e["name"], Path(tmpd) / (e["name"] + ".zst"))
                name = f"shards/{e['zst']['name']}"
                path = src / name if (src / name).exists() else Path(tmpd) / e["zst"]["name"]
                if _remote_size(home, name) == int(e["zst"]["bytes"]):
                    skipped += 1
                else:
                    home.put_file(name, path)
                    uploaded += 1
                bar.update(1)
            sums = {}
            for kind, name, count in _index_files(m):
                trimmed = Path(tmpd) / name
                with open(src / "index" / name, "rb") as f:
                    blob = f.read(count)
                trimmed.write_bytes(blob)
                sums[name] = hashlib.sha256(blob).hexdigest()
                home.put_file(f"index/{name}", trimmed)
            bar.update(2)
            m["index_sha256"] = sums
            mpath = Path(tmpd) / "manifest.json"
            mpath.write_bytes(fmt.dump_manifest(m))
            home.put_file("manifest.json", mpath)
            bar.update(1)
    finally:
        bar.close()
        home.close()
    return {"dataset": str(src), "url": url, "generation": m["generation"], "shards_uploaded": uploaded,
            "shards_skipped": skipped}


def _compress(path: Path, dest: Path) -> dict[str, Any]:
    with open(dest, "wb") as f:
        size, sha = compress_file(path, f)
    return {"name": dest.name, "bytes": size, "sha256": sha}


def _remote_size(home: Home, name: str) -> int | None:
    try:
        return home.size(name)
    except RemoteError:
        return None


def _index_files(m: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(kind, file name, meaningful bytes) of the index files a manifest references."""
    idx = m["index"]
    out = []
    if idx["samples"]:
        out.append(("samples", idx["samples"], int(m["count"]) * fmt.SAMPLE_DTYPE.itemsize))
    if idx["records"]:
        out.append(("records", idx["records"], int(idx["records_count"]) * fmt.RECORD_DTYPE.itemsize))
    for r in idx["keys"]:
        out.append(("keys", r["name"], int(r["count"]) * 16))
    return out
