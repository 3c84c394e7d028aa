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
from collections.abc import Callable
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
    RecordTooLargeError,
)
from ..format import Manifest, TailEntry, names
from .gathered_puts import GatheredPuts
from .generation import Generation, load_generation, read_manifest
from .lock import WriterLock
from .new_generation import start_empty, write_generation
from .open_tail import RECORD_OVERHEAD, OpenTail
from .pending import Pending
from .put_paths import PutPaths
from .reader import Reader
from .recovery import LeftBehind, holds_data, settle, tidy
from .shards import ENVS
from .write_errors import another_writer, disk_full, failure_message, full_at_open

DEFAULT_SHARD_SIZE = 256_000_000
SEAL_ON_CLOSE_MIN = 64 << 10  # a "w" writer's close seals the tail unless the whole dataset is smaller

class Writer(PutPaths):
    """The pending writes of one dataset opened with mode a/w, and its Reader (put and put_many:
    store.put_paths)."""

    m: Manifest           # the last committed generation's manifest
    compress: bool
    pending: Pending

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
        self._written: set[str] = set()  # shard-dir files this writer created: recovery may remove them
        self._writing_generation: int | None = None  # index files of this generation are ours (a commit in flight)
        self._created = False  # True: this writer made the dataset, so a failed first write removes it
        # "w": the dataset is written whole, so close() seals its tail (sealing is a hard link, not
        # a copy) and it is read right away by memory map, not LMDB -- unless the whole dataset
        # is a tail of a few records (< SEAL_ON_CLOSE_MIN bytes): its LMDB reads cost microseconds
        self._seal_on_close = reset
        self._make_reader = make_reader
        self.reader: Reader | None = None
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
            self._recover(shard_size=requested)
            if requested is not None and requested != self.m.shard_size:
                self.m = self.m.replace(shard_size=requested)  # applies to shards sealed from now on
                self.pending.dirty = True
        except BaseException as e:
            self._unlock()
            if isinstance(e, OSError) and disk_full(e):
                raise CommitError(full_at_open(root, e)) from None
            raise

    @property
    def shards_dir(self) -> Path:
        return self.root / names.SHARDS_DIR

    # ------------------------------------------------------------ setup and recovery

    def _recover(self, shard_size: int | None = None) -> None:
        """Bring files back to exactly what manifest.json says and reset pending state.

        Everything the manifest names is checked before any file is touched."""
        self.tail.close(abort=True)
        self._wait_hashing()
        m = read_manifest(self.root)
        tail_path = self.shards_dir / m.tail.name
        for s in m.shards:
            if not (self.shards_dir / s.name).is_file():
                raise MissingShardError(f"shard {self.shards_dir / s.name} is missing; restore it before writing")
        if not tail_path.exists() and m.tail.records:
            raise CorruptDatasetError(f"tail shard {tail_path} is missing; restore it or run `kvdata reindex`")
        gen = load_generation(self.root)  # its index files exist and fit, or a clear error -- still nothing touched
        m = gen.manifest
        self.m = m
        self.compress = m.compress
        self._tidy(m)
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
        self.pending = Pending()
        self._gathered = GatheredPuts(self.shard_size, RECORD_OVERHEAD)  # raw puts not yet written
        self.schema = dict(m.fields)
        self._last_schema: dict[str, Any] | None = None
        self.classes = list(m.classes)
        self.extra = dict(m.extra)
        self._publish(gen)
        self.failed = False

    def _tidy(self, m: Manifest) -> None:
        """Remove leftovers recovery can account for; move anything else aside, never delete it."""
        tidy(self.root, m, LeftBehind(frozenset(self._written), self._writing_generation))

    def _publish(self, gen: Generation) -> None:
        """Readers in this process see `gen` from now on."""
        if self.reader is None:
            self.reader = self._make_reader(gen)
        else:
            self.reader.load(gen)

    def _committed(self) -> Reader:
        assert self.reader is not None  # set by the first recovery, before any write
        return self.reader

    def _wait_hashing(self) -> None:
        """Let the sha256 threads of discarded seals finish before their files are touched."""
        pending = getattr(self, "pending", None)
        if pending is not None:
            pending.wait_hashing()

    @property
    def shard_size(self) -> int:
        return self.tail.shard_size

    def _check(self) -> None:
        if self._lock is None or self.failed:
            raise ClosedError(f"{self.root}: the writer is closed or failed{self._failed_why}; "
                              "open the dataset again to write")

    # ------------------------------------------------------------ writes

    def request_seal(self) -> None:
        self.pending.seal_requested = True

    def set_classes(self, classes: list[str]) -> None:
        self.classes = classes

    def set_extra(self, name: str, value: Any) -> None:
        """Keep plain-JSON `value` in the manifest under `name` from the next commit on (checked now)."""
        self.extra[name] = fmt.checked_extra(self.m, name, value)

    def _committed_pos(self, skey: str, key_hash: int) -> int | None:
        if skey in self.pending.new_keys:
            return None
        reader = self._committed()
        for p in reader.gen.index.candidates(key_hash):
            if p not in self.pending.deleted and reader.metas([p])[0][1]["k"] == skey:
                return p
        return None

    def _put_record(self, skey: str, h: int, rec: bytes, label: int | None, layout: list,
                    committed: int | None) -> None:
        slot = self._append(skey, rec)
        row = (self.tail.id, slot, fmt.NO_LABEL if label is None else int(label))
        p = self.pending
        i = p.new_keys.get(skey)
        if i is not None:
            p.set_row(i, row)
        elif committed is not None:
            p.over[committed] = row
        else:
            p.add(skey, row, h)
        if layout:
            sch = fmt.field_schema(layout)
            if sch != self._last_schema:
                self.schema = fmt.merge_schema(self.schema, sch)
                self._last_schema = sch

    def delete(self, key: str) -> None:
        self._check()
        self.flush_puts()
        kb = fmt.check_key(key)
        skey = kb.decode("utf-8")
        p = self.pending
        i = p.new_keys.pop(skey, None)
        committed = None if i is not None else self._committed_pos(skey, fmt.key_hash(kb))
        if i is None and committed is None:
            raise KeyError(f"{key!r} is not in {self.root}")
        self._append(skey, fmt.encode_tombstone(skey))
        if i is not None:
            p.new_alive[i] = 0
        elif committed is not None:
            p.deleted.add(committed)
            p.over.pop(committed, None)

    def _append(self, skey: str, rec: bytes) -> int:
        """Put one record into the tail (sealing it first if full); return its slot."""
        need = len(rec) + RECORD_OVERHEAD
        if need > self.shard_size:
            raise RecordTooLargeError(
                f"key {skey!r}: record of {len(rec)} bytes does not fit in a shard of {self.shard_size} bytes; "
                "use a larger --shard-size"
            )
        if self.tail.full_for(need):
            self._seal()
        try:
            slot = self.tail.append(rec, need)
        except (OSError, lmdb.Error) as e:
            raise self._tail_failed(e) from None
        self.pending.dirty = True
        return slot

    def _tail_failed(self, e: BaseException) -> CommitError:
        """Discard every write since the last commit after a failed tail write (e.g. the disk
        filled while LMDB spilled dirty pages); the error to raise."""
        self._fail()
        if isinstance(e, lmdb.MapFullError):
            return CommitError(f"{self.root}: the tail shard's map is full; commit more often or lower --shard-size")
        return CommitError(failure_message(self.root, self.m.generation, e))

    def _seal(self) -> None:
        """Turn the full tail into an immutable shard; later records go to a new tail.

        Sealing and opening the next tail are one step: if either fails, everything since the
        last commit is discarded (recovery), so no state can name records that do not exist."""
        inc = self.m.incarnation
        try:
            self._written |= self.tail.names_of_seal(inc)
            entry, records, hasher = self.tail.seal(self.compress, inc)
        except (OSError, lmdb.Error, CorruptDatasetError) as e:
            self._fail()
            raise CommitError(failure_message(self.root, self.m.generation, e)) from None
        self.pending.sealed.append((entry, records))
        self.pending.hashing[entry.id] = hasher

    # ------------------------------------------------------------ commit

    def commit(self) -> int:
        self._check()
        self.flush_puts()
        p = self.pending
        if not p.consistent():
            self._fail()
            raise CommitError(f"{self.root}: a write was interrupted halfway (KeyboardInterrupt?); the writes since "
                              f"generation {self.m.generation} were discarded and nothing was committed; write them again")
        if p.seal_requested and self.tail.slots:
            self._seal()
            p.dirty = True
        p.seal_requested = False
        if not p.dirty and self.classes == list(self.m.classes) and self.extra == self.m.extra:
            return self.m.generation
        self._check_sole_writer()
        try:
            self.tail.sync()
            self.pending.hashed()
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
        self.pending = Pending()
        self._written.clear()
        self._publish(load_generation(self.root))
        return new_m.generation


    def _check_sole_writer(self) -> None:
        """Refuse to commit if another writer got in (a filesystem where flock does not exclude):
        the lock file names someone else, or the manifest moved past the generation we built on."""
        assert self._lock is not None
        on_disk = read_manifest(self.root).generation
        if not self._lock.still_ours() or on_disk != self.m.generation:
            self.failed = True
            raise CommitError(another_writer(self.root, on_disk, self.m.generation))

    def _fail(self) -> None:
        """Discard pending writes and return the files to the last committed generation."""
        try:
            self._recover()
        except Exception:
            self.failed = True

    def _write_generation(self) -> tuple[Manifest, list[str]]:
        self._writing_generation = self.m.generation + 1
        tail = TailEntry(self.tail.id, names.tail_name(self.tail.id, self.m.incarnation), self.tail.slots)
        return write_generation(self.root, self.m, self.pending, self._committed().gen.index, tail,
                                self.schema, self.classes, self.extra)

    # ------------------------------------------------------------ close

    def close(self, commit: bool) -> None:
        if self._lock is None:
            return
        committed = False
        try:
            if commit and not self.failed:
                self.flush_puts()
                if self._seal_on_close and (self.tail.bytes >= SEAL_ON_CLOSE_MIN or self.m.shards or self.pending.sealed):
                    self.request_seal()  # read right away through the sealed (memory-map) path
                self.commit()
                committed = True
        finally:
            self._gathered.drain()
            self.tail.close(abort=True)
            self._wait_hashing()
            never_written = self._created and self.m.generation == 0 and not committed
            if never_written:
                shutil.rmtree(self.root, ignore_errors=True)
            self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
