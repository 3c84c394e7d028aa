"""This uid's claim files in a tier's locks directory (`locks/claims-<uid>/`): small files a
process holds a shared flock on for as long as others should see them. kvdata.tiers.claims (who
reads which dataset how) and kvdata.tiers.orders (announced orders) are built on them; Tier
inherits these methods (ClaimFiles), kept here apart from the tier's budget and copies.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from .._util.fsutil import unlink_quiet
from .tier_trust import others_may_write


class ClaimFiles:
    """Who reads what in a tier, and how: the claim files in a tier's `locks` directory (Tier
    inherits them)."""

    def __init__(self, locks: Path) -> None:
        self.locks = locks

    def _claims_dir(self, create: bool) -> Path:
        """`locks/claims-<uid>`: this uid's claim files (a directory of their own: the locks
        directory holds a staging lock per shard ever staged, too many to list twice a second)."""
        d = self.locks / f"claims-{os.geteuid()}"
        if create:
            self.locks.mkdir(mode=0o755, exist_ok=True)
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                pass
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or others_may_write(st):
            raise OSError(errno.EACCES, f"{d} is not a claims directory of uid {os.geteuid()}")
        return d

    def claim(self, name: str) -> int:
        """Hold a shared flock on the claim file `locks/claims-<uid>/<name>` (created if needed)
        for as long as the returned descriptor stays open: other processes see the claim
        (`claims`) until it is closed or its process dies. The engine claims the datasets it
        reads, in the mode it reads them (kvdata.tiers.staging, the policy for unannounced orders)."""
        d = self._claims_dir(create=True)
        fd = os.open(d / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(errno.EACCES, f"{d / name} is not a claim file of uid {os.geteuid()}")
            fcntl.flock(fd, fcntl.LOCK_SH)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def claims(self, prefix: str) -> dict[str, bytes]:
        """name -> content (at most 256 bytes) of this uid's claim files whose name starts with
        `prefix` and that some process holds (an exclusive probe fails). A claim nobody holds is
        left alone: claim files are shared by name, and its next holder may be about to lock it."""
        try:
            d = self._claims_dir(create=False)
            listed = os.listdir(d)
        except OSError:
            return {}
        out: dict[str, bytes] = {}
        for n, fd, _st, held in self._probe(d, listed, prefix):
            if held:
                try:
                    out[n] = os.pread(fd, 256, 0)
                except OSError:
                    continue
        return out

    def publish(self, name: str, data: bytes) -> int:
        """Write `data` to `locks/claims-<uid>/<name>` and hold a shared flock on it for as
        long as the returned descriptor stays open (like `claim`). The file is flocked before
        it gets its name, so a live publisher's file is never taken for a dead one's."""
        d = self._claims_dir(create=True)
        tmp = d / f".{name}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            view = memoryview(data)
            while view:
                view = view[os.pwrite(fd, view, len(data) - len(view)):]
            os.rename(tmp, d / name)
            return fd
        except BaseException:
            os.close(fd)
            unlink_quiet(tmp)
            raise

    def withdraw(self, name: str, fd: int) -> None:
        """Remove a file `publish` made (if `fd` still is it) and let its flock go."""
        try:
            p = self._claims_dir(create=False) / name
            st, now = os.fstat(fd), os.lstat(p)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                unlink_quiet(p)
        except OSError:
            pass
        finally:
            os.close(fd)

    def published(self, prefix: str) -> Iterator[tuple[str, int, os.stat_result]]:
        """(name, an open read-only descriptor, its stat) for each of this uid's files in the
        claims directory whose name starts with `prefix` and that a live process holds; a
        file nobody holds any more (its publisher died) is removed. Descriptors are closed
        when the iteration moves on."""
        try:
            d = self._claims_dir(create=False)
            listed = os.listdir(d)
        except OSError:
            return
        for n in listed:  # a publisher killed before its file got its name left the temp name
            if n.startswith(f".{prefix}"):
                self._remove_unheld(d / n)
        for n, fd, st, held in self._probe(d, listed, prefix):
            if held:
                yield n, fd, st
                continue
            try:
                now = os.lstat(d / n)
            except OSError:
                continue
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                unlink_quiet(d / n)  # its publisher is gone (a live one holds it from before its name)

    @staticmethod
    def _probe(d: Path, listed: list[str], prefix: str) -> Iterator[tuple[str, int, os.stat_result, bool]]:
        """(name, read-only descriptor, stat, whether another process holds it) of this uid's
        regular files in `d` whose name starts with `prefix`, opened without following links;
        each descriptor is closed when the iteration moves on (an unheld one is exclusively
        locked by us until then)."""
        for n in listed:
            if not n.startswith(prefix):
                continue
            try:
                fd = os.open(d / n, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = False
                except BlockingIOError:
                    held = True
                yield n, fd, st, held
            except OSError:
                continue
            finally:
                os.close(fd)

    @staticmethod
    def _remove_unheld(p: Path) -> None:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st, now = os.fstat(fd), os.lstat(p)
            old = time.time() - st.st_mtime > 10.0  # not one being published right now (created, not yet locked)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino) and st.st_uid == os.geteuid() and old:
                unlink_quiet(p)
        except OSError:
            pass
        finally:
            os.close(fd)
