"""The single-sample path (Store.get_one, store[i], store.get(key), Dataset[i]) answers exactly
what the batch path answers, for every kind of record and dataset state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvdata
from kvdata.errors import CorruptDatasetError


def same(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (bytes, memoryview)):
        return isinstance(b, (bytes, memoryview)) and bytes(a) == bytes(b)
    return bool(a == b)


@pytest.mark.parametrize("sealed", [True, False])
def test_get_one_equals_get_many(tmp_path: Path, sealed: bool) -> None:
    pytest.importorskip("torch", reason="needs torch (pip install 'kvdata[torch]')")
    p = tmp_path / "ds.kv"
    s = kvdata.open(p, "w", shard_size="64KB")
    s.put_many((f"f{i}", {"x": np.arange(i, i + 3000, dtype=np.int32), "label": i, "s": f"v{i}"}) for i in range(40))
    s.put_many((f"r{i}", bytes([i]) * (i + 1)) for i in range(10))
    if sealed:
        s.seal()
        s.close()
    else:
        s.commit()  # the last records stay in an open tail
    st = kvdata.open(p)
    try:
        n = len(st)
        for i in list(range(n)) + [-1, -n]:
            for copy in (False, True):
                assert same(st.get_one(i, copy=copy), st.get_many([i], copy=copy)[0])
            assert same(st[i], st.get_many([i])[0])
        assert same(st.get("f7"), st.get_many([7])[0]) and same(st["r3"], b"\x03" * 4)
        arr = st.get_one(5)["x"]
        assert not arr.flags.writeable                        # a view into the map ...
        assert st.get_one(5, copy=True)["x"].flags.writeable  # ... or an owned copy
        for bad in (n, -n - 1, 10**12):
            with pytest.raises(IndexError, match="out of range"):
                st.get_one(bad)
        with pytest.raises(TypeError):
            st.get_one(1.5)  # type: ignore[arg-type]
        ds = kvdata.Dataset(p)
        assert same(ds[3], st.get_many([3], copy=True)[0])
    finally:
        st.close()
        if not sealed:
            s.close()


def test_a_damaged_row_is_named_not_read(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "w") as s:
        s.put_many((f"k{i}", {"x": np.full(100, i, np.uint8)}) for i in range(8))
        s.seal()
    with kvdata.open(p) as st:
        assert st.manifest.index.records
        rec_file = p / "index" / st.manifest.index.records
    rows = np.memmap(rec_file, dtype=kvdata.format.RECORD_DTYPE, mode="r+")
    rows["offset"][2] = 1 << 40
    rows.flush()
    del rows
    with kvdata.open(p) as st:
        assert same(st[1], st.get_many([1])[0])
        with pytest.raises(CorruptDatasetError, match="reindex"):
            st[2]
