"""Records decoded from the maps they lie in (a sealed shard's, a tail snapshot's) or from LMDB
value bytes, with the decoding plans of their layouts cached: records of equal field shapes
share one plan, so a batch costs one layout parse, not one per record.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .. import format as fmt
from ..errors import CorruptDatasetError

PLAN_CACHE_MAX = 4096
_HEAD_MASK = fmt.MAX_HEAD
_KIND_SHIFT = fmt.KIND_SHIFT


class MappedRecords(Protocol):
    """A map records are read from (store.shards.SealedShard, store.tail_snapshot.TailSnapshot)."""

    path: Path
    mm: mmap.mmap
    mv: memoryview
    u8: np.ndarray


def plain(hk: int) -> bool:
    """Whether a row's head|kind is a sample's record (raw or fields, a head past the prefix)."""
    kind = hk >> _KIND_SHIFT
    return (hk & _HEAD_MASK) >= fmt.PREFIX_SIZE and (kind == fmt.KIND_RAW or kind == fmt.KIND_FIELDS)


def own_bytes(out: list[Any], at: np.ndarray) -> None:
    """Bytes fields of the records out[at] as copies instead of views (of a tail snapshot's map,
    valid only until its read transaction ends)."""
    for j in at.tolist():
        rec = out[j]
        if isinstance(rec, dict):
            for name, v in rec.items():
                if type(v) is memoryview:
                    rec[name] = bytes(v)


class RecordDecoder:
    """Decodes records; holds the plan cache of one Reader."""

    def __init__(self) -> None:
        self._plans: dict[bytes, fmt.Plan] = {}

    def plan(self, layout_bytes: bytes) -> fmt.Plan:
        """Decoding plan of a layout, cached: records of equal shapes share one."""
        plan = self._plans.get(layout_bytes)
        if plan is None:
            if len(self._plans) >= PLAN_CACHE_MAX:
                self._plans.clear()
            plan = self._plans[layout_bytes] = fmt.layout_plan(layout_bytes)
        return plan

    def one(self, h: MappedRecords, off: int, size: int, hk: int, copy: bool) -> Any:
        """The record at row (off, size, hk) of the map of `h` (a view unless copy)."""
        head = hk & _HEAD_MASK
        if hk >> _KIND_SHIFT == fmt.KIND_RAW:
            a = off + head
            return h.mm[a:a + size] if copy else h.mv[a:a + size]
        try:
            pre = fmt.PREFIX.unpack_from(h.mv, off)
            if pre[0] != fmt.MAGIC or pre[1] != fmt.KIND_FIELDS \
                    or pre[fmt.PREFIX_HEAD] != head or fmt.PREFIX_SIZE + pre[fmt.PREFIX_LAYOUT_LEN] > head:
                raise CorruptDatasetError("the record there does not match the side-index; run `kvdata verify`")
            a = off + fmt.PREFIX_SIZE
            plan = self.plan(h.mm[a:a + pre[fmt.PREFIX_LAYOUT_LEN]])
            return fmt.decode_plan(plan, h.u8, h.mv, off + head, copy, off + head + size)
        except CorruptDatasetError as e:
            raise CorruptDatasetError(f"shard {h.path}, record at offset {off}: {e}") from None

    def rows(self, out: list[Any], where: np.ndarray, hs: Iterable[MappedRecords], r: np.ndarray, hk: np.ndarray,
             copy: bool) -> None:
        """out[where[i]] = the record at row r[i] of the map hs[i] (views unless copy): the batch
        loop, with everything it touches per record bound to locals."""
        plans = self._plans
        unpack = fmt.PREFIX.unpack_from
        decode = fmt.decode_plan
        for j, h, off, size, hk_ in zip(where.tolist(), hs, r["offset"].tolist(), r["size"].tolist(), hk.tolist()):
            head = hk_ & _HEAD_MASK
            if hk_ >> _KIND_SHIFT == fmt.KIND_RAW:
                a = off + head
                out[j] = h.mv[a:a + size] if not copy else h.mm[a:a + size]
                continue
            try:
                pre = unpack(h.mv, off)
                if pre[0] != fmt.MAGIC or pre[1] != fmt.KIND_FIELDS or pre[fmt.PREFIX_HEAD] != head \
                        or fmt.PREFIX_SIZE + pre[fmt.PREFIX_LAYOUT_LEN] > head:
                    raise CorruptDatasetError("the record there does not match the side-index; run `kvdata verify`")
                a = off + fmt.PREFIX_SIZE
                lb = h.mm[a:a + pre[fmt.PREFIX_LAYOUT_LEN]]
                plan = plans.get(lb) or self.plan(lb)
                out[j] = decode(plan, h.u8, h.mv, off + head, copy, off + head + size)
            except CorruptDatasetError as e:
                raise CorruptDatasetError(f"shard {h.path}, record at offset {off}: {e}") from None

    def value(self, v: bytes, copy: bool) -> Any:
        """A record from its LMDB value bytes (tail records, shards without offsets); a damaged
        record, or a tombstone where a sample should be, raises CorruptDatasetError."""
        h = fmt.RecordHeader(v)
        if h.kind == fmt.KIND_RAW:
            return bytes(v[h.head:]) if copy else memoryview(v)[h.head:]
        if h.kind != fmt.KIND_FIELDS:
            raise CorruptDatasetError("a sample points at a deleted record; run `kvdata reindex`")
        plan = self.plan(bytes(v[fmt.PREFIX_SIZE:fmt.PREFIX_SIZE + h.layout_len]))
        return fmt.decode_plan(plan, np.frombuffer(v, np.uint8), memoryview(v), h.head, copy)

    def value_at(self, path: Path, slot: int, v: bytes, copy: bool) -> Any:
        """`value`, its errors naming the file and slot."""
        try:
            return self.value(v, copy)
        except CorruptDatasetError as e:
            raise CorruptDatasetError(f"{path}, slot {slot}: {e}") from None
