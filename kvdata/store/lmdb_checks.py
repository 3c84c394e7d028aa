"""Checks of an LMDB file before LMDB itself opens it.

LMDB trusts its own files: it follows a symbolic link where it writes its lock file, maps a
truncated file whole and dies of SIGBUS past the end, and walks damaged tree pages off its map.
None of that can be turned into an exception once it happens, so a shard or tail from anywhere
outside this process is checked here first, and refused with a clear CorruptDatasetError.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from pathlib import Path

from .. import format as fmt
from ..errors import CorruptDatasetError
from ..format import names

_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_META = struct.Struct("<II16x I 92x QQ")  # magic, version, page size (free db's md_pad), last page, txnid


def check_lmdb_file(path: Path) -> None:
    """CorruptDatasetError unless `path` can be handed to LMDB: neither it nor its `-lock` file a
    symbolic link (LMDB would create or overwrite the lock file, its reader table, wherever a
    link points, outside the dataset), a regular file, and not shorter than its newest meta page
    says (LMDB maps it whole and would die of SIGBUS on the first page past the end; the metas
    are read before the size, so a writer growing the file meanwhile never makes it look short).
    FileNotFoundError if it is missing."""
    lock = path.with_name(names.lmdb_lock_name(path.name))  # LMDB opens (and writes) it, following links
    for p in (path, lock):
        if p.is_symlink():
            raise CorruptDatasetError(f"{p} is a symbolic link, not a file of the dataset; remove it and run "
                                      "`kvdata verify`")
    if not stat.S_ISREG(path.stat().st_mode):
        raise CorruptDatasetError(f"{path} is not a regular file; remove it and run `kvdata verify`")
    with open(path, "rb") as f:
        head = f.read((64 << 10) + 256)
        size = os.fstat(f.fileno()).st_size
    if len(head) < 16 + _LMDB_META.size:
        return
    psize = _LMDB_META.unpack_from(head, 16)[2]
    if psize & (psize - 1) or not 512 <= psize <= 65536:
        return  # not a page size: LMDB itself refuses the file
    best: tuple[int, int] | None = None  # (txnid, bytes needed) of the newest valid meta
    for at in (0, psize):
        if len(head) >= at + 16 + _LMDB_META.size:
            magic, _version, _ps, last_pg, txnid = _LMDB_META.unpack_from(head, at + 16)
            if magic == _LMDB_MAGIC and (best is None or txnid > best[0]):
                best = (txnid, (last_pg + 1) * psize)
    if best is not None and size < best[1]:
        raise CorruptDatasetError(f"{path} is truncated ({size} bytes, its LMDB pages need {best[1]}); "
                                  "restore it from a copy and run `kvdata verify`")


def check_tail_pages(path: Path) -> None:
    """CorruptDatasetError unless the B-tree of an existing tail can be walked from its root with
    every node inside the file (format.frames.lmdb_values). LMDB trusts its own pages: appending
    to a tail whose pages were overwritten follows node offsets past the end of the map and dies
    of SIGBUS, which no exception handler can turn into a clear error. Reads only the tree pages,
    not the values; a writer calls it once, when it opens the dataset."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        if size < 2 * 512:  # not even two pages: LMDB refuses it with an error of its own
            return
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            mv = memoryview(mm)
            try:
                ok = fmt.frames.lmdb_values(mv) is not None
            finally:
                mv.release()
    finally:
        os.close(fd)
    if not ok:
        raise CorruptDatasetError(f"{path}: the tail's LMDB pages are damaged (its tree does not fit the file); "
                                  "restore it from a copy, or move it aside and run `kvdata reindex`")
