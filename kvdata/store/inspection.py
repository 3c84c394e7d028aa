"""Looking inside a store without reading payloads: keys, per-record metadata, listings.

Functions over a Reader, kept apart from the read path so reader.py holds only
what reading samples needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import format as fmt
from ..errors import CorruptDatasetError
from .reader import Reader

KEYS_CHUNK = 4096


class KeysView:
    """The keys of a store in sample order, read lazily from record headers."""

    def __init__(self, reader: Reader) -> None:
        self._reader = reader

    def __len__(self) -> int:
        return self._reader.gen.index.count

    def __iter__(self) -> Iterator[str]:
        n = len(self)
        for start in range(0, n, KEYS_CHUNK):
            for _kind, meta in self._reader.metas(np.arange(start, min(n, start + KEYS_CHUNK))):
                yield meta["k"]

    def __contains__(self, key: object) -> bool:
        return self._reader.contains(key)


def describe(reader: Reader, start: int = 0, stop: int | None = None) -> list[dict[str, Any]]:
    """index, key, shard, slot, label and payload bytes of samples [start, stop), without reading payloads."""
    count = reader.gen.index.count
    stop = count if stop is None else min(stop, count)
    pos = np.arange(start, max(start, stop))
    index = reader.gen.index
    shard, slot, rec = index.resolve(pos)
    sizes = np.full(len(pos), -1, dtype=np.int64)
    sizes[rec >= 0] = index.records["size"][rec[rec >= 0]]
    tail_at = np.nonzero(rec < 0)[0]
    if len(tail_at):
        for j, v in zip(tail_at.tolist(), reader.tail_values(slot[tail_at].tolist())):
            sizes[j] = len(v) - fmt.RecordHeader(v).head
    out = []
    for p, s, sl, size, (_kind, meta) in zip(pos.tolist(), shard.tolist(), slot.tolist(), sizes.tolist(),
                                              reader.metas(pos)):
        out.append({"index": p, "key": meta["k"], "shard": s, "slot": sl, "label": meta.get("l"), "bytes": size})
    return out


def record_info(reader: Reader, index: int) -> dict[str, Any]:
    """Metadata of one record (what `kvdata get --json` prints)."""
    pos = int(reader.positions([index])[0])
    shard, slot, _rec = reader.gen.index.resolve(np.array([pos]))
    kind, meta = reader.metas([pos])[0]
    value = reader.get_many([pos])[0]
    if kind not in (fmt.KIND_RAW, fmt.KIND_FIELDS) or (kind == fmt.KIND_FIELDS) != isinstance(value, dict):
        raise CorruptDatasetError(f"{reader.root}: the record of sample {pos} is not of the kind the side-index says; "
                                  f"run `kvdata reindex {reader.root}`")
    info: dict[str, Any] = {"key": meta["k"], "index": pos, "shard": int(shard[0]), "slot": int(slot[0]),
                            "label": meta.get("l"), "kind": "bytes" if kind == fmt.KIND_RAW else "fields"}
    if kind == fmt.KIND_RAW:
        info["size"] = len(value)
    else:
        info["fields"] = {name: _describe(v) for name, v in value.items()}
    return info


def _describe(v: Any) -> dict[str, Any]:
    if isinstance(v, np.ndarray):
        return {"type": "array", "dtype": v.dtype.str, "shape": list(v.shape), "nbytes": int(v.nbytes)}
    if isinstance(v, (bytes, memoryview)):
        return {"type": "bytes", "nbytes": len(v)}
    if isinstance(v, str):
        return {"type": "str", "nbytes": len(v.encode())}
    return {"type": type(v).__name__, "value": v}
