"""LMDB shard files: the open tail that takes appends, sealing, and read handles.

A shard is a real LMDB file (subdir=False) whose keys are 8-byte big-endian slot
numbers in append order and whose values are kvdata records. Sealed shards are
immutable, so besides LMDB access we map them ourselves and read a value by its
file offset (recorded at seal time in the side-index): no B-tree walk, no
transaction, exactly the cost of an np.memmap slice.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from .. import format as fmt
from .._util.fsutil import unlink_quiet
from ..errors import CorruptDatasetError, MissingShardError
from ..format import names
from .lmdb_checks import check_lmdb_file, check_tail_pages

MAX_READERS = 1024
_PAGE = 4096


def tail_map_size(shard_size: int) -> int:
    """LMDB map size for a tail: room for a full shard plus B-tree and free-page slack."""
    size = max(2 * shard_size, shard_size + (64 << 20))
    return (size + _PAGE - 1) // _PAGE * _PAGE


class EnvRegistry:
    """One LMDB Environment per shard file per process, shared and reference-counted.

    LMDB forbids opening one file twice in a process (its POSIX locks are per
    process, so closing one handle would drop the other's locks); py-lmdb refuses
    it. Every Store, the writer, verify and reindex in a process therefore borrow
    environments from here. Tail envs are opened read-write when the file allows it
    so a writer and readers in one process can share them; readers never begin a
    write transaction.

    After fork, the child closes the environments it inherited (py-lmdb would
    otherwise refuse to reopen those files): LMDB's close only clears reader slots
    of the calling pid, and fcntl locks are not inherited, so the parent is
    untouched -- unless a transaction was live at the fork, whose abort would
    touch shared state; such an env is left alone (`busy` counts live txns).
    """

    def __init__(self) -> None:
        self._envs: dict[tuple[Any, ...], list[Any]] = {}
        self._busy: dict[int, int] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._leftovers: list[Any] = []

    def _after_fork(self) -> None:
        for env, _n in self._envs.values():
            if self._busy.get(id(env)):
                self._leftovers.append(env)
            else:
                try:
                    env.close()
                except lmdb.Error:
                    self._leftovers.append(env)
        self._envs, self._busy = {}, {}
        self._pid = os.getpid()

    def acquire(self, path: Path, *, sealed: bool, shard_size: int = 0, create: bool = False) -> lmdb.Environment:
        """The env of the file at `path`, keyed by the file (device, inode), not its name: a
        sealed shard is its former tail's file under a second name (a hard link), and LMDB
        (py-lmdb) refuses a second env on one file in a process. A file already open here under
        either name is served by the env that has it (readers only read through it)."""
        with self._lock:
            if self._pid != os.getpid():
                self._after_fork()
            key = _file_key(path)
            slot = self._envs.get(key) if key is not None else None
            if slot is not None:
                slot[1] += 1
                return slot[0]
            if not create and key is None:
                raise FileNotFoundError(errno.ENOENT, "no such shard file", str(path))
            real = os.path.realpath(path)
            if sealed:
                env = _open_sealed(real)
            elif create:
                env = _open_tail(real, shard_size, create)
            else:
                env = _open_existing_tail(real, shard_size)
            # keyed by the file now there -- or, if the name went meanwhile (a tail sealed and
            # its name removed), by the file that was there before: never by a name alone when
            # an inode is known, or a sealed name of the same file would open it a second time
            key = _file_key(path) or key or ("path", real)
            self._envs[key] = [env, 1]
            return env

    def release(self, env: lmdb.Environment) -> None:
        with self._lock:
            if self._pid != os.getpid():
                return
            for key, slot in list(self._envs.items()):
                if slot[0] is env:
                    slot[1] -= 1
                    if slot[1] <= 0:
                        del self._envs[key]
                        self._busy.pop(id(env), None)
                        env.close()
                    return

    def file_of(self, env: lmdb.Environment) -> tuple[int, int] | None:
        """(device, inode) of the file `env` has open, as the registry keyed it when it opened it
        (None if it is not in the registry, or was keyed by path)."""
        with self._lock:
            for key, slot in self._envs.items():
                if slot[0] is env:
                    return (key[1], key[2]) if key[0] == "ino" else None
        return None

    def mark_busy(self, env: lmdb.Environment, delta: int) -> None:
        """Count a transaction opened (+1) or ended (-1) on env."""
        with self._lock:
            self._busy[id(env)] = self._busy.get(id(env), 0) + delta

    @contextmanager
    def read(self, env: lmdb.Environment, buffers: bool = False) -> Iterator[Any]:
        """A read transaction that the fork logic above knows about."""
        txn = self.begin_read(env, buffers)
        try:
            yield txn
        finally:
            try:
                txn.abort()
            finally:
                self.mark_busy(env, -1)

    def begin_read(self, env: lmdb.Environment, buffers: bool = False) -> Any:
        """Count a transaction on `env` (busy) and begin it; the caller aborts it and counts it
        ended (mark_busy -1). A writer that raised the shard size grows a tail past the map a
        reader opened it with (MDB_MAP_RESIZED): the env adopts the file's size, when no other
        transaction of this process is open on it (LMDB's rule), and begins again."""
        self.mark_busy(env, 1)
        try:
            try:
                return env.begin(buffers=buffers)  # type: ignore[call-overload]
            except lmdb.MapResizedError:
                with self._lock:
                    if self._busy.get(id(env)) != 1:
                        raise
                    env.set_mapsize(0)
                return env.begin(buffers=buffers)  # type: ignore[call-overload]
        except BaseException:
            self.mark_busy(env, -1)
            raise


ENVS = EnvRegistry()


def _file_key(path: str | os.PathLike[str]) -> tuple[Any, ...] | None:
    """(device, inode) of the file at `path` (links followed), None if there is none. An open
    env holds its file open, so its inode cannot be reused while it is in the registry."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return ("ino", st.st_dev, st.st_ino)


LOCK_FILE_BYTES = 128 << 10  # > LMDB's reader table for MAX_READERS (64 bytes a slot plus its header)


def _preallocate_lock(path: str) -> None:
    """Give a new tail's LMDB lock file its blocks before LMDB maps it: LMDB makes it sparse and
    writes its reader table through the map, which a full filesystem answers with SIGBUS;
    allocated here, a full disk is an ENOSPC OSError the writer reports in one line."""
    lock = names.lmdb_lock_name(path)
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        return
    try:
        os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
    except OSError as e:
        os.close(fd)
        unlink_quiet(Path(lock))
        if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            return  # a filesystem without fallocate: LMDB makes the file as before
        raise
    os.close(fd)


def release_dead_pages(env: lmdb.Environment, path: Path) -> None:
    """Cut a tail file back to the pages its last committed transaction uses: a commit that
    failed (a full disk) leaves pages written past them, which nothing will ever read. Safe
    for readers: no snapshot uses a page past the newest meta's last page."""
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    try:  # through a descriptor opened without following links: never another file's length
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # only space is at stake
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode) and os.fstat(fd).st_size > used:
            os.ftruncate(fd, used)
    except OSError:
        pass
    finally:
        os.close(fd)


def _open_tail(path: str, shard_size: int, create: bool) -> lmdb.Environment:
    """A tail env takes part in LMDB's reader table, so the writer never reuses pages a
    reader may still be reading; same flags for every user so one env serves all."""
    map_size = tail_map_size(shard_size)
    if create:
        _preallocate_lock(path)
    try:
        return lmdb.open(path, subdir=False, map_size=map_size, max_readers=MAX_READERS, max_dbs=0, sync=True,
                         metasync=True, meminit=False, readahead=True, lock=True, create=create,
                         max_spare_txns=0)
    except lmdb.Error:
        if create or os.access(path, os.W_OK):
            raise
        return lmdb.open(path, subdir=False, readonly=True, lock=True, max_readers=MAX_READERS,
                         max_spare_txns=0, create=False)


def _open_existing_tail(path: str, shard_size: int) -> lmdb.Environment:
    """A reader's view of a tail that a writer may seal and remove at any moment.

    LMDB creates the file it is asked to open, so a reader racing a writer's seal could
    re-create an empty tail and fail on it. The reader pins the inode first; if LMDB ended up
    on another file, that file was created by this open (tail names are never reused), so it
    is removed again and the reader goes to the sealed shard instead."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such shard file", path) from None
    try:
        pinned = os.fstat(fd).st_ino
        try:
            env = _open_tail(path, shard_size, create=False)
        except lmdb.Error:
            if os.path.lexists(path):
                raise
            # sealed and removed meanwhile; LMDB may have created the lock file before finding
            # the data file gone: nobody uses a removed tail's lock file again (names are not reused)
            unlink_quiet(Path(names.lmdb_lock_name(path)))
            raise FileNotFoundError(errno.ENOENT, "the tail was sealed while it was opened", path) from None
        try:
            now = os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            return env  # sealed and removed after we opened it: the env still reads the old file
        if now == pinned:
            return env
        env.close()
        unlink_quiet(Path(path))
        unlink_quiet(Path(names.lmdb_lock_name(path)))
        raise FileNotFoundError(errno.ENOENT, "the tail was sealed while it was opened", path)
    finally:
        os.close(fd)


def _open_sealed(path: str) -> lmdb.Environment:
    """LMDB view of an immutable shard: no lock file, so it works on read-only copies."""
    return lmdb.open(path, subdir=False, readonly=True, lock=False, create=False,
                     max_spare_txns=0, map_size=max(os.path.getsize(path), _PAGE))


def open_tail_for_write(path: Path, shard_size: int, check_pages: bool = False) -> lmdb.Environment:
    """The tail's env, its map large enough for `shard_size` (which may have been raised since
    the tail was created or since a reader in this process opened it). An existing tail is
    checked first (no symlink, not truncated): LMDB would follow the one and SIGBUS on the other;
    with check_pages, its B-tree too (check_tail_pages: a writer appending; reindex, which
    recovers what it can of a damaged tail, does not ask)."""
    if os.path.lexists(path) or os.path.lexists(names.lmdb_lock_name(str(path))):
        check_lmdb_file(path)
        if check_pages:
            check_tail_pages(path)
    env = ENVS.acquire(path, sealed=False, shard_size=shard_size, create=True)
    if env.info()["map_size"] < tail_map_size(shard_size):
        env.set_mapsize(tail_map_size(shard_size))
    return env


def open_tail_for_read(path: Path, shard_size: int) -> lmdb.Environment:
    return ENVS.acquire(path, sealed=False, shard_size=shard_size)


def open_sealed_lmdb(path: Path) -> lmdb.Environment:
    return ENVS.acquire(path, sealed=True)


def truncate_tail(env: lmdb.Environment, committed: int) -> None:
    """Drop slots >= committed: what a crashed writer wrote but never committed."""
    with env.begin(write=True) as txn:
        entries = txn.stat()["entries"]
        if entries < committed:
            raise CorruptDatasetError(
                f"{env.path()}: holds {entries} records but the manifest committed {committed}; "
                "restore the file or run `kvdata reindex`"
            )
        if entries > committed:
            cur = txn.cursor()
            while cur.set_range(fmt.slot_key(committed)):
                cur.delete()


@dataclass(frozen=True)
class OpenedCopy:
    """A verified copy handed over as an open read-only descriptor (kvdatad passes its staged
    copies so; its tiers are not readable by clients). SealedShard takes ownership of `fd`
    and maps it; `where` only names it in messages."""

    fd: int
    where: str


class SealedShard:
    """A read-only memory map of one sealed shard file, shared by all reads in a process."""

    __slots__ = ("path", "mm", "u8", "mv", "_env", "_fd", "_passed")

    def __init__(self, path: Path | OpenedCopy, expected_bytes: int, hold_lock: bool = False) -> None:
        """hold_lock: keep a shared flock on the file while mapped (staged copies: the
        engine's eviction takes an exclusive one, so it never removes a shard in use).
        An OpenedCopy is mapped from its descriptor (kept open until close)."""
        self._fd: int | None = None
        self._passed = isinstance(path, OpenedCopy)
        if isinstance(path, OpenedCopy):
            self.path = Path(path.where)
            fd = path.fd
        else:
            self.path = path
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise MissingShardError(
                    f"shard {path} is missing; restore it (or re-stage it) and run `kvdata verify`"
                ) from None
        try:
            if hold_lock:
                fcntl.flock(fd, fcntl.LOCK_SH)
            size = os.fstat(fd).st_size
            if size != expected_bytes:
                raise CorruptDatasetError(
                    f"shard {path} has {size} bytes, the manifest says {expected_bytes}; restore it and run `kvdata verify`"
                )
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        if hold_lock or self._passed:
            self._fd = fd
        else:
            os.close(fd)
        self.mm = mm
        self.u8 = np.frombuffer(mm, dtype=np.uint8)
        self.mv = memoryview(mm)
        self._env: lmdb.Environment | None = None

    def lmdb_value(self, slot: int) -> bytes:
        """A copy of a value read through LMDB (when the index has no offset for it)."""
        if self._env is None:
            if self._passed and self._fd is not None:  # only a descriptor: LMDB reopens it through /proc
                try:
                    self._env = open_sealed_lmdb(Path(f"/proc/self/fd/{self._fd}"))
                except (lmdb.Error, OSError):
                    raise CorruptDatasetError(
                        f"shard {self.path}: its records' offsets are unknown and the daemon's copy can only be mapped; "
                        "run `kvdata reindex` on the dataset") from None
            else:
                self._env = open_sealed_lmdb(self.path)  # held for the process's life; shards are few
        with ENVS.read(self._env) as txn:
            v = txn.get(fmt.slot_key(slot))
        if v is None:
            raise CorruptDatasetError(f"shard {self.path}: slot {slot} is missing; run `kvdata verify`")
        return v

    def forget_env(self) -> None:
        """After fork: drop the parent's LMDB env without closing it (the registry keeps it)."""
        self._env = None

    def close(self) -> None:
        """Give back the LMDB env and the reader lock (the memory map lives on while views of it exist)."""
        if self._env is not None:
            ENVS.release(self._env)
            self._env = None
        if self._fd is not None:
            if self._passed:  # a passed descriptor may share its open file (and so the lock) with a kept dup
                _unlock(self._fd)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                if getattr(self, "_passed", False):
                    _unlock(fd)
                os.close(fd)
            except OSError:
                pass


def _unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass



def iter_lmdb_records(path: Path, tail: bool, shard_size: int = 0) -> Iterator[tuple[int, memoryview]]:
    """(slot, value) of every record through LMDB, for verify and rebuild of a tail."""
    env = open_tail_for_read(path, shard_size) if tail else open_sealed_lmdb(path)
    try:
        with ENVS.read(env, buffers=True) as txn:
            for k, v in txn.cursor():
                yield fmt.slot_of(bytes(k)), v
    finally:
        ENVS.release(env)
