"""The single-writer lock of a dataset directory (an flock on `.lock` holding the owner's pid)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..errors import WriterLockedError
from ..format import names


class WriterLock:
    """Held while a writer (or reindex) owns the dataset; released by `release()` or at exit."""

    def __init__(self, root: Path) -> None:
        fd = os.open(root / names.LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise WriterLockedError(
                f"{root} is open for writing by another process (pid {pid}); wait for it to finish, one writer at a time"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
