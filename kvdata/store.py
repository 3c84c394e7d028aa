"""The Store: one dataset directory, read through the memmap side-index.

Reads see one committed generation (the one loaded at open or by the last
commit/refresh), so a reader never observes half a commit. Sealed shards are
memory-mapped once per process and sliced by the offsets the index holds; only
records still in the open tail go through an LMDB read transaction.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import msgpack
import numpy as np

from . import format as fmt
from .batching import Copier
from .fsutil import read_regular
from .errors import ClosedError, CorruptDatasetError, MissingShardError, NotADatasetError, ReadOnlyError
from .index import Index
from .inspection import Inspection
from .shards import ENVS, SealedShard, open_tail_for_read

MANIFEST = "manifest.json"
MAX_MANIFEST = 1 << 30
_HEAD_MASK = fmt.MAX_HEAD
_PLAN_CACHE_MAX = 4096
# Values at least this large get an madvise(WILLNEED) over their exact byte range
# before they are touched: one large read instead of a page fault every 4 KiB when
# cold, and the reads of a whole batch in flight at once. Smaller values fit in
# the kernel's fault read-around anyway.
READAHEAD_MIN = 64 << 10
_PAGE_MASK = ~(mmap.PAGESIZE - 1)
# entry -> (path of a complete copy, whether it is a staged copy to hold a reader lock on)
ShardLocator = Callable[[dict], "tuple[Path, bool]"]


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    try:
        data = read_regular(path, MAX_MANIFEST)
    except IsADirectoryError:
        raise CorruptDatasetError(f"{path} is not a regular file; run `kvdata reindex {root}`") from None
    except FileNotFoundError:
        if not root.exists():
            raise NotADatasetError(
                f"{root}: no such dataset; create one with `kvdata put {root} FILE` or kvdata.open(path, 'a')"
            ) from None
        if (root / "shards").is_dir():
            raise CorruptDatasetError(f"{path} is missing; run `kvdata reindex {root}` to rebuild it from the shards") from None
        raise NotADatasetError(f"{root} is not a kvdata dataset (no {MANIFEST}); check the path") from None
    except (NotADirectoryError, IsADirectoryError):
        raise NotADatasetError(f"{root} is not a kvdata dataset directory; check the path") from None
    return fmt.parse_manifest(data, str(path))


class Store(Inspection):
    """A kvdata dataset. Use kvdata.open() to get one; use it as a context manager."""

    def __init__(self, root: str | os.PathLike[str], mode: str = "r", *, shard_size: int | str | None = None,
                 compress: bool = True, shard_locator: ShardLocator | None = None,
                 copy_threads: int | None = None, readahead: bool = True, max_open_shards: int = 16,
                 shard_mapped: Callable[[dict], None] | None = None,
                 shards_needed: Callable[[list[dict]], None] | None = None) -> None:
        if mode not in ("r", "a", "w"):
            raise ValueError(f"mode must be 'r', 'a' or 'w', not {mode!r}")
        self.root = Path(root)
        self.mode = mode
        self._locator = shard_locator
        self._pid = os.getpid()
        self._sealed: OrderedDict[str, SealedShard] = OrderedDict()  # sha -> handle, least recent first
        self._sealed_ids: dict[str, int] = {}
        # With staged copies, a mapped shard holds a reader lock that keeps it from eviction:
        # keep only the most recently used few mapped, so tiers can turn over.
        self._max_open = max_open_shards if shard_locator is not None else None
        self._shard_mapped = shard_mapped  # told once a staged copy is mapped and reader-locked
        self._shards_needed = shards_needed  # told of a batch's unmapped shards before they are mapped
        self._tail_env: Any = None
        self._closed = False
        self._plans: dict[bytes, fmt.Plan] = {}
        self._copier = Copier(copy_threads)
        self._readahead = readahead
        self._closers: list[Callable[[], None]] = []
        self.home: Any = None     # set by kvdata.access when shards come through a staging engine
        self.engine: Any = None
        self._writer: Any = None
        if mode == "r":
            self._load()
        else:
            from .writer import Writer  # the write path is only loaded by writers

            self._writer = Writer(self, shard_size=shard_size, compress=compress, reset=(mode == "w"))

    # ------------------------------------------------------------ lifecycle

    def _load(self) -> None:
        """Load the current generation's manifest and index (retrying if a commit races us)."""
        for attempt in range(5):
            m = read_manifest(self.root)
            try:
                self._index = Index(self.root / "index", m)
            except FileNotFoundError as e:
                if attempt < 4 and read_manifest(self.root)["generation"] != m["generation"]:
                    continue
                raise CorruptDatasetError(f"index file {e.filename} is missing; run `kvdata reindex {self.root}`") from None
            break
        old_tail = getattr(self, "manifest", {}).get("tail")
        self.manifest = m
        self._entries = m["shards"]
        self._shard_handles: list[SealedShard | None] = [self._sealed.get(s["sha256"]) for s in self._entries]
        if self._tail_env is not None and old_tail != m["tail"]:
            ENVS.release(self._tail_env)
            self._tail_env = None

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call fn when the store closes (owners of engines and homes use it)."""
        self._closers.append(fn)

    def refresh(self) -> bool:
        """Move a reader to the newest committed generation; True if it changed."""
        self._check_open()
        gen = self.manifest["generation"]
        if read_manifest(self.root)["generation"] != gen:
            self._load()
        return self.manifest["generation"] != gen

    def close(self) -> None:
        """Commit pending writes (mode a/w) and release files. Idempotent."""
        if self._closed:
            return
        try:
            if self._writer is not None:
                self._writer.close(commit=True)
        finally:
            self._closed = True
            if os.getpid() == self._pid:
                if self._tail_env is not None:
                    ENVS.release(self._tail_env)
                for h in self._sealed.values():
                    h.close()
            self._tail_env = None
            self._sealed.clear()
            self._shard_handles = []
            self._copier.close()
            closers, self._closers = self._closers, []
            for fn in closers:
                fn()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self._writer is not None:
            self._writer.close(commit=False)
            self._writer = None
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_writer", None) is not None and not self._closed:
            try:
                self._writer.close(commit=False)
            except Exception:
                pass

    def __reduce__(self) -> tuple:
        if self.mode != "r":
            raise ReadOnlyError(f"{self.root}: a store open for writing cannot be pickled; pickle a read-only one")
        return (Store, (str(self.root), "r"), None, None, None)

    def __repr__(self) -> str:
        return f"<kvdata.Store {str(self.root)!r} mode={self.mode!r} samples={len(self)} generation={self.generation}>"

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.root}: the store is closed; open it again")
        if os.getpid() != self._pid:
            self._after_fork()

    def _after_fork(self) -> None:
        # LMDB handles must not be used or closed in a child (the registry keeps the
        # parent's alive); memory maps stay valid across fork.
        self._tail_env = None
        for h in self._sealed.values():
            h._env = None
        self._pid = os.getpid()

    # ------------------------------------------------------------ properties

    @property
    def generation(self) -> int:
        return int(self.manifest["generation"])

    @property
    def classes(self) -> list[str]:
        return list(self.manifest.get("classes") or [])

    @property
    def fields(self) -> dict[str, dict[str, Any]]:
        return dict(self.manifest.get("fields") or {})

    @property
    def labels(self) -> np.ndarray:
        """int64 label per sample (fmt.NO_LABEL where none), a read-only view of the index."""
        return self._index.samples["label"]

    def shard_of(self, indices: Any) -> np.ndarray:
        """Shard id of each sample index: what samplers and the stager plan with."""
        return self._index.samples["shard"][np.asarray(indices, dtype=np.int64)].astype(np.int64)

    @property
    def sample_shards(self) -> np.ndarray:
        """Shard id of every sample, a read-only view of the index."""
        return self._index.samples["shard"]

    def __len__(self) -> int:
        return self._index.count

    # ------------------------------------------------------------ reads

    def _positions(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self._index.count
        if idx.size and (idx.min() < 0):
            idx = np.where(idx < 0, idx + n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = idx[(idx < 0) | (idx >= n)][0]
            raise IndexError(f"sample index {int(bad)} out of range for {n} samples in {self.root}")
        return idx

    def get_many(self, indices: Sequence[int] | np.ndarray, *, copy: bool = False) -> list[Any]:
        """Records at sample indices, in the order given.

        Sealed records are sliced from memory maps: byte records come back as
        read-only memoryviews and array fields as read-only numpy views, valid
        while the store is open (copy=True returns owned bytes/arrays).
        """
        self._check_open()
        pos = self._positions(indices)
        shard, slot, rec = self._index.resolve(pos)
        out: list[Any] = [None] * len(pos)
        sealed = rec >= 0
        all_sealed = bool(sealed.all())
        where = np.arange(len(pos)) if all_sealed else np.nonzero(sealed)[0]
        if len(where):
            sh = shard if all_sealed else shard[where]
            r = self._index.records[rec if all_sealed else rec[where]]
            unknown = r["offset"] == fmt.UNKNOWN_OFFSET
            if unknown.any():  # shards sealed where offsets could not be learned: read through LMDB
                for j, s, sl in zip(where[unknown].tolist(), sh[unknown].tolist(), slot[where[unknown]].tolist()):
                    out[j] = self._decode_value(self._open_sealed(s).lmdb_value(sl), copy)
                where, sh, r = where[~unknown], sh[~unknown], r[~unknown]
            hk = r["head_kind"]
            ends = r["offset"].astype(np.int64) + (hk & _HEAD_MASK) + r["size"]
            if (ends > self._index.shard_bytes[sh]).any():
                raise CorruptDatasetError(f"{self.root}: side-index offsets run past a shard's end; run `kvdata reindex`")
            handles = self._shard_handles
            if self._readahead:
                self._advise_willneed(sh, r, hk)
            if self._max_open is not None:
                self._touch(np.unique(sh).tolist())
            plans = self._plans
            unpack = fmt.PREFIX.unpack_from
            decode = fmt.decode_plan
            for j, s, off, size, hk_ in zip(where.tolist(), sh.tolist(), r["offset"].tolist(),
                                            r["size"].tolist(), hk.tolist()):
                h = handles[s] or self._open_sealed(s)
                head = hk_ & _HEAD_MASK
                if hk_ >> 24 == fmt.KIND_RAW:
                    a = off + head
                    out[j] = h.mv[a:a + size] if not copy else h.mm[a:a + size]
                else:
                    a = off + fmt.PREFIX_SIZE
                    lb = h.mm[a:a + unpack(h.mv, off)[5]]
                    plan = plans.get(lb) or self._plan(lb)
                    out[j] = decode(plan, h.u8, h.mv, off + head, copy)
        if not all_sealed:
            tail_at = np.nonzero(~sealed)[0]
            for j, v in zip(tail_at.tolist(), self._tail_values(slot[tail_at].tolist())):
                out[j] = self._decode_value(v, copy)
        return out

    def _advise_willneed(self, sh: np.ndarray, r: np.ndarray, hk: np.ndarray) -> None:
        """Readahead hints for a batch's large values -- unless a few probes (mincore) find
        them already in the page cache, where a hint per value is only syscall overhead."""
        big = r["size"] >= READAHEAD_MIN
        if not big.any():
            return
        starts = r["offset"][big].astype(np.int64)
        ends = starts + (hk[big] & _HEAD_MASK) + r["size"][big]
        handles = self._shard_handles
        shards = sh[big].tolist()
        probe = np.linspace(0, len(shards) - 1, min(len(shards), 8)).astype(int).tolist()
        if all(_resident(handles[shards[i]] or self._open_sealed(shards[i]), int(starts[i]), int(ends[i]))
               for i in probe):
            return
        for s, a, b in zip(shards, starts.tolist(), ends.tolist()):
            h = handles[s] or self._open_sealed(s)
            a0 = a & _PAGE_MASK
            h.mm.madvise(mmap.MADV_WILLNEED, a0, b - a0)

    def get_batch(self, indices: Sequence[int] | np.ndarray, *, fields: Sequence[str] | None = None,
                  alloc: Callable[[tuple, np.dtype], np.ndarray] | None = None) -> Any:
        """A batch as arrays: each array field stacked into one (N, ...) array (one copy per
        sample, large batches split across copy threads; `alloc(shape, dtype)` may provide
        the arrays, e.g. in shared memory), scalars as 1-D arrays, ragged fields and bytes
        as lists. Byte records come back as a list of bytes. `fields` keeps only those."""
        recs = self.get_many(indices)
        if recs and not isinstance(recs[0], dict):
            return [bytes(r) for r in recs]
        if fields is not None:
            recs = [{f: r[f] for f in fields} for r in recs]
        return self._copier.stack(recs, alloc)

    def _touch(self, shard_ids: list[int]) -> None:
        """Mark shards as just used, and unmap the least recently used beyond max_open_shards
        (their memory stays valid for views already handed out; only the lock is dropped)."""
        cold = [self._entries[s] for s in shard_ids if self._shard_handles[s] is None]
        if len(cold) > 1 and self._shards_needed is not None:
            self._shards_needed(cold)
        for s in shard_ids:
            if self._shard_handles[s] is None:
                self._open_sealed(s)
            self._sealed.move_to_end(self._entries[s]["sha256"])
        while self._max_open is not None and len(self._sealed) > max(self._max_open, len(shard_ids)):
            sha, old = self._sealed.popitem(last=False)
            sid = self._sealed_ids.pop(sha, None)
            if sid is not None and sid < len(self._shard_handles):
                self._shard_handles[sid] = None
            old.close()

    def _plan(self, layout_bytes: bytes) -> fmt.Plan:
        """Decoding plan of a layout, cached: records of equal shapes share one."""
        if len(self._plans) >= _PLAN_CACHE_MAX:
            self._plans.clear()
        plan = self._plans[layout_bytes] = fmt.make_plan(msgpack.unpackb(layout_bytes))
        return plan

    def _decode_value(self, v: bytes, copy: bool) -> Any:
        h = fmt.RecordHeader(v)
        if h.kind == fmt.KIND_RAW:
            return bytes(v[h.head:]) if copy else memoryview(v)[h.head:]
        plan = self._plan(bytes(v[fmt.PREFIX_SIZE:fmt.PREFIX_SIZE + h.layout_len]))
        return fmt.decode_plan(plan, np.frombuffer(v, np.uint8), memoryview(v), h.head, copy)

    def _open_sealed(self, shard_id: int) -> SealedShard:
        entry = self._entries[shard_id]
        h = self._sealed.get(entry["sha256"])
        if h is None:
            h = self._map_shard(entry)
            self._sealed[entry["sha256"]] = h
        self._sealed_ids[entry["sha256"]] = shard_id
        self._shard_handles[shard_id] = h
        return h

    def _tail_values(self, slots: list[int]) -> list[bytes]:
        """Copies of tail records (LMDB buffers die with their transaction)."""
        env = self._writer.read_env(self.manifest["tail"]["id"]) if self._writer else self._open_tail()
        if env is None:  # the tail was sealed since we loaded: same slots, now a sealed file
            h = self._open_sealed_fallback()
            return [h.lmdb_value(s) for s in slots]
        out = []
        with ENVS.read(env) as txn:
            for s in slots:
                v = txn.get(fmt.slot_key(s))
                if v is None:
                    raise CorruptDatasetError(f"{self.root}: tail record {s} is missing; run `kvdata verify`")
                out.append(v)
        return out

    def _open_tail(self) -> Any:
        if self._tail_env is None:
            path = self.root / "shards" / self.manifest["tail"]["name"]
            try:
                self._tail_env = open_tail_for_read(path, int(self.manifest["shard_size"]))
            except FileNotFoundError:
                return None
        return self._tail_env

    def _map_shard(self, entry: dict) -> SealedShard:
        """Map the fastest complete copy; if a staged copy vanishes before we map it, look again."""
        if self._locator is None:
            return SealedShard(self.root / "shards" / entry["name"], int(entry["bytes"]))
        for attempt in range(3):
            path, staged = self._locator(entry)
            try:
                h = SealedShard(path, int(entry["bytes"]), hold_lock=staged)
                if self._shard_mapped is not None:
                    self._shard_mapped(entry)
                return h
            except MissingShardError:
                if not staged or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _open_sealed_fallback(self) -> SealedShard:
        tid = self.manifest["tail"]["id"]
        current = read_manifest(self.root)
        for e in current["shards"]:
            if e["id"] == tid:
                return self._map_shard(e)
        raise CorruptDatasetError(f"{self.root}: tail shard {self.manifest['tail']['name']} is missing; run `kvdata reindex`")

    def _metas(self, positions: Any) -> list[tuple[int, dict]]:
        """(kind, meta) of the records at sample positions: keys and labels without payloads."""
        pos = self._positions(positions)
        shard, slot, rec = self._index.resolve(pos)
        out: list[Any] = [None] * len(pos)
        tail_at: list[int] = []
        offs = np.zeros(len(pos), np.uint64)
        offs[rec >= 0] = self._index.records["offset"][rec[rec >= 0]]
        for j, (s, r, off) in enumerate(zip(shard.tolist(), rec.tolist(), offs.tolist())):
            if r < 0:
                tail_at.append(j)
                continue
            h = self._shard_handles[s] or self._open_sealed(s)
            if off == int(fmt.UNKNOWN_OFFSET):
                v = h.lmdb_value(int(slot[j]))
                hd = fmt.RecordHeader(v)
                out[j] = (hd.kind, hd.meta(v))
                continue
            _m, kind, _v, _f, _h, ll, ml, _c = fmt.PREFIX.unpack_from(h.mv, off)
            s0 = off + fmt.PREFIX_SIZE + ll
            out[j] = (kind, msgpack.unpackb(h.mv[s0:s0 + ml]))
        if tail_at:
            for j, v in zip(tail_at, self._tail_values([int(slot[j]) for j in tail_at])):
                hd = fmt.RecordHeader(v)
                out[j] = (hd.kind, hd.meta(v))
        return out

    def find(self, key: str | bytes) -> int | None:
        """Sample index of `key`, or None."""
        self._check_open()
        kb = fmt.check_key(key)
        skey = kb.decode("utf-8")
        for p in self._index.candidates(fmt.key_hash(kb)):
            if p < self._index.count and self._metas([p])[0][1]["k"] == skey:
                return p
        return None

    def __contains__(self, key: object) -> bool:
        try:
            return self.find(key) is not None  # type: ignore[arg-type]
        except fmt.InvalidKeyError:
            return False

    def get(self, key: str | bytes, default: Any = None, *, copy: bool = False) -> Any:
        """The record stored under `key`, or `default`."""
        p = self.find(key)
        return default if p is None else self.get_many([p], copy=copy)[0]

    def __getitem__(self, item: int | str) -> Any:
        if isinstance(item, (int, np.integer)):
            return self.get_many([int(item)])[0]
        if isinstance(item, (str, bytes)):
            p = self.find(item)
            if p is None:
                raise KeyError(item)
            return self.get_many([p])[0]
        raise TypeError(f"index a Store with an int or a str key, not {type(item).__name__}")

    def __iter__(self) -> Iterator[Any]:
        n = len(self)
        for start in range(0, n, 256):
            yield from self.get_many(range(start, min(n, start + 256)))

    # ------------------------------------------------------------ writes (delegated)

    def _w(self) -> Any:
        self._check_open()
        if self._writer is None:
            raise ReadOnlyError(f"{self.root} is open read-only; open it with mode='a' to write")
        return self._writer

    def put(self, key: str, value: Any, *, label: int | None = None) -> None:
        """Store `value` (bytes, or a dict of arrays/bytes/str/scalars) under `key`."""
        self._w().put(key, value, label)

    def put_many(self, pairs: Iterable[tuple[Any, ...]]) -> int:
        """Store many (key, value) or (key, value, label) tuples; returns how many."""
        return self._w().put_many(pairs)

    def delete(self, key: str) -> None:
        self._w().delete(key)

    def seal(self) -> None:
        """Seal the tail at the next commit even if it is not full.

        A finished dataset should end sealed: every record is then read by memory-map
        offset, and every shard can be compressed, checksummed, pushed and staged.
        """
        self._w().seal_requested = True

    def set_classes(self, classes: Sequence[str]) -> None:
        """Class names (label i -> classes[i]) kept in the manifest."""
        self._w().classes = [str(c) for c in classes]

    def commit(self) -> int:
        """Make every write since the last commit durable and visible, atomically; returns the generation."""
        return self._w().commit()


def _resident(h: SealedShard, start: int, end: int) -> bool:
    """Whether the first and last pages of [start, end) of a mapped shard are in the page cache."""
    base = h.u8.ctypes.data
    vec = ctypes.create_string_buffer(1)
    for off in (start, end - 1):
        page = (base + off) & _PAGE_MASK
        if _libc().mincore(ctypes.c_void_p(page), ctypes.c_size_t(mmap.PAGESIZE), vec) != 0 or not vec.raw[0] & 1:
            return False
    return True


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def open_store(path: str | os.PathLike[str], mode: str = "r", *, shard_size: int | str | None = None,
               compress: bool = True, copy_threads: int | None = None) -> Store:
    """Open a dataset: "r" reads, "a" appends (creating it if missing), "w" starts it empty.

    shard_size: seal shards at this size ("256MB", "1GiB" or bytes); default 256MB for a
    new dataset, else the dataset's own. A new value applies to shards sealed from now on.
    A new dataset whose first commit never happens (an error in the `with` block) is removed.

    copy_threads: threads that assemble large batches in get_batch (default: up to 4
    cores; use 1 inside worker processes).
    """
    return Store(path, mode, shard_size=shard_size, compress=compress, copy_threads=copy_threads)
