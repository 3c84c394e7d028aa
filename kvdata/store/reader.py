"""The read path of one dataset: sample indices or keys to record values, one generation at a time.

Sealed shards are memory-mapped once per process and sliced by the offsets the
side-index holds (no LMDB transaction, no copy); only records still in the open
tail go through an LMDB read transaction. Where the shard files come from is the
ShardSource's business (read in place when there is none).
"""

from __future__ import annotations

import mmap
import operator
import os
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import ExitStack
from itertools import repeat
from typing import Any

import numpy as np

from .. import format as fmt
from .._util.libc import pages_resident
from ..errors import CorruptDatasetError, InvalidKeyError, InvalidValueError, MissingShardError
from ..format import ShardEntry, names
from . import record_metas
from .generation import Generation
from .record_decoder import RecordDecoder, own_bytes, plain
from .record_metas import State
from .shards import SealedShard
from .source import ShardSource
from .stacking import ArrayAlloc, Copier
from .tail_reads import TailReads, lmdb_value

# Values at least this large get an madvise(WILLNEED) over their exact byte range
# before they are touched: one large read instead of a page fault every 4 KiB when
# cold, and the reads of a whole batch in flight at once. Smaller values fit in
# the kernel's fault read-around anyway.
READAHEAD_MIN = 64 << 10
READAHEAD_PROBES = 8  # values of a batch probed with mincore before hinting the rest
LOCATE_ATTEMPTS = 3   # a staged copy may vanish between being located and being mapped
_PAGE_MASK = ~(mmap.PAGESIZE - 1)
_HEAD_MASK = fmt.MAX_HEAD
_KIND_SHIFT = fmt.KIND_SHIFT


class Reader:
    """Reads records of one generation; `load()` moves it to another."""

    def __init__(self, gen: Generation, *, source: ShardSource | None = None, copy_threads: int | None = None,
                 readahead: bool = True) -> None:
        self.root = gen.root
        self.source = source
        self._pid = os.getpid()
        self._sealed: OrderedDict[str, SealedShard] = OrderedDict()  # sha -> handle, least recent first
        self._sealed_ids: dict[str, int] = {}
        # With staged copies, a mapped shard holds a reader lock that keeps it from eviction:
        # keep only the most recently used few mapped, so tiers can turn over.
        self.max_open: int | None = source.max_open if source is not None else None
        self._tail = TailReads(self.root, self._map_shard)
        self._decoder = RecordDecoder()
        self._copier = Copier(copy_threads)
        self._readahead = readahead
        # the generation read and its shards' handles, replaced as one by load(): a read takes
        # both once, so a load() from another thread never mixes two generations in one batch
        self._state: State = (gen, [None] * len(gen.shards))

    @property
    def gen(self) -> Generation:
        return self._state[0]

    @property
    def _handles(self) -> list[SealedShard | None]:
        return self._state[1]

    @property
    def state(self) -> State:
        """The generation read now and its shards' handles, as one (a read takes it once)."""
        return self._state

    # ------------------------------------------------------------ lifecycle

    def load(self, gen: Generation) -> None:
        """Read `gen` from now on (mapped shards it shares with the old one stay mapped)."""
        old_tail = self.gen.manifest.tail
        wanted = {s.sha256 for s in gen.shards}
        for sha in [sha for sha in self._sealed if sha not in wanted]:  # rewritten by a compaction: let
            self._sealed.pop(sha).close()                               # its file go (views stay valid)
            self._sealed_ids.pop(sha, None)
        self._state = (gen, [self._sealed.get(s.sha256) for s in gen.shards])
        if old_tail != gen.manifest.tail:
            self._tail.release()

    def check_fork(self) -> None:
        """After fork, LMDB handles must not be used or closed in the child (the registry keeps
        the parent's alive); memory maps stay valid across fork."""
        if os.getpid() != self._pid:
            self._tail.forget()
            for h in self._sealed.values():
                h.forget_env()
            self._pid = os.getpid()

    def close(self) -> None:
        if os.getpid() == self._pid:
            self._tail.release()
            for h in self._sealed.values():
                h.close()
        self._tail.forget()
        self._sealed.clear()
        self._state = (self.gen, [None] * len(self.gen.shards))
        self._copier.close()

    # ------------------------------------------------------------ reads

    def positions(self, indices: Any, gen: Generation | None = None) -> np.ndarray:
        """Sample indices as int64 positions (negative from the end) of `gen` (the one read now),
        bounds-checked."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = (gen or self.gen).index.count
        if idx.size and (idx.min() < 0):
            idx = np.where(idx < 0, idx + n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = idx[(idx < 0) | (idx >= n)][0]
            raise IndexError(f"sample index {int(bad)} out of range for {n} samples in {self.root}")
        return idx

    def get_one(self, index: int, copy: bool = False) -> Any:
        """One record by sample index: get_many's result for [index], with scalar work only.

        A single `store[i]` is what per-sample code (a Dataset.__getitem__, a notebook) pays
        on every sample, so a sealed record read in place takes no arrays, no batch planning
        and no readahead probing (a page fault reads ahead on its own), and neither does a tail
        record once a tail snapshot is held (a copy, read in one transaction); anything else
        (the tail before that, a tier source, offsets not known) takes the batch path."""
        state = self._state
        gen = state[0]
        index_ = gen.index
        n = index_.count
        i = operator.index(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {index} out of range for {n} samples in {self.root}")
        if self.source is not None or self.max_open is not None:
            return self._get_many([i], copy, state)[0]
        shard, slot, _label = index_.samples[i].item()
        if shard >= index_.n_sealed:  # the tail: by its snapshot's rows once one is held
            snap = self._tail.held(gen)
            if snap is None or shard != index_.n_sealed or slot >= snap.records:
                return self._get_many([i], copy, state)[0]
            off, size, hk = snap.rows[slot].item()
            if plain(hk):
                with self._tail.reading(gen, snap) as usable:
                    if usable:
                        return self._decoder.one(snap, off, size, hk, True)
            return self._get_many([i], copy, state)[0]
        rec = int(index_.base[shard]) + slot
        if rec >= index_.base[shard + 1]:
            return self._get_many([i], copy, state)[0]  # (names the damage)
        off, size, hk = index_.records[rec].item()
        if off + (hk & _HEAD_MASK) + size > index_.shard_bytes[shard] or not plain(hk):
            return self._get_many([i], copy, state)[0]  # unknown offsets, or a damaged row: the checks name it
        return self._decoder.one(state[1][shard] or self.handle(shard, state), off, size, hk, copy)

    def get_many(self, indices: Sequence[int] | np.ndarray, copy: bool = False) -> list[Any]:
        """Records at sample indices, in the order given (views into the maps unless copy; a
        record of the open tail is always a copy)."""
        return self._get_many(indices, copy, self._state)

    def _get_many(self, indices: Sequence[int] | np.ndarray, copy: bool,
                  state: State, hold: ExitStack | None = None) -> list[Any]:
        """get_many of the generation in `state`. With `hold` (and not copy), the array fields of
        tail records read by snapshot are views, valid until `hold` closes (the read transaction
        stays open in it): get_batch stacks them before that; their other fields are copies."""
        gen, handles = state
        pos = self.positions(indices, gen)
        index = gen.index
        shard, slot, rec = index.resolve(pos)
        out: list[Any] = [None] * len(pos)
        sealed = rec >= 0
        all_sealed = bool(sealed.all())
        where = np.arange(len(pos)) if all_sealed else np.nonzero(sealed)[0]
        if len(where):
            sh = shard if all_sealed else shard[where]
            r = index.records[rec if all_sealed else rec[where]]
            unknown = r["offset"] == fmt.UNKNOWN_OFFSET
            if unknown.any():  # shards sealed where offsets could not be learned: read through LMDB
                for j, s, sl in zip(where[unknown].tolist(), sh[unknown].tolist(), slot[where[unknown]].tolist()):
                    h = self.handle(s, state)
                    out[j] = self._decoder.value_at(h.path, sl, lmdb_value(h, sl), copy)
                where, sh, r = where[~unknown], sh[~unknown], r[~unknown]
            hk = r["head_kind"]
            self._check_rows(gen, pos[where], sh, r, hk)
            if self.source is not None:  # shards the source reads record by record (no whole copy)
                done = self._read_records(state, where, sh, slot[where], r, hk, out, copy)
                if done is not None:
                    where, sh, r, hk = where[~done], sh[~done], r[~done], hk[~done]
            if self.max_open is not None:
                self._touch(state, np.unique(sh).tolist())
            if self._readahead:
                self._advise_willneed(state, sh, r, hk)
            hs = [handles[s] or self.handle(s, state) for s in sh.tolist()]
            self._decoder.rows(out, where, hs, r, hk, copy)
        if not all_sealed:
            self._read_tail(gen, np.nonzero(~sealed)[0], slot, out, copy, hold)
        return out

    def _read_tail(self, gen: Generation, tail_at: np.ndarray, slot: np.ndarray, out: list[Any], copy: bool,
                   hold: ExitStack | None) -> None:
        """out[tail_at] = the tail records at slot[tail_at]: by snapshot (store.tail_snapshot)
        inside one read transaction if one is held and still current, else through LMDB."""
        tail_slots = slot[tail_at]
        snap = self._tail.snapshot(gen, len(tail_at))
        if snap is not None:
            with ExitStack() as own:
                if (hold or own).enter_context(self._tail.reading(gen, snap)):
                    r = snap.rows[tail_slots]
                    views = hold is not None and not copy
                    self._decoder.rows(out, tail_at, repeat(snap, len(tail_at)), r, r["head_kind"], not views)
                    if views:  # get_batch copies array fields into the batch; any other field is
                        own_bytes(out, tail_at)  # handed on as it is, and must outlive the transaction
                    return
        for j, sl, v in zip(tail_at.tolist(), tail_slots.tolist(), self._tail.values(gen, tail_slots.tolist())):
            out[j] = self._decoder.value_at(gen.tail_path, sl, v, copy)

    def _read_records(self, state: State, where: np.ndarray, sh: np.ndarray,
                      slots: np.ndarray, r: np.ndarray, hk: np.ndarray, out: list[Any], copy: bool) -> np.ndarray | None:
        """Samples of a batch whose shard has no mapped copy and which the source does not want
        whole: their records come from `source.read_records` (every shard of the batch in one
        call, so all their fetches are in flight together) and are decoded here.
        Returns which of `where` were read (None: none); a shard the source answers None for is
        left to the whole-shard path."""
        source = self.source
        assert source is not None
        gen, handles = state
        shards = gen.shards
        # per shard, not per sample: a warm batch (every shard mapped) costs one np.unique
        cold = [s for s in np.unique(sh).tolist() if handles[s] is None and not source.wants_whole(shards[s])]
        if not cold:
            return None
        groups = {s: np.nonzero(sh == s)[0].tolist() for s in cold}
        slot_l = slots.tolist()
        todo = list(groups)
        got = source.read_records([(shards[s], [slot_l[i] for i in groups[s]]) for s in todo])
        done = np.zeros(len(where), dtype=bool)
        sizes, hks = r["size"].tolist(), hk.tolist()
        for s, values in zip(todo, got):
            if values is None:
                continue
            entry = shards[s]
            if len(values) != len(groups[s]):
                raise CorruptDatasetError(f"shard {entry.name}: {len(values)} records came back for "
                                          f"{len(groups[s])} slots")
            for i, v in zip(groups[s], values):
                sl = slot_l[i]
                try:
                    if len(v) != (hks[i] & _HEAD_MASK) + sizes[i]:
                        raise CorruptDatasetError(f"the record read from the home has {len(v)} bytes, the side-index "
                                                  f"gives {(hks[i] & _HEAD_MASK) + sizes[i]}; run `kvdata verify`")
                    out[int(where[i])] = self._decoder.value(v, copy)
                except CorruptDatasetError as e:
                    raise CorruptDatasetError(f"shard {entry.name} from {source.home.url}, slot {sl}: {e}") from None
                done[i] = True
        return done if done.any() else None

    def _check_rows(self, gen: Generation, pos: np.ndarray, sh: np.ndarray, r: np.ndarray, hk: np.ndarray) -> None:
        """Side-index rows of sealed records must lie inside their shard and name a record kind a
        sample can have (raw or fields), before any offset is used to slice a map."""
        if not len(r):
            return
        index = gen.index
        off = r["offset"]
        head = hk & _HEAD_MASK
        kind = hk >> _KIND_SHIFT
        limit = index.shard_bytes[sh]
        bad = (off > limit.astype(np.uint64)) | (head < fmt.PREFIX_SIZE) \
            | ((kind != fmt.KIND_RAW) & (kind != fmt.KIND_FIELDS))
        if not bad.any():
            bad = off.astype(np.int64) + head + r["size"] > limit
            if not bad.any():
                return
        i = int(np.nonzero(bad)[0][0])
        where = self.root / names.INDEX_DIR / str(gen.manifest.index.records)
        raise CorruptDatasetError(
            f"index file {where}: the row of sample {int(pos[i])} (shard {int(sh[i])}) is damaged (offset past the "
            f"shard's end, or a bad head or kind); run `kvdata reindex {self.root}`")

    def get_batch(self, indices: Sequence[int] | np.ndarray, fields: Sequence[str] | None = None,
                  alloc: ArrayAlloc | None = None) -> Any:
        """A batch as arrays (see Store.get_batch)."""
        with ExitStack() as hold:  # tail records read by snapshot are views until it closes
            return self._stack(self._get_many(indices, False, self._state, hold), fields, alloc)

    def _stack(self, recs: list[Any], fields: Sequence[str] | None, alloc: ArrayAlloc | None) -> Any:
        dicts = sum(isinstance(r, dict) for r in recs)
        if dicts and dicts != len(recs):
            raise InvalidValueError(f"{self.root}: this batch mixes raw-bytes records and records with fields; "
                                    "get_batch stacks one kind, read them with get_many")
        if recs and not dicts:
            return [bytes(r) for r in recs]
        try:
            if fields is not None:
                recs = [{f: r[f] for f in fields} for r in recs]
            return self._copier.stack(recs, alloc)
        except KeyError as e:
            raise InvalidValueError(f"{self.root}: field {e.args[0]!r} is missing from some records of this batch; "
                                    "pass fields= that every record has, or read them with get_many") from None

    def _advise_willneed(self, state: State, sh: np.ndarray, r: np.ndarray,
                         hk: np.ndarray) -> None:
        """Readahead hints for a batch's large values -- unless a few probes (mincore) find
        them already in the page cache, where a hint per value is only syscall overhead."""
        big = r["size"] >= READAHEAD_MIN
        if not big.any():
            return
        starts = r["offset"][big].astype(np.int64)
        ends = starts + (hk[big] & _HEAD_MASK) + r["size"][big]
        shards = sh[big].tolist()
        step = max(1, len(shards) // READAHEAD_PROBES)
        probe = range(0, len(shards), step)
        if all(pages_resident(self.handle(shards[i], state).u8.ctypes.data, (int(starts[i]), int(ends[i]) - 1))
               for i in probe):
            return
        handles = state[1]
        for s, a, b in zip(shards, starts.tolist(), ends.tolist()):
            h = handles[s] or self.handle(s, state)
            a0 = a & _PAGE_MASK
            h.mm.madvise(mmap.MADV_WILLNEED, a0, b - a0)

    def _touch(self, state: State, shard_ids: list[int]) -> None:
        """Mark shards as just used, and unmap the least recently used beyond max_open
        (their memory stays valid for views already handed out; only the lock is dropped).

        The old maps go *before* this batch's cold shards are located: a mapped copy holds a
        reader lock, so staging a cold shard would otherwise find the tier full of copies the
        last batch read and this one does not (measured: at each window of a ShardShuffleSampler
        the new window's shards evicted kept ones, or became private copies, in every worker)."""
        gen, handles = state
        shards = gen.shards
        if self.max_open is not None:
            limit = max(self.max_open, len(shard_ids))
            wanted = {shards[s].sha256 for s in shard_ids}
            cold_n = sum(1 for s in shard_ids if handles[s] is None)
            for sha in [sha for sha in self._sealed if sha not in wanted][:max(0, len(self._sealed) + cold_n - limit)]:
                self._unmap(sha, handles)
        cold = [shards[s] for s in shard_ids if handles[s] is None]
        if len(cold) > 1 and self.source is not None:
            self.source.need(cold)
        for s in shard_ids:
            if handles[s] is None:
                self.handle(s, state)
            if shards[s].sha256 in self._sealed:  # (another thread may have unmapped it meanwhile)
                self._sealed.move_to_end(shards[s].sha256)

    def _unmap(self, sha: str, handles: list[SealedShard | None]) -> None:
        old = self._sealed.pop(sha)
        sid = self._sealed_ids.pop(sha, None)
        for hs in (handles, self._handles):  # the batch's generation's, and the current one's
            if sid is not None and sid < len(hs) and hs[sid] is old:
                hs[sid] = None
        old.close()

    def decode_value(self, v: bytes, copy: bool) -> Any:
        """A record from its LMDB value bytes (RecordDecoder.value)."""
        return self._decoder.value(v, copy)

    def handle(self, shard_id: int, state: State | None = None) -> SealedShard:
        """The mapped handle of a sealed shard of the generation in `state` (the one read now
        unless given), mapping it now if needed."""
        gen, handles = state or self._state
        h = handles[shard_id]
        if h is not None:
            return h
        entry = gen.shards[shard_id]
        h = self._sealed.get(entry.sha256)
        if h is None:
            h = self._map_shard(entry)
            self._sealed[entry.sha256] = h
        self._sealed_ids[entry.sha256] = shard_id
        handles[shard_id] = h
        return h

    def _map_shard(self, entry: ShardEntry) -> SealedShard:
        """Map the fastest complete copy; if a staged copy vanishes before we map it, look again."""
        if self.source is None:
            path = self.gen.shard_path(entry)
            try:
                return SealedShard(path, entry.bytes)
            except OSError as e:  # (a missing file is MissingShardError) a symlink loop, a directory, ...
                raise CorruptDatasetError(f"shard {path} cannot be read ({e.strerror or e}); restore it and run "
                                          "`kvdata verify`") from None
        for attempt in range(LOCATE_ATTEMPTS):
            copy, staged = self.source.locate(entry)  # a path, or a descriptor the daemon passed
            try:
                h = SealedShard(copy, entry.bytes, hold_lock=staged)
                self.source.mapped(entry)
                return h
            except MissingShardError:
                if not staged or attempt == LOCATE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    # ------------------------------------------------------------ tail and metadata (tail_reads, record_metas)

    def tail_values(self, slots: list[int], gen: Generation | None = None) -> list[bytes]:
        """Copies of tail records of `gen` (the one read now unless given; TailReads.values)."""
        return self._tail.values(gen or self.gen, slots)

    def metas(self, positions: Any) -> list[tuple[int, dict[str, Any]]]:
        """(kind, meta) of the records at sample positions: keys and labels without payloads."""
        return record_metas.metas(self, positions)

    def find(self, key: str | bytes) -> int | None:
        """Sample index of `key`, or None."""
        return record_metas.find(self, key)

    def contains(self, key: object) -> bool:
        try:
            return self.find(key) is not None  # type: ignore[arg-type]
        except InvalidKeyError:
            return False




