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
    group = "ml"

Tiers are listed fastest first. With no file, the embedded default is one tier
under ~/.cache/kvdata with a budget of 80% of that disk's free space, and local
homes are read in place.
"""

from __future__ import annotations

import os
import shutil
import tomllib
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
        tiers.append(TierConfig(name, Path(str(t["path"])).expanduser(), parse_size(t["budget"], f"tier {name!r} budget")))
    d = data.get("daemon") or {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: [daemon] must be a table")
    unknown = set(d) - {"socket", "group", "metrics_port"}
    if unknown:
        raise ConfigError(f"{where}: [daemon] has unknown setting(s) {', '.join(sorted(unknown))}")
    port = d.get("metrics_port")
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        raise ConfigError(f"{where}: [daemon] metrics_port must be a port number, got {port!r}")
    daemon = DaemonConfig(socket=Path(d["socket"]).expanduser() if d.get("socket") else None,
                          group=str(d["group"]) if d.get("group") else None, metrics_port=port)
    return Config(tiers=tuple(tiers), daemon=daemon, source=source, stage_local=True)
