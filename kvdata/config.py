"""Tier and daemon settings: frozen dataclasses, read from TOML only at entry points.

Config file: $KVDATA_CONFIG, else ~/.config/kvdata/kvdata.toml::

    [[tiers]]
    name = "ram"
    path = "/dev/shm/kvdata-cache"
    budget = "8GiB"
    [[tiers]]
    name = "ssd"
    path = "/var/cache/kvdata"
    budget = "200GiB"

    [daemon]
    socket = "/run/kvdata/kvdatad.sock"
    group = "ml"                       # or all_users = true; default: the daemon's user only
    allow_homes = ["s3://bucket/prefix", "https://host/path"]   # remote homes kvdatad fetches
    max_connections = 1024
    max_connections_per_uid = 256
    request_timeout = 120              # seconds a request may spend on a home or a disk

Tiers are listed fastest first. With no file, the embedded default is one tier
under ~/.cache/kvdata with a budget of 80% of that disk's free space, and local
homes are read in place.
"""

from __future__ import annotations

import os
import shutil
import tomllib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._util.sizes import parse_size
from .errors import ConfigError


@dataclass(frozen=True)
class TierConfig:
    name: str
    path: Path
    budget: int


@dataclass(frozen=True)
class DaemonConfig:
    socket: Path | None = None
    group: str | None = None
    metrics_port: int | None = None
    all_users: bool = False                 # socket mode 0666: every local user may connect
    allow_homes: tuple[str, ...] = ()       # normalized URL prefixes kvdatad may fetch (docs/SECURITY.md)
    max_connections: int = 1024
    max_connections_per_uid: int = 256
    request_timeout: float = 120.0

    def home_allowed(self, url: str) -> bool:
        """Whether kvdatad may fetch this home with its own credentials: a prefix match,
        segment by segment, of the normalized URL on an `allow_homes` entry."""
        try:
            u = normalize_home_url(url)
        except ConfigError:
            return False
        return any(u == p or u.startswith(p + "/") for p in self.allow_homes)


HOME_SCHEMES = ("s3", "http", "https")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_home_url(url: str) -> str:
    """scheme://host[:port]/path of a remote home, or ConfigError: lowercase scheme and host,
    default port dropped, '//' collapsed, no trailing '/'. Refused: other schemes, user info,
    query, fragment, percent-escapes, '.'/'..' segments, NUL, backslashes and control bytes
    -- nothing that two parties could read as two different places."""
    if not isinstance(url, str) or not url or len(url) > 4096:
        raise ConfigError(f"home URL {url!r} must be a non-empty string")
    if any(ord(ch) < 0x20 or ch in "\\%" or ord(ch) == 0x7F for ch in url):
        raise ConfigError(f"home URL {url!r} may not contain control bytes, backslashes or percent-escapes")
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port
    except ValueError as e:
        raise ConfigError(f"home URL {url!r} is not a valid URL ({e})") from None
    scheme = u.scheme.lower()
    if scheme not in HOME_SCHEMES:
        raise ConfigError(f"home URL {url!r} must be s3://, http:// or https:// (kvdatad does not fetch fsspec "
                          "homes: their readers stage them in-process; see docs/SECURITY.md)")
    if u.username is not None or u.password is not None or "@" in u.netloc:
        raise ConfigError(f"home URL {url!r} may not carry user info; give credentials to the daemon, not in URLs")
    if u.query or u.fragment or "?" in url or "#" in url:
        raise ConfigError(f"home URL {url!r} may not have a query or fragment")
    host = (u.hostname or "").lower()
    if not host:
        raise ConfigError(f"home URL {url!r} names no host or bucket")
    if scheme == "s3" and port is not None:
        raise ConfigError(f"home URL {url!r}: an S3 bucket has no port")
    netloc = host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    if ":" in host:  # IPv6 literal
        netloc = f"[{host}]" if port is None or port == _DEFAULT_PORTS.get(scheme) else f"[{host}]:{port}"
    parts = [p for p in u.path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ConfigError(f"home URL {url!r} may not contain '.' or '..' segments")
    return f"{scheme}://{netloc}" + "".join("/" + p for p in parts)


@dataclass(frozen=True)
class Config:
    tiers: tuple[TierConfig, ...]
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    source: Path | None = None          # the file it came from (None: embedded default)
    stage_local: bool = False           # stage local homes too (true when tiers are configured)

    def tier(self, name: str | None) -> TierConfig:
        """The named tier, or the fastest one."""
        if name is None:
            return self.tiers[0]
        for t in self.tiers:
            if t.name == name:
                return t
        raise ConfigError(f"no tier named {name!r}; configured tiers: {', '.join(t.name for t in self.tiers)}")


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("KVDATA_CONFIG"):
        return Path(env["KVDATA_CONFIG"]).expanduser()
    base = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "kvdata" / "kvdata.toml"


def default_config(env: Mapping[str, str] | None = None) -> Config:
    """One tier under ~/.cache/kvdata (or $XDG_CACHE_HOME/kvdata), 80% of its disk's free space."""
    env = os.environ if env is None else env
    base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvdata"
    probe = base
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    return Config(tiers=(TierConfig("cache", base, max(int(free * 0.8), 1)),))


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """The config from `path` (or the standard location); the embedded default if none exists."""
    explicit = path is not None or bool((os.environ if env is None else env).get("KVDATA_CONFIG"))
    p = Path(path).expanduser() if path is not None else config_path(env)
    if not p.exists():
        if explicit:
            raise ConfigError(f"config file {p} does not exist; create it or unset KVDATA_CONFIG")
        return default_config(env)
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{p}: cannot read the config ({e}); fix the TOML") from None
    return parse_config(data, p)


def parse_config(data: Mapping[str, Any], source: Path | None = None) -> Config:
    where = str(source) if source else "config"
    tiers_raw = data.get("tiers")
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError(f"{where}: needs at least one [[tiers]] table with name, path and budget")
    tiers = []
    seen: set[str] = set()
    for i, t in enumerate(tiers_raw):
        if not isinstance(t, dict):
            raise ConfigError(f"{where}: tiers[{i}] must be a table")
        missing = [k for k in ("name", "path", "budget") if k not in t]
        if missing:
            raise ConfigError(f"{where}: tiers[{i}] is missing {', '.join(missing)}")
        name = str(t["name"])
        if not name or name in seen or "/" in name:
            raise ConfigError(f"{where}: tier name {name!r} must be non-empty, unique and contain no '/'")
        seen.add(name)
        unknown = set(t) - {"name", "path", "budget"}
        if unknown:
            raise ConfigError(f"{where}: tier {name!r} has unknown setting(s) {', '.join(sorted(unknown))}")
        budget = parse_size(t["budget"], f"{where}: tier {name!r} budget")
        tiers.append(TierConfig(name, Path(str(t["path"])).expanduser(), budget))
    d = data.get("daemon") or {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: [daemon] must be a table")
    unknown = set(d) - {"socket", "group", "metrics_port", "all_users", "allow_homes", "max_connections",
                        "max_connections_per_uid", "request_timeout"}
    if unknown:
        raise ConfigError(f"{where}: [daemon] has unknown setting(s) {', '.join(sorted(unknown))}")
    port = d.get("metrics_port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise ConfigError(f"{where}: [daemon] metrics_port must be a port number, got {port!r}")
    allow = d.get("allow_homes", [])
    if not isinstance(allow, list) or not all(isinstance(a, str) for a in allow):
        raise ConfigError(f"{where}: [daemon] allow_homes must be a list of URL prefixes, e.g. [\"s3://bucket/prefix\"]")
    try:
        allow_homes = tuple(normalize_home_url(a) for a in allow)
    except ConfigError as e:
        raise ConfigError(f"{where}: [daemon] allow_homes: {e}") from None
    all_users = d.get("all_users", False)
    if not isinstance(all_users, bool):
        raise ConfigError(f"{where}: [daemon] all_users must be true or false")
    if all_users and d.get("group"):
        raise ConfigError(f"{where}: [daemon] set either group or all_users, not both")
    limits = {}
    for key, low, high in (("max_connections", 1, 1 << 20), ("max_connections_per_uid", 1, 1 << 20)):
        v = d.get(key, getattr(DaemonConfig, key))
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise ConfigError(f"{where}: [daemon] {key} must be an integer in [{low}, {high}], got {v!r}")
        limits[key] = v
    timeout = d.get("request_timeout", DaemonConfig.request_timeout)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 86400:
        raise ConfigError(f"{where}: [daemon] request_timeout must be seconds in (0, 86400], got {timeout!r}")
    daemon = DaemonConfig(socket=Path(d["socket"]).expanduser() if d.get("socket") else None,
                          group=str(d["group"]) if d.get("group") else None, metrics_port=port,
                          all_users=all_users, allow_homes=allow_homes, request_timeout=float(timeout), **limits)
    return Config(tiers=tuple(tiers), daemon=daemon, source=source, stage_local=True)
