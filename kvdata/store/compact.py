"""`kvdata compact DATASET`: rewrite what holds dead records, merge small shards, give back the space.

Overwrites and deletes leave dead records in sealed shards (the old copies, the tombstones), and
appends in mode "a" leave many small shards. Compaction makes a new generation whose records all
lie in sample order (store.compact_plan says which shards are kept and how the rest is packed),
copying record values as they are (raw LMDB values, never decoded; each one's crc32 checked on
the way) and hard-linking the shards it keeps. `store[i]` and `store[key]` give the same values
before and after, for every i and key, and so does `kvdata reindex` of the result. The checks
made before anything is written are store.compact_checks; reading and checking the values that
are copied, store.compact_values.

**Names.** The new generation is a new incarnation K (= its generation number), so every file it
names has a name that never held other bytes: kept shards are hard links under their K names,
new shards new files, the tail (empty) a K name too. Nothing of the old generation is modified.

**Commit**, as atomic as a writer's (under the writer lock, after recovery):
  1. the journal `compact-iK.json` (store.retire) is written and fsync'ed, before any file of K;
  2. K's reader registry, the shard files of K (links, then new files, each synced) and the
     index files of generation K are written and fsync'ed; the key runs stay as they are
     (sample positions do not change);
  3. manifest.json is replaced by rename: the commit point;
  4. the old incarnation's files are removed if no reader pins them (store.pins), else kept
     and reported; the next compaction, commit or recovery removes them once their readers
     have gone (store.retire).
A SIGKILL anywhere leaves generation G or K, complete; the next writer's recovery undoes an
uncommitted compaction or finishes a committed one, from the journal, and moves nothing it
cannot account for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import format as fmt
from .._util.fsutil import atomic_write, fsync_dir, tree_bytes, unlink_quiet
from .._util.progress import progress as make_progress
from ..errors import CorruptDatasetError, KVDataError
from ..format import IndexFiles, Manifest, ShardEntry, TailEntry, ZstCopy, names
from ..format.codec import file_sha256
from ..format.manifest import ItemAccess
from . import index as ix
from .compact_checks import check_layout, checked_generation, writer_lock
from .compact_plan import CompactionPlan, Piece, plan
from .compact_values import CheckedValues
from .generation import Generation, load_generation, read_manifest
from .linking import link_or_copy
from .lock import WriterLock
from .pins import create_registry
from .reader import Reader
from .recovery import LeftBehind, tidy
from .retire import Journal, Swept, old_files, retire, rollback, write_journal
from .sealing import write_cold_copy
from .shard_writer import ShardBuilder

__all__ = ["compact", "CompactSummary"]

PAGE = 4096


@dataclass(frozen=True)
class CompactSummary(ItemAccess):
    """What `compact` did (or, with dry_run, would do). bytes_before/after are what the whole
    dataset directory takes on disk (each file once; a dry run's bytes_after is an estimate)."""

    dataset: str
    dry_run: bool
    compacted: bool               # a new generation was committed
    generation_before: int
    generation_after: int
    shards_before: int
    shards_after: int
    shards_kept: int              # linked under their new names, not copied
    shards_rewritten: int         # old shards whose live records were copied (and whose files go)
    shards_written: int           # new shard files
    records_rewritten: int        # live records copied (the tail's included)
    records_dropped: int          # overwritten, deleted and tombstone records left behind
    bytes_before: int             # the dataset's files on disk, before
    bytes_after: int              # ... and after (a dry run: an estimate)
    bytes_copied: int             # record bytes copied into new shards
    bytes_reclaimed: int          # before - after, never negative (0 while readers keep the old files)
    bytes_kept_for_readers: int   # old files readers still use: reclaimed once they close
    files_kept_for_readers: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compact(path: str | os.PathLike[str], *, dry_run: bool = False, progress: bool | None = None) -> CompactSummary:
    """Compact the local dataset at `path` (see the module docstring) and return what was done.

    Refused with one-line errors and the dataset untouched: not a dataset, a directory this user
    cannot write, another writer holding the lock, shards/ or a shard file that is not a real
    file (a symbolic link), a shard of the wrong size or a damaged record. dry_run: plan only."""
    t0 = time.monotonic()
    root = Path(path)
    read_manifest(root)  # not a dataset: a clear error before anything else
    check_layout(root, writing=not dry_run)
    if dry_run:  # reads only: no lock, no recovery
        before = disk_bytes(root)
        return _Job.running(root, checked_generation(root), Swept(), progress, lambda job: job.run(None, t0, before))
    lock = writer_lock(root)
    try:
        gen = checked_generation(root)
        before = disk_bytes(root)  # before recovery: what it removes (a replaced generation's files) counts
        swept = tidy(root, gen.manifest, LeftBehind(frozenset(), None))
        return _Job.running(root, load_generation(root), swept, progress, lambda job: job.run(lock, t0, before))
    finally:
        lock.release()


def disk_bytes(root: Path) -> int:
    """What the dataset takes on disk: its files' bytes, each file once (hard links), the
    writer lock's owner record left out."""
    return tree_bytes(root, skip=frozenset({names.LOCK}))


# ---------------------------------------------------------------- the work


class _Job:
    """One compaction of generation `gen`: its plan, the old files' bytes, and the new files."""

    def __init__(self, root: Path, gen: Generation, swept: Swept, progress: bool | None) -> None:
        self.root, self.gen, self.m = root, gen, gen.manifest
        self.swept = swept
        self.progress = progress
        self.reader = Reader(gen)
        self.tail = self._tail_values()
        self.values = CheckedValues(gen, self.tail, root)
        self.plan = self._plan()

    @classmethod
    def running(cls, root: Path, gen: Generation, swept: Swept, progress: bool | None,
                work: Callable[[_Job], CompactSummary]) -> CompactSummary:
        job = cls(root, gen, swept, progress)
        try:
            return work(job)
        finally:
            job.close()

    def close(self) -> None:
        self.values.close()
        self.reader.close()

    # ------------------------------------------------------------ planning

    def _tail_values(self) -> dict[int, bytes]:
        """The tail's live records (by slot): the tail is at most a shard, and it is copied whole."""
        idx = self.gen.index
        slots = idx.samples["slot"][idx.samples["shard"] == idx.n_sealed].astype(np.int64).tolist()
        return dict(zip(slots, self.reader.tail_values(slots))) if slots else {}

    def _plan(self) -> CompactionPlan:
        idx = self.gen.index
        shard, _slot, rec = idx.resolve(np.arange(idx.count, dtype=np.int64))  # bounds-checked
        lengths = np.zeros(idx.count, dtype=np.int64)
        sealed = rec >= 0
        rows = idx.records[rec[sealed]]
        lengths[sealed] = (rows["head_kind"] & fmt.MAX_HEAD).astype(np.int64) + rows["size"]
        tail_at = np.flatnonzero(~sealed)
        if len(tail_at):
            lengths[tail_at] = [len(self.tail[s]) for s in idx.samples["slot"][tail_at].tolist()]
        return plan(idx.samples, np.array([s.records for s in self.m.shards], dtype=np.int64),
                    np.array([s.bytes for s in self.m.shards], dtype=np.int64), lengths, self.m.tail.records,
                    self.m.shard_size)

    # ------------------------------------------------------------ running

    def run(self, lock: WriterLock | None, t0: float, before: int) -> CompactSummary:
        """Compact (or with no lock, a dry run: only say what would be done)."""
        p, m = self.plan, self.m
        dry_run = lock is None
        kept = sum(1 for piece in p.pieces if piece.kept >= 0) if p.needed else len(m.shards)
        new = p.new_pieces if p.needed else []
        base = dict(dataset=str(self.root), dry_run=dry_run, generation_before=m.generation,
                    shards_before=len(m.shards), shards_kept=kept,
                    shards_rewritten=len(p.rewritten) if p.needed else 0, shards_written=len(new),
                    records_rewritten=p.records_copied if p.needed else 0,
                    records_dropped=p.records_dropped if p.needed else 0, bytes_before=before)
        swept = self.swept
        if lock is None or not p.needed:
            after = before - self._estimate_reclaimed() if p.needed else disk_bytes(self.root)
            return CompactSummary(**base, compacted=False, generation_after=m.generation,  # type: ignore[arg-type]
                                  shards_after=len(p.pieces) if p.needed else len(m.shards), bytes_after=after,
                                  bytes_copied=sum(piece.bytes_estimate for piece in new) if dry_run else 0,
                                  bytes_reclaimed=max(0, before - after), bytes_kept_for_readers=swept.kept_bytes,
                                  files_kept_for_readers=sorted(swept.kept), seconds=round(time.monotonic() - t0, 3))
        new_m, copied = self._commit(lock)
        done = retire(self.root, new_m, self._journal())
        self._remove_old_index(new_m)
        after = disk_bytes(self.root)
        return CompactSummary(**base, compacted=True, generation_after=new_m.generation,  # type: ignore[arg-type]
                              shards_after=len(new_m.shards), bytes_after=after, bytes_copied=copied,
                              bytes_reclaimed=max(0, before - after),
                              bytes_kept_for_readers=swept.kept_bytes + done.kept_bytes,
                              files_kept_for_readers=sorted(swept.kept + done.kept),
                              seconds=round(time.monotonic() - t0, 3))

    def _estimate_reclaimed(self) -> int:
        """What a compaction would free (a dry run): the old files of the shards it rewrites and
        of the tail, less the new shards (their records plus LMDB's overhead, in whole pages;
        cold copies at the old ones' ratio)."""
        m, shards_dir = self.m, self.gen.shards_dir
        old = [m.shards[i] for i in self.plan.rewritten.tolist()]
        raw = sum(e.bytes for e in old)
        zst = sum(e.zst.bytes for e in old if e.zst)
        freed = raw + zst
        for name in (m.tail.name, names.lmdb_lock_name(m.tail.name)):
            try:
                freed += os.lstat(shards_dir / name).st_size
            except FileNotFoundError:
                pass
        new = sum((piece.bytes_estimate + PAGE - 1) // PAGE * PAGE + 2 * PAGE for piece in self.plan.new_pieces)
        if m.compress:
            new += int(new * zst / raw) if raw and zst else new
        return freed - new

    def _remove_old_index(self, new_m: Manifest) -> None:
        """The old generation's samples and records files (readers map an index when they load
        it, so none is disturbed), as a writer's commit removes its stale ones."""
        mine = {n for _kind, n, _b in new_m.index_files()}
        for _kind, name, _b in self.m.index_files():
            if name not in mine:
                unlink_quiet(self.root / names.INDEX_DIR / name)

    def _journal(self) -> Journal:
        m = self.m
        return Journal(m.generation + 1, m.generation, m.incarnation, old_files(m))

    def _commit(self, lock: WriterLock) -> tuple[Manifest, int]:
        """Write incarnation K and commit it; undo everything on any failure before the commit.
        Returns (new manifest, record bytes copied)."""
        journal = self._journal()
        k = journal.to_incarnation
        self._refuse_strangers(k)
        write_journal(self.root, journal)
        try:
            create_registry(self.root, k)
            entries, records, copied = self._write_shards(k)
            new_m = self._write_index(k, entries, records)
            on_disk = read_manifest(self.root).generation
            if not lock.still_ours() or on_disk != self.m.generation:
                raise CorruptDatasetError(
                    f"{self.root}: another writer got in while it was compacted (manifest at generation {on_disk}, "
                    f"compaction started from {self.m.generation}; NFS, where locks may not exclude?); nothing was "
                    "committed; compact again once no one else writes it")
            atomic_write(self.root / names.MANIFEST, fmt.dump_manifest(new_m))
        except BaseException:
            if _incarnation_now(self.root) != k:
                rollback(self.root, journal)
            raise
        return new_m, copied

    def _refuse_strangers(self, k: int) -> None:
        """Nothing may hold a name of incarnation K yet (recovery moved any such file aside): a
        file there now was planted, and undoing this compaction must never remove it."""
        there = [self.root / names.reader_pin_name(k), self.root / names.compact_journal_name(k)]
        there += [p for p in self.gen.shards_dir.iterdir() if names.incarnation_of(p.name.removesuffix(".tmp")) == k]
        there += [p for p in (self.root / names.INDEX_DIR).iterdir() if names.index_generation(p.name) == k]
        for p in there:
            if os.path.lexists(p):
                raise CorruptDatasetError(f"{p} exists and kvdata did not make it (compaction is about to use that "
                                          "name); move it away, then compact again; nothing was changed")

    def _write_shards(self, k: int) -> tuple[list[ShardEntry], list[np.ndarray], int]:
        shards_dir = self.gen.shards_dir
        idx = self.gen.index
        entries: list[ShardEntry | None] = []
        records: list[np.ndarray] = []
        hashing: dict[int, Future[tuple[int, str]]] = {}
        built: dict[int, tuple[Path, np.ndarray, int]] = {}
        copied = 0
        bar = make_progress(sum(p.bytes_estimate for p in self.plan.new_pieces) or None, "compact", self.progress)
        hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdata-compact-sha256")
        try:
            for new_id, piece in enumerate(self.plan.pieces):
                dest = shards_dir / names.shard_name(new_id, k)
                if piece.kept >= 0:
                    e = self.m.shards[piece.kept]
                    entries.append(self._link(e, dest, new_id))
                    records.append(np.asarray(idx.records[idx.base[e.id]:idx.base[e.id + 1]]))
                    continue
                rows, size, n = self._build(dest, piece, bar)
                copied += n
                built[new_id] = (dest, rows, size)
                hashing[new_id] = hasher.submit(file_sha256, dest)
                entries.append(None)
                records.append(rows)
            for new_id, (dest, rows, size) in built.items():
                got_size, sha = hashing[new_id].result()
                if got_size != size:
                    raise CorruptDatasetError(f"{dest} changed size while it was compacted ({size} -> {got_size} "
                                              "bytes); nothing was committed")
                zst = write_cold_copy(dest, dest, rows) if self.m.compress else None
                entries[new_id] = ShardEntry(new_id, dest.name, len(rows), size, sha, zst)
        finally:
            hasher.shutdown(wait=True)
            bar.close()
        fsync_dir(shards_dir)
        return [e for e in entries if e is not None], records, copied

    def _link(self, e: ShardEntry, dest: Path, new_id: int) -> ShardEntry:
        """A kept shard (and its cold copy) under its name in the new incarnation."""
        shards_dir = self.gen.shards_dir
        link_or_copy(shards_dir / e.name, dest, e.bytes, e.sha256, "compacted")
        zst = None
        if e.zst is not None:
            zname = names.zst_name(dest.name)
            link_or_copy(shards_dir / e.zst.name, shards_dir / zname, e.zst.bytes, e.zst.sha256, "compacted")
            zst = ZstCopy(zname, e.zst.bytes, e.zst.sha256, e.zst.seek_bytes, e.zst.seek_sha256)
        return ShardEntry(new_id, dest.name, e.records, e.bytes, e.sha256, zst)

    def _build(self, dest: Path, piece: Piece, bar: Any) -> tuple[np.ndarray, int, int]:
        """A new shard of the records of `piece`, in sample order: (rows, file size, bytes copied)."""
        builder = ShardBuilder(dest, piece.bytes_estimate)
        copied = 0
        try:
            for values, head_kind in self.values.chunks(piece.positions):
                builder.add(values, head_kind)
                n = sum(len(v) for v in values)
                copied += n
                bar.update(n)
            rows, size = builder.finish()
        except BaseException:
            builder.abort()
            raise
        return rows, size, copied

    def _write_index(self, k: int, entries: list[ShardEntry], records: list[np.ndarray]) -> Manifest:
        """Generation K's samples and records files (fsync'ed) and its manifest, not yet committed."""
        m, idx = self.m, self.gen.index
        index_dir = self.root / names.INDEX_DIR
        samples = np.zeros(idx.count, dtype=fmt.SAMPLE_DTYPE)
        lens = np.array([len(p.positions) for p in self.plan.pieces], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) if len(lens) else np.zeros(0, np.int64)
        samples["shard"] = np.repeat(np.arange(len(lens), dtype=np.uint32), lens)
        samples["slot"] = np.arange(idx.count, dtype=np.int64) - np.repeat(starts, lens)
        samples["label"] = idx.samples["label"]
        rows = np.concatenate(records) if records else np.zeros(0, dtype=fmt.RECORD_DTYPE)
        samples_name = names.samples_name(k) if idx.count else None
        records_name = names.records_name(k) if len(rows) else None
        if samples_name:
            ix.write_new(index_dir / samples_name, samples)
        if records_name:
            ix.write_new(index_dir / records_name, rows)
        fsync_dir(index_dir)
        n = len(entries)
        return m.replace(generation=k, incarnation=k, shards=tuple(entries),
                         tail=TailEntry(n, names.tail_name(n, k), 0),
                         index=IndexFiles(samples_name, records_name, int(len(rows)), m.index.keys),
                         index_sha256=None)


def _incarnation_now(root: Path) -> int | None:
    try:
        return read_manifest(root).incarnation
    except KVDataError:
        return None
