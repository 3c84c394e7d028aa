"""The messages a Writer gives when the disk fills or a write fails: one line that says what
happened, that nothing was committed (or what was kept), and what to do.

LMDB reports a full disk as text (and a short write as a bare I/O error), so telling a full disk
from other failures needs the errno and the text both.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import lmdb

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(e: BaseException) -> bool:
    """Whether an OSError or an LMDB error says the disk (or the quota) is full: LMDB gives the
    errno only in its text (and a short write as a bare I/O error, which this cannot tell)."""
    if getattr(e, "errno", None) in DISK_FULL_ERRNOS:
        return True
    return isinstance(e, lmdb.Error) and any(os.strerror(n) in str(e) for n in DISK_FULL_ERRNOS)


def full_at_open(root: Path, e: BaseException) -> str:
    """The message when opening `root` for writing found the disk full."""
    reason = getattr(e, "strerror", None) or str(e)
    return (f"{root}: cannot open it for writing, the disk is full ({reason}); nothing was committed; "
            "free space on its filesystem and try again")


def failure_message(root: Path, generation: int, e: BaseException) -> str:
    """The message when a write or a commit failed and the writes since the last commit (the
    dataset is at `generation`) were discarded."""
    if disk_full(e) or isinstance(e, lmdb.MapFullError):
        why = "the disk is full"
    elif isinstance(e, lmdb.Error):  # LMDB reports ENOSPC/EFBIG as text, often as a bare I/O error
        why = f"writing the tail shard failed: {e}; is the disk full?"
    else:
        why = str(e)
    return (f"{root}: commit failed ({why}); the dataset is unchanged at generation {generation} and the "
            "writes since the last commit were discarded; free space and write them again")


def another_writer(root: Path, on_disk: int, started: int) -> str:
    """The message when another writer got in while this one wrote (the manifest is at
    generation `on_disk`, this writer started from `started`)."""
    return (f"{root}: another writer opened or committed this dataset while this one was writing "
            f"(manifest at generation {on_disk}, this writer started from {started}; is it on NFS, "
            "where file locks may not exclude?); nothing was committed; open it again and write once at a time")
