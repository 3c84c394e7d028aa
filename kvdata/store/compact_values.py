"""The record values a compaction copies (kvdata.store.compact), read raw and checked first.

Its own module because this is where compaction decides a record may be copied: every value is
checked (magic, kind, head, crc32) before it goes into a new shard, so a damaged record is never
written again under a fresh checksum. Sealed shards' values are sliced from their maps (headers
checked against the index rows all at once), the tail's come from the values read at the start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .. import format as fmt
from .._util.checksum import crc32
from ..errors import CorruptDatasetError
from .generation import Generation
from .shards import SealedShard


class CheckedValues:
    """The raw, checked record values of generation `gen`'s samples by position; `tail` holds
    the tail's live records by slot (read whole at the start). Sealed shards are mapped once
    each, until close()."""

    def __init__(self, gen: Generation, tail: dict[int, bytes], root: Path) -> None:
        self.gen, self.tail, self.root = gen, tail, root
        self._maps: dict[int, SealedShard] = {}

    def close(self) -> None:
        self._maps.clear()

    def chunks(self, positions: np.ndarray, chunk: int = 4096) -> Iterator[tuple[list[Any], np.ndarray]]:
        """(raw record values, their head_kind) of sample positions, in chunks; each record is
        checked first (magic, kind, head, crc32) so a damaged one is never copied into a shard
        with a fresh checksum."""
        idx = self.gen.index
        for start in range(0, len(positions), chunk):
            pos = positions[start:start + chunk]
            shard, slot, rec = idx.resolve(pos)
            out: list[Any] = [None] * len(pos)
            head_kind = np.zeros(len(pos), dtype=np.uint32)
            for j in np.flatnonzero(rec < 0).tolist():  # the tail's (values read at start)
                sl = int(slot[j])
                out[j], head_kind[j] = self.tail[sl], _checked(self.tail[sl], None, f"{self.gen.tail_path}, slot {sl}",
                                                               self.root)
            sealed_at = np.flatnonzero(rec >= 0)
            for s in np.unique(shard[sealed_at]).tolist():
                js = sealed_at[shard[sealed_at] == s]
                self._sealed(s, js, slot[js], idx.records[rec[js]], out, head_kind)
            yield out, head_kind

    def _sealed(self, s: int, js: np.ndarray, slots: np.ndarray, rows: np.ndarray, out: list[Any],
                head_kind: np.ndarray) -> None:
        """Values of one sealed shard's records (at `js` of the chunk), sliced from its map, the
        headers checked against the index rows all at once, the crc32s one by one."""
        h = self._map(s)
        hk = rows["head_kind"]
        head_kind[js] = hk
        known = rows["offset"] != fmt.UNKNOWN_OFFSET
        for j, sl, k in zip(js[~known].tolist(), slots[~known].tolist(), hk[~known].tolist()):
            out[j] = h.lmdb_value(sl)  # offsets unknown (no /proc at seal time): through LMDB
            _checked(out[j], k & fmt.MAX_HEAD, f"shard {h.path}, slot {sl}", self.root)
        if not known.any():
            return
        js, slots, rows, hk = js[known], slots[known], rows[known], hk[known]
        off = rows["offset"].astype(np.int64)
        head = (hk & fmt.MAX_HEAD).astype(np.int64)
        end = off + head + rows["size"]
        bad = (end > len(h.mv)) | (head < fmt.PREFIX_SIZE)
        if not bad.any():
            pre = h.u8[off[:, None] + np.arange(fmt.PREFIX_SIZE)].view(_PREFIX_DTYPE)[:, 0]
            bad = (pre["magic"] != fmt.MAGIC) | (pre["kind"] != (hk >> fmt.KIND_SHIFT)) \
                | ((pre["kind"] != fmt.KIND_RAW) & (pre["kind"] != fmt.KIND_FIELDS)) | (pre["head"] != head)
        if bad.any():
            _damaged(f"shard {h.path}, slot {int(slots[np.flatnonzero(bad)[0]])}", self.root)
        mv = h.mv
        for j, sl, a, b, c in zip(js.tolist(), slots.tolist(), off.tolist(), end.tolist(), pre["crc"].tolist()):
            if crc32(mv[a + fmt.PREFIX_SIZE:b], crc32(mv[a:a + fmt.PREFIX_SIZE - 4])) != c:
                _damaged(f"shard {h.path}, slot {sl}", self.root)
            out[j] = mv[a:b]

    def _map(self, shard_id: int) -> SealedShard:
        h = self._maps.get(shard_id)
        if h is None:
            e = self.gen.manifest.shards[shard_id]
            h = self._maps[shard_id] = SealedShard(self.gen.shard_path(e), e.bytes)
        return h


_PREFIX_DTYPE = np.dtype([("magic", "u1"), ("kind", "u1"), ("version", "u1"), ("flags", "u1"), ("head", "<u4"),
                          ("layout_len", "<u4"), ("meta_len", "<u4"), ("crc", "<u4")])  # = fmt.PREFIX


def _checked(v: Any, head: int | None, where: str, root: Path) -> int:
    """The head_kind of a record about to be copied, once it is known to be a whole, undamaged
    sample record (with the index's head, if given)."""
    mv = memoryview(v)
    if mv.nbytes >= fmt.PREFIX_SIZE:
        magic, kind, _ver, _flags, hd, _ll, _ml, _crc = fmt.PREFIX.unpack_from(mv, 0)
        if magic == fmt.MAGIC and kind in (fmt.KIND_RAW, fmt.KIND_FIELDS) and fmt.PREFIX_SIZE <= hd <= mv.nbytes \
                and (head is None or hd == head) and fmt.record_crc_ok(mv):
            return int(hd | kind << fmt.KIND_SHIFT)
    _damaged(where, root)


def _damaged(where: str, root: Path) -> NoReturn:
    raise CorruptDatasetError(f"{where}: the record is damaged (crc32 or header mismatch); nothing was changed; "
                              f"run `kvdata verify {root}` and restore the shard")
