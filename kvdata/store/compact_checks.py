"""The checks a compaction makes before it writes anything (kvdata.store.compact): the dataset's
directories, the lock file and the reader registry are what kvdata made, the writer lock can be
taken, and every file the committed generation names is there, a regular file of its size.

Its own module because these are the refusals (one-line errors, the dataset untouched), apart
from the work that follows them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import CorruptDatasetError, MissingShardError, ReadOnlyError
from ..format import names
from .generation import Generation, load_generation, read_manifest
from .lmdb_checks import check_lmdb_file
from .lock import WriterLock


def check_layout(root: Path, writing: bool) -> None:
    """The dataset's directories are real directories (that this user may write, if `writing`),
    and the lock file and the reader registry are not planted links."""
    for sub in (names.SHARDS_DIR, names.INDEX_DIR):
        try:
            st = os.lstat(root / sub)
        except FileNotFoundError:
            raise CorruptDatasetError(f"{root / sub} is missing; run `kvdata reindex {root}`") from None
        if not stat.S_ISDIR(st.st_mode):
            raise CorruptDatasetError(f"{root / sub} is not a directory of the dataset (a symbolic link?); put the "
                                      f"dataset's files there and run `kvdata verify {root}`; nothing was changed")
    for d in (root, root / names.SHARDS_DIR, root / names.INDEX_DIR) if writing else ():
        if not os.access(d, os.W_OK):
            raise ReadOnlyError(f"{d} is not writable by this user; compact the dataset as its owner, or a "
                                "writable copy of it; nothing was changed")
    m = read_manifest(root)
    for name in (names.LOCK, names.reader_pin_name(m.incarnation)):
        p = root / name
        if os.path.lexists(p) and not stat.S_ISREG(os.lstat(p).st_mode):
            raise CorruptDatasetError(f"{p} is not a regular file (a symbolic link?) and kvdata did not make it; "
                                      "remove it, then compact again; nothing was changed")


def writer_lock(root: Path) -> WriterLock:
    try:
        return WriterLock(root)
    except OSError as e:
        raise ReadOnlyError(f"{root / names.LOCK}: cannot take the writer lock ({e.strerror or e}); compact the "
                            "dataset where this user may write it; nothing was changed") from None


def checked_generation(root: Path) -> Generation:
    """The committed generation, with every file it names checked as a writer's recovery
    checks them (and more: regular files, of their recorded size), before anything is touched."""
    gen = load_generation(root)
    m = gen.manifest
    for e in m.shards:
        for name, size in [(e.name, e.bytes)] + ([(e.zst.name, e.zst.bytes)] if e.zst else []):
            p = gen.shards_dir / name
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                raise MissingShardError(f"shard {p} is missing; restore it, then compact; nothing was changed") from None
            if not stat.S_ISREG(st.st_mode):
                raise CorruptDatasetError(f"{p} is not a regular file (a symbolic link?); restore the shard there "
                                          f"and run `kvdata verify {root}`; nothing was changed")
            if st.st_size != size:
                raise CorruptDatasetError(f"{p} has {st.st_size} bytes, the manifest says {size}; restore it and run "
                                          f"`kvdata verify {root}`; nothing was changed")
    if m.tail.records:
        try:
            check_lmdb_file(gen.tail_path)
        except FileNotFoundError:
            raise MissingShardError(f"tail shard {gen.tail_path} is missing; restore it or run "
                                    f"`kvdata reindex {root}`; nothing was changed") from None
    return gen
