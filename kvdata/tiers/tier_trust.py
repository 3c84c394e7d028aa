"""Which names in a tier may be trusted: the ownership and permission rules Tier applies before
it serves, counts or evicts a copy (kvdata.tiers.tier). Kept apart from the budget and the copies:
these rules decide whose files a tier shared by several users may hand out.

**Whose copies are served (a tier shared by several users).** A name `<sha256>.mdb` is
trusted only when nobody but this uid (or root) can have put that file under that name:

- the copy is a regular file (not a symlink) owned by this uid, with one link, that
  others cannot write (copies are created 0644 at most -- 0600 under the daemon's umask
  -- and 0600 in a shared directory);
- its directory and every ancestor (of the configured path and of the path it resolves
  to) are owned by this uid or root and are not writable by others unless sticky: nobody
  else can rename an entry in them or swap a directory in the path (a group counts as
  others unless it is our user private group: named after us, nobody else in it);
- a shared tier -- a sticky directory others may write, like /tmp or a root-owned 1777
  directory -- also needs the kernel's fs.protected_hardlinks=1, so nobody can hardlink
  one of our copies under another shard's name.

A tier that fails these rules is skipped (`problem` says why and how to fix it): reads
come from another tier, from the home, or from a private copy in memory. Files of other
uids are never served, counted or evicted; a name another user's file holds in a shared
tier is not staged here (the reader reads around it).

*Why not verify foreign copies' sha256 on first use instead:* the owner of a file can
rewrite it after the check (they may chmod their own file), and a reader's map shows the
new bytes -- only a private copy would be safe, which costs what staging our own does.
*Why not a per-uid subdirectory:* it would need the same ownership checks (another user
could create it first) and would change the layout kvdatad and the tools share; with
the rules above, content-named copies in one directory give the same guarantee. The
budget is per uid: only our own files can be counted and evicted by us.
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import stat
from pathlib import Path

PROTECTED_HARDLINKS = Path("/proc/sys/fs/protected_hardlinks")


def ours(st: os.stat_result) -> bool:
    """A copy this uid made: a regular file it owns, with one link, that nobody else can write."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1 and not others_may_write(st)


def directory_problem(shards: Path, locks: Path) -> tuple[str | None, bool]:
    """(why names in `shards` cannot be trusted or None, whether others may write it: shared).
    Every directory on the way -- of the configured path and of the one it resolves to -- must
    be owned by root or us and not writable by others unless sticky."""
    me = os.geteuid()
    seen: set[Path] = set()
    shared = False
    for top in (shards, locks):
        for p in (Path(os.path.abspath(top)), Path(os.path.realpath(top))):
            for d in (p, *p.parents):
                if d in seen:
                    continue
                seen.add(d)
                try:
                    st = os.stat(d)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    return f"{d} cannot be checked ({e.strerror or e})", False
                if st.st_uid not in (0, me):
                    return (f"{d} is owned by uid {st.st_uid}, who could swap the copies in this tier; use a tier "
                            f"directory of your own (or one owned by root with mode 1777)"), False
                others_write = others_may_write(st)
                if others_write and not st.st_mode & stat.S_ISVTX:
                    return (f"{d} is writable by other users, who could swap the copies in this tier; remove "
                            "group/other write permission (or make it sticky: chmod +t)"), False
                if others_write and d == p and top == shards:
                    shared = True
    if shared and _protected_hardlinks() != 1:
        return (f"{shards} is shared with other users (sticky, writable by others) but fs.protected_hardlinks is "
                "not 1, so they could hardlink your copies under other names; set it (sysctl) or use a private "
                "tier directory"), True
    return None, shared


def others_may_write(st: os.stat_result) -> bool:
    """Whether a user other than us may write this file or directory (its group too, unless
    it is our user private group: named after us and with nobody else in it)."""
    if st.st_mode & stat.S_IWOTH:
        return True
    return bool(st.st_mode & stat.S_IWGRP) and not _private_group(st.st_gid, os.geteuid(), os.getegid())


@functools.lru_cache(maxsize=64)
def _private_group(gid: int, uid: int, egid: int) -> bool:
    try:
        group = grp.getgrgid(gid)
        me = pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    return gid == egid and group.gr_name == me and set(group.gr_mem) <= {me}


def _protected_hardlinks() -> int:
    try:
        return int(PROTECTED_HARDLINKS.read_text().strip())
    except (OSError, ValueError):
        return 0
