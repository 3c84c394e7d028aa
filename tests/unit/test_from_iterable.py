"""kvdata.from_iterable / kvdata.from_arrays: record-for-record round trips, modes, and clear refusals."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kvdata
from kvdata.errors import ConfigError, InvalidKeyError, InvalidValueError


def _read_all(path):
    with kvdata.open(path) as store:
        return {store.key_at(i): store.get_one(i, copy=True) for i in range(len(store))}


def test_from_iterable_round_trips_every_field_type(tmp_path):
    rng = np.random.default_rng(0)
    items = [{"id": f"s{i}", "image": rng.integers(0, 255, (4, 5, 3), dtype=np.uint8), "label": i % 3,
              "score": float(i) / 7, "caption": f"sample {i} é", "raw": bytes([i]) * i, "flag": bool(i % 2),
              "vec": [i, i + 1]} for i in range(50)]
    gen = (dict(item) for item in items)  # no len(): a plain generator works too
    out = kvdata.from_iterable(tmp_path / "ds", gen, key="id")
    assert out["imported"] == 50 and out["classes"] == 3 and out["writers"] == 1
    got = _read_all(tmp_path / "ds")
    assert list(got) == [it["id"] for it in items]
    for it in items:
        rec = got[it["id"]]
        assert set(rec) == set(it)
        np.testing.assert_array_equal(rec["image"], it["image"])
        assert rec["label"] == it["label"] and rec["score"] == it["score"] and rec["flag"] == it["flag"]
        assert rec["caption"] == it["caption"] and bytes(rec["raw"]) == it["raw"] and rec["id"] == it["id"]
        np.testing.assert_array_equal(rec["vec"], it["vec"])
    with kvdata.open(tmp_path / "ds") as store:
        assert store.labels.tolist() == [i % 3 for i in range(50)]
        assert store.classes == ["0", "1", "2"]  # numbered as every importer records them; the summary counts these


def test_from_arrays_round_trips_row_for_row_with_generated_keys(tmp_path):
    x = np.random.default_rng(1).random((30, 2, 3)).astype(np.float32)
    y = np.arange(30, dtype=np.int64) % 5
    kvdata.from_arrays(tmp_path / "ds", x=x, label=y)
    got = _read_all(tmp_path / "ds")
    assert list(got) == [f"{i:010d}" for i in range(30)]
    for i, rec in enumerate(got.values()):
        np.testing.assert_array_equal(rec["x"], x[i])
        assert rec["x"].dtype == np.float32 and int(rec["label"]) == y[i]
    # fields named like an option go in the positional mapping
    kvdata.from_arrays(tmp_path / "ds2", {"mode": y})
    assert int(_read_all(tmp_path / "ds2")["0000000004"]["mode"]) == 4


def test_unequal_arrays_name_the_array_and_write_nothing(tmp_path):
    with pytest.raises(InvalidValueError, match=r"array 'y' has 9 rows but 'x' has 10"):
        kvdata.from_arrays(tmp_path / "ds", x=np.zeros(10), y=np.zeros(9))
    assert not (tmp_path / "ds").exists()


def test_modes_refuse_append_and_replace(tmp_path):
    ds = tmp_path / "ds"
    kvdata.from_arrays(ds, v=np.arange(3))
    with pytest.raises(ConfigError, match="already holds a dataset of 3 records; pass mode='a'"):
        kvdata.from_arrays(ds, v=np.arange(2))
    assert len(_read_all(ds)) == 3
    kvdata.from_arrays(ds, v=np.arange(10, 12), mode="a")  # generated keys count on
    got = _read_all(ds)
    assert list(got) == [f"{i:010d}" for i in range(5)] and int(got["0000000004"]["v"]) == 11
    kvdata.from_arrays(ds, v=np.arange(7, 8), mode="w")
    assert [int(r["v"]) for r in _read_all(ds).values()] == [7]
    with pytest.raises(ConfigError, match="mode: must be"):
        kvdata.from_arrays(ds, v=np.arange(2), mode="r")


def test_a_bad_item_midway_commits_nothing(tmp_path):
    ds = tmp_path / "ds"
    kvdata.from_iterable(ds, [{"k": "a", "v": 1}], key="k")

    def items():
        yield {"k": "b", "v": 2}
        yield {"k": "c", "v": object()}

    with pytest.raises(InvalidValueError, match="field 'v'"):
        kvdata.from_iterable(ds, items(), key="k", mode="a")
    assert list(_read_all(ds)) == ["a"]
    with pytest.raises(InvalidKeyError, match="key 'b' was already used by item 0"):
        kvdata.from_iterable(ds, [{"k": "b"}, {"k": "b"}], key="k", mode="a")
    with pytest.raises(InvalidKeyError, match="item 0 has no 'id' field"):
        kvdata.from_iterable(ds, [{"k": "b"}], key="id", mode="a")
    with pytest.raises(InvalidValueError, match="item 1: expected a dict of fields, got a list"):
        kvdata.from_iterable(tmp_path / "new", [{"v": 1}, [1, 2]])
    assert not (tmp_path / "new").exists()
    assert list(_read_all(ds)) == ["a"]


def test_import_kvdata_loads_no_importer_and_no_torch():
    code = ("import sys, kvdata; assert callable(kvdata.from_arrays); "
            "print('torch' in sys.modules, 'google.protobuf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
