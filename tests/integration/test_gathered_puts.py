"""put() of raw bytes gathers records and writes them a chunk at a time (store.gathered_puts): the
dataset is the same as one put at a time whatever writes are mixed in, bad input still fails
the put that gave it, and nothing gathered outlives an abort."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.errors import ClosedError, CorruptDatasetError, InvalidKeyError, RecordTooLargeError
from kvdata.reader.open import verify
from kvdata.store import record_metas
from kvdata.store import gathered_puts


def _state(p: Path) -> tuple[list[str], list[Any], list[int]]:
    with kvdata.open(p) as s:
        keys = list(s.keys())
        values = [bytes(v) if not isinstance(v, dict) else {f: np.asarray(a).tolist() for f, a in v.items()}
                  for v in s.get_many(range(len(s)))]
        return keys, values, np.asarray(s.labels).tolist()


def _run(p: Path, ops: list[tuple[Any, ...]], gathered: bool) -> None:
    """Apply ops; raw values go as bytes (gathered) or as bytearray (written one at a time)."""
    with kvdata.open(p, "a", shard_size="64KB") as s:
        for op in ops:
            if op[0] == "put":
                _, key, value, label = op
                if isinstance(value, bytes) and not gathered:
                    value = bytearray(value)
                s.put(key, value, label=label)
            elif op[0] == "delete":
                s.delete(op[1])
            elif op[0] == "commit":
                s.commit()
            elif op[0] == "seal":
                s.seal()
            elif op[0] == "put_many":
                s.put_many(op[1])


@pytest.mark.parametrize("seed", range(4))
def test_a_put_loop_mixing_every_kind_of_write_is_the_same_dataset(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = [f"k{i}" for i in range(120)]
    alive: set[str] = set()
    ops: list[tuple[Any, ...]] = []
    for _ in range(1500):
        r = rng.random()
        key = keys[int(rng.integers(len(keys)))]
        if r < 0.70:
            ops.append(("put", key, rng.bytes(int(rng.integers(0, 3000))), None))
            alive.add(key)
        elif r < 0.76:
            ops.append(("put", key, {"x": np.full(3, int(rng.integers(100)), np.int32)}, int(rng.integers(5))))
            alive.add(key)
        elif r < 0.80:
            ops.append(("put", key, rng.bytes(10), int(rng.integers(5))))  # raw with a label: not gathered
            alive.add(key)
        elif r < 0.88 and alive:
            victim = sorted(alive)[int(rng.integers(len(alive)))]
            ops.append(("delete", victim))
            alive.discard(victim)
        elif r < 0.93:
            ops.append(("commit",))
        elif r < 0.95:
            ops.append(("seal",))
        else:
            pairs = [(keys[int(rng.integers(len(keys)))], rng.bytes(50)) for _ in range(int(rng.integers(1, 40)))]
            ops.append(("put_many", pairs))
            alive.update(k for k, _v in pairs)
    a, b = tmp_path / "gathered.kv", tmp_path / "one_at_a_time.kv"
    _run(a, ops, gathered=True)
    _run(b, ops, gathered=False)
    got, want = _state(a), _state(b)
    assert got == want
    assert set(got[0]) == alive
    assert verify(a)["ok"]


def test_bad_input_fails_its_own_put_and_loses_nothing_gathered(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a", shard_size="64KB") as s:
        for i in range(10):
            s.put(f"k{i}", b"v%d" % i)
        with pytest.raises(InvalidKeyError):
            s.put("", b"x")
        with pytest.raises(InvalidKeyError):
            s.put("a\x00b", b"x")
        with pytest.raises(InvalidKeyError, match="4097 bytes"):
            s.put("k" * 4097, b"x")
        with pytest.raises(InvalidKeyError, match="UTF-8"):
            s.put("\udcff", b"x")
        with pytest.raises(RecordTooLargeError, match="'big'"):
            s.put("big", b"x" * 70_000)
        with pytest.raises(RecordTooLargeError, match="'k{4000}"):
            s.put("k" * 4000, b"x" * 62_000)  # fits with a short key, not with this one
        s.put("k10", b"v10")
        s.put(b"k11", b"v11")  # a bytes key, a non-ASCII key: gathered the same
        s.put("ключ", b"v12")
    with kvdata.open(p) as s:
        assert list(s.keys()) == [f"k{i}" for i in range(12)] + ["ключ"]
        assert [bytes(s[f"k{i}"]) for i in range(12)] == [b"v%d" % i for i in range(12)]
        assert bytes(s["ключ"]) == b"v12"


def test_an_abort_writes_none_of_the_gathered_puts(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a") as s:
        s.put("kept", b"1")
    with pytest.raises(RuntimeError, match="boom"):
        with kvdata.open(p, "a") as s:
            for i in range(50):
                s.put(f"lost{i}", b"x" * 100)
            raise RuntimeError("boom")
    with kvdata.open(p) as s:
        assert list(s.keys()) == ["kept"]
    assert verify(p)["ok"]


def test_a_long_put_loop_is_written_in_chunks_and_reads_back(tmp_path: Path) -> None:
    """More puts than one chunk holds, and values large enough to reach the byte limit first."""
    p = tmp_path / "ds.kv"
    small = [(f"s{i:05d}", np.random.default_rng(i).bytes(100)) for i in range(gathered_puts.GATHER_RECORDS * 3 + 7)]
    large = [(f"l{i:03d}", np.random.default_rng(i).bytes(300_000)) for i in range(30)]  # > gathered_puts.GATHER_BYTES
    with kvdata.open(p, "w", shard_size="4MB") as s:
        for k, v in small + large:
            s.put(k, v)
        assert s.get("s00000") is None  # nothing is visible before the commit, gathered or not
    with kvdata.open(p) as s:
        assert list(s.keys()) == [k for k, _v in small + large]
        assert all(bytes(s[k]) == v for k, v in small + large)
    assert verify(p)["ok"]


def test_a_failure_while_gathered_puts_are_written_commits_none_of_them(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a tail failure (those discard the pending writes and say so): the lookup of the
    gathered keys fails (a damaged committed record; here injected). The puts that gave them had
    returned, so the writer fails rather than commit a session without them."""
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a") as s:
        s.put("kept", b"1")

    def damaged(*_a: Any, **_k: Any) -> Any:
        raise CorruptDatasetError(f"{p}: record 0 is damaged")

    s = kvdata.open(p, "a")
    for i in range(10):
        s.put(f"k{i}", b"x")
    monkeypatch.setattr(record_metas, "find_many", damaged)
    with pytest.raises(CorruptDatasetError, match="damaged"):
        s.commit()
    with pytest.raises(ClosedError, match="open the dataset again"):
        s.put("after", b"y")
    with pytest.raises(ClosedError):
        s.commit()
    s.close()
    with kvdata.open(p) as r:
        assert list(r.keys()) == ["kept"]
    assert verify(p)["ok"]
