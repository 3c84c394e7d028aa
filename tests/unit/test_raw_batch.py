"""put_many's batch path for raw records (format.raw_batch, Writer._put_raw_batch): the same
bytes as one record at a time, the same dataset whatever the chunk holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvdata
from kvdata import format as fmt
from kvdata.errors import InvalidKeyError, RecordTooLargeError
from kvdata.format import raw_batch
from kvdata.reader.open import verify
from kvdata.store import open_tail as open_tail_mod
from kvdata.store.rebuild import reindex

KEYS = ["a", "k" * 31, "k" * 32, "k" * 255, "k" * 256, "k" * 4096, "ключ-é", "日本語のキー", "x y\tz"]


def test_records_are_byte_for_byte_those_of_encode_record() -> None:
    rng = np.random.default_rng(0)
    values: list[bytes | bytearray] = [b"", b"x", bytearray(b"abc"), rng.integers(0, 256, 1024, np.uint8).tobytes(),
                                       rng.integers(0, 256, 70_001, np.uint8).tobytes(), b"\x00" * 7, b"y" * 8,
                                       b"z" * 9, b"w" * 4096]
    kbs = raw_batch.check_keys(KEYS)
    assert kbs == [k.encode() for k in KEYS]
    got = raw_batch.encode_raw_records(kbs, values)
    want = [fmt.encode_record(k, bytes(v))[0] for k, v in zip(KEYS, values)]
    assert got == want
    for rec in got:
        assert fmt.record_crc_ok(rec)


def test_key_hashes_are_key_hash() -> None:
    kbs = [k.encode() for k in KEYS] + [f"{i:08d}".encode() for i in range(1000)]
    assert raw_batch.key_hashes(kbs).tolist() == [fmt.key_hash(kb) for kb in kbs]
    assert raw_batch.key_hashes(kbs).dtype == np.uint64


@pytest.mark.parametrize("bad", [[""], ["a\x00b"], ["k" * 4097], ["\udcff"], [b"bytes"], [1], ["ok", None]])
def test_keys_the_batch_check_does_not_pass(bad: list) -> None:
    assert raw_batch.check_keys(bad) is None


def test_values_the_batch_does_not_take() -> None:
    assert raw_batch.raw_values([b"a", bytearray(b"b")])
    assert not raw_batch.raw_values([b"a", memoryview(b"b")])
    assert not raw_batch.raw_values([b"a", {"x": 1}])


def _state(p: Path) -> dict[str, bytes]:
    with kvdata.open(p) as s:
        return {k: bytes(s[k]) for k in s.keys()}


def test_put_many_of_raw_records_equals_a_put_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks cut by seals and by LMDB transactions in their middle, keys of every length."""
    monkeypatch.setattr(open_tail_mod, "LMDB_TXN_BYTES", 50_000)  # a transaction every ~45 records
    rng = np.random.default_rng(1)
    items = [(f"{i}-{'k' * int(rng.integers(1, 300))}", rng.integers(0, 256, int(rng.integers(0, 3000)), np.uint8)
              .tobytes()) for i in range(3000)]
    a, b = tmp_path / "batch.kv", tmp_path / "loop.kv"
    with kvdata.open(a, "w", shard_size="256KB") as s:
        assert s.put_many(items) == len(items)
    with kvdata.open(b, "w", shard_size="256KB") as s:
        for k, v in items:
            s.put(k, v)
    assert _state(a) == _state(b) == dict(items)
    with kvdata.open(a) as s, kvdata.open(b) as t:
        assert list(s.keys()) == list(t.keys()) == [k for k, _v in items]
        assert len(s.manifest["shards"]) == len(t.manifest["shards"]) > 10
    assert verify(a)["ok"]
    reindex(a)
    assert _state(a) == dict(items)


def test_chunks_that_need_the_record_path_still_write_the_same(tmp_path: Path) -> None:
    """Overwrites of committed and pending keys, a key twice in a chunk, labels, fields, deletes."""
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a", shard_size="64KB") as s:
        s.put_many((f"k{i}", bytes([i % 256]) * 100) for i in range(2500))
    with kvdata.open(p, "a") as s:
        s.put_many([("k3", b"new3"), ("fresh", b"f")])                    # a committed key
        s.put_many([("p", b"1"), ("q", b"2")])
        s.put_many([("p", b"3"), ("r", b"4")])                            # a pending key
        s.put_many([("d", b"5"), ("d", b"6")])                            # twice in one chunk
        s.put_many([("lab", b"7", 4), ("lab2", b"8", None)])              # labels
        s.put_many([("arr", {"x": np.arange(3)}), ("raw", b"9")])         # fields
        s.delete("q")
        s.put_many([("q", b"10")])                                        # a key deleted while pending
    with kvdata.open(p) as s:
        assert bytes(s["k3"]) == b"new3" and bytes(s["fresh"]) == b"f" and bytes(s["p"]) == b"3"
        assert bytes(s["d"]) == b"6" and bytes(s["q"]) == b"10" and bytes(s["raw"]) == b"9"
        assert int(s.labels[s.find("lab")]) == 4
        assert len(s) == 2500 + 9
    assert verify(p)["ok"]


def test_bad_input_in_a_chunk_loses_nothing(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a", shard_size="64KB") as s:
        s.put_many((f"k{i}", b"v") for i in range(10))
    with pytest.raises(InvalidKeyError, match="NUL"), kvdata.open(p, "a") as s:
        s.put_many([("ok", b"1"), ("bad\x00", b"2")])
    with pytest.raises(RecordTooLargeError, match="'big'"), kvdata.open(p, "a", shard_size="64KB") as s:
        s.put_many([("ok", b"1"), ("big", b"x" * 70_000)])
    assert _state(p) == {f"k{i}": b"v" for i in range(10)}
    with kvdata.open(p, "a") as s:  # the writer still takes the chunk's good records
        s.put_many([("ok", b"1"), ("ok2", b"2")])
    assert _state(p)["ok2"] == b"2"
