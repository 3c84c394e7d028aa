"""The datasets kvdatad has open, and for whom (a part of kvdata_daemon.state.Service): the check of
a location a client names, the dataset a request names as its peer sees it -- shared (an allowed
URL, or a privileged peer's path) or read from that uid's passed descriptors --, opening and
refreshing one, and how it is read (its mode).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvdata.config import normalize_home_url
from kvdata.errors import BadRequest, ConfigError, NotAllowed
from kvdata.protocol import pack_flags
from kvdata.tiers import ShardEntry, policy
from kvdata.tiers.homes import Home, PassedFiles, open_home
from kvdata.tiers.mirror import cache_root, mirror, read_manifest

from .service_state import ClientState, OpenDataset, ServiceState

MAX_LOCATION = 4096
PASSED_DATASETS = 4      # datasets per connection with descriptors held


def is_url(location: str) -> bool:
    return location.startswith(("s3://", "http://", "https://"))


def check_location(value: Any) -> str:
    """A dataset location a client may name (a normalized URL or a clean absolute path), or BadRequest."""
    if not isinstance(value, str) or not value or len(value) > MAX_LOCATION or "\x00" in value:
        raise BadRequest("dataset must be a non-empty string without NUL bytes")
    if is_url(value):
        try:
            return normalize_home_url(value)
        except ConfigError as e:
            raise BadRequest(f"dataset URL: {e}") from None
    p = Path(value)
    if not p.is_absolute():
        raise BadRequest(f"dataset {value!r} must be an absolute path or an s3:// / http(s):// URL")
    if ".." in p.parts:
        raise BadRequest(f"dataset path {value!r} may not contain '..'")
    return str(p)


def passed_key(uid: int, location: str) -> str:
    return f"{location}\x00uid={uid}"  # NUL never occurs in a location: no clash with a shared one


class Datasets(ServiceState):
    """Service's open datasets: lookup, opening, read modes."""

    def local_datasets(self) -> list[str]:
        """Local datasets the daemon itself reads (watched for new generations)."""
        with self._lock:
            return [loc for loc, d in self.datasets.items() if d.owner is None and d.home.local_path("") is not None]

    def _location(self, value: Any) -> str:
        loc = check_location(value)
        if is_url(loc) and not self.config.daemon.home_allowed(loc):
            raise NotAllowed(f"kvdatad does not fetch {loc}: it is not under its [daemon] allow_homes, so the reader "
                             "stages it itself")
        return loc

    def _dataset(self, cid: int | None, value: Any) -> tuple[OpenDataset, Home]:
        """The dataset a request names, as this peer sees it, and the home to stage its shards
        from for this connection."""
        loc = self._location(value)
        st = self._client(cid)
        if is_url(loc) or st.peer.privileged:
            shared = self._shared(loc, st.peer.uid)
            self._use(st, shared)
            return shared, shared.home
        key = passed_key(st.peer.uid, loc)
        with self._lock:
            ds = self.datasets.get(key)
        if ds is None:
            raise NotAllowed(f"{loc} is not open for uid {st.peer.uid}: open it first, passing its manifest "
                             "(kvdatad reads local datasets only from descriptors their reader passes)")
        self._use(st, ds)
        return ds, self._passed_home(st, key, loc)

    def _use(self, st: ClientState, ds: OpenDataset) -> None:
        with self._lock:
            st.using.add(ds.key)

    def _mode(self, ds: OpenDataset) -> dict[str, Any]:
        """How the dataset is read (reply fields of an empty `want`): "shard-aware", or
        "random" with the largest sha256 of its resident set (a shard with a sha256 <= it is
        kept whole; every other one is read record by record)."""
        modes = self.engine.modes
        modes.activate([ds.key])
        reply: dict[str, Any] = {"mode": modes.mode(ds.key), "resident_below": modes.resident_threshold(ds.key)}
        shas = [e.sha256 for e in ds.manifest.shards]
        if self.engine.congested():  # no room for a needed shard lately: read what is not staged by record
            reply["congested"] = True
            reply["staged"] = pack_flags(self.engine.staged(shas))
        elif reply["mode"] == policy.SHARD_AWARE and self.engine.keep_set()[0] is not None:
            # larger than the tiers: shards read once this pass are read by record (Engine.bypassed)
            staged = self.engine.staged(shas)
            reply["whole"] = pack_flags([have or not self.engine.bypassed(sha) for sha, have in zip(shas, staged)])
        return reply

    def _shared(self, loc: str, uid: int) -> OpenDataset:
        with self._lock:
            ds = self.datasets.get(loc)
        if ds is None:
            ds = self.open_dataset(loc)
        with self._lock:
            ds.users.add(uid)
        return ds

    def _passed_home(self, st: ClientState, key: str, loc: str) -> PassedFiles:
        with self._lock:
            home = st.passed.get(key)
            if home is None:
                home = st.passed[key] = PassedFiles(loc)
                while len(st.passed) > PASSED_DATASETS:
                    _k, old = st.passed.popitem(last=False)
                    old.close()
            st.passed.move_to_end(key)
            return home

    def open_dataset(self, loc: str, refresh: bool = False) -> OpenDataset:
        """A dataset the daemon reads itself (a privileged peer's path, or an allowed URL)."""
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
        ds = OpenDataset(loc, home, root, m, staged_all=bool(old and old.staged_all),
                         users=set(old.users) if old is not None else set(),
                         key=self.engine.open_dataset(m.shards, label=loc))
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
