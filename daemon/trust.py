"""Who is asking, and whose directories these are: the daemon's side of docs/SECURITY.md.

- `Peer`: a connection's uid/gid/pid from SO_PEERCRED (the kernel's word, not the client's);
  `INTERNAL`, the daemon itself.
- `secure_tiers`: the daemon owns its tier directories. At start (and on reload) each
  tier root and its subdirectories are created 0700 if missing; one owned by another uid,
  or under a directory another user may rename it out of, refuses the start with one
  line; one of ours that group/others may write is closed (chmod 0700) and then must hold
  no entry of another uid. Nothing in a tier is ever readable or writable by clients:
  they get read-only descriptors of staged copies instead.
- `raise_fd_limit`: connections and passed descriptors are bounded by config; the soft
  RLIMIT_NOFILE is raised to the hard one so those bounds, not the kernel's, apply.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from kvdata.config import Config
from kvdata.errors import KVDataError

log = logging.getLogger("kvdatad")
_UCRED = struct.Struct("3i")
TIER_SUBDIRS = ("shards", "locks")


@dataclass(frozen=True)
class Peer:
    uid: int
    gid: int
    pid: int
    privileged: bool  # root or the daemon's own uid: may name local paths, sees every client and dataset


INTERNAL = Peer(0, 0, 0, True)  # the daemon itself (status for metrics, a Service used without a socket)


def peer_of(sock: socket.socket) -> Peer:
    """The connecting process's credentials, from the kernel (SO_PEERCRED)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return Peer(uid, gid, pid, uid in (0, os.geteuid()))


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; the resulting soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 20


def secure_tiers(config: Config) -> list[str]:
    """Create/check every tier directory (see module docstring); KVDataError with one line if
    one cannot be trusted. Returns what was fixed, for the log."""
    me = os.geteuid()
    fixed: list[str] = []
    for i, t in enumerate(config.tiers):
        root = Path(os.path.abspath(t.path))
        _check_ancestors(t.name, root, me)
        subs = TIER_SUBDIRS + (("datasets",) if i == len(config.tiers) - 1 else ())  # mirrors: the last tier
        for d in (root, *(root / sub for sub in subs)):
            _ensure_private_dir(t.name, d, me, fixed)
    return fixed


def _check_ancestors(tier: str, root: Path, me: int) -> None:
    """Every existing ancestor must be owned by root or us, and not writable by others unless
    sticky (/tmp): else another user could move the tier away and put their own in its place."""
    for parent in reversed(root.parents):
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue
        if st.st_uid not in (0, me):
            raise KVDataError(f"tier {tier!r}: {parent} is owned by uid {st.st_uid}, who could replace the tier "
                              f"directory {root}; put the tier under a directory owned by root or uid {me}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise KVDataError(f"tier {tier!r}: {parent} is writable by other users, who could replace the tier "
                              f"directory {root}; remove group/other write permission or move the tier")


def _ensure_private_dir(tier: str, d: Path, me: int, fixed: list[str]) -> None:
    try:
        d.mkdir(mode=0o700, parents=True)  # missing parents too: under the daemon's umask 077
    except FileExistsError:
        pass
    except OSError as e:
        raise KVDataError(f"tier {tier!r}: cannot create {d} ({e.strerror or e}); fix the path in the config") from None
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode):  # a symlinked tier root is fine if what it names passes the same checks
        st = os.stat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise KVDataError(f"tier {tier!r}: {d} is not a directory; remove it or change the tier's path")
    if st.st_uid != me:
        raise KVDataError(f"tier {tier!r}: {d} is owned by uid {st.st_uid}, not kvdatad's uid {me}; a tier belongs to "
                          "the daemon alone: remove it or give it to the daemon's user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        was_writable = bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
        os.chmod(d, 0o700)
        fixed.append(f"{d}: mode {stat.S_IMODE(st.st_mode):o} -> 700")
        if was_writable:  # others could have planted entries before the chmod
            for entry in os.scandir(d):
                owner = entry.stat(follow_symlinks=False).st_uid
                if owner != me:
                    raise KVDataError(f"tier {tier!r}: {d} was writable by others and holds {entry.name!r} of uid "
                                      f"{owner}; remove what you do not trust, then start kvdatad again")
