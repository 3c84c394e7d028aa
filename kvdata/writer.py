"""The single writer of a dataset: appends, overwrites, deletes, sealing and atomic commits.

Commit protocol (a crash at any instant leaves the old or the new generation):
  1. the tail's LMDB transaction commits and is synced (sealed shards were fsync'ed when sealed);
  2. the new side-index rows/runs go to files no reader of the old generation looks at, fsync'ed;
  3. manifest.json is replaced by rename (the commit point), and the directory fsync'ed;
  4. files the new generation no longer references are removed.
Opening a writer (and a failed commit) runs recovery: orphan files are removed and the tail is
cut back to the slots the manifest committed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

import lmdb
import numpy as np

from . import format as fmt
from . import index as ix
from .errors import ClosedError, CommitError, CorruptDatasetError, NotADatasetError, RecordTooLargeError, WriterLockedError
from .fsutil import atomic_write, fsync_dir, unlink_quiet
from .shards import ENVS, open_tail_for_write, seal, truncate_tail
from .sizes import parse_size

LOCK = ".lock"
LMDB_TXN_BYTES = 64 << 20  # commit the LMDB transaction this often to bound dirty memory
RECORD_OVERHEAD = 64


def _lock(root: Path) -> int:
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            pid = os.pread(fd, 32, 0).decode().strip() or "?"
        finally:
            os.close(fd)
        raise WriterLockedError(
            f"{root} is open for writing by another process (pid {pid}); wait for it to finish, one writer at a time"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class Writer:
    """Pending writes of one Store opened with mode a/w."""

    def __init__(self, store: Any, *, shard_size: int | str | None, compress: bool, reset: bool) -> None:
        self.store = store
        self.root: Path = store.root
        if self.root.exists() and not self.root.is_dir():
            raise NotADatasetError(f"{self.root} exists and is not a directory; choose another dataset path")
        if self.root.exists() and not (self.root / "manifest.json").exists() and not (self.root / "shards").exists() \
                and any(p.name != LOCK for p in self.root.iterdir()):
            raise NotADatasetError(f"{self.root} exists, is not empty and is not a kvdata dataset; choose another path")
        fresh_dir = not self.root.exists() or not any(self.root.iterdir())
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = _lock(self.root)
        self._created = False  # True: this writer made the dataset, so a failed first write removes it
        self.txn: Any = None
        self.env: Any = None
        self._old_envs: dict[int, Any] = {}
        self.failed = False
        try:
            (self.root / "shards").mkdir(exist_ok=True)
            (self.root / "index").mkdir(exist_ok=True)
            manifest_path = self.root / "manifest.json"
            requested = None if shard_size is None else parse_size(shard_size, "shard_size")
            if reset or not manifest_path.exists():
                self._created = fresh_dir and not reset
                self._start_empty(requested or 256_000_000, compress)
            self._recover()
            if requested is not None and requested != self.shard_size:
                self.shard_size = requested  # applies to shards sealed from now on
                self.m = dict(self.m, shard_size=requested)
                self.dirty = True
        except BaseException:
            self._unlock()
            raise

    # ------------------------------------------------------------ setup and recovery

    def _start_empty(self, shard_size: int, compress: bool) -> None:
        m = fmt.new_manifest(shard_size, compress)
        try:
            from .store import read_manifest

            old = read_manifest(self.root)
            m["generation"] = int(old["generation"]) + 1
            # the old tail must not be reused in place: unlink it so open readers keep their copy
            unlink_quiet(self.root / "shards" / old["tail"]["name"])
            unlink_quiet(self.root / "shards" / (old["tail"]["name"] + "-lock"))
        except (NotADatasetError, CorruptDatasetError):
            pass
        unlink_quiet(self.root / "shards" / fmt.tail_name(0))
        unlink_quiet(self.root / "shards" / (fmt.tail_name(0) + "-lock"))
        atomic_write(self.root / "manifest.json", fmt.dump_manifest(m))

    def _recover(self) -> None:
        """Bring files back to exactly what manifest.json says and reset pending state."""
        from .store import read_manifest

        self._close_envs(abort=True)
        m = read_manifest(self.root)
        self.m = m
        self.shard_size = int(m["shard_size"])
        self.compress = bool(m["compress"])
        for p in self.root.glob("manifest.json.tmp*"):  # a writer killed while replacing the manifest
            unlink_quiet(p)
        keep_shards = {s["name"] for s in m["shards"]} | {s["zst"]["name"] for s in m["shards"] if s.get("zst")}
        tail = m["tail"]["name"]
        keep_shards |= {tail, tail + "-lock"}
        for p in (self.root / "shards").iterdir():
            if p.name not in keep_shards:
                unlink_quiet(p)
        idx = m["index"]
        keep_index = {idx["samples"], idx["records"]} | {r["name"] for r in idx["keys"]}
        for p in (self.root / "index").iterdir():
            if p.name not in keep_index:
                unlink_quiet(p)
        for s in m["shards"]:
            if not (self.root / "shards" / s["name"]).exists():
                from .errors import MissingShardError

                raise MissingShardError(f"shard {self.root / 'shards' / s['name']} is missing; restore it before writing")
        tail_path = self.root / "shards" / tail
        if not tail_path.exists() and m["tail"]["records"]:
            raise CorruptDatasetError(f"tail shard {tail_path} is missing; restore it or run `kvdata reindex`")
        try:
            self.env = open_tail_for_write(tail_path, self.shard_size)
            truncate_tail(self.env, int(m["tail"]["records"]))
        except lmdb.Error as e:
            raise CorruptDatasetError(f"{tail_path}: cannot open the tail shard ({e}); run `kvdata reindex`") from None
        self.tail_id = int(m["tail"]["id"])
        self.tail_slots = int(m["tail"]["records"])
        info = self.env.info()
        self.tail_bytes = (info["last_pgno"] + 1) * 4096 if self.tail_slots else 0
        self.txn_bytes = 0
        self.sealed: list[tuple[dict[str, Any], np.ndarray]] = []
        self.new_keys: dict[str, int] = {}
        self.new_rows: list[tuple[int, int, int]] = []
        self.new_hash: list[int] = []
        self.new_alive: list[bool] = []
        self.over: dict[int, tuple[int, int, int]] = {}
        self.deleted: set[int] = set()
        self.dirty = False
        self.seal_requested = False
        self.schema = dict(m.get("fields") or {})
        self._last_schema: dict[str, Any] | None = None
        self.classes = list(m.get("classes") or [])
        self.store._load()
        self.failed = False

    def _close_envs(self, abort: bool) -> None:
        if self.txn is not None:
            ENVS.mark_busy(self.env, -1)
            try:
                self.txn.abort() if abort else self.txn.commit()
            except lmdb.Error:
                pass
            self.txn = None
        for e in list(self._old_envs.values()) + ([self.env] if self.env is not None else []):
            ENVS.release(e)
        self._old_envs.clear()
        self.env = None

    def read_env(self, tail_id: int) -> Any:
        """The LMDB env a reader in this process must use for tail `tail_id` (one env per file per process)."""
        return self.env if tail_id == self.tail_id else self._old_envs.get(tail_id)

    def _check(self) -> None:
        if self._lock_fd is None or self.failed:
            raise ClosedError(f"{self.root}: the writer is closed or failed; open the dataset again to write")

    # ------------------------------------------------------------ writes

    def put(self, key: str, value: Any, label: int | None) -> None:
        self._check()
        kb = fmt.check_key(key)
        skey = kb.decode("utf-8")
        rec, label, layout = fmt.encode_record(skey, value, label)
        self._put_record(skey, fmt.key_hash(kb), rec, label, layout, self._committed_pos(skey, kb))

    def put_many(self, pairs: Iterable[tuple[Any, ...]]) -> int:
        self._check()
        n = 0
        chunk: list[tuple[Any, ...]] = []
        for pair in pairs:
            chunk.append(pair)
            if len(chunk) >= 1024:
                n += self._put_chunk(chunk)
                chunk = []
        if chunk:
            n += self._put_chunk(chunk)
        return n

    def _put_chunk(self, chunk: list[tuple[Any, ...]]) -> int:
        keys: list[str] = []
        hashes: list[int] = []
        for item in chunk:
            kb = fmt.check_key(item[0])
            keys.append(kb.decode("utf-8"))
            hashes.append(fmt.key_hash(kb))
        found: dict[int, int] = {}
        q, p = self.store._index.candidates_many(np.array(hashes, dtype=np.uint64))
        if len(q):
            metas = self.store._metas(p)
            for qi, pi, (_k, meta) in zip(q.tolist(), p.tolist(), metas):
                if meta["k"] == keys[qi]:
                    found[qi] = pi
        for i, (item, skey, h) in enumerate(zip(chunk, keys, hashes)):
            value = item[1]
            label = item[2] if len(item) > 2 else None
            rec, label, layout = fmt.encode_record(skey, value, label)
            pos = found.get(i)
            self._put_record(skey, h, rec, label, layout, None if pos is None or pos in self.deleted else pos)
        return len(chunk)

    def _committed_pos(self, skey: str, kb: bytes) -> int | None:
        if skey in self.new_keys:
            return None
        for p in self.store._index.candidates(fmt.key_hash(kb)):
            if p not in self.deleted and self.store._metas([p])[0][1]["k"] == skey:
                return p
        return None

    def _put_record(self, skey: str, h: int, rec: bytes, label: int | None, layout: list,
                    committed: int | None) -> None:
        slot = self._append(skey, rec)
        row = (self.tail_id, slot, fmt.NO_LABEL if label is None else int(label))
        i = self.new_keys.get(skey)
        if i is not None:
            self.new_rows[i] = row
        elif committed is not None:
            self.over[committed] = row
        else:
            self.new_keys[skey] = len(self.new_rows)
            self.new_rows.append(row)
            self.new_hash.append(h)
            self.new_alive.append(True)
        if layout:
            sch = fmt.field_schema(layout)
            if sch != self._last_schema:
                self.schema = fmt.merge_schema(self.schema, sch)
                self._last_schema = sch

    def delete(self, key: str) -> None:
        self._check()
        kb = fmt.check_key(key)
        skey = kb.decode("utf-8")
        i = self.new_keys.pop(skey, None)
        committed = None if i is not None else self._committed_pos(skey, kb)
        if i is None and committed is None:
            raise KeyError(f"{key!r} is not in {self.root}")
        self._append(skey, fmt.encode_tombstone(skey))
        if i is not None:
            self.new_alive[i] = False
        else:
            self.deleted.add(committed)  # type: ignore[arg-type]
            self.over.pop(committed, None)  # type: ignore[arg-type]

    def _append(self, skey: str, rec: bytes) -> int:
        """Put one record into the tail (sealing it first if full); return its slot."""
        need = len(rec) + RECORD_OVERHEAD
        if need > self.shard_size:
            raise RecordTooLargeError(
                f"key {skey!r}: record of {len(rec)} bytes does not fit in a shard of {self.shard_size} bytes; "
                "use a larger --shard-size"
            )
        if self.tail_slots and self.tail_bytes + need > self.shard_size:
            self._seal()
        if self.txn is None:
            self.txn = self.env.begin(write=True)
            ENVS.mark_busy(self.env, 1)
        slot = self.tail_slots
        try:
            self.txn.put(fmt.slot_key(slot), rec, append=True)
        except lmdb.MapFullError:
            self._fail()
            raise CommitError(f"{self.root}: the tail shard's map is full; commit more often or lower --shard-size") from None
        self.tail_slots += 1
        self.tail_bytes += need
        self.txn_bytes += need
        self.dirty = True
        if self.txn_bytes >= LMDB_TXN_BYTES:
            self._flush_txn()
        return slot

    def _flush_txn(self) -> None:
        if self.txn is not None:
            txn, self.txn = self.txn, None
            ENVS.mark_busy(self.env, -1)
            txn.commit()
        self.txn_bytes = 0

    def _seal(self) -> None:
        """Turn the full tail into an immutable shard; later records go to a new tail."""
        try:
            self._flush_txn()
            self.env.sync(True)
            entry, records = seal(self.env, self.root / "shards", self.tail_id, self.compress)
        except (OSError, lmdb.Error) as e:
            self._fail()
            raise CommitError(self._failure_message(e)) from None
        self.sealed.append((entry, records))
        self._old_envs[self.tail_id] = self.env
        self.tail_id += 1
        self.env = open_tail_for_write(self.root / "shards" / fmt.tail_name(self.tail_id), self.shard_size)
        self.tail_slots = 0
        self.tail_bytes = 0

    # ------------------------------------------------------------ commit

    def commit(self) -> int:
        self._check()
        if self.seal_requested and self.tail_slots:
            self._seal()
            self.dirty = True
        self.seal_requested = False
        if not self.dirty and self.classes == list(self.m.get("classes") or []):
            return int(self.m["generation"])
        try:
            self._flush_txn()
            self.env.sync(True)
            new_m, stale = self._write_generation()
        except (OSError, lmdb.Error) as e:
            self._fail()
            raise CommitError(self._failure_message(e)) from None
        for name in stale:
            unlink_quiet(self.root / name)
        for tid, env in list(self._old_envs.items()):
            ENVS.release(env)
            unlink_quiet(self.root / "shards" / fmt.tail_name(tid))
            unlink_quiet(self.root / "shards" / (fmt.tail_name(tid) + "-lock"))
        self._old_envs.clear()
        self.m = new_m
        self.sealed = []
        self.new_keys, self.new_rows, self.new_hash, self.new_alive = {}, [], [], []
        self.over, self.deleted = {}, set()
        self.dirty = False
        self.store._load()
        return int(new_m["generation"])

    def _failure_message(self, e: BaseException) -> str:
        gen = self.m["generation"]
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) or isinstance(e, lmdb.MapFullError):
            why = "the disk is full"
        elif isinstance(e, lmdb.Error):  # LMDB reports ENOSPC/EFBIG as text, often as a bare I/O error
            why = f"writing the tail shard failed: {e}; is the disk full?"
        else:
            why = str(e)
        return (f"{self.root}: commit failed ({why}); the dataset is unchanged at generation {gen} and the "
                "writes since the last commit were discarded; free space and write them again")

    def _fail(self) -> None:
        """Discard pending writes and return the files to the last committed generation."""
        try:
            self._recover()
        except Exception:
            self.failed = True

    def _write_generation(self) -> tuple[dict[str, Any], list[str]]:
        m = self.m
        gen = int(m["generation"]) + 1
        index_dir = self.root / "index"
        idx = self.store._index
        old = m["index"]
        stale: list[str] = []
        n = idx.count
        live = [i for i, a in enumerate(self.new_alive) if a]
        new_rows = np.array([self.new_rows[i] for i in live], dtype=fmt.SAMPLE_DTYPE)
        new_hash = np.array([self.new_hash[i] for i in live], dtype=np.uint64)

        records_name, records_count = old["records"], int(old["records_count"])
        if self.sealed:
            rows = np.concatenate([r for _e, r in self.sealed])
            records_name = records_name or f"records-{gen:08d}.bin"
            ix.append_rows(index_dir / records_name, records_count, rows)
            records_count += len(rows)

        if not self.over and not self.deleted:
            samples_name = old["samples"] or f"samples-{gen:08d}.bin"
            ix.append_rows(index_dir / samples_name, n, new_rows)
            runs = ix.add_key_run(index_dir, old["keys"], gen, new_hash, np.arange(n, n + len(live), dtype=np.uint64))
            count = n + len(live)
        else:
            samples = np.array(idx.samples)
            for p, row in self.over.items():
                samples[p] = row
            hashes = ix.all_key_hashes(idx)
            keep = np.ones(n, dtype=bool)
            keep[list(self.deleted)] = False
            samples = np.concatenate([samples[keep], new_rows])
            hashes = np.concatenate([hashes[keep], new_hash])
            samples_name = f"samples-{gen:08d}.bin"
            ix.write_new(index_dir / samples_name, samples)
            run_name = f"keys-{gen:08d}-00.bin"
            ix.write_key_run(index_dir / run_name, hashes, np.arange(len(samples), dtype=np.uint64))
            runs = [{"name": run_name, "count": int(len(samples))}]
            count = len(samples)
        fsync_dir(index_dir)
        referenced = {samples_name, records_name} | {r["name"] for r in runs}
        stale += [f"index/{name}" for name in {old["samples"]} | {r["name"] for r in old["keys"]} if name and name not in referenced]

        new_m = dict(m)
        new_m.update({
            "generation": gen,
            "count": int(count),
            "shards": list(m["shards"]) + [e for e, _r in self.sealed],
            "tail": {"id": self.tail_id, "name": fmt.tail_name(self.tail_id), "records": self.tail_slots},
            "index": {"samples": samples_name, "records": records_name, "records_count": records_count, "keys": runs},
            "fields": self.schema,
            "classes": self.classes,
        })
        atomic_write(self.root / "manifest.json", fmt.dump_manifest(new_m))
        return new_m, stale

    # ------------------------------------------------------------ close

    def close(self, commit: bool) -> None:
        if self._lock_fd is None:
            return
        committed = False
        try:
            if commit and not self.failed:
                self.commit()
                committed = True
        finally:
            self._close_envs(abort=True)
            never_written = self._created and int(self.m["generation"]) == 0 and not committed
            if never_written:
                shutil.rmtree(self.root, ignore_errors=True)
            self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
