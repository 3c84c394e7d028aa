"""The single-writer lock of a dataset directory.

An flock on `.lock` excludes a second writer where flock works. Where it does not
(some NFS setups), the file's content does: the owner writes `host pid token`, a
new writer refuses a lock whose recorded owner may still be alive, and the owner
re-reads the token before every commit, so two writers can never both commit.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import socket
from pathlib import Path

from ..errors import WriterLockedError
from ..format import names

MAX_LOCK_BYTES = 512


def _pid_alive(pid: int) -> bool:
    """Whether a process of this pid runs on this host (a zombie -- killed, not yet reaped -- does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class WriterLock:
    """Held while a writer (or reindex) owns the dataset; released by `release()` or at exit."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = socket.gethostname()
        self.token = secrets.token_hex(8)
        fd = os.open(root / names.LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = self._owner(fd)
            finally:
                os.close(fd)
            raise WriterLockedError(
                f"{root} is open for writing by another process (pid {owner[1]}); wait for it to finish, "
                "one writer at a time"
            ) from None
        try:
            host, pid, token = self._owner(fd)
            if token and (host != self.host or (pid.isdigit() and _pid_alive(int(pid)) and int(pid) != os.getpid())):
                where = f"pid {pid} on {host}" if host != self.host else f"pid {pid}"
                raise WriterLockedError(
                    f"{root} is open for writing by {where}, and this filesystem's locks did not stop a second "
                    f"writer (NFS?); wait for it to finish, or if that writer is gone delete {root / names.LOCK}"
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{self.host} {os.getpid()} {self.token}".encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    @staticmethod
    def _owner(fd: int) -> tuple[str, str, str]:
        """(host, pid, token) recorded in the lock file; an old-style lock holds only a pid."""
        text = os.pread(fd, MAX_LOCK_BYTES, 0).decode(errors="replace").split()
        if len(text) == 3:
            return text[0], text[1], text[2]
        return socket.gethostname(), (text[0] if text else "?"), ""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def still_ours(self) -> bool:
        """Whether the lock file still names this writer (another writer on a filesystem where
        flock does not exclude would have replaced it)."""
        try:
            fd = os.open(self.root / names.LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            return e.errno not in (errno.ENOENT, errno.ELOOP)
        try:
            return self._owner(fd)[2] == self.token
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)  # an empty lock file: nobody's
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None
