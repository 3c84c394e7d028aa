"""A Generation: one committed manifest and the side-index it names, read-only.

Readers and the writer both work against a Generation (never against each
other's state): a commit produces the next one, a reader moves to it with
`refresh()`. Files a loaded generation references are never modified, so a
Generation stays valid while newer ones are committed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .._util.fsutil import read_regular
from ..errors import CorruptDatasetError, NotADatasetError
from ..format import Manifest, ShardEntry, names, parse_manifest
from .index import Index
from .pins import ReaderPin, pin

MAX_MANIFEST = 1 << 30
LOAD_ATTEMPTS = 50  # a commit may replace the manifest between reading it and mapping its index


def read_manifest(root: Path) -> Manifest:
    """The dataset's current manifest, validated; a one-line error naming the fix otherwise."""
    path = root / names.MANIFEST
    try:
        data = read_regular(path, MAX_MANIFEST)
    except IsADirectoryError:
        raise CorruptDatasetError(f"{path} is not a regular file; run `kvdata reindex {root}`") from None
    except FileNotFoundError:
        if not root.exists():
            raise NotADatasetError(
                f"{root}: no such dataset; create one with `kvdata put {root} FILE` or kvdata.open(path, 'a')"
            ) from None
        if (root / names.SHARDS_DIR).is_dir():
            raise CorruptDatasetError(f"{path} is missing; run `kvdata reindex {root}` to rebuild it from the shards") from None
        raise NotADatasetError(f"{root} is not a kvdata dataset (no {names.MANIFEST}); check the path") from None
    except NotADirectoryError:
        raise NotADatasetError(f"{root} is not a kvdata dataset directory; check the path") from None
    return parse_manifest(data, str(path))


@dataclass(frozen=True)
class Generation:
    """What one commit made visible: the manifest and its memory-mapped side-index."""

    root: Path
    manifest: Manifest
    index: Index

    @property
    def number(self) -> int:
        return self.manifest.generation

    @property
    def shards(self) -> tuple[ShardEntry, ...]:
        return self.manifest.shards

    @property
    def shards_dir(self) -> Path:
        return self.root / names.SHARDS_DIR

    @property
    def tail_path(self) -> Path:
        return self.root / names.SHARDS_DIR / self.manifest.tail.name

    def shard_path(self, entry: ShardEntry) -> Path:
        return self.root / names.SHARDS_DIR / entry.name


def load_generation(root: Path) -> Generation:
    """The current generation, retrying if a commit replaces it while we map its index."""
    for _attempt in range(LOAD_ATTEMPTS):
        m = read_manifest(root)
        try:
            return Generation(root, m, Index(root / names.INDEX_DIR, m))
        except FileNotFoundError as e:
            if read_manifest(root).generation != m.generation:
                continue  # a commit replaced it (and removed its index files): load the new one
            raise CorruptDatasetError(f"index file {e.filename} is missing; run `kvdata reindex {root}`") from None
    raise CorruptDatasetError(f"{root}: the manifest keeps changing while it is read; try again")


def _manifest_id(root: Path) -> tuple[int, ...] | None:
    """Which manifest file is in place (it is replaced by rename, never written in place)."""
    try:
        st = os.stat(root / names.MANIFEST)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def load_pinned(root: Path, held: ReaderPin | None = None) -> tuple[Generation, ReaderPin | None]:
    """The current generation and a pin on its incarnation's files (store.pins), or no pin
    where this reader cannot take one. `held`: the caller's pin, kept if the incarnation did
    not change (the caller closes it otherwise, once it stops reading the old generation).

    The pin is checked against the manifest after it is taken: a compaction that committed
    in between may already have removed the files of the generation just loaded, so then the
    newer generation is loaded instead."""
    for _attempt in range(LOAD_ATTEMPTS):
        before = _manifest_id(root)
        gen = load_generation(root)
        inc = gen.manifest.incarnation
        if held is not None and held.held and held.incarnation == inc:
            return gen, held  # the caller's pin was checked when it was taken; files of inc stay
        got = pin(root, inc)
        if before is not None and _manifest_id(root) == before:
            return gen, got
        if read_manifest(root).incarnation == inc:
            return gen, got
        if got is not None:
            got.close()
    return load_generation(root), None  # still racing compactions: read unpinned
