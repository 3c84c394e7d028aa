"""`kvdata reindex`: rebuild the side-index (and, if lost, the manifest) from the shards alone.

The shards are the truth: records in (shard, slot) order replay every put and
delete. A key's last record decides whether it lives (a tombstone deletes it) and
which record it reads; its position is where it first appeared after its last
deletion. That is exactly what the online writer does, so a rebuilt index equals
the one the writer kept.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from .. import format as fmt
from .._util.fsutil import atomic_write, fsync_dir, unlink_quiet
from .._util.progress import progress as make_progress
from ..errors import CorruptDatasetError, NotADatasetError
from ..format import IndexFiles, KeyRunEntry, Manifest, ShardEntry, TailEntry, names
from ..format.codec import file_sha256, zst_copy_of
from . import index as ix
from .generation import read_manifest
from .lock import WriterLock
from .sealing import is_tail_link
from .shard_rows import scan
from .shards import ENVS, open_sealed_lmdb, open_tail_for_write, truncate_tail

DEFAULT_SHARD_SIZE = 256_000_000


class _Collector:
    """Per-record arrays gathered while scanning shards, one shard at a time."""

    def __init__(self) -> None:
        self.hash: list[int] = []
        self.kind: list[int] = []
        self.label: list[int] = []
        self.shard: list[int] = []
        self.slot: list[int] = []
        self.schema: dict[str, Any] = {}
        self._last: Any = None
        self.shard_id = 0

    def __call__(self, slot: int, h: fmt.RecordHeader, v: memoryview) -> None:
        meta = h.meta(v)
        self.hash.append(fmt.key_hash(meta["k"].encode("utf-8")))
        self.kind.append(h.kind)
        self.label.append(meta.get("l", fmt.NO_LABEL))
        self.shard.append(self.shard_id)
        self.slot.append(slot)
        if h.kind == fmt.KIND_FIELDS:
            sch = fmt.field_schema(h.layout(v))
            if sch != self._last:
                self.schema = fmt.merge_schema(self.schema, sch)
                self._last = sch


def _discover(root: Path) -> tuple[list[int], int | None, int]:
    """Sealed shard ids, the tail id and the incarnation found on disk (when the manifest is lost).

    Files of an older incarnation (a dataset written again with mode "w") are left alone."""
    found = [(names.parse_shard_name(p.name), names.parse_tail_name(p.name))
             for p in (root / names.SHARDS_DIR).iterdir()]
    incarnation = max((x[1] for pair in found for x in pair if x is not None), default=0)
    sealed = [s[0] for s, _t in found if s is not None and s[1] == incarnation]
    tails = [t[0] for _s, t in found if t is not None and t[1] == incarnation]
    sealed.sort()
    if sealed != list(range(len(sealed))):
        missing = sorted(set(range(max(sealed) + 1)) - set(sealed))
        raise CorruptDatasetError(f"{root / 'shards'}: sealed shard(s) {missing} are missing; restore them, then reindex")
    tail = max(tails) if tails else None
    return sealed, tail, incarnation


def reindex(path: str | os.PathLike[str], *, progress: bool | None = None) -> dict[str, Any]:
    """Rebuild index files and manifest from the shards; returns a summary."""
    root = Path(path)
    if not (root / "shards").is_dir():
        raise NotADatasetError(f"{root} has no shards/ directory; it is not a kvdata dataset")
    lock = WriterLock(root)
    try:
        return _reindex_locked(root, progress)
    finally:
        lock.release()


def _reindex_locked(root: Path, show: bool | None) -> dict[str, Any]:
    try:
        m: Manifest | None = read_manifest(root)
    except CorruptDatasetError:  # lost or damaged: rebuild it. A newer format version is not ours to touch.
        m = None
    shards_dir = root / "shards"
    if m is not None:
        _drop_uncommitted_seal(shards_dir, m.tail.name)
        entries = list(m.shards)
        tail_id, tail_records = m.tail.id, m.tail.records
        shard_size, compress = m.shard_size, m.compress
        incarnation = m.incarnation
    else:
        ids, found_tail, incarnation = _discover(root)
        if found_tail is not None and found_tail in ids and \
                _drop_uncommitted_seal(shards_dir, names.tail_name(found_tail, incarnation)):
            ids.remove(found_tail)  # the newest tail under its sealed name too: still the tail
        entries = [_entry_from_disk(shards_dir, i, incarnation) for i in ids]
        tail_id = len(ids)
        if found_tail is not None and found_tail != tail_id:
            raise CorruptDatasetError(f"{shards_dir}: {names.tail_name(found_tail, incarnation)} does not follow "
                                      "the sealed shards; restore the shards")
        tail_records = -1  # unknown: keep every record in the tail
        shard_size = DEFAULT_SHARD_SIZE
        compress = any(e.zst for e in entries) or not entries
    collect = _Collector()
    record_rows: list[np.ndarray] = []
    total = sum(e.records for e in entries)
    bar = make_progress(total or None, "reindex", show)
    try:
        for e in entries:
            path = shards_dir / e.name
            if not path.exists():
                raise CorruptDatasetError(f"shard {path} is missing; restore it, then run reindex again")
            collect.shard_id = e.id
            rows = scan(path, collect)
            if len(rows) != e.records:
                raise CorruptDatasetError(f"shard {path} holds {len(rows)} records, the manifest says {e.records}; restore it")
            record_rows.append(rows)
            bar.update(len(rows))
        tail_path = shards_dir / (m.tail.name if m else names.tail_name(tail_id, incarnation))
        tail_n = 0
        if tail_path.exists():
            env = open_tail_for_write(tail_path, shard_size)
            try:
                if tail_records >= 0:
                    truncate_tail(env, tail_records)
                collect.shard_id = tail_id
                with ENVS.read(env, buffers=True) as txn:
                    for k, v in txn.cursor():
                        collect(fmt.slot_of(bytes(k)), fmt.RecordHeader(v), v)
                        tail_n += 1
            finally:
                ENVS.release(env)
        elif tail_records > 0:
            raise CorruptDatasetError(f"tail shard {tail_path} is missing; restore it, then run reindex again")
    finally:
        bar.close()

    samples, hashes = _resolve(collect, entries, shards_dir, tail_id, tail_path)
    gen = (m.generation if m else _max_generation(root)) + 1
    index_dir = root / names.INDEX_DIR
    index_dir.mkdir(exist_ok=True)
    files = {"samples": names.samples_name(gen), "records": names.records_name(gen), "keys": names.keys_name(gen, 0)}
    records = np.concatenate(record_rows) if record_rows else np.zeros(0, fmt.RECORD_DTYPE)
    ix.write_new(index_dir / files["samples"], samples)
    ix.write_new(index_dir / files["records"], records)
    ix.write_key_run(index_dir / files["keys"], hashes, np.arange(len(samples), dtype=np.uint64))
    fsync_dir(index_dir)
    base = m if m else fmt.new_manifest(shard_size, compress)
    new_m = base.replace(
        generation=gen, count=int(len(samples)), shards=tuple(entries),
        tail=TailEntry(tail_id, tail_path.name, tail_n), incarnation=incarnation,
        index=IndexFiles(files["samples"], files["records"], int(len(records)),
                         (KeyRunEntry(files["keys"], int(len(samples))),)),
        fields=collect.schema if not m else (m.fields or collect.schema),
    )
    atomic_write(root / names.MANIFEST, fmt.dump_manifest(new_m))
    for p in index_dir.iterdir():
        if p.name not in files.values():
            unlink_quiet(p)
    return {"dataset": str(root), "generation": gen, "samples": int(len(samples)), "shards": len(entries),
            "records": int(len(collect.hash)), "manifest_rebuilt": m is None}


def _drop_uncommitted_seal(shards_dir: Path, tail_name: str) -> bool:
    """Remove the sealed name a seal gave the tail `tail_name` before it was committed (the
    tail's own file: no bytes go), so the tail can be cut back without touching a shard name."""
    ids = names.parse_tail_name(tail_name)
    if ids is None:
        return False
    name = names.shard_name(*ids)
    if is_tail_link(shards_dir, name, tail_name):
        unlink_quiet(shards_dir / name)
        return True
    return False


def _entry_from_disk(shards_dir: Path, shard_id: int, incarnation: int) -> ShardEntry:
    path = shards_dir / names.shard_name(shard_id, incarnation)
    size, sha = file_sha256(path)
    env = open_sealed_lmdb(path)
    try:
        n = env.stat()["entries"]
    finally:
        ENVS.release(env)
    zst = path.with_name(names.zst_name(path.name))
    copy = zst_copy_of(zst) if zst.exists() else None  # with its seek table, if it has one
    return ShardEntry(shard_id, path.name, n, size, sha, copy)


def _max_generation(root: Path) -> int:
    """Highest generation named by leftover index files, so generations never go back."""
    gens = [int(m.group(1)) for p in (root / names.INDEX_DIR).glob("*.bin") if (m := re.search(r"-([0-9]{8})", p.name))]
    return max(gens, default=0)


def _resolve(c: _Collector, entries: list[ShardEntry], shards_dir: Path, tail_id: int,
             tail_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Replay records in order into (sample rows, key hashes) in sample order."""
    h = np.array(c.hash, dtype=np.uint64)
    n = len(h)
    seq = np.arange(n)
    order = np.lexsort((seq, h))
    hs = h[order]
    start = np.ones(n, dtype=bool)
    start[1:] = hs[1:] != hs[:-1]
    group_start = np.nonzero(start)[0]
    group_len = np.diff(np.append(group_start, n))
    kind = np.array(c.kind, dtype=np.int64)
    birth = np.full(n, -1, dtype=np.int64)   # birth seq of the record that ends up live, indexed by pointer seq
    single = group_start[group_len == 1]
    s_seq = order[single]
    live = s_seq[kind[s_seq] != fmt.KIND_TOMBSTONE]
    birth[live] = live
    multi = [(int(a), int(b)) for a, b in zip(group_start[group_len > 1], group_len[group_len > 1])]
    if multi:
        keys = _read_keys(c, [int(order[a + i]) for a, ln in multi for i in range(ln)], entries, shards_dir, tail_id, tail_path)
        for a, ln in multi:
            state: dict[str, tuple[int, int]] = {}
            for i in range(ln):  # records of this hash in seq order
                r = int(order[a + i])
                k = keys[r]
                if kind[r] == fmt.KIND_TOMBSTONE:
                    state.pop(k, None)
                elif k in state:
                    state[k] = (state[k][0], r)
                else:
                    state[k] = (r, r)
            for b, ptr in state.values():
                birth[ptr] = b
    ptrs = np.nonzero(birth >= 0)[0]
    ptrs = ptrs[np.argsort(birth[ptrs], kind="stable")]
    samples = np.zeros(len(ptrs), dtype=fmt.SAMPLE_DTYPE)
    samples["shard"] = np.array(c.shard, dtype=np.uint32)[ptrs]
    samples["slot"] = np.array(c.slot, dtype=np.uint32)[ptrs]
    samples["label"] = np.array(c.label, dtype=np.int64)[ptrs]
    return samples, h[ptrs]


def _read_keys(c: _Collector, seqs: list[int], entries: list[ShardEntry], shards_dir: Path,
               tail_id: int, tail_path: Path) -> dict[int, str]:
    """Keys of a few records (those sharing a hash), read back from their shards."""
    out: dict[int, str] = {}
    by_shard: dict[int, list[int]] = {}
    for r in seqs:
        by_shard.setdefault(c.shard[r], []).append(r)
    for sid, rs in by_shard.items():
        path = tail_path if sid == tail_id else shards_dir / entries[sid].name
        env = open_sealed_lmdb(path)
        try:
            with ENVS.read(env) as txn:
                for r in rs:
                    v = txn.get(fmt.slot_key(c.slot[r]))
                    out[r] = fmt.RecordHeader(v).meta(v)["k"]
        finally:
            ENVS.release(env)
    return out
