"""Parts for the merge tests (tests/integration/test_merge.py, test_home_merge.py): records of
every kind (arrays of varying shape with labels, scalars, strings, raw bytes without labels),
written as datasets of small shards, some with overwrites and deletes, and a deep comparison of
values as read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import kvdata

CLASSES = ["cat", "dog", "eel", "fox"]


def records(part: int, n: int) -> list[tuple[str, Any, int | None]]:
    """Arrays of varying shape with labels, scalars, strings, and raw byte records without labels."""
    rng = np.random.default_rng(part)
    out: list[tuple[str, Any, int | None]] = []
    for j in range(n):
        key = f"part{part}/{j:05d}"
        if j % 4 == 3:
            out.append((key, rng.bytes(int(rng.integers(1, 3000))), None))
        else:
            img = rng.integers(0, 255, size=(int(rng.integers(2, 9)), 5, 3), dtype=np.uint8)
            out.append((key, {"image": img, "score": float(j) / 7, "name": key.upper(), "id": j}, j % 4))
    return out


def write_part(path: Path, recs: list[tuple[str, Any, int | None]], *, deletes: int = 0,
               classes: list[str] | None = CLASSES, seal: bool = True) -> None:
    """A dataset of small shards; `deletes` records are overwritten and deleted again, so its
    sealed shards hold dead records and tombstones too."""
    with kvdata.open(path, "a", shard_size="64KB") as s:
        s.put_many(recs)
        for k, v, lab in recs[:deletes]:
            s.put(k + "-gone", b"x")
            s.delete(k + "-gone")
            s.put(k, v, label=lab)  # an overwrite of the same value: the old slot is dead
        if classes is not None:
            s.set_classes(classes)
        if seal:
            s.seal()
        s.commit()


def same(a: Any, b: Any) -> bool:
    """Values read back are equal: dicts field by field, arrays by dtype, shape and bytes."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, memoryview | bytes):
        return bytes(a) == bytes(b)
    if isinstance(a, kvdata.Ragged):
        return same(a.values, b.values) and same(a.offsets, b.offsets)
    return bool(a == b)
