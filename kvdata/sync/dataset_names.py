"""Which dataset a staged copy belongs to, kept across restarts (`kvdata cache ls`).

Copies are named by sha256 alone, so a tier cannot tell whose they are. When kvdatad opens a
dataset it reads itself, it writes a small name record beside the index mirrors
(`<cache_root>/names/<sha256(location)[:32]>.json`: the location and each shard's sha256 and
name); `cache ls` reads them back, with the mirrors of remote datasets, to name the copies.

What is read back is treated as hostile: a record is used only when nobody but this uid can
have written it (a regular file we own, one link, not writable by others, in a directory we
own that others cannot write -- kvdata.tiers.tier_trust), at most MAX_RECORD bytes, and only
names that are printable strings and sha256 values of 64 hex digits are taken; anything else
is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._util.fsutil import atomic_write
from ..format import ShardEntry
from ..tiers.tier_trust import others_may_write, ours

NAMES_DIR = "names"
MAX_RECORD = 8 << 20
MAX_NAME = 4096
_SHA = re.compile(r"[0-9a-f]{64}")


def record_path(root: Path, location: str) -> Path:
    return root / NAMES_DIR / (hashlib.sha256(location.encode()).hexdigest()[:32] + ".json")


def record_names(root: Path, location: str, shards: Sequence[ShardEntry]) -> None:
    """Keep `location`'s shard names under `root` (the cache root); rewritten only when they change.
    Raises OSError (callers log it: a name record is never worth failing an open)."""
    if not _printable(location):
        return
    data = json.dumps({"dataset": location, "shards": [[e.sha256, e.name] for e in shards]},
                      separators=(",", ":")).encode()
    path = record_path(root, location)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if read_trusted(path, MAX_RECORD) == data:
        return
    atomic_write(path, data)


def read_names(root: Path) -> dict[str, list[str]]:
    """{sha256: ["location#shard name", ...]} from the trusted, valid name records under `root`."""
    owners: dict[str, list[str]] = {}
    d = root / NAMES_DIR
    if not _trusted_dir(d):
        return owners
    for p in sorted(d.glob("*.json")):
        raw = read_trusted(p, MAX_RECORD)
        if raw is None:
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        for sha, label in valid_shards(rec):
            owners.setdefault(sha, []).append(label)
    return owners


def valid_shards(rec: Any, location: Any = None) -> list[tuple[str, str]]:
    """[(sha256, "location#name")] of a record ({"dataset", "shards": [[sha, name]]}) or of a
    mirrored manifest ({"shards": [{"sha256", "name"}]} with `location`); [] if malformed."""
    if not isinstance(rec, dict):
        return []
    loc = rec.get("dataset") if location is None else location
    shards = rec.get("shards")
    if not _printable(loc) or not isinstance(shards, list):
        return []
    out = []
    for s in shards:
        sha, name = (s.get("sha256"), s.get("name")) if isinstance(s, dict) else (
            s if isinstance(s, list) and len(s) == 2 else (None, None))
        if isinstance(sha, str) and _SHA.fullmatch(sha) and _printable(name):
            out.append((sha, f"{loc}#{name}"))
    return out


def read_trusted(path: Path, limit: int) -> bytes | None:
    """The bytes of `path` if it is a regular file of this uid nobody else could have written
    (not through a symlink), of at most `limit` bytes; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not ours(st) or st.st_size > limit:
            return None
        chunks = []
        total = 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
            if total > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _trusted_dir(d: Path) -> bool:
    try:
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not others_may_write(st)


def _printable(s: Any) -> bool:
    return isinstance(s, str) and 0 < len(s) <= MAX_NAME and s.isprintable()
