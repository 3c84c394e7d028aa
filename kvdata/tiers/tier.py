"""Tiers: cache directories with a byte budget, holding verified copies of sealed shards.

A copy is named by its shard's sha256 (content addressing): every job reading the same
shard shares one file, and a dataset rewritten at home can never be served a stale copy.
Readers hold a shared flock on the copies they map, so eviction (which needs an exclusive
one) never takes a shard being read; on Linux an unlinked file also stays readable through
an existing map, so eviction never fails a read. A tier whose directory vanishes or whose
writes fail reports why (`problem`) and is skipped for a while. The staging engine that
fills tiers is kvdata.tiers.staging.

**The budget holds across processes.** Every byte that enters a tier is reserved first,
under the tier's budget lock (`locks/budget-<uid>.lock`, an exclusive flock held for a
moment): count the copies and the temp files of copies in flight, evict to fit, then
create the temp file at its full size (`reserve`). So the copies plus the temp files of
every process of this uid never exceed the budget, however many stage at once. A temp
file is flocked by its stager from its creation (under the budget lock) until it has its
real name, so a temp nobody holds is provably abandoned -- its stager was killed -- and
the next reservation removes it (`reclaim_abandoned`); until then it counts as used.

**Whose copies are served** in a tier shared by several users: only those nobody but this uid
(or root) can have put under their name (the rules, and why: kvdata.tiers.tier_trust). Claim
files -- who reads what here, and how -- are kvdata.tiers.claim_files (Tier inherits them).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import signal
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .._util.fsutil import unlink_quiet
from ..config import TierConfig
from ..format import names
from .claim_files import ClaimFiles
from .tier_trust import directory_problem, ours

PIN_SECONDS = 5.0
METADATA_DIR = "datasets"  # kvdata.sync.mirror.cache_root puts remote datasets' indexes here
METADATA_TTL = 2.0
TRUST_RECHECK = 30.0  # seconds a directory's trust verdict is kept (only its owner, us or root, can change it)


class Reservation:
    """Room for one incoming copy: its temp file, created at full size and flocked under the
    tier's budget lock. `file` writes it; closing it releases the lock (rename first)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.file: BinaryIO = os.fdopen(fd, "wb")

    def discard(self) -> None:
        try:
            unlink_quiet(self.path)
        finally:
            self.file.close()


class Tier(ClaimFiles):
    """One cache directory with a byte budget: <root>/shards/<sha256>.mdb."""

    def __init__(self, cfg: TierConfig) -> None:
        self.name, self.root, self.budget = cfg.name, Path(cfg.path), int(cfg.budget)
        self.dir = self.root / "shards"
        super().__init__(self.root / "locks")
        self.problem: str | None = None   # why the tier is unusable, for status; None when healthy
        self._problem_until = 0.0
        self._untrusted: str | None = None
        self._shared = False
        self._trust_until = 0.0
        # kvdatad: a copy any process still has open or mapped (a descriptor it passed and a
        # client kept, a map whose reader lock was dropped) is not evicted either; unlinked,
        # its bytes would stay in the tier, uncounted, until the last map goes (_lease)
        self.probe_open = False
        self._metadata: tuple[float, int] = (0.0, 0)

    def metadata_bytes(self) -> int:
        """Bytes of the remote datasets' verified manifests and indexes kept under this tier
        (kvdata.sync.mirror.cache_root: the last tier's `datasets/`): they take the tier's disk
        like copies do, so the budget counts them; rescanned at most every METADATA_TTL seconds."""
        now = time.monotonic()
        until, size = self._metadata
        if now < until:
            return size
        size = 0
        for dirpath, _dirs, files in os.walk(self.root / METADATA_DIR):
            for f in files:
                try:
                    size += os.lstat(os.path.join(dirpath, f)).st_size
                except OSError:
                    continue
        self._metadata = (now + METADATA_TTL, size)
        return size

    def room(self) -> int:
        """The budget less the datasets' metadata kept here: what copies and temp files may take."""
        return max(0, self.budget - self.metadata_bytes())

    def ensure(self) -> None:
        """Create the tier's directories (at start only: a directory that vanishes later is
        reported, not silently recreated on whatever filesystem lies underneath). Never
        writable by others, whatever the umask."""
        missing = []
        p = self.root
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            d.mkdir(mode=0o755, exist_ok=True)
        self.dir.mkdir(mode=0o755, exist_ok=True)
        self.locks.mkdir(mode=0o755, exist_ok=True)
        self._trust_until = 0.0

    def healthy(self) -> bool:
        if not self.dir.is_dir():
            self.problem = "directory missing"
            return False
        why = self.untrusted()
        if why is not None:
            self.problem = why
            return False
        if self.problem and time.monotonic() < self._problem_until:
            return False
        self.problem = None
        return True

    def fail(self, why: str, seconds: float = 30.0) -> None:
        self.problem = why
        self._problem_until = time.monotonic() + seconds

    def untrusted(self) -> str | None:
        """Why names in this tier cannot be trusted (kvdata.tiers.tier_trust), or None; a missing
        directory is not judged (nothing in it is served)."""
        now = time.monotonic()
        if now < self._trust_until:
            return self._untrusted
        why, shared = directory_problem(self.dir, self.locks)
        if why is not None or self.dir.is_dir():
            self._untrusted, self._shared, self._trust_until = why, shared, now + TRUST_RECHECK
        return why

    def path(self, sha: str) -> Path:
        return self.dir / names.staged_name(sha)

    def has(self, sha: str) -> bool:
        """A copy under this name that this uid staged (a symlink, or a file planted by
        another user, is never served, counted or evicted; see kvdata.tiers.tier_trust)."""
        try:
            st = os.lstat(self.dir / names.staged_name(sha))
        except OSError:
            return False
        return ours(st) and self.untrusted() is None

    def occupied(self, sha: str) -> bool:
        """Another user's file holds this name and we may not replace it (a sticky shared
        directory that is not ours): the copy cannot be staged here."""
        try:
            st = os.lstat(self.path(sha))
            dst = os.stat(self.dir)
        except OSError:
            return False
        me = os.geteuid()
        return (not ours(st) and st.st_uid != me and me != 0 and dst.st_uid != me
                and bool(dst.st_mode & stat.S_ISVTX))

    def resident(self) -> dict[str, int]:
        """sha256 -> size of the copies this uid may serve."""
        out: dict[str, int] = {}
        if self.untrusted() is not None:
            return out
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    sha = names.parse_staged_name(e.name)
                    if sha is not None:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if ours(st):
                            out[sha] = st.st_size
        except FileNotFoundError:
            pass
        return out

    def temps(self) -> dict[str, int]:
        """name -> size of this uid's temp files: copies in flight (each at its full size
        from the start) and the leftovers of stagers that died."""
        out: dict[str, int] = {}
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    if _is_temp(e.name):
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                            out[e.name] = st.st_size
        except FileNotFoundError:
            pass
        return out

    def used(self) -> int:
        """Bytes this uid holds in the tier: copies and temp files (in flight or abandoned)."""
        return sum(self.resident().values()) + sum(self.temps().values())

    def reclaim_abandoned(self) -> int:
        """Remove this uid's temp files that no stager holds (it died mid-copy); a live
        stager's temp is flocked, so it is never taken. Call under budget_lock: stagers
        create and lock their temps under it, so no temp is seen before its lock."""
        removed = 0
        for name in self.temps():
            p = self.dir / name
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its stager is alive
                st, now = os.fstat(fd), os.lstat(p)
                if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                    unlink_quiet(p)
                    removed += 1
            except OSError:
                continue
            finally:
                os.close(fd)
        return removed

    def clean_partials(self) -> int:
        """Remove the temp files of stagers that died (at engine start)."""
        if not self.dir.is_dir() or self.untrusted() is not None:
            return 0
        with self.budget_lock():
            return self.reclaim_abandoned()

    def reserve(self, sha: str, size: int) -> Reservation:
        """Room for `size` incoming bytes: a new temp file at that size, flocked until its
        copy is renamed. Call under budget_lock, after making room."""
        tmp = self.dir / names.temp_name(sha, f"{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new inode: nobody else can hold it
            if self._shared:  # others may list a shared tier: they need not read our data either
                os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            _allocate(fd, size)
            return Reservation(tmp, fd)
        except BaseException:
            os.close(fd)
            unlink_quiet(tmp)
            raise

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
        return self.evict_one(sha, grace) == "gone"

    def evict_one(self, sha: str, grace: float = 0.0) -> str:
        """try_evict, saying why not: "gone", "held" (a reader maps it) or "recent" (grace)."""
        p = self.path(sha)
        if not self.has(sha):
            return "gone"
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return "gone"
        if grace and time.time() - os.fstat(fd).st_mtime < grace:
            os.close(fd)
            return "recent"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return "held"
        if self.probe_open and _lease(fd) == "busy":
            os.close(fd)
            return "held"
        try:
            unlink_quiet(p)
        finally:
            os.close(fd)  # (gives the lease back)
        return "gone"

    @contextmanager
    def budget_lock(self) -> Iterator[None]:
        """Cross-process, this uid: reservations (count, evict, create the temp) one at a time."""
        with self._lock_file(f"budget-{os.geteuid()}.lock"):
            yield

    @contextmanager
    def staging_lock(self, sha: str) -> Iterator[None]:
        """Cross-process, this uid: one stager per shard per tier; others wait and then find it staged."""
        with self._lock_file(f"{sha}-{os.geteuid()}.lock"):
            yield

    @contextmanager
    def _lock_file(self, name: str) -> Iterator[None]:
        """An exclusive flock on a lock file of our own (per uid: nobody else can hold it)."""
        self.locks.mkdir(mode=0o755, exist_ok=True)
        fd = os.open(self.locks / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(errno.EACCES, f"{self.locks / name} is not a lock file of uid {os.geteuid()}")
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _lease(fd: int) -> str | None:
    """Take a write lease on a copy we are about to unlink: the kernel grants it only when no
    other open file (or memory map) of it exists anywhere. "busy" when one does, "leased", or
    None where leases are not available (another filesystem, a handler on the signal a lease
    break would send). The break signal is SIGURG (ignored by default), never SIGIO (fatal);
    only kvdatad uses this: a process that forks could hand its children the leased descriptor."""
    if signal.getsignal(signal.SIGURG) not in (signal.SIG_DFL, signal.SIG_IGN):
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as e:
        return "busy" if e.errno in (errno.EAGAIN, errno.EBUSY) else None
    return "leased"


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


TIER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.ENOENT, errno.EIO, errno.EPERM}


def _allocate(fd: int, size: int) -> None:
    """Allocate the reserved bytes now (posix_fallocate), so that a full disk refuses the
    reservation instead of failing copies midway: a sparse ftruncate alone reserves nothing on
    tmpfs or ext4, and two copies racing for the room of one could then both fail halfway.
    A filesystem that cannot allocate ahead (some NFS) keeps the sparse file."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
