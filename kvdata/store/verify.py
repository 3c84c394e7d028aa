"""`kvdata verify`: prove every byte a reader could be served is what was written.

Sealed shards are checked against the manifest's sha256 (and their .zst copies
against theirs); every record's crc32 is checked, read through the side-index
offsets so a damaged B-tree page cannot crash the check; the index is checked
against the records it points to (key hashes, kinds, labels).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from .. import format as fmt
from .._util.progress import progress as make_progress
from ..errors import CorruptDatasetError, KVDataError
from ..format.codec import file_sha256
from . import index as ix
from .facade import Store
from .shards import OpenedCopy, SealedShard, check_lmdb_file, iter_lmdb_records


def _check_record(v: Any) -> tuple[str | None, str | None]:
    """(key or None, problem or None) for one record value."""
    try:
        h = fmt.RecordHeader(v)
    except KVDataError:
        return None, "damaged record header"
    try:
        key = h.meta(v)["k"]
    except Exception:
        key = None
    if not fmt.record_crc_ok(memoryview(v).cast("B") if not isinstance(v, memoryview) else v):
        return key, "crc32 mismatch"
    return key, None


def _fd_sha256(fd: int) -> tuple[int, str]:
    """(size, hex sha256) of an open file, read with pread (its offset is left alone)."""
    h = hashlib.sha256()
    off = 0
    while chunk := os.pread(fd, 8 << 20, off):
        h.update(chunk)
        off += len(chunk)
    return off, h.hexdigest()


def verify_store(store: Store, *, progress: bool | None = None) -> dict[str, Any]:
    """Check an open dataset; the report's "ok" is False if anything is bad, and names it.

    For a dataset served through tiers the shards checked are the staged copies, staged
    now if needed (staging itself refuses a copy whose checksum does not match).
    """
    return _verify(store, progress)


def _verify(store: Store, show: bool | None) -> dict[str, Any]:
    root = store.root
    m = store.manifest
    reader = store.reader()
    idx = reader.gen.index
    source = store.source
    bad_shards: list[dict[str, Any]] = []
    bad_records: list[dict[str, Any]] = []
    index_problems: list[str] = []
    checked = 0
    bar = make_progress(idx.records_count + idx.tail_records or None, "verify", show)
    try:
        for e in m.shards:
            path = reader.gen.shard_path(e)
            opened: OpenedCopy | None = None  # a copy the daemon passed as a descriptor
            if source is not None:
                try:
                    located = source.locate(e)[0]
                except KVDataError as err:
                    bad_shards.append({"shard": e.name, "problem": str(err)})
                    bar.update(e.records)
                    continue
                if isinstance(located, OpenedCopy):
                    opened, path = located, Path(located.where)
                else:
                    path = located
            if opened is None and not path.exists():
                bad_shards.append({"shard": e.name, "problem": "missing"})
                bar.update(e.records)
                continue
            if opened is None and not path.is_file():  # a directory, a symlink loop: nothing to hash or map
                bad_shards.append({"shard": e.name, "problem": "not a regular file"})
                bar.update(e.records)
                continue
            size, sha = _fd_sha256(opened.fd) if opened is not None else file_sha256(path)
            if size != e.bytes or sha != e.sha256:
                bad_shards.append({"shard": e.name, "problem": "checksum mismatch" if size == e.bytes else
                                   f"size {size} != {e.bytes}"})
            if e.zst is not None and source is None:
                zpath = reader.gen.shards_dir / e.zst.name
                if not zpath.exists():
                    bad_shards.append({"shard": e.zst.name, "problem": "missing"})
                elif file_sha256(zpath) != (e.zst.bytes, e.zst.sha256):
                    bad_shards.append({"shard": e.zst.name, "problem": "checksum mismatch"})
            if size != e.bytes:
                if opened is not None:
                    os.close(opened.fd)
                bar.update(e.records)
                continue
            sid = e.id
            rows = idx.records[idx.base[sid]:idx.base[sid + 1]]
            handle = SealedShard(opened if opened is not None else path, size)
            for slot, (off, psize, hk) in enumerate(zip(rows["offset"].tolist(), rows["size"].tolist(),
                                                         rows["head_kind"].tolist())):
                if off == int(fmt.UNKNOWN_OFFSET):
                    try:
                        v: Any = handle.lmdb_value(slot)
                    except (lmdb.Error, CorruptDatasetError) as exc:
                        reason = (str(exc).splitlines() or [""])[0] or type(exc).__name__
                        bad_records.append({"shard": e.name, "slot": slot, "key": None, "problem": f"LMDB: {reason}"})
                        continue
                else:
                    end = off + (hk & fmt.MAX_HEAD) + psize
                    if end > size:
                        bad_records.append({"shard": e.name, "slot": slot, "key": None, "problem": "offset past end"})
                        continue
                    v = handle.mv[off:end]
                key, problem = _check_record(v)
                if problem:
                    bad_records.append({"shard": e.name, "slot": slot, "key": key, "problem": problem})
                checked += 1
            if opened is not None:
                handle.close()
            bar.update(len(rows))
        tail = m.tail
        tail_path = reader.gen.tail_path
        if tail.records:
            if not tail_path.exists():
                bad_shards.append({"shard": tail.name, "problem": "missing"})
            else:
                try:
                    check_lmdb_file(tail_path)
                    for slot, v in iter_lmdb_records(tail_path, tail=True, shard_size=m.shard_size):
                        if slot >= tail.records:
                            break
                        key, problem = _check_record(v)
                        if problem:
                            bad_records.append({"shard": tail.name, "slot": slot, "key": key, "problem": problem})
                        checked += 1
                        bar.update(1)
                except lmdb.Error as err:
                    bad_shards.append({"shard": tail.name, "problem": f"LMDB cannot read it ({type(err).__name__})"})
                except CorruptDatasetError as err:
                    bad_shards.append({"shard": tail.name, "problem": str(err)})
    finally:
        bar.close()
    if not bad_shards and not bad_records:
        index_problems = _check_index(store)
    ok = not (bad_shards or bad_records or index_problems)
    return {"dataset": str(root), "generation": m.generation, "ok": ok, "samples": len(store),
            "shards": len(m.shards) + 1, "records_checked": checked, "bad_shards": bad_shards,
            "bad_records": bad_records, "index_problems": index_problems}


def _check_index(store: Store) -> list[str]:
    """Every sample row must point at a live record whose key hash the key runs agree on."""
    problems: list[str] = []
    reader = store.reader()
    idx = reader.gen.index
    try:
        hashes = ix.all_key_hashes(idx)
    except CorruptDatasetError as e:
        return [str(e)]
    if sum(len(r.hashes) for r in idx.runs) != idx.count:
        entries = sum(len(r.hashes) for r in idx.runs)
        problems.append(f"key index has {entries} entries for {idx.count} samples; run `kvdata reindex`")
    for r in idx.runs:
        if len(r.hashes) > 1 and not bool(np.all(r.hashes[1:] >= r.hashes[:-1])):
            problems.append("a key run is not sorted; run `kvdata reindex`")
    for start in range(0, idx.count, 8192):
        pos = np.arange(start, min(idx.count, start + 8192))
        try:
            metas = reader.metas(pos)
        except KVDataError as e:
            return problems + [str(e)]
        for p, (kind, meta) in zip(pos.tolist(), metas):
            if kind == fmt.KIND_TOMBSTONE:
                problems.append(f"sample {p} points at a deleted record ({meta['k']!r}); run `kvdata reindex`")
            elif fmt.key_hash(meta["k"].encode("utf-8")) != int(hashes[p]):
                problems.append(f"key index disagrees with sample {p} ({meta['k']!r}); run `kvdata reindex`")
            elif int(idx.samples["label"][p]) != meta.get("l", fmt.NO_LABEL):
                problems.append(f"label of sample {p} ({meta['k']!r}) differs from its record; run `kvdata reindex`")
            if len(problems) > 100:
                return problems
    return problems
