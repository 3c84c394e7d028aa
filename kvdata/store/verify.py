"""`kvdata verify`: prove every byte a reader could be served is what was written.

Sealed shards are checked against the manifest's sha256 (and their .zst copies
against theirs); every record's crc32 is checked, read through the side-index
offsets so a damaged B-tree page cannot crash the check; the index is checked
against the records it points to (key hashes, kinds, labels).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from .. import format as fmt
from .._util.progress import progress as make_progress
from ..errors import CorruptDatasetError, KVDataError
from ..format import ShardEntry
from ..format.codec import file_sha256
from . import index as ix
from .facade import Store
from .lmdb_checks import check_lmdb_file
from .shards import OpenedCopy, SealedShard, iter_lmdb_records


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
    m = store.manifest
    idx = store.reader().gen.index
    v = _Verification(store)
    bar = make_progress(idx.records_count + idx.tail_records or None, "verify", show)
    try:
        for e in m.shards:
            v.shard(e)
            bar.update(e.records)
        v.tail(bar.update)
    finally:
        bar.close()
    index_problems = _check_index(store) if not v.bad_shards and not v.bad_records else []
    ok = not (v.bad_shards or v.bad_records or index_problems)
    return {"dataset": str(store.root), "generation": m.generation, "ok": ok, "samples": len(store),
            "shards": len(m.shards) + 1, "records_checked": v.checked, "bad_shards": v.bad_shards,
            "bad_records": v.bad_records, "index_problems": index_problems}


class _Verification:
    """What verify found so far: problem rows per shard and per record, records checked."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.reader = store.reader()
        self.bad_shards: list[dict[str, Any]] = []
        self.bad_records: list[dict[str, Any]] = []
        self.checked = 0

    def _bad_shard(self, name: str, problem: str) -> None:
        self.bad_shards.append({"shard": name, "problem": problem})

    def _bad_record(self, shard: str, slot: int, key: str | None, problem: str) -> None:
        self.bad_records.append({"shard": shard, "slot": slot, "key": key, "problem": problem})

    def _copy(self, e: ShardEntry) -> tuple[Path, OpenedCopy | None] | None:
        """The copy of a sealed shard to check (where it lies, or the source's verified copy;
        a descriptor when the daemon passed one), or None after recording why there is none."""
        source = self.store.source
        path = self.reader.gen.shard_path(e)
        if source is not None:
            try:
                located = source.locate(e)[0]
            except KVDataError as err:
                self._bad_shard(e.name, str(err))
                return None
            if isinstance(located, OpenedCopy):
                return Path(located.where), located
            path = located
        if not path.exists():
            self._bad_shard(e.name, "missing")
            return None
        if not path.is_file():  # a directory, a symlink loop: nothing to hash or map
            self._bad_shard(e.name, "not a regular file")
            return None
        return path, None

    def shard(self, e: ShardEntry) -> None:
        """A sealed shard's size and sha256, its zst copy's (read in place), then every record."""
        found = self._copy(e)
        if found is None:
            return
        path, opened = found
        size, sha = _fd_sha256(opened.fd) if opened is not None else file_sha256(path)
        if size != e.bytes or sha != e.sha256:
            self._bad_shard(e.name, "checksum mismatch" if size == e.bytes else f"size {size} != {e.bytes}")
        if e.zst is not None and self.store.source is None:
            zpath = self.reader.gen.shards_dir / e.zst.name
            if not zpath.exists():
                self._bad_shard(e.zst.name, "missing")
            elif file_sha256(zpath) != (e.zst.bytes, e.zst.sha256):
                self._bad_shard(e.zst.name, "checksum mismatch")
        if size != e.bytes:
            if opened is not None:
                os.close(opened.fd)
            return
        handle = SealedShard(opened if opened is not None else path, size)
        try:
            self._records(e, handle, size)
        finally:
            if opened is not None:
                handle.close()

    def _records(self, e: ShardEntry, handle: SealedShard, size: int) -> None:
        idx = self.reader.gen.index
        rows = idx.records[idx.base[e.id]:idx.base[e.id + 1]]
        for slot, (off, psize, hk) in enumerate(zip(rows["offset"].tolist(), rows["size"].tolist(),
                                                     rows["head_kind"].tolist())):
            if off == int(fmt.UNKNOWN_OFFSET):
                try:
                    v: Any = handle.lmdb_value(slot)
                except (lmdb.Error, CorruptDatasetError) as exc:
                    self._bad_record(e.name, slot, None, f"LMDB: {(str(exc).splitlines() or [''])[0] or type(exc).__name__}")
                    continue
            else:
                end = off + (hk & fmt.MAX_HEAD) + psize
                if end > size:
                    self._bad_record(e.name, slot, None, "offset past end")
                    continue
                v = handle.mv[off:end]
            self._record(e.name, slot, v)

    def _record(self, shard: str, slot: int, v: Any) -> None:
        key, problem = _check_record(v)
        if problem:
            self._bad_record(shard, slot, key, problem)
        self.checked += 1

    def tail(self, advance: Callable[[int], Any]) -> None:
        """The committed records of the unsealed tail, read through LMDB."""
        m = self.store.manifest
        tail, tail_path = m.tail, self.reader.gen.tail_path
        if not tail.records:
            return
        if not tail_path.exists():
            self._bad_shard(tail.name, "missing")
            return
        try:
            check_lmdb_file(tail_path)
            for slot, v in iter_lmdb_records(tail_path, tail=True, shard_size=m.shard_size):
                if slot >= tail.records:
                    break
                self._record(tail.name, slot, v)
                advance(1)
        except lmdb.Error as err:
            self._bad_shard(tail.name, f"LMDB cannot read it ({type(err).__name__})")
        except CorruptDatasetError as err:
            self._bad_shard(tail.name, str(err))


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
