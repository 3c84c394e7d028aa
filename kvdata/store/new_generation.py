"""A commit's new generation: the index files of what a Writer's Pending adds, then the manifest;
and the empty generation a new or rewritten dataset starts from (start_empty).

Commit steps 2 and 3 (store.writer): the new sample rows, record rows and key runs go to files
no reader of the old generation looks at (appended past the rows the old manifest counts, or
written new when samples were overwritten or deleted), fsync'ed; manifest.json is then replaced
by rename, the commit point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .. import format as fmt
from .._util.fsutil import atomic_write, fsync_dir
from ..errors import CorruptDatasetError, NotADatasetError
from ..format import IndexFiles, KeyRunEntry, Manifest, TailEntry, names
from . import index as ix
from .generation import read_manifest
from .pending import Pending
from .recovery import settle
from .retire import Journal, old_files, write_journal


def write_generation(root: Path, m: Manifest, pending: Pending, idx: ix.Index, tail: TailEntry,
                     fields: dict[str, Any], classes: list[str], extra: dict[str, Any]) -> tuple[Manifest, list[str]]:
    """Write generation m.generation + 1 of the dataset at `root` (index files, then the manifest):
    `m` and `idx` are the last committed generation's, `tail` the tail as it now stands.
    Returns the new manifest and the index files (relative to root) it no longer references."""
    p = pending
    gen = m.generation + 1
    index_dir = root / names.INDEX_DIR
    old = m.index
    stale: list[str] = []
    n = idx.count
    new_rows, new_hash = p.live()

    records_name, records_count = old.records, old.records_count
    if p.sealed:
        rows = np.concatenate([r for _e, r in p.sealed])
        records_name = records_name or names.records_name(gen)
        ix.append_rows(index_dir / records_name, records_count, rows)
        records_count += len(rows)

    if not p.over and not p.deleted:
        samples_name = old.samples or names.samples_name(gen)
        ix.append_rows(index_dir / samples_name, n, new_rows)
        runs = ix.add_key_run(index_dir, old.keys, gen, new_hash, np.arange(n, n + len(new_rows), dtype=np.uint64))
        count = n + len(new_rows)
    else:
        samples = np.array(idx.samples)
        for pos, row in p.over.items():
            samples[pos] = row
        hashes = ix.all_key_hashes(idx)
        keep = np.ones(n, dtype=bool)
        keep[list(p.deleted)] = False
        samples = np.concatenate([samples[keep], new_rows])
        hashes = np.concatenate([hashes[keep], new_hash])
        samples_name = names.samples_name(gen)
        ix.write_new(index_dir / samples_name, samples)
        run_name = names.keys_name(gen, 0)
        ix.write_key_run(index_dir / run_name, hashes, np.arange(len(samples), dtype=np.uint64))
        runs = [KeyRunEntry(run_name, int(len(samples)))]
        count = len(samples)
    fsync_dir(index_dir)
    referenced = {samples_name, records_name} | {r.name for r in runs}
    stale += [f"{names.INDEX_DIR}/{name}" for name in {old.samples} | {r.name for r in old.keys}
              if name and name not in referenced]

    new_m = m.replace(
        generation=gen,
        count=int(count),
        shards=m.shards + tuple(e for e, _r in p.sealed),
        tail=tail,
        index=IndexFiles(samples_name, records_name, int(records_count), tuple(runs)),
        fields=fields,
        classes=tuple(classes),
        extra=dict(extra),
    )
    atomic_write(root / names.MANIFEST, fmt.dump_manifest(new_m))
    return new_m, stale


def start_empty(root: Path, shard_size: int, compress: bool) -> None:
    """A new, empty generation. Written again from empty ("w"), the dataset starts a new
    incarnation, so none of its new file names can be one an old reader opens; the old
    generation's files go as a compaction's do (store.retire): a journal written first
    names them, and they are removed once no reader pins them."""
    generation = 0
    try:
        old = read_manifest(root)
    except (NotADatasetError, CorruptDatasetError):
        pass
    else:
        generation = old.generation + 1
        settle(root, old)  # a killed compaction to this incarnation: its files go first
        write_journal(root, Journal(generation, old.generation, old.incarnation, old_files(old)))
    atomic_write(root / names.MANIFEST, fmt.dump_manifest(fmt.new_manifest(shard_size, compress, generation)))
