"""The requests a reader or the CLI makes of kvdatad outside a read: `open` (passing a local
dataset's manifest as a descriptor when the daemon does not open this uid's paths), `stage` and
`evict` (what `kvdata stage` / `kvdata evict` send), and the directory a dataset is opened from
through the daemon (open_root).

Its own module because these are one-shot requests with the descriptor-passing rule of
docs/SECURITY.md, apart from DaemonStager (daemon_client.py), which serves shards during a read
and uses open_request and shard_file from here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import DaemonError, KVDataError
from ..format import ShardEntry, names
from ..homes import is_url
from ..protocol import MAX_FDS, Client, close_fds
from ..sync.mirror import mirror_from_fds


def user_mirror_root() -> Path:
    """Where a reader keeps its own copy of a remote dataset's index that kvdatad passed."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvdata" / "daemon-mirrors"


def _open_file(path: Path) -> int | None:
    try:  # O_NONBLOCK: a FIFO planted in the dataset cannot hang the reader (the daemon refuses it)
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None


def shard_file(location: str, entry: ShardEntry) -> tuple[int, str] | None:
    """(descriptor, kind) of a local dataset's shard file, opened by this process with its
    own rights: the shard itself ("mdb"), else its compressed copy ("zst")."""
    shards = Path(location) / names.SHARDS_DIR
    fd = _open_file(shards / entry.name)
    if fd is not None:
        return fd, "mdb"
    if entry.zst is not None:
        fd = _open_file(shards / entry.zst.name)
        if fd is not None:
            return fd, "zst"
    return None


def open_request(client: Client, location: str) -> tuple[dict[str, Any], list[int]]:
    """`open` a dataset through the daemon: a local one's manifest is passed as a descriptor
    when the daemon does not open this uid's paths. DaemonError if it refuses."""
    fds: list[int] = []
    if not client.may_name_paths and not is_url(location):
        fd = _open_file(Path(location) / names.MANIFEST)
        if fd is None:
            raise DaemonError(f"{location}/{names.MANIFEST} cannot be opened by this reader", "NotAllowed")
        fds.append(fd)
    try:
        return client.request_fds("open", fds=fds, dataset=location)
    finally:
        close_fds(fds)


def stage_request(client: Client, location: str, entries: Sequence[ShardEntry], tier: str | None = None,
                  wait: bool = False) -> dict[str, Any]:
    """`stage` a dataset through the daemon (what `kvdata stage` needs): by name for a URL or
    a client the daemon opens paths for; else the manifest is passed with `open` and the
    shard files go with `stage` requests, MAX_FDS at a time. DaemonError if it refuses."""
    if client.may_name_paths or is_url(location):
        return client.request("stage", dataset=location, tier=tier, wait=wait)
    _reply, got = open_request(client, location)
    close_fds(got)
    shards = queued = 0
    for i in range(0, len(entries), MAX_FDS):
        fds: list[int] = []
        items: list[list[Any]] = []
        try:
            for e in entries[i:i + MAX_FDS]:
                f = shard_file(location, e)
                if f is None:
                    raise DaemonError(f"{location}: shard {e.name} cannot be opened by this reader", "NotAllowed")
                fds.append(f[0])
                items.append([e.id, f[1]])
            r = client.request("stage", fds=fds, dataset=location, tier=tier, wait=wait, ahead=items)
        finally:
            close_fds(fds)
        shards += int(r["shards"])
        queued += int(r["queued"])
    return {"shards": shards, "queued": queued}


def evict_request(client: Client, location: str, tier: str | None = None) -> dict[str, Any]:
    """`evict` a dataset's copies through the daemon (what `kvdata evict` needs): a uid the
    daemon does not open paths for opens the dataset first, passing its manifest, since the
    daemon evicts only datasets the uid has open. DaemonError if it refuses."""
    if not client.may_name_paths and not is_url(location):
        _reply, got = open_request(client, location)
        close_fds(got)
    return client.request("evict", dataset=location, tier=tier)


def stage_entries(location: str) -> Sequence[ShardEntry]:
    """The shard entries `stage_request` passes files for: the local manifest's (a URL
    needs none: the daemon reads its manifest itself)."""
    if is_url(location):
        return ()
    from ..store.generation import read_manifest

    return read_manifest(Path(location)).shards


def open_root(client: Client, location: str) -> Path | None:
    """The directory a reader opens a dataset from through the daemon, or None if the daemon
    refuses it (the caller then stages in-process): the dataset itself when local; for a URL,
    the daemon's verified index mirror, or this uid's own copy of it when the daemon's tier
    is not readable here (the daemon passes the mirror's files as descriptors)."""
    try:
        reply, fds = open_request(client, location)
    except DaemonError:
        return None
    try:
        root = Path(reply["root"])
        if not is_url(location) or os.access(root / names.MANIFEST, os.R_OK):
            return root
        files = reply.get("files")
        if not isinstance(files, list) or len(files) != len(fds):
            return None
        try:
            return mirror_from_fds(list(zip((str(f) for f in files), fds)), user_mirror_root(), location)
        except (KVDataError, OSError):
            return None
    finally:
        close_fds(fds)
