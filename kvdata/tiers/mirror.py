"""The local, verified copy of a remote dataset's manifest and index (its "index mirror").

A reader of s3:// or http(s):// opens the mirror like a local dataset whose shards
come through the tiers. Every index file is checked against the sha256 that push
recorded in the manifest before it is used.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .._util.fsutil import atomic_write
from ..config import Config
from ..errors import CorruptDatasetError
from ..format import Manifest, names, parse_manifest
from ..format.codec import file_sha256
from ..store.generation import read_manifest
from .homes import Home

MIRROR_NAME_HEX = 24  # hex digits of sha256(url) naming a mirror directory


def cache_root(config: Config) -> Path:
    """Where mirrored manifests/indexes of remote datasets live: the largest (last) tier."""
    return config.tiers[-1].path / "datasets"


def mirror_dir(root: Path, url: str) -> Path:
    return root / hashlib.sha256(url.encode()).hexdigest()[:MIRROR_NAME_HEX]


def mirror(home: Home, root: Path) -> Path:
    """Local copy of a remote dataset's manifest and index (content-checked); its directory."""
    local = mirror_dir(root, home.url)
    (local / names.INDEX_DIR).mkdir(parents=True, exist_ok=True)
    data = home.read(names.MANIFEST)
    try:
        if (local / names.MANIFEST).read_bytes() == data:  # same generation, already verified
            return local
    except FileNotFoundError:
        pass
    m = parse_manifest(data, home.where(names.MANIFEST))
    if m.tail.records:
        raise CorruptDatasetError(f"{home.where(names.MANIFEST)}: the dataset has unsealed records; push it again")
    sums = m.index_sha256 or {}
    for _kind, name, _size in m.index_files():
        dest = local / names.INDEX_DIR / name
        want = sums.get(name)
        if dest.exists() and want and file_sha256(dest)[1] == want:
            continue
        blob = home.read(f"{names.INDEX_DIR}/{name}")
        if want and hashlib.sha256(blob).hexdigest() != want:
            raise CorruptDatasetError(f"{home.where(names.INDEX_DIR + '/' + name)} does not match its checksum; "
                                      "push the dataset again")
        atomic_write(dest, blob)
    (local / names.SHARDS_DIR).mkdir(exist_ok=True)
    (local / names.SOURCE).write_text(json.dumps({"url": home.url}))
    atomic_write(local / names.MANIFEST, data)
    return local


def mirrored_manifest(root: Path) -> Manifest:
    """The manifest of a mirror (or a local dataset) directory, validated (see read_manifest)."""
    return read_manifest(root)


__all__ = ["cache_root", "mirror", "mirror_dir", "mirrored_manifest", "read_manifest"]
