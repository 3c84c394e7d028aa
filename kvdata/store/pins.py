"""The reader registry: which incarnations' shard files some reader may still open.

A reader of a generation maps its shard files lazily, by name, long after it read the
manifest. Commits never remove a file a reader of the same incarnation may open (a sealed
tail's records stay in its sealed shard), but compaction (and a "w" rewrite) gives the dataset
a new incarnation (new file names) and its old files must then go -- only once no reader uses
them (store.retire).

So every reader of a local dataset holds a shared flock on `readers-iIIIIIIII.lock` (the
registry of its generation's incarnation, beside the manifest) from open until it closes or
moves to another incarnation. Whoever removes an old incarnation's files (compaction, or any
later commit or recovery, all under the writer lock) first takes an exclusive flock on that
file without waiting: if a reader holds it the files stay ("kept for readers"); if not, they
are removed under the exclusive lock, then the registry file itself.

The race a reader could lose -- it reads the manifest, a compaction commits and removes the
old files, then the reader takes its pin -- is closed by checking the manifest again after
pinning: if it moved on, the reader loads the new generation instead (`generation.load_pinned`).

Per process: the pin is one open file description, taken once at open (and at a switch to
another incarnation), never per read. A forked child (a DataLoader worker) inherits the
descriptor and with it the lock: flock belongs to the open file description, so the
generation stays pinned while any process that may read it lives. Nobody ever unlocks
explicitly (LOCK_UN would release the lock for every process sharing it); a pin is
released by closing its descriptor, and the lock goes when the last copy is closed.

Where a reader cannot pin -- a read-only dataset whose registry file was never created, a
filesystem without flock, a registry file that is not a regular file -- it reads unpinned:
a compaction may then remove files it has not opened yet (it gets MissingShardError and
opens the dataset again). On NFS, flock is emulated with byte-range locks where the mount
allows (a pin is seen by other clients); with `local_lock=flock` it is seen on this host only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from ..format import names

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # never through a link, never hang on a FIFO
PIN_MODE = 0o644  # any uid that reads the dataset may take a shared lock on it


class ReaderPin:
    """A shared flock on one incarnation's registry file, held until `close()`."""

    __slots__ = ("incarnation", "_fd")

    def __init__(self, fd: int, incarnation: int) -> None:
        self._fd: int | None = fd
        self.incarnation = incarnation

    @property
    def held(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        """Close this process's descriptor (the lock goes with the last copy: see the module docstring)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close()


def _open_regular(path: Path, create: bool) -> int | None:
    """A descriptor of the regular file at `path` (created if asked: readable by every uid
    whatever the umask, for readers running as other users), or None."""
    try:
        if create:
            try:
                fd = os.open(path, _OPEN | os.O_CREAT | os.O_EXCL, PIN_MODE)
                os.fchmod(fd, PIN_MODE)
                return fd
            except FileExistsError:
                pass
        fd = os.open(path, _OPEN)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def pin(root: Path, incarnation: int) -> ReaderPin | None:
    """A shared lock on the registry of `incarnation`, or None where this reader cannot pin
    (see the module docstring) or the incarnation is being removed right now (its remover
    holds the exclusive lock: the manifest has moved on, and the caller loads it again)."""
    path = root / names.reader_pin_name(incarnation)
    fd = _open_regular(path, create=False)
    if fd is None and not os.path.lexists(path):
        fd = _open_regular(path, create=True)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # EWOULDBLOCK: being removed; ENOLCK: no locks on this filesystem
        os.close(fd)
        return None
    return ReaderPin(fd, incarnation)


def create_registry(root: Path, incarnation: int) -> Path:
    """Make the registry file of a new incarnation before a manifest names it, so readers that
    cannot create files in the dataset (another uid, read-only permissions) can still pin it.
    Refuses (OSError) anything already at that name: a new incarnation has no registry yet."""
    path = root / names.reader_pin_name(incarnation)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PIN_MODE)
    try:
        os.fchmod(fd, PIN_MODE)  # readable by every reader whatever the umask
    finally:
        os.close(fd)
    return path


@contextlib.contextmanager
def unused(root: Path, incarnation: int) -> Iterator[str | None]:
    """Whether the files of `incarnation` may be removed now: yields None while holding the
    registry's exclusive lock (no reader holds it; the caller removes the files, and the
    registry file is removed on the way out), else the reason they must stay. The caller
    holds the writer lock."""
    path = root / names.reader_pin_name(incarnation)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        yield None  # no registry: no reader pinned it (a reader creating it now re-checks the manifest)
        return
    if not stat.S_ISREG(st.st_mode):
        yield f"{path.name} is not a regular file (remove it)"
        return
    fd = _open_regular(path, create=False)
    if fd is None:
        yield f"{path.name} cannot be opened"
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            yield "a reader holds it" if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else f"no lock ({e.strerror})"
            return
        yield None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # under the exclusive lock: a reader that opened it re-checks the manifest
    finally:
        os.close(fd)
