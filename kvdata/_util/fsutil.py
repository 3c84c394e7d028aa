"""Durable file operations: fsync'ed writes and atomic renames."""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path

from ..errors import KVDataError


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_beside(path: Path) -> Path:
    """The temp file a writer of `path` fills before renaming it into place: one per process
    AND thread, so two threads writing the same file (kvdatad mirroring one index for two
    readers that opened it together) never write, truncate or rename each other's temp."""
    return path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_native_id()}")


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` by `data` so a crash leaves the old or the new content, never a mix. The
    temp file is never written through a symbolic link planted at its name (ELOOP)."""
    tmp = temp_beside(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def write_at(path: Path, offset: int, data: bytes | memoryview) -> None:
    """Write `data` at `offset` of `path` (created if missing) and fsync it. A symbolic link at
    `path` is refused (OSError ELOOP), never written through."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        mv = memoryview(data).cast("B")
        done = 0
        while done < mv.nbytes:
            done += os.pwrite(fd, mv[done:], offset + done)
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """Bytes of a regular file of at most `limit` bytes: a FIFO, device or /dev/zero symlink
    in a dataset must not hang or exhaust a reader (or the daemon)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(errno.EINVAL, "not a regular file", str(path))
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def is_regular(path: str | os.PathLike[str]) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def create_exclusive(candidates: Iterable[Path], what: str) -> tuple[int, Path]:
    """A new, empty file under the first candidate name that does not exist, opened for
    writing: O_CREAT|O_EXCL|O_NOFOLLOW (never an existing file, never through a symlink
    planted there) and mode 0666 less the umask, like any new file. Callers pass random temp
    names (format.names.temp_name), so a name taken by anyone else is skipped, never used."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for tmp in candidates:
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise KVDataError(f"cannot create a temp file beside {what}: every name tried exists")


def tree_bytes(root: str | os.PathLike[str], skip: frozenset[str] = frozenset()) -> int:
    """Bytes of the regular files under `root` (apparent sizes, each file once however many
    names it has; links are not followed; top-level names in `skip` left out)."""
    seen: dict[tuple[int, int], int] = {}
    stack = [(os.fspath(root), True)]
    while stack:
        path, top = stack.pop()
        try:
            entries = list(os.scandir(path))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if top and e.name in skip:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append((e.path, False))
            elif stat.S_ISREG(st.st_mode):
                seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())
