"""The local homes: a dataset at a path (LocalHome), and the shard files a reader passes to
kvdatad (PassedFiles), with the checks and reads of such a passed descriptor.

Every home implements base.Home; open_home (kvdata.homes.open) picks one by URL scheme.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from .._util.digest import is_sha256
from .._util.fsutil import create_exclusive, fsync_dir, read_regular, unlink_quiet
from ..errors import RemoteError
from ..format import names
from ..format.codec import CHUNK
from .base import READ_LIMIT, Home

SHA256_XATTR = "user.kvdata.sha256"   # a local home file's recorded sha256 (see LocalHome.sha256)


class LocalHome(Home):
    writable = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = Path(path)
        super().__init__(str(self.root))

    def local_path(self, name: str) -> Path | None:
        return self.root / name

    def size(self, name: str) -> int:
        try:
            return os.path.getsize(self.root / name)
        except FileNotFoundError:
            raise RemoteError(f"{self.root / name} is missing at the home") from None

    def read_range(self, name: str, start: int, length: int) -> bytes:
        try:
            with open(self.root / name, "rb") as f:
                f.seek(start)
                return f.read() if length < 0 else f.read(length)
        except FileNotFoundError:
            raise RemoteError(f"{self.root / name} is missing at the home") from None

    def read(self, name: str, limit: int = READ_LIMIT) -> bytes:
        try:
            return read_regular(self.root / name, limit)
        except FileNotFoundError:
            raise RemoteError(f"{self.root / name} is missing at the home") from None
        except OSError as e:
            raise RemoteError(f"{self.root / name}: {e.strerror or e} (the limit is {limit} bytes of a regular file)") from None

    def sha256(self, name: str) -> str | None:
        """The file's sha256: the one recorded in its `user.kvdata.sha256` extended attribute
        while the file is provably unchanged since, else hashed from its bytes (and recorded).

        Why not the home's manifest: it states what the last *completed* push meant to
        upload, not what a file holds now -- a push interrupted after replacing a shard, or a
        file changed by hand, makes it wrong, and trusting it is the bug this replaces. Why
        not always hash: on NFS that reads the whole home on every push. The record is
        "sha256 size mtime_ns", written by the process that computed the sha256 from the
        same open file; it is trusted only if size and mtime still match and the file's
        ctime is later than that mtime (git's "racy clean" rule: a write within the same
        timestamp tick as the record would not change mtime, so such a record is re-hashed
        once). A file system without user xattrs (some NFS mounts) is simply hashed."""
        try:
            fd = os.open(self.root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            recorded = _recorded_sha256(fd, st)
            if recorded is not None:
                return recorded
            h = hashlib.sha256()
            while chunk := os.read(fd, CHUNK):
                h.update(chunk)
            after = os.fstat(fd)
            if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
                return None   # changed while being hashed: upload it again
            digest = h.hexdigest()
            _record_sha256(fd, after, digest)
            return digest
        except OSError:
            return None
        finally:
            os.close(fd)

    def put_file(self, name: str, path: Path, sha256: str | None = None) -> None:
        """Copy into a fresh temp name beside the destination (random, created O_EXCL, so a
        symlink planted at any temp name is never followed), hashing as it copies; fsync,
        record the sha256, rename over the destination, fsync the directory."""
        dest = self.root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temp(dest)
        try:
            h = hashlib.sha256()
            with open(fd, "wb", closefd=True) as out, open(path, "rb") as src:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                out.flush()
                digest = h.hexdigest()
                if sha256 is not None:
                    self.check_upload(name, path, sha256, digest)
                os.fsync(out.fileno())
                _record_sha256(out.fileno(), os.fstat(out.fileno()), digest)
            os.replace(tmp, dest)
        except BaseException:
            unlink_quiet(tmp)
            raise
        fsync_dir(dest.parent)


def _create_temp(dest: Path) -> tuple[int, Path]:
    """A new, empty file under a random hidden temp name beside `dest` (fsutil.create_exclusive)."""
    names_tried = (dest.with_name(names.temp_name(dest.name, secrets.token_hex(8))) for _ in range(16))
    return create_exclusive(names_tried, str(dest))


def _recorded_sha256(fd: int, st: os.stat_result) -> str | None:
    """The sha256 recorded on an open file if the record still describes it (see LocalHome.sha256)."""
    try:
        raw = os.getxattr(fd, SHA256_XATTR)
    except OSError:   # no record, or no user xattrs on this file system
        return None
    parts = raw.decode("ascii", "replace").split()
    if len(parts) != 3 or not is_sha256(parts[0]) or not all(p.isdigit() for p in parts[1:]):
        return None
    size, mtime_ns = int(parts[1]), int(parts[2])
    if (size, mtime_ns) != (st.st_size, st.st_mtime_ns) or st.st_ctime_ns <= mtime_ns:
        return None
    return parts[0]


def _record_sha256(fd: int, st: os.stat_result, digest: str) -> None:
    """Record `digest` as the sha256 of the open file as `st` describes it (best effort:
    without user xattrs, or on a file we may not change, the next push hashes it again)."""
    try:
        os.setxattr(fd, SHA256_XATTR, f"{digest} {st.st_size} {st.st_mtime_ns}".encode("ascii"))
    except OSError:
        pass


class PassedFiles(Home):
    """A local dataset's shard files as descriptors its reader opened and passed to kvdatad
    (docs/SECURITY.md): the daemon reads them, never the paths. Each descriptor is checked
    when it is added (a regular file, opened for reading, of the manifest's size); copies
    made from it are verified by their full sha256, as nothing here vouches for the
    manifest. Descriptors are read with pread (their file offset is shared with the client)."""

    trusted_manifest = False

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self._fds: dict[str, tuple[int, str]] = {}   # sha256 -> (fd, "mdb" | "zst")
        self._lock = threading.Lock()
        self._closed = False
        self.proven: set[str] = set()  # shards a verified copy was made from one of these descriptors

    def mark_proven(self, sha: str) -> None:
        with self._lock:
            self.proven.add(sha)

    def add(self, sha: str, fd: int, kind: str, size: int) -> None:
        """Take ownership of `fd` as the shard `sha`'s file (kind "mdb": the shard itself,
        "zst": its compressed copy of `size` bytes); RemoteError (fd closed) if it is not one."""
        try:
            check_passed_fd(fd, size, f"the descriptor passed for shard {sha[:12]}")
        except RemoteError:
            os.close(fd)
            raise
        with self._lock:
            if self._closed:
                os.close(fd)
                return
            old = self._fds.pop(sha, None)
            self._fds[sha] = (fd, kind)
        if old is not None:
            os.close(old[0])

    def __len__(self) -> int:
        with self._lock:
            return len(self._fds)

    def has(self, sha: str) -> bool:
        with self._lock:
            return sha in self._fds

    def drop_oldest(self, keep: int) -> None:
        """Close descriptors beyond the `keep` most recently added."""
        with self._lock:
            extra = list(self._fds)[: max(0, len(self._fds) - keep)]
            gone = [self._fds.pop(sha) for sha in extra]
        for fd, _kind in gone:
            os.close(fd)

    def can_stage(self, sha: str) -> bool:
        return self.has(sha)

    def size(self, name: str) -> int:
        raise RemoteError(f"{self.where(name)}: kvdatad reads this dataset only from files its reader passes")

    def read_range(self, name: str, start: int, length: int) -> bytes:
        raise RemoteError(f"{self.where(name)}: kvdatad reads this dataset only from files its reader passes")

    def open_passed(self, sha: str) -> tuple[int, str] | None:
        """(a dup of the descriptor, its kind), owned by the caller; None if none was passed."""
        with self._lock:
            got = self._fds.get(sha)
            return (os.dup(got[0]), got[1]) if got is not None else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
        for fd, _kind in fds:
            os.close(fd)


def check_passed_fd(fd: int, size: int | None, what: str) -> os.stat_result:
    """A descriptor a client passed must be a regular file opened for reading (of `size`
    bytes if given); the one-line error says only that, nothing about the file."""
    try:
        st = os.fstat(fd)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        raise RemoteError(f"{what} is not an open file") from None
    path_only = getattr(os, "O_PATH", 0)
    if not stat.S_ISREG(st.st_mode) or (path_only and flags & path_only) or flags & os.O_ACCMODE == os.O_WRONLY:
        raise RemoteError(f"{what} is not a regular file opened for reading")
    if size is not None and st.st_size != size:
        raise RemoteError(f"{what} does not have the size the manifest gives")
    return st


def pread_chunks(fd: int, size: int, chunk: int) -> Iterator[bytes]:
    """`size` bytes of a descriptor from offset 0, without touching its shared file offset."""
    off = 0
    while off < size:
        data = os.pread(fd, min(chunk, size - off), off)
        if not data:
            raise RemoteError(f"a passed file ended at {off} of {size} bytes")
        off += len(data)
        yield data


def read_fd(fd: int, limit: int, what: str) -> bytes:
    """A passed regular file's bytes (at most `limit`), or RemoteError."""
    st = check_passed_fd(fd, None, what)
    if st.st_size > limit:
        raise RemoteError(f"{what} is larger than the {limit}-byte limit")
    try:
        return b"".join(pread_chunks(fd, st.st_size, 1 << 20))
    except OSError as e:
        raise RemoteError(f"{what} cannot be read ({errno.errorcode.get(e.errno or 0, e)})") from None
