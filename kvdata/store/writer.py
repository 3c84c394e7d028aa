"""The single writer of a dataset: appends, overwrites, deletes, sealing and atomic commits.

Commit protocol (a crash at any instant leaves the old or the new generation):
  1. the tail's LMDB transaction commits and is synced (sealed shards were fsync'ed when sealed);
  2. the new side-index rows/runs go to files no reader of the old generation looks at, fsync'ed;
  3. manifest.json is replaced by rename (the commit point), and the directory fsync'ed;
  4. files the new generation no longer references are removed (and those of a compacted
     generation that no reader pins any more: store.retire).
Opening a writer (and a failed commit) runs recovery, which first checks that every file the
manifest names is there, then cuts the tail back to the slots the manifest committed and puts
files the manifest does not name out of the way: leftovers it can account for (temp files,
index files and tails of older generations, files of a generation "w" replaced) are removed;
anything else (e.g. shards of a newer generation under a stale manifest) is moved aside into
`lost+found/`, never deleted.

The writer reads the committed generation only through its Reader's public methods
(key lookups for overwrites) and hands it each new Generation.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lmdb

from .. import format as fmt
from .._util.fsutil import unlink_quiet
from .._util.sizes import parse_size
from ..errors import (
    ClosedError,
    CommitError,
    CorruptDatasetError,
    MissingShardError,
    NotADatasetError,
)
from ..format import Manifest, TailEntry, names
from .generation import Generation, load_generation, read_manifest
from .lock import WriterLock
from .new_generation import start_empty, write_generation
from .open_tail import OpenTail
from .put_paths import PutPaths
from .reader import Reader
from .record_path import RecordPath
from .recovery import LeftBehind, holds_data, settle, tidy
from .shards import ENVS
from .write_errors import another_writer, disk_full, failure_message, full_at_open

DEFAULT_SHARD_SIZE = 256_000_000
SEAL_ON_CLOSE_MIN = 64 << 10  # a "w" writer's close seals the tail unless the whole dataset is smaller

class Writer:
    """The pending writes of one dataset opened with mode a/w, and its Reader. Its parts: the
    record path (store.record_path: records into the tail, their rows pending) and the put paths
    (store.put_paths: put and put_many, raw puts gathered), each built once, with what it uses."""

    def __init__(self, root: Path, *, shard_size: int | str | None, compress: bool, reset: bool,
                 make_reader: Callable[[Generation], Reader]) -> None:
        self.root = root
        if root.exists() and not root.is_dir():
            raise NotADatasetError(f"{root} exists and is not a directory; choose another dataset path")
        if root.exists() and not (root / names.MANIFEST).exists() and not (root / names.SHARDS_DIR).exists() \
                and any(p.name != names.LOCK for p in root.iterdir()):
            raise NotADatasetError(f"{root} exists, is not empty and is not a kvdata dataset; choose another path")
        fresh_dir = not root.exists() or not any(root.iterdir())
        try:
            root.mkdir(parents=True, exist_ok=True)
            self._lock: WriterLock | None = WriterLock(root)
        except OSError as e:
            if disk_full(e):
                raise CommitError(full_at_open(root, e)) from None
            raise
        self._writing_generation: int | None = None  # index files of this generation are ours (a commit in flight)
        self._created = False  # True: this writer made the dataset, so a failed first write removes it
        # "w": the dataset is written whole, so close() seals its tail (sealing is a hard link, not
        # a copy) and it is read right away by memory map, not LMDB -- unless the whole dataset
        # is a tail of a few records (< SEAL_ON_CLOSE_MIN bytes): its LMDB reads cost microseconds
        self._seal_on_close = reset
        self.tail = OpenTail(root / names.SHARDS_DIR)
        self.failed = False
        self._failed_why = ""  # said by the ClosedError of every later call
        try:
            (root / names.SHARDS_DIR).mkdir(exist_ok=True)
            (root / names.INDEX_DIR).mkdir(exist_ok=True)
            requested = None if shard_size is None else parse_size(shard_size, "shard_size")
            if not reset and not (root / names.MANIFEST).exists() and holds_data(root):
                raise CorruptDatasetError(f"{root / names.MANIFEST} is missing but the dataset has shards; "
                                          f"run `kvdata reindex {root}` to rebuild it before writing")
            if reset or not (root / names.MANIFEST).exists():
                self._created = fresh_dir and not reset
                start_empty(self.root, requested or DEFAULT_SHARD_SIZE, compress)
            gen = self._settle(frozenset(), shard_size=requested)
            self.m = gen.manifest  # the last committed generation's manifest
            self.reader = make_reader(gen)  # readers in this process see each new generation through it
            self._records = RecordPath(root, self.tail, self.reader, self.m, discard=self._fail)
            self._puts = PutPaths(self._records, self.reader, give_up=self._give_up)
            self.classes = list(self.m.classes)
            self.extra = dict(self.m.extra)
            if requested is not None and requested != self.m.shard_size:
                self.m = self.m.replace(shard_size=requested)  # applies to shards sealed from now on
                self._records.pending.dirty = True
        except BaseException as e:
            self._unlock()
            if isinstance(e, OSError) and disk_full(e):
                raise CommitError(full_at_open(root, e)) from None
            raise

    @property
    def shards_dir(self) -> Path:
        return self.root / names.SHARDS_DIR

    @property
    def schema(self) -> dict[str, Any]:
        """The fields of the records, as the next commit's manifest lists them."""
        return self._records.schema

    @schema.setter
    def schema(self, fields: dict[str, Any]) -> None:
        self._records.schema = fields

    # ------------------------------------------------------------ setup and recovery

    def _settle(self, written: frozenset[str], shard_size: int | None = None) -> Generation:
        """Bring files back to exactly what manifest.json says (the tail cut back to its committed
        slots, leftovers put out of the way; `written`: the shard-dir files this writer created
        since its last commit); the committed generation.

        Everything the manifest names is checked before any file is touched."""
        m = read_manifest(self.root)
        tail_path = self.shards_dir / m.tail.name
        for s in m.shards:
            if not (self.shards_dir / s.name).is_file():
                raise MissingShardError(f"shard {self.shards_dir / s.name} is missing; restore it before writing")
        if not tail_path.exists() and m.tail.records:
            raise CorruptDatasetError(f"tail shard {tail_path} is missing; restore it or run `kvdata reindex`")
        gen = load_generation(self.root)  # its index files exist and fit, or a clear error -- still nothing touched
        m = gen.manifest
        tidy(self.root, m, LeftBehind(written, self._writing_generation))
        try:
            self.tail.reopen(tail_path, m.tail.id, m.tail.records, shard_size or m.shard_size)
        except OSError as e:
            if disk_full(e):
                raise CommitError(full_at_open(self.root, e)) from None
            raise
        except lmdb.Error as e:
            if disk_full(e):
                raise CommitError(full_at_open(self.root, e)) from None
            reason = (str(e).splitlines() or [""])[0].removeprefix(f"{tail_path}: ") or type(e).__name__
            raise CorruptDatasetError(f"{tail_path}: cannot open the tail shard ({reason}); run `kvdata reindex`") from None
        return gen

    def _fail(self) -> None:
        """Discard pending writes and return the files to the last committed generation."""
        try:
            self.tail.close(abort=True)
            self._records.wait_hashing()  # the sha256 threads of discarded seals end before their files are touched
            gen = self._settle(frozenset(self._records.written))
            self.m = gen.manifest
            self._records.restart(gen.manifest)
            self._puts.restart()
            self.classes = list(gen.manifest.classes)
            self.extra = dict(gen.manifest.extra)
            self.reader.load(gen)
            self.failed = False
        except Exception:
            self.failed = True

    def _give_up(self, what: str) -> None:
        """Discard pending writes and fail: every later call says `what` happened."""
        self._fail()
        self.failed = True
        self._failed_why = f" ({what}; the writes since generation {self.m.generation} were discarded)"

    def _check(self) -> None:
        if self._lock is None or self.failed:
            raise ClosedError(f"{self.root}: the writer is closed or failed{self._failed_why}; "
                              "open the dataset again to write")

    # ------------------------------------------------------------ writes

    def put(self, key: str, value: Any, label: int | None) -> None:
        """Write one record (visible at the next commit); see PutPaths.put."""
        self._check()
        self._puts.put(key, value, label)

    def put_many(self, pairs: Iterable[tuple[Any, ...]]) -> int:
        self._check()
        return self._puts.put_many(pairs)

    def request_seal(self) -> None:
        self._records.pending.seal_requested = True

    def set_classes(self, classes: list[str]) -> None:
        self.classes = classes

    def set_extra(self, name: str, value: Any) -> None:
        """Keep plain-JSON `value` in the manifest under `name` from the next commit on (checked now)."""
        self.extra[name] = fmt.checked_extra(self.m, name, value)

    def delete(self, key: str) -> None:
        self._check()
        self._puts.flush()
        kb = fmt.check_key(key)
        if not self._records.delete(kb.decode("utf-8"), kb):
            raise KeyError(f"{key!r} is not in {self.root}")

    # ------------------------------------------------------------ commit

    def commit(self) -> int:
        self._check()
        self._puts.flush()
        p = self._records.pending
        if not p.consistent():
            self._fail()
            raise CommitError(f"{self.root}: a write was interrupted halfway (KeyboardInterrupt?); the writes since "
                              f"generation {self.m.generation} were discarded and nothing was committed; write them again")
        if p.seal_requested and self.tail.slots:
            self._records.seal()
            p.dirty = True
        p.seal_requested = False
        if not p.dirty and self.classes == list(self.m.classes) and self.extra == self.m.extra:
            return self.m.generation
        self._check_sole_writer()
        try:
            self.tail.sync()
            p.hashed()
            new_m, stale = self._write_generation()
        except (OSError, lmdb.Error) as e:
            self._fail()
            raise CommitError(failure_message(self.root, self.m.generation, e)) from None
        for name in stale:
            unlink_quiet(self.root / name)
        for tid, env in list(self.tail.sealed_envs.items()):
            ENVS.release(env)
            old_tail = names.tail_name(tid, self.m.incarnation)
            unlink_quiet(self.shards_dir / old_tail)
            unlink_quiet(self.shards_dir / names.lmdb_lock_name(old_tail))
        self.tail.sealed_envs.clear()
        settle(self.root, new_m)  # files of a compacted generation whose readers have gone (store.retire)
        self.m = new_m
        self._records.committed_as(new_m)
        self.reader.load(load_generation(self.root))  # readers in this process see it from now on
        return new_m.generation

    def _check_sole_writer(self) -> None:
        """Refuse to commit if another writer got in (a filesystem where flock does not exclude):
        the lock file names someone else, or the manifest moved past the generation we built on."""
        assert self._lock is not None
        on_disk = read_manifest(self.root).generation
        if not self._lock.still_ours() or on_disk != self.m.generation:
            self.failed = True
            raise CommitError(another_writer(self.root, on_disk, self.m.generation))

    def _write_generation(self) -> tuple[Manifest, list[str]]:
        self._writing_generation = self.m.generation + 1
        tail = TailEntry(self.tail.id, names.tail_name(self.tail.id, self.m.incarnation), self.tail.slots)
        return write_generation(self.root, self.m, self._records.pending, self.reader.gen.index, tail,
                                self._records.schema, self.classes, self.extra)

    # ------------------------------------------------------------ close

    def close(self, commit: bool) -> None:
        if self._lock is None:
            return
        committed = False
        try:
            if commit and not self.failed:
                self._puts.flush()
                if self._seal_on_close and (self.tail.bytes >= SEAL_ON_CLOSE_MIN or self.m.shards
                                            or self._records.pending.sealed):
                    self.request_seal()  # read right away through the sealed (memory-map) path
                self.commit()
                committed = True
        finally:
            self._puts.drop_gathered()
            self.tail.close(abort=True)
            self._records.wait_hashing()
            never_written = self._created and self.m.generation == 0 and not committed
            if never_written:
                shutil.rmtree(self.root, ignore_errors=True)
            self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
