"""One immutable file under a second name: a hard link, or a copy checked against its sha256.

Merge and compaction give sealed shards (and their cold copies) new names without copying
them: a sealed shard never changes, so a hard link is the same bytes under a name that never
held others. Where the filesystem refuses links (NO_LINK_ERRNOS: another filesystem, no link
support) the file is copied and the copy is checked against the size and sha256 the manifest
records before it is used.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from ..errors import CorruptDatasetError, MissingShardError
from .sealing import NO_LINK_ERRNOS

COPY_CHUNK = 8 << 20


def link_or_copy(src: Path, dst: Path, size: int, sha256: str, doing: str) -> str:
    """`dst` as a hard link to `src` ("link"), or where links are refused a copy whose size and
    sha256 match the manifest ("copy"). `dst` must not exist (never replaced); a file swapped
    for a symlink meanwhile is refused. `doing` ("merged", "compacted") words the errors."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileNotFoundError:
        raise MissingShardError(f"{src} was removed while it was {doing} (a writer rewriting that dataset?); nothing "
                                f"was committed; try again once no one writes it") from None
    except OSError as e:
        if e.errno not in NO_LINK_ERRNOS:
            raise
        copy_checked(src, dst, size, sha256)
        return "copy"
    st = os.lstat(dst)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        raise CorruptDatasetError(f"{src} changed while it was {doing} (now not a {size}-byte file); "
                                  "nothing was committed; check it with `kvdata verify` and try again")
    return "link"


def copy_checked(src: Path, dst: Path, size: int, sha256: str) -> None:
    """Copy `src` to the new file `dst` (fsync'ed), refusing a source that does not match its manifest."""
    h = hashlib.sha256()
    n = 0
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with open(dst, "xb") as out:
            while chunk := os.read(fd, COPY_CHUNK):
                h.update(chunk)
                out.write(chunk)
                n += len(chunk)
            out.flush()
            os.fsync(out.fileno())
    finally:
        os.close(fd)
    if n != size or h.hexdigest() != sha256:
        raise CorruptDatasetError(f"{src} does not match its manifest's size and sha256; nothing was committed; "
                                  f"run `kvdata verify {src.parent.parent}` and restore the shard")
