"""Records of a generation's open tail, read through LMDB -- or, once the writer has sealed that
tail since the reader loaded the generation, from the shard it became.

Reads of many tail records go through a TailSnapshot (store.tail_snapshot) once enough of them
are asked for to pay for its walk of the tail's pages: the records are then read by memory map
and record rows, as a sealed shard's are, not one LMDB `get` at a time.

The tail is the one part of a dataset a writer still changes, so its reads are the only ones
that race a writer: a tail sealed (and its file removed) between a reader's load and its read
is found again under its sealed name -- in the same incarnation only: after a "w" rewrite or a
compaction a shard with that id holds other records, and the reader is told to open the
dataset again. Sealed records whose offsets are unknown are read through LMDB here too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
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
    """The LMDB env of one reader's current tail (opened on first use) and the reads through it.

    `map_shard` maps a sealed shard as the reader does (in place, or a tier's copy)."""

    def __init__(self, root: Path, map_shard: Callable[[ShardEntry], SealedShard]) -> None:
        self.root = root
        self._map_shard = map_shard
        self._env: Any = None
        self._snap: TailSnapshot | None = None
        self._held: tuple[Generation, TailSnapshot] | None = None  # (a generation it serves, it): one attribute
        self._asked = 0  # tail records asked for since the snapshot was dropped (or a take failed)
        self._lock = threading.Lock()

    def release(self) -> None:
        """Let the env go (another generation's tail is read from now on, or the reader closes);
        the snapshot's pin ends when the last view of its map does."""
        with self._lock:
            self._snap, self._held, self._asked = None, None, 0
            if self._env is not None:
                ENVS.release(self._env)
            self._env = None

    def forget(self) -> None:
        """After fork: the parent's LMDB handle and snapshot must not be used or closed in the child."""
        self._env, self._snap, self._held, self._asked = None, None, None, 0
        self._lock = threading.Lock()

    def held(self, gen: Generation) -> TailSnapshot | None:
        """The snapshot held for `gen`'s tail, if any (single reads: no counting, no taking)."""
        held = self._held  # read once: another thread may replace it meanwhile
        if held is not None and held[0] is gen:
            return held[1]
        snap = self._snap
        return snap if snap is not None and snap.path == gen.tail_path else None

    def snapshot(self, gen: Generation, asked: int) -> TailSnapshot | None:
        """The snapshot to read `gen`'s tail records from, if one is held or worth taking now that
        `asked` more of them are wanted; None: read them through LMDB (`values`)."""
        records = gen.manifest.tail.records
        with self._lock:
            snap = self._snap
            if snap is not None and snap.path == gen.tail_path and snap.records >= records:
                self._held = (gen, snap)
                return snap
            self._asked += asked
            if self._asked * SNAPSHOT_SHARE < records:
                return None
            self._asked = 0
            env = self._open(gen)
            if env is None:
                return None
            snap = self._snap = TailSnapshot.take(env, gen.tail_path, records)
            self._held = None if snap is None else (gen, snap)
            return snap

    def values(self, gen: Generation, slots: list[int]) -> list[bytes]:
        """Copies of the tail records at `slots` (LMDB buffers die with their transaction)."""
        env = self._open(gen)
        if env is None:  # the tail was sealed since we loaded: same slots, now a sealed file
            return self._former_values(gen, slots)
        out = []
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

    def _open(self, gen: Generation) -> Any:
        if self._env is None:
            path = gen.tail_path
            try:
                check_lmdb_file(path)
                self._env = open_tail_for_read(path, gen.manifest.shard_size)
            except FileNotFoundError:
                return None
            except lmdb.Error as e:
                raise lmdb_error(path, e) from None
        return self._env

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
