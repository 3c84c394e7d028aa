"""The one way to open a dataset, wherever it lives: `kvdata.open(location, mode)`.

`kvdata.open`, `kvdata.Dataset`, `kvdata.BatchReader`, the importers and the CLI
all call `open_dataset`:
- a local path with no tier config: the Store reads it in place (embedded default);
- a local path with tiers configured: sealed shards are served from the fastest
  tier holding a verified copy, staged from the path on demand or ahead of time;
- s3:// or http(s)://: the manifest and index are mirrored (verified) into the
  cache, and shards are staged into the tiers;
- when kvdatad answers on its socket, shards come through it (one staged copy
  for every job on the box).
Writers (mode "a"/"w") always open a local path in place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..config import Config, load_config
from ..errors import ReadOnlyError
from ..format import names
from ..homes import is_url, open_home
from ..protocol import connect
from ..store import Store
from ..store.verify import verify_store
from ..sync.mirror import cache_root, mirror
from ..tiers.source import EngineSource, max_open_within
from ..tiers.staging import Engine
from .daemon_client import DaemonStager
from .daemon_requests import open_root


def open_dataset(location: str | os.PathLike[str], mode: str = "r", *, shard_size: int | str | None = None,
                 compress: bool = False, copy_threads: int | None = None, config: Config | None = None,
                 engine: Engine | None = None, use_daemon: bool = True, mirror_root: str | None = None) -> Store:
    """Open a dataset by path or URL (see module docstring): "r" reads, "a" appends (creating
    it if missing), "w" starts it empty.

    shard_size: seal shards at this size ("256MB", "1GiB" or bytes); default 256MB for a
    new dataset, else the dataset's own. A new value applies to shards sealed from now on.
    A new dataset whose first commit never happens (an error in the `with` block) is removed.
    copy_threads: threads that assemble large batches in get_batch (default: up to 4
    cores; use 1 inside worker processes).
    engine: stage through this engine (shared by the caller) instead of one of the store's own.
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
        trusted = Path(mirror_root) if mirror_root and (Path(mirror_root) / names.MANIFEST).exists() else None
        root = (trusted or mirror(home, cache_root(cfg))) if is_url(loc) else Path(loc)
        probe = Store(root, "r")  # the generation's shard list sizes the source before shards are mapped
        shards = probe.manifest.shards
        probe.close()
        eng.check_budgets(list(shards))
        source = EngineSource(eng, home, shards, own_engine=own_engine,
                              tables=root / names.SEEK_DIR if is_url(loc) else None)
    except BaseException:
        if own_engine:
            eng.close()
        home.close()
        raise
    return Store(root, "r", copy_threads=copy_threads, source=source)


def _open_through_daemon(loc: str, cfg: Config, copy_threads: int | None) -> Store | None:
    """A Store whose shards come through kvdatad, or None (no daemon, or it refuses the
    dataset -- a home not in its allow-list, a file it cannot check: stage in-process)."""
    client = connect(cfg.daemon.socket)
    if client is None:
        return None
    location = loc if is_url(loc) else str(Path(loc).resolve())
    root = open_root(client, location)
    if root is None:
        client.close()
        return None
    home = open_home(location)
    stager = DaemonStager(client, location, home, cfg, tables=root / names.SEEK_DIR if is_url(location) else None)
    try:
        store = Store(root, "r", copy_threads=copy_threads, source=stager)
        if cfg.tiers:  # (the daemon's tiers, as far as this process's config knows them)
            store.max_open_shards = max_open_within(cfg.tiers[0].budget, store.manifest.shards, stager.max_open)
        return store
    except BaseException:
        stager.close()
        raise


def verify(location: str | os.PathLike[str], *, progress: bool | None = None, **open_args: Any) -> dict[str, Any]:
    """Open a dataset (by path or URL) and check it: see kvdata.store.verify.verify_store."""
    store = open_dataset(location, **open_args)
    try:
        return verify_store(store, progress=progress)
    finally:
        store.close()
