"""Records of a generation's open tail, read through LMDB -- or, once the writer has sealed that
tail since the reader loaded the generation, from the shard it became.

Reads of many tail records go through a TailSnapshot (store.tail_snapshot) once enough of them
are asked for to pay for its walk of the tail's pages: the records are then read by memory map
and record rows, as a sealed shard's are, not one LMDB `get` at a time -- as long as nothing was
committed to the tail since the walk, which every read checks under its own transaction.

The tail is the one part of a dataset a writer still changes, so its reads are the only ones
that race a writer: a tail sealed (and its file removed) between a reader's load and its read
is found again under its sealed name -- in the same incarnation only: after a "w" rewrite or a
compaction a shard with that id holds other records, and the reader is told to open the
dataset again. Sealed records whose offsets are unknown are read through LMDB here too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from .. import format as fmt
from ..errors import CorruptDatasetError, KVDataError, MissingShardError
from ..format import ShardEntry, names
from .generation import Generation, read_manifest
from .lmdb_checks import check_lmdb_file
from .shards import ENVS, SealedShard, open_tail_for_read
from .tail_snapshot import TailSnapshot

# A snapshot is taken once a reader has asked for this share of a tail's records (its walk costs
# about a tenth of what reading one record through LMDB instead of the map costs, per record)
SNAPSHOT_SHARE = 16


class TailReads:
    """The LMDB envs of one reader's tails (opened on first use, lent to each read) and the reads
    through them, or through a TailSnapshot.

    `map_shard` maps a sealed shard as the reader does (in place, or a tier's copy)."""

    def __init__(self, root: Path, map_shard: Callable[[ShardEntry], SealedShard]) -> None:
        self.root = root
        self._map_shard = map_shard
        # tail name -> lease slot [env, users, retired, (device, inode), name] (_borrow): an env is
        # let go once it is retired (release) and its last user is done -- never under another thread
        self._envs: dict[str, list[Any]] = {}
        self._snap: TailSnapshot | None = None
        self._held: tuple[Generation, TailSnapshot] | None = None  # (a generation it serves, it): one attribute
        self._asked = 0  # tail records asked for since the snapshot was dropped (or a take failed)
        self._share = SNAPSHOT_SHARE  # a snapshot is taken once asked * share >= the tail's records
        self._lock = threading.Lock()

    def release(self) -> None:
        """Let the env and the snapshot go (another generation's tail is read from now on, or the
        reader closes)."""
        with self._lock:
            self._snap, self._held, self._asked, self._share = None, None, 0, SNAPSHOT_SHARE
            for name, slot in list(self._envs.items()):
                slot[2] = True
                if slot[1] == 0:
                    del self._envs[name]
                    ENVS.release(slot[0])

    def forget(self) -> None:
        """After fork: the parent's LMDB handle must not be used or closed in the child. The
        snapshot holds none, and is kept: the child's reads check it under their own env."""
        self._envs = {}
        self._lock = threading.Lock()

    def held(self, gen: Generation) -> TailSnapshot | None:
        """The snapshot held for `gen`'s tail, if any (single reads: no counting, no taking)."""
        held = self._held  # read once: another thread may replace it meanwhile
        if held is not None and held[0] is gen:
            return held[1]
        snap = self._snap
        return snap if snap is not None and snap.path == gen.tail_path else None

    def snapshot(self, gen: Generation, asked: int) -> TailSnapshot | None:
        """The snapshot to read `gen`'s tail records from (inside `reading`), if one is held or
        worth taking now that `asked` more of them are wanted; None: read them through LMDB."""
        records = gen.manifest.tail.records
        with self._lock:
            snap = self._snap
            if snap is not None and snap.path == gen.tail_path and snap.records >= records:
                self._held = (gen, snap)
                return snap
            self._asked += asked
            if self._asked * self._share < records:
                return None
            self._asked = 0
        with self._env_of(gen) as env:
            snap = None if env is None else TailSnapshot.take(env, gen.tail_path, records)
        with self._lock:
            self._snap = snap
            self._held = None if snap is None else (gen, snap)
            if snap is None:  # refused (pages in doubt): not walked again for twice as many asks
                self._share = max(1, self._share // 2)
        return snap

    def reading(self, gen: Generation, snap: TailSnapshot) -> SnapshotRead:
        """A read transaction for a `with` block, which gets True if `snap`'s rows may be read in
        it (no commit to the tail since it was taken; store.tail_snapshot)."""
        return SnapshotRead(self, gen, snap)

    def _stale(self, snap: TailSnapshot) -> None:
        """`snap` met a commit: dropped, and the next one waits for twice as many asks (a writer
        committing all the time would otherwise have the tail walked again and again for a few
        reads each)."""
        with self._lock:
            if self._snap is snap:
                self._snap, self._held, self._asked = None, None, 0
                self._share = max(1, self._share // 2)

    def values(self, gen: Generation, slots: list[int]) -> list[bytes]:
        """Copies of the tail records at `slots` (LMDB buffers die with their transaction)."""
        out = []
        with self._env_of(gen) as env:
            if env is None:  # the tail was sealed since we loaded: same slots, now a sealed file
                return self._former_values(gen, slots)
            try:
                with ENVS.read(env) as txn:
                    for s in slots:
                        v = txn.get(fmt.slot_key(s))
                        if v is None:
                            break
                        out.append(v)
            except lmdb.Error as e:
                raise lmdb_error(gen.tail_path, e) from None
        if len(out) < len(slots):
            if self._moved_on(gen):  # sealed or rewritten while we read: the sealed file, or a clear error
                return self._former_values(gen, slots)
            raise CorruptDatasetError(f"{self.root}: tail record {slots[len(out)]} is missing; run `kvdata verify`")
        return out

    def _moved_on(self, gen: Generation) -> bool:
        try:
            current = read_manifest(self.root)
        except KVDataError:
            return False
        mine = gen.manifest
        return current.incarnation != mine.incarnation or current.tail.id != mine.tail.id

    def _former_values(self, gen: Generation, slots: list[int]) -> list[bytes]:
        """Our tail's records from the shard it was sealed into (same incarnation only)."""
        h = self._sealed_former_tail(gen)
        try:
            return [lmdb_value(h, s) for s in slots]
        except CorruptDatasetError:
            if read_manifest(self.root).incarnation != gen.manifest.incarnation:
                raise MissingShardError(f"{self.root} was written again (mode \"w\") since this reader opened it; "
                                        "open the dataset again") from None
            raise

    @contextmanager
    def _env_of(self, gen: Generation) -> Iterator[Any]:
        """The env of `gen`'s tail for the block (opened if needed), or None if that file is gone
        (sealed since); kept open until the block ends, whatever release() does meanwhile."""
        slot = self._borrow(gen)
        try:
            yield None if slot is None else slot[0]
        finally:
            if slot is not None:
                self._give_back(slot)

    def _borrow(self, gen: Generation) -> list[Any] | None:
        """The lease slot [env, users, retired, (device, inode), name] of `gen`'s tail, one user
        more (give it back with _give_back), or None if that file is gone."""
        name = gen.manifest.tail.name
        with self._lock:
            slot = self._envs.get(name)
            if slot is None or slot[2]:
                path = gen.tail_path
                try:
                    check_lmdb_file(path)
                    env = open_tail_for_read(path, gen.manifest.shard_size)
                except FileNotFoundError:
                    return None
                except lmdb.Error as e:
                    raise lmdb_error(path, e) from None
                old, slot = slot, [env, 0, False, ENVS.file_of(env), name]
                self._envs[name] = slot
                if old is not None and old[1] == 0:  # (a retired one still in use lets go by itself)
                    ENVS.release(old[0])
            slot[1] += 1
            return slot

    def _give_back(self, slot: list[Any]) -> None:
        with self._lock:
            slot[1] -= 1
            if slot[2] and slot[1] == 0:
                if self._envs.get(slot[4]) is slot:
                    del self._envs[slot[4]]
                ENVS.release(slot[0])

    def _sealed_former_tail(self, gen: Generation) -> SealedShard:
        """The shard our tail was sealed into -- only in the same incarnation: after a "w"
        rewrite a shard with that id holds the new dataset's records, never ours."""
        mine = gen.manifest
        tid = mine.tail.id
        current = read_manifest(self.root)
        if current.incarnation != mine.incarnation:
            # compacted or written again since: a pinned reader's old files stay (store.pins),
            # and a name is never reused, so the file of that name holds our tail's records
            path = gen.shards_dir / names.shard_name(tid, mine.incarnation)
            try:
                size = os.stat(path, follow_symlinks=False).st_size
                return SealedShard(path, size)
            except (OSError, KVDataError):
                raise MissingShardError(f"{self.root} was compacted or written again since this reader opened it, "
                                        f"and its old tail {mine.tail.name} is gone; open the dataset again") from None
        for e in current.shards:
            if e.id == tid:
                return self._map_shard(e)
        raise CorruptDatasetError(f"{self.root}: tail shard {mine.tail.name} is missing; run `kvdata reindex`")


def lmdb_error(path: Path, e: Exception) -> CorruptDatasetError:
    reason = (str(e).splitlines() or [""])[0].removeprefix(f"{path}: ") or type(e).__name__
    return CorruptDatasetError(f"{path}: LMDB cannot read it ({reason}); restore it from a copy and run `kvdata verify`")


def lmdb_value(h: SealedShard, slot: int) -> bytes:
    """A sealed record read through LMDB (shards whose offsets are unknown); LMDB errors become
    CorruptDatasetError."""
    try:
        return h.lmdb_value(slot)
    except lmdb.Error as e:
        raise lmdb_error(h.path, e) from None
    except FileNotFoundError:  # removed since it was mapped (LMDB opens it again by name)
        raise MissingShardError(f"shard {h.path} is gone since it was mapped; open the dataset again") from None


class SnapshotRead:
    """TailReads.reading: `with` it to get whether a snapshot's rows may be read, inside one read
    transaction of the tail's env, which stays open until the block ends. A class, not a
    generator context: store[i] of a tail record pays for it on every call."""

    __slots__ = ("_reads", "_gen", "_snap", "_slot", "_txn")

    def __init__(self, reads: TailReads, gen: Generation, snap: TailSnapshot) -> None:
        self._reads, self._gen, self._snap = reads, gen, snap
        self._slot: list[Any] | None = None
        self._txn: Any = None

    def __enter__(self) -> bool:
        slot = self._slot = self._reads._borrow(self._gen)
        if slot is None:  # sealed since we loaded: the LMDB path finds the sealed file
            return False
        try:
            self._txn = ENVS.begin_read(slot[0])
            ok = self._txn.id() == self._snap.txnid and slot[3] == self._snap.file
        except lmdb.Error:
            ok = False
        if not ok:
            self._reads._stale(self._snap)
        return ok

    def __exit__(self, *exc: object) -> None:
        slot, txn = self._slot, self._txn
        self._slot = self._txn = None
        if slot is None:
            return
        try:
            if txn is not None:
                try:
                    txn.abort()
                finally:
                    ENVS.mark_busy(slot[0], -1)
        finally:
            self._reads._give_back(slot)
