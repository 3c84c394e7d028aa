"""`kvdata push`: upload a local dataset to a home, manifest last.

A dataset with committed records in its open tail is sealed first (a local commit: sealing
is a hard link of the tail, no copy), so what is pushed is always a sealed generation; if
another writer holds the dataset, push refuses rather than publish records that writer may
still cut back or seal itself. The zstd cold copy of a shard that has none (seals do not
make one unless asked) is made at push, into a temp directory, and listed in the pushed
manifest's `zst` entry.

A half-pushed dataset is never visible: shards (.zst) and the trimmed index files
go first, the manifest (with the index checksums) last.

An object already at the home is skipped only if the home vouches that it holds the
sha256 the manifest gives for it (`Home.sha256`: S3 metadata recorded at upload, a
local file's recorded or computed hash) -- never by its size: a changed shard of the same
size is uploaded again. Every upload checks the local file against that sha256 first, so
a push never publishes bytes its manifest does not describe.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from .._util.progress import progress as make_progress
from ..errors import KVDataError, ReadOnlyError, RemoteError, WriterLockedError
from ..format import ZstCopy, dump_manifest, names
from ..format.codec import compress_file, zst_copy
from ..homes import Home, open_home
from ..store import Store


def push(dataset: str | os.PathLike[str], url: str, *, show: bool | None = None) -> dict[str, Any]:
    """Upload a local dataset: shards (.zst), index, then the manifest last, so a half-pushed
    dataset is never visible. A committed tail is sealed first (see the module doc). Shards
    and index files the home already holds with the right sha256 are skipped, so an
    interrupted push resumes; the manifest is always uploaded."""
    src = Path(dataset)
    m = _manifest(src)
    if m.tail.records:
        _seal_tail(src, m.tail.records)
        m = _manifest(src)
        if m.tail.records:  # another writer committed into a new tail between the two
            raise KVDataError(f"{src}: a writer keeps adding records; push once it has closed the dataset")
    home = open_home(url)
    if not home.writable:
        raise ReadOnlyError(f"{url} is read-only; push to a local path or s3://")
    uploaded = skipped = index_uploaded = index_skipped = 0
    bar = make_progress(len(m.shards) + 3, "push", show)
    shards_dir = src / names.SHARDS_DIR
    try:
        with tempfile.TemporaryDirectory(prefix="kvdata-push-") as tmpd:
            entries = []
            for e in m.shards:
                zst = e.zst
                if zst is None:
                    zst = _compress(shards_dir / e.name, Path(tmpd) / names.zst_name(e.name))
                    e = e.__class__(e.id, e.name, e.records, e.bytes, e.sha256, zst)
                entries.append(e)
                name = f"{names.SHARDS_DIR}/{zst.name}"
                path = src / name if (src / name).exists() else Path(tmpd) / zst.name
                if _holds(home, name, zst.sha256):
                    skipped += 1
                else:
                    home.put_file(name, path, sha256=zst.sha256)
                    uploaded += 1
                bar.update(1)
            sums = {}
            for _kind, name, count in m.index_files():
                trimmed = Path(tmpd) / name
                with open(src / names.INDEX_DIR / name, "rb") as f:
                    blob = f.read(count)
                trimmed.write_bytes(blob)
                sums[name] = hashlib.sha256(blob).hexdigest()
                remote = f"{names.INDEX_DIR}/{name}"
                if _holds(home, remote, sums[name]):
                    index_skipped += 1
                else:
                    home.put_file(remote, trimmed, sha256=sums[name])
                    index_uploaded += 1
            bar.update(2)
            pushed = m.replace(shards=tuple(entries), index_sha256=sums)
            mpath = Path(tmpd) / names.MANIFEST
            mblob = dump_manifest(pushed)
            mpath.write_bytes(mblob)
            home.put_file(names.MANIFEST, mpath, sha256=hashlib.sha256(mblob).hexdigest())
            bar.update(1)
    finally:
        bar.close()
        home.close()
    return {"dataset": str(src), "url": url, "generation": m.generation, "shards_uploaded": uploaded,
            "shards_skipped": skipped, "index_uploaded": index_uploaded, "index_skipped": index_skipped}


def _manifest(src: Path) -> Any:
    store = Store(src, "r")
    try:
        return store.manifest
    finally:
        store.close()


def _seal_tail(src: Path, records: int) -> None:
    """Seal the committed tail as a local commit (the writer lock taken like any writer's)."""
    try:
        store = Store(src, "a")
    except WriterLockedError as e:
        raise KVDataError(f"{src} has {records} records in its open tail, which push seals first, but {e}; push "
                          "after that writer closes the dataset") from None
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise KVDataError(f"{src} has {records} records in its open tail, which push seals first, but it cannot "
                          f"be written here ({e.strerror}); run `kvdata seal {src}` as its owner, then push") from None
    try:
        store.seal()
        store.commit()
    finally:
        store.close()


def _compress(path: Path, dest: Path) -> ZstCopy:
    with open(dest, "wb") as f:  # framed at record boundaries, with its seek table (record reads)
        return zst_copy(dest.name, compress_file(path, f))


def _holds(home: Home, name: str, sha256: str) -> bool:
    """Whether the home vouches that `name` holds exactly the bytes of `sha256` (a size
    match proves nothing; an object the home cannot vouch for is uploaded again)."""
    try:
        return home.sha256(name) == sha256
    except RemoteError:
        return False
