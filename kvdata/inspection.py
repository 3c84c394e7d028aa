"""Looking inside a store without reading payloads: keys, per-record metadata, listings.

A mixin of Store (it uses the store's index and record headers); kept apart from the
read path so store.py holds only what reading samples needs.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from . import format as fmt


class KeysView:
    """The keys of a store in sample order, read lazily from record headers."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __len__(self) -> int:
        return len(self._store)

    def __iter__(self) -> Iterator[str]:
        n = len(self._store)
        for start in range(0, n, 4096):
            for _kind, meta in self._store._metas(np.arange(start, min(n, start + 4096))):
                yield meta["k"]

    def __contains__(self, key: object) -> bool:
        return key in self._store


class Inspection:
    """Store methods that list and describe records (see Store for the attributes used)."""

    _index: Any

    def keys(self) -> KeysView:
        self._check_open()
        return KeysView(self)

    def describe(self, start: int = 0, stop: int | None = None) -> list[dict[str, Any]]:
        """index, key, shard, slot, label and payload bytes of samples [start, stop), without reading payloads."""
        self._check_open()
        stop = len(self) if stop is None else min(stop, len(self))
        pos = np.arange(start, max(start, stop))
        shard, slot, rec = self._index.resolve(pos)
        sizes = np.full(len(pos), -1, dtype=np.int64)
        sizes[rec >= 0] = self._index.records["size"][rec[rec >= 0]]
        tail_at = np.nonzero(rec < 0)[0]
        if len(tail_at):
            for j, v in zip(tail_at.tolist(), self._tail_values(slot[tail_at].tolist())):
                sizes[j] = len(v) - fmt.RecordHeader(v).head
        out = []
        for p, s, sl, size, (_kind, meta) in zip(pos.tolist(), shard.tolist(), slot.tolist(), sizes.tolist(),
                                                  self._metas(pos)):
            out.append({"index": p, "key": meta["k"], "shard": s, "slot": sl, "label": meta.get("l"), "bytes": size})
        return out

    def key_at(self, index: int) -> str:
        return self._metas([index])[0][1]["k"]

    def record_info(self, index: int) -> dict[str, Any]:
        """Metadata of one record (what `kvdata get --json` prints)."""
        pos = int(self._positions([index])[0])
        shard, slot, _rec = self._index.resolve(np.array([pos]))
        kind, meta = self._metas([pos])[0]
        value = self.get_many([pos])[0]
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
