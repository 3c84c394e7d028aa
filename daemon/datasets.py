"""The datasets kvdatad has open, and for whom (Datasets): shared ones -- an allowed URL, or a
privileged peer's path, read by the daemon itself and refreshed when they change -- and those read
from a uid's passed manifest (the UID_DATASETS it opened last), under a name private to that uid.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvdata.config import Config
from kvdata.errors import BadRequest, NotAllowed
from kvdata.format import Manifest, ShardEntry
from kvdata.homes import Home, open_home
from kvdata.homes.local import PassedFiles
from kvdata.sync.dataset_names import record_names
from kvdata.sync.mirror import cache_root, mirror, read_manifest
from kvdata.tiers.staging import Engine

from .messages import is_url
from .trust import Peer

log = logging.getLogger("kvdatad")
UID_DATASETS = 32        # datasets one unprivileged uid has open from passed manifests (least recent dropped)


def passed_key(uid: int, location: str) -> str:
    return f"{location}\x00uid={uid}"  # NUL never occurs in a location: no clash with a shared one


@dataclass
class OpenDataset:
    location: str
    home: Home
    root: Path
    manifest: Manifest
    owner: int | None = None          # uid whose passed manifest this is; None: read by the daemon itself
    users: set[int] = field(default_factory=set)  # uids that opened it (status shows it to these)
    staged_all: bool = False  # `kvdata stage` asked for it: keep new generations staged too
    key: str = ""             # the engine's key for its shard list (policy.dataset_key): mode, resident set

    def entry(self, shard: int | None) -> ShardEntry:
        """The shard a request names by id (None: not an integer), or BadRequest naming the range."""
        if shard is None or not 0 <= shard < len(self.manifest.shards):
            raise BadRequest(f"shard must be an integer id in [0, {len(self.manifest.shards)}) of {self.location}")
        return self.manifest.shards[shard]


class Datasets:
    """The open datasets by key: a shared one's location, or passed_key(uid, location)."""

    def __init__(self, config: Config, engine: Engine) -> None:
        self._config = config
        self._engine = engine
        self._lock = threading.Lock()
        self._open: dict[str, OpenDataset] = {}

    def reconfigure(self, config: Config) -> None:
        self._config = config

    def check_allowed(self, location: str) -> None:
        """NotAllowed for a URL outside [daemon] allow_homes (its reader stages it itself)."""
        if is_url(location) and not self._config.daemon.home_allowed(location):
            raise NotAllowed(f"kvdatad does not fetch {location}: it is not under its [daemon] allow_homes, so the "
                             "reader stages it itself")

    def shared(self, location: str, uid: int) -> OpenDataset:
        """A dataset the daemon reads itself, opened if it is not, for `uid` (who may see it now)."""
        with self._lock:
            ds = self._open.get(location)
        if ds is None:
            ds = self.open_dataset(location)
        with self._lock:
            ds.users.add(uid)
        return ds

    def passed(self, location: str, uid: int) -> OpenDataset:
        """The dataset `uid` opened from the manifest it passed; NotAllowed if it did not."""
        with self._lock:
            ds = self._open.get(passed_key(uid, location))
        if ds is None:
            raise NotAllowed(f"{location} is not open for uid {uid}: open it first, passing its manifest "
                             "(kvdatad reads local datasets only from descriptors their reader passes)")
        return ds

    def add_passed(self, location: str, uid: int, manifest: Manifest) -> OpenDataset:
        """`uid`'s dataset at `location` from the manifest it passed (a uid cannot grow the daemon
        without bound: its least recent beyond UID_DATASETS are dropped)."""
        self._engine.check_budgets(list(manifest.shards))
        ds = OpenDataset(location, PassedFiles(location), Path(location), manifest, owner=uid, users={uid},
                         key=self._engine.open_dataset(manifest.shards, label=location))
        if uid == os.geteuid():  # only the daemon's own uid's names: others cannot fill its tier
            self._record_names(location, manifest)
        key = passed_key(uid, location)
        with self._lock:
            self._open.pop(key, None)
            self._open[key] = ds  # most recent last
            mine = [k for k, d in self._open.items() if d.owner == uid]
            for old in mine[: max(0, len(mine) - UID_DATASETS)]:
                del self._open[old]
        return ds

    def open_dataset(self, location: str, refresh: bool = False) -> OpenDataset:
        """A dataset the daemon reads itself (a privileged peer's path, or an allowed URL), read
        again from its home if `refresh` (staging its new shards if it was staged whole)."""
        with self._lock:
            old = self._open.get(location)
        if old is not None and not refresh:
            return old
        home = old.home if old is not None else open_home(location)
        if home.local_path("") is not None:
            root = Path(location)
            m = read_manifest(root)
        else:
            root = mirror(home, cache_root(self._config))
            m = read_manifest(root)
        self._engine.check_budgets(list(m.shards))
        ds = OpenDataset(location, home, root, m, staged_all=bool(old and old.staged_all),
                         users=set(old.users) if old is not None else set(),
                         key=self._engine.open_dataset(m.shards, label=location))
        with self._lock:
            self._open[location] = ds
        self._record_names(location, m)
        if ds.staged_all:
            for e in m.shards:
                self._engine.stage(home, e)
        return ds

    def _record_names(self, location: str, m: Manifest) -> None:
        """Which dataset its copies belong to, for `kvdata cache ls` after a restart (a name
        record beside the index mirrors; kvdata.sync.dataset_names)."""
        try:
            record_names(cache_root(self._config), location, m.shards)
        except OSError as e:
            log.warning("cannot keep the shard names of %s: %s", location, e)

    def stage_all(self, ds: OpenDataset) -> None:
        """Keep every generation of `ds` staged (`kvdata stage`)."""
        with self._lock:
            ds.staged_all = True

    def unstage_all(self, ds: OpenDataset, peer: Peer) -> None:
        """An evict by `peer` ends `kvdata stage`'s keeping `ds` staged, unless another uid reads it."""
        with self._lock:
            if peer.privileged or ds.users <= {peer.uid}:
                ds.staged_all = False

    def named_by_others(self, uid: int) -> set[str]:
        """The sha256 of every shard of a dataset some other uid opened."""
        with self._lock:
            datasets = [d for d in self._open.values() if d.users - {uid}]
        return {e.sha256 for d in datasets for e in d.manifest.shards}

    def shown_to(self, peer: Peer) -> list[OpenDataset]:
        """The datasets `status` shows `peer`: all to a privileged one, else those its uid opened."""
        with self._lock:
            return [d for d in self._open.values() if peer.privileged or peer.uid in d.users]

    def local(self) -> list[str]:
        """Local datasets the daemon itself reads (watched for new generations)."""
        with self._lock:
            return [loc for loc, d in self._open.items() if d.owner is None and d.home.local_path("") is not None]
