"""The local, verified copy of a remote dataset's manifest and index (its "index mirror").

A reader of s3:// or http(s):// opens the mirror like a local dataset whose shards
come through the tiers. Every index file is checked against the sha256 that push
recorded in the manifest before it is used.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .._util.fsutil import atomic_write, fsync_dir, temp_beside, unlink_quiet
from ..config import Config
from ..errors import CorruptDatasetError
from ..format import Manifest, names, parse_manifest
from ..format.codec import file_sha256
from ..homes.base import PART_SIZE, Home
from ..homes.local import check_passed_fd, pread_chunks, read_fd
from ..store.generation import read_manifest

MIRROR_NAME_HEX = 24  # hex digits of sha256(url) naming a mirror directory
MAX_MANIFEST_BYTES = 16 << 20  # a remote manifest (or one passed to kvdatad): ~50,000 shards fit


def cache_root(config: Config) -> Path:
    """Where mirrored manifests/indexes of remote datasets live: the largest (last) tier."""
    return config.tiers[-1].path / "datasets"


def mirror_dir(root: Path, url: str) -> Path:
    return root / hashlib.sha256(url.encode()).hexdigest()[:MIRROR_NAME_HEX]


def mirror(home: Home, root: Path) -> Path:
    """Local copy of a remote dataset's manifest and index (content-checked); its directory."""
    local = mirror_dir(root, home.url)
    (local / names.INDEX_DIR).mkdir(parents=True, exist_ok=True)
    data = home.read(names.MANIFEST, MAX_MANIFEST_BYTES)
    try:
        if (local / names.MANIFEST).read_bytes() == data:  # same generation, already verified
            return local
    except FileNotFoundError:
        pass
    m = parse_manifest(data, home.where(names.MANIFEST))
    if m.tail.records:
        raise CorruptDatasetError(f"{home.where(names.MANIFEST)}: the dataset has unsealed records; push it again")
    sums = m.index_sha256 or {}
    for _kind, name, size in m.index_files():
        dest = local / names.INDEX_DIR / name
        want = sums.get(name)
        if dest.exists() and want and file_sha256(dest)[1] == want:
            continue
        fetch_exact(home, f"{names.INDEX_DIR}/{name}", size, want, dest)
    (local / names.SHARDS_DIR).mkdir(exist_ok=True)
    (local / names.SOURCE).write_text(json.dumps({"url": home.url}))
    atomic_write(local / names.MANIFEST, data)
    _drop_old_tables(local / names.SEEK_DIR, {e.zst.seek_sha256 for e in m.shards if e.zst is not None})
    return local


def _drop_old_tables(tables: Path, wanted: set[str | None]) -> None:
    """Seek tables (kvdata.tiers.records) of shards the mirrored generation no longer has: only
    files named as such go (a reader still on the old generation fetches its table again)."""
    try:
        names_there = os.listdir(tables)
    except OSError:
        return
    for n in names_there:
        sha = names.parse_seek_table_name(n)
        if sha is not None and sha not in wanted:
            unlink_quiet(tables / n)


def fetch_exact(home: Home, name: str, size: int, sha: str | None, dest: Path) -> None:
    """Stream exactly the `size` bytes the manifest gives (no more is ever asked for or
    held: parts of PART_SIZE) into `dest`, checked against `sha`; atomically."""
    tmp = temp_beside(dest)
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for off in range(0, size, PART_SIZE):
                n = min(PART_SIZE, size - off)
                part = home.read_range(name, off, n)
                if len(part) != n:
                    raise CorruptDatasetError(f"{home.where(name)} is shorter than the {size} bytes its manifest gives; "
                                              "push the dataset again")
                h.update(part)
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        if sha and h.hexdigest() != sha:
            raise CorruptDatasetError(f"{home.where(name)} does not match its checksum; push the dataset again")
        os.replace(tmp, dest)
    except BaseException:
        unlink_quiet(tmp)
        raise
    fsync_dir(dest.parent)


def _copy_fd(fd: int, size: int, sha: str | None, dest: Path, where: str) -> None:
    """`size` bytes of a passed file into `dest` (streamed, checked against `sha`), atomically."""
    check_passed_fd(fd, size, where)
    tmp = temp_beside(dest)
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for chunk in pread_chunks(fd, size, 1 << 20):
                h.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if sha and h.hexdigest() != sha:
            raise CorruptDatasetError(f"{where} does not match its manifest's checksum; open the dataset again")
        os.replace(tmp, dest)
    except BaseException:
        unlink_quiet(tmp)
        raise


def manifest_from_fd(fd: int, where: str) -> Manifest:
    """A manifest from a descriptor a client passed (a regular file of at most
    MAX_MANIFEST_BYTES), validated like any other."""
    return parse_manifest(read_fd(fd, MAX_MANIFEST_BYTES, where), where)


def open_mirror_files(root: Path) -> list[tuple[str, int]]:
    """Read-only descriptors of what a reader of a mirror needs -- its manifest, then the
    index files that very manifest names -- as (name relative to the mirror, fd)."""
    out: list[tuple[str, int]] = []
    try:
        fd = os.open(root / names.MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        out.append((names.MANIFEST, fd))
        m = manifest_from_fd(fd, str(root / names.MANIFEST))
        for _kind, name, _size in m.index_files():
            rel = f"{names.INDEX_DIR}/{name}"
            out.append((rel, os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)))
    except BaseException:
        for _name, fd in out:
            os.close(fd)
        raise
    return out


def mirror_from_fds(files: list[tuple[str, int]], root: Path, url: str) -> Path:
    """A reader's own copy of the mirror kvdatad passed as descriptors (when the daemon's
    tier is not readable by this uid): the manifest is parsed and every index file checked
    against it (size, and sha256 where push recorded one) before the manifest is written."""
    by_name = dict(files)
    mfd = by_name.get(names.MANIFEST)
    if mfd is None:
        raise CorruptDatasetError(f"{url}: kvdatad passed no manifest")
    data = read_fd(mfd, MAX_MANIFEST_BYTES, f"{url} manifest from kvdatad")
    local = mirror_dir(root, url)
    try:
        if (local / names.MANIFEST).read_bytes() == data:
            return local
    except FileNotFoundError:
        pass
    m = parse_manifest(data, f"{url}/{names.MANIFEST}")
    (local / names.INDEX_DIR).mkdir(parents=True, exist_ok=True)
    sums = m.index_sha256 or {}
    for _kind, name, size in m.index_files():
        rel = f"{names.INDEX_DIR}/{name}"
        fd = by_name.get(rel)
        if fd is None:
            raise CorruptDatasetError(f"{url}: kvdatad passed no {rel}")
        _copy_fd(fd, size, sums.get(name), local / rel, f"{url}/{rel} from kvdatad")
    (local / names.SHARDS_DIR).mkdir(exist_ok=True)
    (local / names.SOURCE).write_text(json.dumps({"url": url}))
    atomic_write(local / names.MANIFEST, data)
    return local


def mirrored_manifest(root: Path) -> Manifest:
    """The manifest of a mirror (or a local dataset) directory, validated (see read_manifest)."""
    return read_manifest(root)


__all__ = ["cache_root", "fetch_exact", "manifest_from_fd", "mirror", "mirror_dir", "mirror_from_fds", "mirrored_manifest",
           "open_mirror_files",
           "read_manifest"]
