"""Recovery's tidy-up: what a writer may remove from a dataset directory, and where the rest goes.

Recovery never deletes what it cannot account for. It removes only leftovers it can name the
origin of -- temp files, tails already sealed into a committed shard, index files of older
generations, lock files of LMDB files that are gone, files this writer itself made since its
last commit, and what a journal accounts for (store.retire: the files of an uncommitted
compaction; those of the generation a compaction or a "w" rewrite replaced, once no reader
pins them -- until then they stay where readers look for them) -- and
moves every other file the manifest does not name into `lost+found/<time>-<pid>/`, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .._util.fsutil import fsync_dir, unlink_quiet
from ..format import Manifest, names
from .retire import Swept, sweep
from .sealing import is_tail_link

log = logging.getLogger("kvdata")

LOST_FOUND = "lost+found"  # where recovery moves files it cannot account for


@dataclass(frozen=True)
class LeftBehind:
    """What the writer running recovery knows it made or replaced."""

    written: frozenset[str]          # shard-dir files this writer created since its last commit
    writing_generation: int | None   # index files of this generation are its failed commit's


def tidy(root: Path, m: Manifest, left: LeftBehind) -> Swept:
    """Bring the dataset directory to exactly the files `m` names (see the module docstring),
    but for files kept for readers; returns what the compaction journals settled."""
    swept = settle(root, m)
    shards_dir = root / names.SHARDS_DIR
    keep = {s.name for s in m.shards} | {s.zst.name for s in m.shards if s.zst} \
        | {m.tail.name, names.lmdb_lock_name(m.tail.name)} | set(swept.kept)
    aside: list[Path] = []
    for p in root.glob(names.MANIFEST + ".tmp*"):  # a writer killed while replacing the manifest
        unlink_quiet(p)
    for p in shards_dir.iterdir():
        if p.name in keep:
            continue
        base = p.name[:-len("-lock")] if p.name.endswith("-lock") else p.name
        tail = names.parse_tail_name(base)
        if p.name.endswith(".tmp") or p.name in left.written:
            unlink_quiet(p)  # a seal's temp file; our own
        elif p.name.endswith("-lock") and not os.path.lexists(shards_dir / base):
            unlink_quiet(p)  # an LMDB lock file (a reader table, no data) of a file that is gone
        elif tail is not None and tail[1] == m.incarnation and tail[0] < m.tail.id:
            unlink_quiet(p)  # a tail already sealed into a committed shard
        elif is_tail_link(shards_dir, p.name, m.tail.name):
            unlink_quiet(p)  # the committed tail's own file under its sealed name: a seal never committed
        else:
            aside.append(p)
    keep_index = {n for n in (m.index.samples, m.index.records) if n} | {r.name for r in m.index.keys}
    for p in (root / names.INDEX_DIR).iterdir():
        if p.name in keep_index:
            continue
        gen = names.index_generation(p.name)
        if gen is not None and gen <= m.generation:
            unlink_quiet(p)  # an older generation's index file (derived state)
        elif gen is not None and gen == left.writing_generation:
            unlink_quiet(p)  # written by this writer's commit that failed
        else:
            aside.append(p)
    if aside:
        move_aside(root, aside)
    return swept


def settle(root: Path, m: Manifest) -> Swept:
    """Settle the compaction journals against `m` (store.retire.sweep); a journal that accounts
    for nothing goes to lost+found/. The caller holds the writer lock."""
    swept = sweep(root, m)
    if swept.aside:
        move_aside(root, swept.aside)
    if swept.kept:
        log.info("kvdata: %s: %d file(s) of a compacted generation kept while readers use it (%s)", root,
                 len(swept.kept), "; ".join(swept.why))
    return swept


def move_aside(root: Path, paths: list[Path]) -> None:
    """Move files into a new `lost+found/<time>-<pid>/` of the dataset, and say so."""
    dest = root / LOST_FOUND / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    dest.mkdir(parents=True, exist_ok=True)
    moved = []
    for p in paths:
        try:
            os.replace(p, dest / f"{p.parent.name}-{p.name}")
            moved.append(p.name)
        except FileNotFoundError:
            pass  # gone meanwhile (a reader removing the lock file it made for a sealed tail)
    if not moved:
        with contextlib.suppress(OSError):
            dest.rmdir()
        return
    fsync_dir(dest)
    log.warning("kvdata: %s: moved %d file(s) the manifest does not name to %s (%s); delete them once you "
                "know they are not needed", root, len(moved), dest, ", ".join(sorted(moved)))


def holds_data(root: Path) -> bool:
    """Whether a dataset directory has shard or index files (then a missing manifest is damage)."""
    for sub in (names.SHARDS_DIR, names.INDEX_DIR):
        try:
            if any(True for _ in (root / sub).iterdir()):
                return True
        except (FileNotFoundError, NotADirectoryError):
            pass
    return False
