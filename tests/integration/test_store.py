"""The Store on real files: semantics, snapshots, sealing, rebuild and LMDB compatibility."""

from __future__ import annotations

import hashlib
import io
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

import kvdata
from kvdata import format as fmt
from kvdata.errors import ReadOnlyError
from kvdata.format import raw_batch
from kvdata.reader.open import verify
from kvdata.store.rebuild import reindex


def img(i: int, shape=(40, 40, 3)) -> np.ndarray:
    return np.full(shape, i % 251, dtype=np.uint8)


def fill(path: Path, n: int, shard_size: str = "64KB", start: int = 0, compress: bool = False) -> None:
    with kvdata.open(path, "a", shard_size=shard_size, compress=compress) as s:
        for i in range(start, start + n):
            s.put(f"k{i}", {"image": img(i), "label": i % 7, "name": f"n{i}"})


def state(s: kvdata.Store) -> tuple:
    """Everything a reader can observe, for equality checks."""
    vals = []
    for v in s.get_many(range(len(s))):
        vals.append(bytes(v) if not isinstance(v, dict) else (v["image"].tobytes(), v["label"], v["name"]))
    return len(s), list(s.keys()), s.labels.tolist(), vals


def test_round_trip_bytes_and_fields(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a") as s:
        s.put("raw", b"hello")
        s.put("f", {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "s": "text", "b": b"\x00\x01", "n": None,
                    "i": -5, "x": 2.5, "t": True})
        s.put("lab", b"z", label=3)
    s = kvdata.open(p)
    assert len(s) == 3 and s.generation == 1
    assert bytes(s["raw"]) == b"hello" and bytes(s[0]) == b"hello"
    f = s.get("f")
    np.testing.assert_array_equal(f["a"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert (f["s"], bytes(f["b"]), f["n"], f["i"], f["x"], f["t"]) == ("text", b"\x00\x01", None, -5, 2.5, True)
    assert s.labels.tolist() == [fmt.NO_LABEL, fmt.NO_LABEL, 3]
    assert [bytes(v) for v in s.get_many([-1, 0, 2])] == [b"z", b"hello", b"z"]
    assert s.get("nope") is None and "nope" not in s and "raw" in s
    with pytest.raises(KeyError):
        s["nope"]
    with pytest.raises(IndexError, match="out of range"):
        s.get_many([3])
    with pytest.raises(IndexError):
        s[-4]
    with pytest.raises(ReadOnlyError):
        s.put("x", b"y")


def test_views_are_read_only_and_copies_are_owned(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    fill(p, 30)
    with kvdata.open(p) as s:
        view = s[3]["image"]
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0, 0, 0] = 1
        owned = s.get_many([3], copy=True)[0]["image"]
        owned[0, 0, 0] = 1
        assert s[3]["image"][0, 0, 0] == 3
        raw = kvdata.open(tmp_path / "r.kv", "a")
        raw.put("a", b"abc")
        raw.seal()
        raw.close()
        r = kvdata.open(tmp_path / "r.kv")
        assert isinstance(r.get_many([0], copy=True)[0], bytes)
        assert isinstance(r.get_many([0])[0], memoryview) and r.get_many([0])[0].readonly


def test_sealing_writes_checksummed_shards_and_zstd_copies(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    fill(p, 120, compress=True)  # cold copies at seal (the default leaves them to push)
    m = kvdata.open(p).manifest
    assert len(m["shards"]) >= 5
    for e in m["shards"]:
        data = (p / "shards" / e["name"]).read_bytes()
        assert len(data) == e["bytes"] and hashlib.sha256(data).hexdigest() == e["sha256"]
        z = (p / "shards" / e["zst"]["name"]).read_bytes()
        assert hashlib.sha256(z).hexdigest() == e["zst"]["sha256"]
        # the cold copy is several zstd frames (cut at record boundaries) plus a skippable seek
        # table: it decompresses as one stream to the shard
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(z), read_across_frames=True) as r:
            assert r.read() == data
    s = kvdata.open(p)
    assert (s._index.records["offset"] != fmt.UNKNOWN_OFFSET).all()
    assert state(s)[1] == [f"k{i}" for i in range(120)]


def test_no_compress_switch(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a", shard_size="64KB") as s:  # the default: no cold copy at seal
        s.put_many((f"k{i}", {"image": img(i)}) for i in range(60))
    assert not list((p / "shards").glob("*.zst"))
    assert all(e["zst"] is None for e in kvdata.open(p).manifest["shards"])


def test_shards_are_real_lmdb_files(tmp_path: Path) -> None:
    if not shutil.which("mdb_stat"):
        if os.environ.get("CI"):
            pytest.fail("lmdb-utils must be installed in CI (.ci/run installs it)")
        pytest.skip("mdb_stat (Debian lmdb-utils) not installed")
    p = tmp_path / "ds.kv"
    fill(p, 40)
    shard = p / "shards" / "000000.mdb"
    out = subprocess.run(["mdb_stat", "-n", str(shard)], capture_output=True, text=True, check=True).stdout
    entries = int(out.split("Entries:")[1].split()[0])
    assert entries == kvdata.open(p).manifest["shards"][0]["records"]
    dump = subprocess.run(["mdb_dump", "-n", str(shard)], capture_output=True, check=True).stdout
    assert b"HEADER=END" in dump and b"0000000000000000" in dump


def test_overwrite_delete_and_reindex_agree(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    fill(p, 50)
    with kvdata.open(p, "a") as s:
        s.put("k3", b"new three")       # overwrite keeps position 3
        s.delete("k10")                 # later samples shift down
        s.put("k10", b"back")           # re-put after delete goes to the end
        s.put("fresh", b"f")
        s.delete("fresh")               # put+delete in one batch leaves nothing
        with pytest.raises(KeyError):
            s.delete("never")
    s = kvdata.open(p)
    keys = list(s.keys())
    assert keys[3] == "k3" and bytes(s[3]) == b"new three"
    assert keys[-1] == "k10" and "fresh" not in s and len(s) == 50
    before = state(s)
    s.close()
    reindex(p)
    assert state(kvdata.open(p)) == before
    (p / "manifest.json").unlink()
    summary = reindex(p)
    assert summary["manifest_rebuilt"] and state(kvdata.open(p)) == before
    assert verify(p)["ok"]


def test_hash_collisions_are_resolved_by_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = fmt.key_hash
    monkeypatch.setattr(fmt, "key_hash", lambda kb: real(kb) % 3)  # everything collides
    monkeypatch.setattr(raw_batch, "key_hashes", lambda kbs: np.array([real(kb) % 3 for kb in kbs], np.uint64))
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a", shard_size="64KB") as s:
        s.put_many((f"k{i}", {"image": img(i)}) for i in range(40))
    with kvdata.open(p, "a") as s:
        s.put("k5", b"five")
        s.delete("k7")
        s.put_many([("k9", b"nine"), ("new", b"n")])
    s = kvdata.open(p)
    assert bytes(s["k5"]) == b"five" and bytes(s["k9"]) == b"nine" and "k7" not in s and bytes(s["new"]) == b"n"
    assert s.find("k20") == 19
    before = state_keys = list(s.keys())
    s.close()
    reindex(p)
    assert list(kvdata.open(p).keys()) == state_keys == before
    assert verify(p)["ok"]


def test_old_generation_readers_keep_working(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    fill(p, 10, shard_size="64KB")
    old = kvdata.open(p)
    snapshot = state(old)
    assert old.manifest["tail"]["records"] > 0  # some records are read from the open tail
    fill(p, 60, start=10)                       # seals the tail the old reader uses
    with kvdata.open(p, "a") as w:
        w.put("k1", b"changed")
        w.delete("k2")
    assert state(old) == snapshot
    assert old.refresh() is True
    assert len(old) == 69 and bytes(old["k1"]) == b"changed"


def test_reads_in_write_mode_see_the_last_commit(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    with kvdata.open(p, "a") as s:
        s.put("a", b"1")
        assert len(s) == 0 and "a" not in s
        s.commit()
        assert len(s) == 1 and bytes(s["a"]) == b"1"
        s.put("a", b"2")
        assert bytes(s["a"]) == b"1"
    assert bytes(kvdata.open(p)["a"]) == b"2"


def test_exception_in_block_commits_nothing(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    fill(p, 5)
    with pytest.raises(RuntimeError):
        with kvdata.open(p, "a") as s:
            s.put("x", b"x")
            raise RuntimeError("boom")
    s = kvdata.open(p)
    assert len(s) == 5 and "x" not in s and verify(p)["ok"]


def test_mode_w_starts_empty_and_old_readers_survive(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    fill(p, 40)
    old = kvdata.open(p)
    snap = state(old)
    with kvdata.open(p, "w", shard_size="64KB") as s:
        assert len(s) == 0
        s.put("only", b"one")
    assert list(kvdata.open(p).keys()) == ["only"]
    assert state(old) == snap
    assert verify(p)["ok"]


def test_many_commits_keep_few_key_runs(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    for c in range(40):
        with kvdata.open(p, "a", shard_size="1MB") as s:
            s.put_many((f"c{c}-{i}", b"v") for i in range(c + 1))
    s = kvdata.open(p)
    assert len(s) == sum(range(1, 41))
    assert len(s.manifest["index"]["keys"]) <= 8
    assert s.find("c39-0") == len(s) - 40 and bytes(s["c0-0"]) == b"v"


def test_get_batch_stacks_fields(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    fill(p, 30)
    with kvdata.open(p, "a") as s:
        s.put("ragged", {"image": img(1, (5, 5, 3)), "label": 1, "name": "r"})
    s = kvdata.open(p, copy_threads=2)
    b = s.get_batch([4, 2, 9])
    assert b["image"].shape == (3, 40, 40, 3) and b["image"].flags.writeable
    assert b["label"].tolist() == [4, 2, 2] and b["name"] == ["n4", "n2", "n9"]
    np.testing.assert_array_equal(b["image"][1], img(2))
    assert isinstance(s.get_batch([0, 30])["image"], list)  # shapes that differ beyond the first axis: a list
    s.close()


def test_variable_length_fields_batch_into_one_flat_array_and_offsets(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="needs torch (pip install 'kvdata[torch]')")
    p = tmp_path / "ds.kv"
    toks = [np.arange(i % 4, dtype=np.int32) * (i + 1) for i in range(10)]
    with kvdata.open(p, "w") as s:
        s.put_many((f"k{i}", {"tok": t, "box": np.ones((i % 3, 4), np.float32) * i}) for i, t in enumerate(toks))
    with kvdata.open(p) as s:
        b = s.get_batch([3, 1, 6, 0])
        tok = b["tok"]
        assert isinstance(tok, kvdata.Ragged) and tok.offsets.tolist() == [0, 3, 4, 6, 6]
        assert tok.values.dtype == np.int32 and tok.values.flags.writeable
        for k, i in enumerate([3, 1, 6, 0]):
            np.testing.assert_array_equal(tok.values[tok.offsets[k]:tok.offsets[k + 1]], toks[i])
        box = b["box"]
        assert isinstance(box, kvdata.Ragged) and box.values.shape == (0 + 1 + 0 + 0, 4)  # i % 3 rows of sample i
        import torch

        t = kvdata.collate(kvdata.Dataset(p).__getitems__([3, 1, 6, 0]))["tok"]
        assert isinstance(t, kvdata.Ragged) and isinstance(t.values, torch.Tensor)
        assert t.values.tolist() == tok.values.tolist() and t.offsets.tolist() == tok.offsets.tolist()


def _child_read(path: str, q: mp.Queue) -> None:
    s = _PARENT_STORE if _PARENT_STORE is not None else kvdata.open(path)
    q.put([int(v["image"][0, 0, 0]) for v in s.get_many([0, 5, 64])] + [bytes(s["tailkey"]).decode()])


_PARENT_STORE = None


def test_store_opened_before_fork_reads_in_child(tmp_path: Path) -> None:
    global _PARENT_STORE
    p = tmp_path / "ds.kv"
    fill(p, 65)
    with kvdata.open(p, "a") as w:
        w.put("tailkey", b"in the tail")
    _PARENT_STORE = kvdata.open(p)
    _PARENT_STORE.get_many([0, 64, 65])  # handles opened in the parent, tail included
    try:
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        proc = ctx.Process(target=_child_read, args=(str(p), q))
        proc.start()
        got = q.get(timeout=30)
        proc.join(30)
        assert got == [0, 5, 64, "in the tail"] and proc.exitcode == 0
        assert bytes(_PARENT_STORE["tailkey"]) == b"in the tail"  # parent still fine
    finally:
        _PARENT_STORE = None


def test_tail_readable_by_another_process_while_writer_is_open(tmp_path: Path) -> None:
    p = tmp_path / "ds.kv"
    w = kvdata.open(p, "a")
    try:
        w.put("a", b"first")
        w.commit()
        w.put("b", b"pending")
        code = ("import kvdata,sys; s=kvdata.open(sys.argv[1]); "
                "print(len(s), bytes(s['a']).decode(), 'b' in s)")
        out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=60)
        assert out.stdout.split() == ["1", "first", "False"], out.stderr
    finally:
        w.close()
    assert bytes(kvdata.open(p)["b"]) == b"pending"


def test_unknown_offsets_fall_back_to_lmdb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdata.store import shard_rows

    monkeypatch.setattr(shard_rows, "rows_from_pages", lambda path: None)  # as where the pages are in doubt
    monkeypatch.setattr(shard_rows, "_map_base", lambda path, addr: None)
    p = tmp_path / "ds.kv"
    fill(p, 40)
    s = kvdata.open(p)
    assert (s._index.records["offset"] == fmt.UNKNOWN_OFFSET).all()
    assert state(s)[1] == [f"k{i}" for i in range(40)]
    np.testing.assert_array_equal(s[17]["image"], img(17))
    assert verify(p)["ok"]


def test_import_kvdata_imports_no_torch_or_sdk() -> None:
    code = "import sys, kvdata; print(sorted(m for m in ('torch', 'boto3', 'botocore', 'PIL') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_open_errors(tmp_path: Path) -> None:
    from kvdata.errors import NotADatasetError

    with pytest.raises(NotADatasetError, match="no such dataset"):
        kvdata.open(tmp_path / "missing.kv")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(NotADatasetError, match="not a kvdata dataset"):
        kvdata.open(tmp_path / "junk")
    with pytest.raises(NotADatasetError, match="not empty"):
        kvdata.open(tmp_path / "junk", "a")
    assert (tmp_path / "junk" / "file.txt").read_text() == "x"
