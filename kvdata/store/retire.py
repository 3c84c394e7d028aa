"""The journal of a compaction, and the removal of the files it replaced once no reader uses them.

A compaction (store.compact) gives the dataset a new incarnation K: every shard of the new
generation has a name that never held other bytes (kept shards are hard links under it). Before
it creates any file of K it writes `compact-iKKKKKKKK.json` beside the manifest (fsync'ed):

    {"format": "kvdata-compact", "to_incarnation": K, "from_generation": G,
     "from_incarnation": J, "files": ["000000.mdb", "000000.mdb.zst", "tail-000004.mdb", ...]}

`files` are the shard-directory files of generation G (incarnation J) that K replaces. A writer
opened with mode "w" on an existing dataset starts a new incarnation too and writes the same
journal before its empty manifest, so its old files follow the same rule. The journal is what
lets recovery account for every file a compaction leaves, wherever it was killed:

- the manifest is still generation G (incarnation J): the compaction never committed. Every
  file of incarnation K in shards/, the index files of generation K and K's reader registry
  are its own, unreferenced: they are removed, then the journal (`rollback`).
- the manifest's incarnation is K or later: it committed. J's files are removed once no reader
  pins J (store.pins), then J's registry, then the journal (`retire`); until then they stay, and
  the journal says why they are there. Compaction tries right after its commit; every later
  commit and every recovery tries again.
- anything else (a journal that does not parse, a manifest restored from elsewhere): the journal
  accounts for nothing; it is moved to lost+found/ and the files go the usual way of recovery.

All of this runs under the writer lock.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._util.fsutil import atomic_write, fsync_dir, read_regular, unlink_quiet
from ..format import Manifest, names
from .pins import unused

log = logging.getLogger("kvdata")

JOURNAL_FORMAT = "kvdata-compact"
MAX_JOURNAL = 64 << 20


@dataclass(frozen=True)
class Journal:
    """A compaction from generation `from_generation` (incarnation `from_incarnation`) to
    incarnation `to_incarnation`; `files` are the old generation's shard-directory files."""

    to_incarnation: int
    from_generation: int
    from_incarnation: int
    files: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"format": JOURNAL_FORMAT, "to_incarnation": self.to_incarnation,
                "from_generation": self.from_generation, "from_incarnation": self.from_incarnation,
                "files": list(self.files)}


def old_files(m: Manifest) -> tuple[str, ...]:
    """The shard-directory files of generation `m` that a compaction of it replaces."""
    out = [s.name for s in m.shards] + [s.zst.name for s in m.shards if s.zst]
    out += [m.tail.name, names.lmdb_lock_name(m.tail.name)]
    return tuple(out)


def write_journal(root: Path, j: Journal) -> Path:
    """The journal, durable (file and directory fsync'ed) before any file of the new incarnation exists."""
    path = root / names.compact_journal_name(j.to_incarnation)
    atomic_write(path, (json.dumps(j.to_json(), indent=1) + "\n").encode())
    return path


def _parse(path: Path) -> Journal | None:
    """The journal at `path`, or None if it is not one this code wrote (hostile input: every
    name must be a shard-directory file of its old incarnation)."""
    to = names.parse_compact_journal_name(path.name)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None  # a link planted at a journal's name is never followed
        d = json.loads(read_regular(path, MAX_JOURNAL))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(d, dict) or d.get("format") != JOURNAL_FORMAT or d.get("to_incarnation") != to:
        return None
    fg, fi, files = d.get("from_generation"), d.get("from_incarnation"), d.get("files")
    if not (isinstance(fg, int) and isinstance(fi, int) and isinstance(files, list) and to is not None):
        return None
    if isinstance(fg, bool) or isinstance(fi, bool) or not 0 <= fi <= fg < to:
        return None
    if not all(isinstance(f, str) and names.incarnation_of(f) == fi for f in files):
        return None
    return Journal(to, fg, fi, tuple(files))


@dataclass
class Swept:
    """What a sweep did: files removed, and files kept because a reader may use them."""

    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)         # shard-directory names
    kept_bytes: int = 0
    why: list[str] = field(default_factory=list)
    aside: list[Path] = field(default_factory=list)  # journals that account for nothing: for lost+found/


def _remove(path: Path, done: Swept) -> None:
    """Unlink one file of a replaced generation."""
    if os.path.lexists(path):
        unlink_quiet(path)
        done.removed.append(path.name)


def _unique_bytes(path: Path) -> int:
    """The bytes removing this name would free (none if another name keeps the file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0


def rollback(root: Path, j: Journal, done: Swept | None = None) -> Swept:
    """Undo a compaction that did not commit: every file of its incarnation, then the journal."""
    done = done if done is not None else Swept()
    shards_dir = root / names.SHARDS_DIR
    for p in sorted(shards_dir.iterdir()):
        base = p.name.removesuffix(".tmp")
        if names.incarnation_of(base) == j.to_incarnation:
            _remove(p, done)
    for p in sorted((root / names.INDEX_DIR).iterdir()):
        if names.index_generation(p.name) == j.to_incarnation:  # a compaction to K writes generation K
            _remove(p, done)
    fsync_dir(shards_dir)
    fsync_dir(root / names.INDEX_DIR)
    unlink_quiet(root / names.reader_pin_name(j.to_incarnation))
    unlink_quiet(root / names.compact_journal_name(j.to_incarnation))
    fsync_dir(root)
    return done


def retire(root: Path, m: Manifest, j: Journal, done: Swept | None = None) -> Swept:
    """After a committed compaction: remove the old incarnation's files if no reader pins it
    (then its registry and the journal), else leave them and say so."""
    done = done if done is not None else Swept()
    shards_dir = root / names.SHARDS_DIR
    current = set(old_files(m))
    mine = [f for f in j.files if f not in current]
    with unused(root, j.from_incarnation) as why:
        if why is None:
            for f in mine:
                _remove(shards_dir / f, done)
            fsync_dir(shards_dir)
    if why is not None:
        here = [f for f in mine if os.path.lexists(shards_dir / f)]
        done.kept += here
        done.kept_bytes += sum(_unique_bytes(shards_dir / f) for f in here)
        done.why.append(f"incarnation {j.from_incarnation}: {why}")
        return done
    unlink_quiet(root / names.compact_journal_name(j.to_incarnation))
    fsync_dir(root)
    return done


def sweep(root: Path, m: Manifest) -> Swept:
    """Settle every compaction journal of the dataset against its manifest `m` (see the module
    docstring), and remove reader registries of other incarnations nobody holds. Returns what
    was removed, what must stay (recovery leaves those names alone) and the journals that
    account for nothing (the caller moves them to lost+found/)."""
    done = Swept()
    aside: list[Path] = []
    pending: set[int] = set()  # old incarnations still kept for readers
    for path in sorted(root.glob("compact-i*.json")):
        j = _parse(path)
        if j is None:
            aside.append(path)
        elif m.incarnation == j.from_incarnation and m.generation == j.from_generation:
            rollback(root, j, done)
        elif m.incarnation >= j.to_incarnation:
            retire(root, m, j, done)
            if os.path.lexists(path):
                pending.add(j.from_incarnation)
        else:
            aside.append(path)
    for path in root.glob("compact-i*.json.tmp*"):  # a compaction killed while writing its journal
        if names.parse_compact_journal_name(path.name.split(".tmp")[0]) is not None:
            unlink_quiet(path)
    for path in sorted(root.glob("readers-i*.lock")):
        inc = names.parse_reader_pin_name(path.name)
        if inc is None or inc == m.incarnation or inc in pending or inc > m.incarnation:
            continue
        with unused(root, inc):
            pass  # removed on the way out if nobody holds it (a registry a late reader made)
    done.aside = aside
    return done



