"""put() of raw bytes gathers records and writes them a chunk at a time (store.gathered_puts): the
dataset is the same as one put at a time whatever writes are mixed in, bad input still fails
the put that gave it, and nothing gathered outlives an abort."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.errors import ClosedError, CommitError, CorruptDatasetError, InvalidKeyError, RecordTooLargeError
from kvdata.format import raw_batch
from kvdata.reader.open import verify
from kvdata.store import gathered_puts
from kvdata.store.pending import Pending


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


def _damaged_record(p: Path, key: str) -> None:
    """Flip the magic byte of `key`'s record in its sealed shard (its header no longer reads)."""
    shard = next((p / "shards").glob("0*.mdb"))
    data = bytearray(shard.read_bytes())
    at = data.find(b"\x81\xa1k" + bytes([0xA0 | len(key)]) + key.encode())  # the meta {"k": key}
    assert at > 20
    data[at - 20] ^= 0xFF
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))


def test_a_damaged_committed_record_fails_only_its_own_gathered_put(tmp_path: Path) -> None:
    """Overwriting a key whose committed record is damaged fails that put -- named, at the call
    that writes it -- and every other gathered put is written, as one put at a time would."""
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "w") as s:
        s.put("a", b"A" * 100)
        s.put("b", b"B" * 100)
        s.seal()
    _damaged_record(p, "a")
    s = kvdata.open(p, "a")
    for k in ("c", "a", "d"):
        s.put(k, b"new")
    with pytest.raises(CorruptDatasetError, match="key 'a' .*was not written.*record header is damaged"):
        s.commit()
    s.put("e", b"new")
    s.commit()
    s.close()
    with kvdata.open(p) as r:  # (listing every key would read the damaged header)
        assert len(r) == 5
        assert [bytes(r[k]) for k in "bcde"] == [b"B" * 100] + [b"new"] * 3


def test_a_failure_while_a_gathered_chunk_is_written_fails_the_writer_saying_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a tail failure (those discard the pending writes and say so) and not in the key
    lookup (nothing written yet): the chunk may be half written after its puts returned, so the
    writer fails rather than commit a session without them, and later calls say why."""
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a") as s:
        s.put("kept", b"1")

    def broken(*_a: Any, **_k: Any) -> Any:
        raise MemoryError("no memory for the chunk")

    s = kvdata.open(p, "a")
    for i in range(10):
        s.put(f"k{i}", b"x")
    monkeypatch.setattr(raw_batch, "encode_raw_records", broken)
    with pytest.raises(MemoryError):
        s.commit()
    with pytest.raises(ClosedError, match="writing 10 gathered puts failed: MemoryError.*discarded.*open the dataset again"):
        s.put("after", b"y")
    with pytest.raises(ClosedError):
        s.commit()
    s.close()
    with kvdata.open(p) as r:
        assert list(r.keys()) == ["kept"]
    assert verify(p)["ok"]


def test_a_ctrl_c_while_gathered_puts_are_written_waits_until_they_are(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT in the middle of writing a chunk: the chunk is written whole, then the
    KeyboardInterrupt comes; the loop's puts all commit."""
    p = tmp_path / "ds.kv"
    real = raw_batch.encode_raw_records
    sent = []

    def interrupted(*a: Any, **k: Any) -> Any:
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the signal is taken while the chunk is being written
        return real(*a, **k)

    monkeypatch.setattr(raw_batch, "encode_raw_records", interrupted)
    # Python's own Ctrl-C handler, whatever this run started with (started in the background,
    # a process inherits SIGINT ignored and Python installs no handler)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    s = kvdata.open(p, "w")
    n = 0
    try:
        with pytest.raises(KeyboardInterrupt):
            while n < 5000:
                s.put(f"k{n}", b"x" * 100)
                n += 1
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, before)
    assert sent and n < 5000
    s.commit()
    s.close()
    with kvdata.open(p) as r:
        assert len(r) >= n  # every put that returned, and maybe the interrupted one (it was gathered)
        assert list(r.keys())[:n] == [f"k{i}" for i in range(n)]
    assert verify(p)["ok"]


def test_an_interrupted_record_at_a_time_put_fails_the_commit_clearly(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt between the steps of one put (its row half added) makes the commit
    refuse with one line, not an IndexError, and keep the last commit."""
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a") as s:
        s.put("kept", b"1")
    real_add = Pending.add

    def half(self: Pending, key: str, row: Any, key_hash: int) -> None:
        self.new_keys[key] = len(self.new_slot)
        self.new_shard.append(row[0])
        raise KeyboardInterrupt

    s = kvdata.open(p, "a")
    s.put("a", bytearray(b"1"))  # bytearray: written at once
    monkeypatch.setattr(Pending, "add", half)
    with pytest.raises(KeyboardInterrupt):
        s.put("b", bytearray(b"2"))
    monkeypatch.setattr(Pending, "add", real_add)
    with pytest.raises(CommitError, match="interrupted halfway.*discarded"):
        s.commit()
    s.put("c", b"3")
    s.close()
    with kvdata.open(p) as r:
        assert list(r.keys()) == ["kept", "c"]
    assert verify(p)["ok"]


@pytest.mark.parametrize("conv", [bytes, bytearray])
def test_puts_made_by_put_manys_own_iterable_keep_their_order(tmp_path: Path, conv: Any) -> None:
    """Puts the iterable makes while put_many takes a chunk from it land before the chunk,
    gathered (bytes) or not (bytearray), as they always did."""
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "w") as s:
        def items() -> Any:
            for i in range(3):
                s.put(f"meta{i}", conv(b"m"))
                yield f"item{i}", b"i"
            s.put("x", conv(b"default"))
            yield "x", b"final"
        s.put_many(items())
    with kvdata.open(p) as r:
        assert list(r.keys()) == ["meta0", "meta1", "meta2", "x", "item0", "item1", "item2"]
        assert bytes(r["x"]) == b"final"
