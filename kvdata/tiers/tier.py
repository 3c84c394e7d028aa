"""Tiers: cache directories with a byte budget, holding verified copies of sealed shards.

A copy is named by its shard's sha256 (content addressing): every job and user reading
the same shard shares one file, and a dataset rewritten at home can never be served a
stale copy. Readers hold a shared flock on the copies they map, so eviction (which needs
an exclusive one) never takes a shard being read; on Linux an unlinked file also stays
readable through an existing map, so eviction never fails a read. A tier whose directory
vanishes or whose writes fail reports why (`problem`) and is skipped for a while.
The staging engine that fills tiers is kvdata.engine.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .._util.fsutil import unlink_quiet
from ..config import TierConfig
from ..format import names

PIN_SECONDS = 5.0
EVICT_GRACE = 2.0


class Tier:
    """One cache directory with a byte budget: <root>/shards/<sha256>.mdb."""

    def __init__(self, cfg: TierConfig) -> None:
        self.name, self.root, self.budget = cfg.name, Path(cfg.path), int(cfg.budget)
        self.dir = self.root / "shards"
        self.locks = self.root / "locks"
        self.problem: str | None = None   # why the tier is unusable, for status; None when healthy
        self._problem_until = 0.0

    def ensure(self) -> None:
        """Create the tier's directories (at start only: a directory that vanishes later is
        reported, not silently recreated on whatever filesystem lies underneath)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)

    def healthy(self) -> bool:
        if not self.dir.is_dir():
            self.problem = "directory missing"
            return False
        if self.problem and time.monotonic() < self._problem_until:
            return False
        self.problem = None
        return True

    def fail(self, why: str, seconds: float = 30.0) -> None:
        self.problem = why
        self._problem_until = time.monotonic() + seconds

    def path(self, sha: str) -> Path:
        return self.dir / names.staged_name(sha)

    def has(self, sha: str) -> bool:
        """A copy under this name that this uid staged: a regular file it owns (a symlink
        or a file planted by another user is never served, counted or evicted)."""
        try:
            return _ours(os.lstat(self.dir / names.staged_name(sha)))
        except OSError:
            return False

    def resident(self) -> dict[str, int]:
        out: dict[str, int] = {}
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    sha = names.parse_staged_name(e.name)
                    if sha is not None:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if _ours(st):
                            out[sha] = st.st_size
        except FileNotFoundError:
            pass
        return out

    def used(self) -> int:
        return sum(self.resident().values())

    def clean_partials(self) -> int:
        """Remove temp files of stagers that died (their pid no longer runs)."""
        removed = 0
        try:
            listing = os.listdir(self.dir)
        except FileNotFoundError:
            return 0
        for name in listing:
            if name.startswith(".") and name.endswith(".tmp"):
                try:
                    pid = int(name.split(".")[2])
                except (IndexError, ValueError):
                    pid = -1
                if pid == os.getpid() or not _pid_alive(pid):
                    unlink_quiet(self.dir / name)
                    removed += 1
        return removed

    def held(self, shas: Iterator[str] | list[str]) -> set[str]:
        """Which of these copies a reader holds (probing with a non-blocking exclusive flock)."""
        out = set()
        for sha in shas:
            try:
                fd = os.open(self.path(sha), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                out.add(sha)
            finally:
                os.close(fd)
        return out

    def try_evict(self, sha: str, grace: float = 0.0) -> bool:
        """Delete a copy unless a reader holds it (shared flock) or it was staged less than
        `grace` seconds ago (a reader in another process may be about to map it); True if gone."""
        p = self.path(sha)
        if not self.has(sha):
            return True
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return True
        if grace and time.time() - os.fstat(fd).st_mtime < grace:
            os.close(fd)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            unlink_quiet(p)
        finally:
            os.close(fd)
        return True

    @contextmanager
    def staging_lock(self, sha: str) -> Iterator[None]:
        """Cross-process: one stager per shard per tier; others wait and then find it staged."""
        self.locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.locks / f"{sha}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


TIER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.ENOENT, errno.EIO, errno.EPERM}
