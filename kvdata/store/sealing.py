"""Sealing a full tail into an immutable shard in place, and the shard's sha256 and cold copy.

A sealed shard is the tail's own LMDB file under a second name (a hard link, no copy), so
sealing costs a sync, a link and the scan of its record rows (shard_rows); where the
filesystem refuses hard links the tail is copied compacted instead. The sha256 is computed
on a thread while the next tail fills (Hasher); a zstd cold copy only when asked.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import lmdb
import numpy as np

from .._util.fsutil import fsync_dir, fsync_file, unlink_quiet
from ..format import ShardEntry, ZstCopy, names
from ..format.codec import compress_file, mapped_file_sha256, zst_copy
from .shard_rows import scan, scan_env

NO_LINK_ERRNOS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS)


class Hasher:
    """The (size, sha256) of a sealed shard file, computed on a daemon thread (hashlib and file
    reads release the GIL), so the writer goes on appending to the next tail meanwhile; the
    commit waits for it (`result`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._out: tuple[int, str] | None = None
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvdata-seal-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._out = mapped_file_sha256(self.path)
        except BaseException as e:  # handed to the committer
            self._err = e

    def result(self) -> tuple[int, str]:
        self._thread.join()
        if self._err is not None:
            raise self._err
        assert self._out is not None
        return self._out

    def wait(self) -> None:
        self._thread.join()


def seal(tail_env: lmdb.Environment, shards_dir: Path, shard_id: int, compress: bool = False,
         incarnation: int = 0) -> tuple[ShardEntry, np.ndarray, Hasher]:
    """Seal the tail in place: return (manifest entry, record rows, hasher) of shard `shard_id`.

    The tail is append-only and already a complete LMDB file, so it is not copied: once its
    last transaction is synced, the file gets its sealed name as a second hard link (fsync'ed
    with the directory), and its record offsets (from the tail env's own map) and sha256 are
    read from it. The writer never writes to that file again; recovery removes the link
    before it ever cuts a tail back (writer._tidy), and the commit removes the tail's name.
    Where the filesystem refuses hard links (NO_LINK_ERRNOS) the tail is copied compacted to
    `NNNNNN.mdb.tmp` instead and renamed once complete, as before issue 12.
    No zstd copy is made unless `compress` (cold copies are made when needed: `kvdata push`).
    The entry's sha256 is left empty (its bytes are the file's size): the file is hashed on a
    thread (the Hasher returned), started as soon as the file has its name -- before the record
    rows are read, so the two overlap; the caller waits for it before any manifest names the shard.
    """
    dest = shards_dir / names.shard_name(shard_id, incarnation)
    tail = shards_dir / names.tail_name(shard_id, incarnation)
    tmp = dest.with_name(dest.name + ".tmp")
    ztmp = dest.with_name(names.zst_name(dest.name) + ".tmp")
    tail_env.sync(True)
    fsync_file(tail)
    try:
        os.link(tail, dest, follow_symlinks=False)  # FileExistsError if anything has the name: never replaced
        src = dest
    except OSError as e:
        if e.errno not in NO_LINK_ERRNOS:
            raise
        src = tmp
    hasher: Hasher | None = None
    try:
        if src == dest:
            fsync_dir(shards_dir)
            hasher = Hasher(dest)
            records = scan_env(tail_env, dest)
        else:
            unlink_quiet(tmp)
            tail_env.copy(str(tmp), compact=True)
            fsync_file(tmp)
            records = scan(tmp)
        size = os.stat(src).st_size
        zst = write_cold_copy(src, dest, records) if compress else None
        if src == tmp:
            os.replace(tmp, dest)
            src = dest
            fsync_dir(shards_dir)
        elif compress:
            fsync_dir(shards_dir)
        if hasher is None:
            hasher = Hasher(dest)
    except BaseException:
        if src == dest:  # our link (or our copy, renamed): nothing else ever had the name
            unlink_quiet(dest)
        unlink_quiet(tmp)
        unlink_quiet(ztmp)
        if hasher is not None:
            hasher.wait()  # its result is never read; nothing of ours reads the file after this
        raise
    return ShardEntry(shard_id, dest.name, int(len(records)), size, "", zst), records, hasher


def write_cold_copy(src: Path, dest: Path, records: np.ndarray) -> ZstCopy:
    """The framed zstd copy of the shard file `src` as `<dest>.zst` (written to a temp name,
    never through a link planted there, fsync'ed, renamed); its manifest entry. The caller
    fsyncs the directory."""
    final = dest.with_name(names.zst_name(dest.name))
    ztmp = final.with_name(final.name + ".tmp")
    fd = os.open(ztmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            framed = compress_file(src, f, records=records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(ztmp, final)
    except BaseException:
        unlink_quiet(ztmp)
        raise
    return zst_copy(final.name, framed)


def is_tail_link(shards_dir: Path, name: str, tail_name: str) -> bool:
    """Whether `name` in shards_dir is a sealed shard's name given to the file of the tail
    `tail_name` (same id and incarnation, same file): a seal that was not committed. Removing
    that name removes no bytes (the tail keeps them)."""
    shard, tail = names.parse_shard_name(name), names.parse_tail_name(tail_name)
    if shard is None or shard != tail:
        return False
    try:
        a = os.stat(shards_dir / name, follow_symlinks=False)
        b = os.stat(shards_dir / tail_name, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(a.st_mode) and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
