"""No slow path for a dataset as written (issue 12 item 4).

A dataset written with `kvdata.open(p, "w")`, puts and close() -- no seal() -- is read right
away through the sealed memory-map path: close() seals the tail, and sealing is a hard link
of the tail file (no copy), its record offsets and sha256 learned in place. No zstd copy is
made at seal unless asked; `kvdata push` makes the missing ones (and seals a committed tail
itself). A writer SIGKILLed while it seals leaves the old or the new generation.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata import format as fmt
from kvdata.errors import KVDataError
from kvdata.format import names
from kvdata.reader.open import verify
from kvdata.store import reader as reader_mod
from kvdata.store import sealing as sealing_mod
from kvdata.store import shards as shards_mod
from kvdata.store.rebuild import reindex
from kvdata.store.writer import SEAL_ON_CLOSE_MIN
from kvdata.sync.push import push

from helpers.servers import tiers_config


def _img(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)


def _small(i: int) -> bytes:
    return np.random.default_rng(10_000 + i).integers(0, 256, size=1024, dtype=np.uint8).tobytes()


def _manifest(ds: Path) -> dict[str, Any]:
    return json.loads((ds / "manifest.json").read_text())


def _no_lmdb_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read from here on must go through the sealed shards' memory map."""
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("read through LMDB, not the sealed memory-map path")
    monkeypatch.setattr(reader_mod.Reader, "tail_values", refuse)
    monkeypatch.setattr(shards_mod.SealedShard, "lmdb_value", refuse)


def _assert_sealed_path(st: kvdata.Store) -> None:
    m = st.manifest
    assert m.tail.records == 0
    assert sum(e.records for e in m.shards) == len(st)
    assert (st._index.records["offset"] != fmt.UNKNOWN_OFFSET).all()


# ---------------------------------------------------------------- reads right after writing


@pytest.mark.parametrize("kind", ["images", "1KiB"])
@pytest.mark.parametrize("shard_size", ["256MB", "96KB"])  # all in one tail; several shards + a tail
def test_read_right_after_writing_goes_through_the_sealed_path(tmp_path: Path, kind: str, shard_size: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ds = tmp_path / "ds"
    n = 300
    value = (lambda i: {"image": _img(i), "label": i % 5}) if kind == "images" else _small
    with kvdata.open(ds, "w", shard_size=shard_size, compress=False) as st:
        st.put_many((f"k{i:05d}", value(i)) for i in range(n))
        tail = ds / "shards" / st.manifest.tail.name  # the tail close() will seal
    with kvdata.open(ds) as st:
        _no_lmdb_reads(monkeypatch)
        _assert_sealed_path(st)
        idx = np.random.default_rng(1).permutation(n)
        if kind == "images":
            got = st.get_batch(idx, fields=["image"])["image"]
            assert all(np.array_equal(got[j], _img(int(i))) for j, i in enumerate(idx))
            assert [int(st[int(i)]["label"]) for i in idx[:20]] == [int(i) % 5 for i in idx[:20]]
        else:
            assert [bytes(v) for v in st.get_many(idx)] == [_small(int(i)) for i in idx]
        assert bytes(st.get("k00007")["image"] if kind == "images" else st.get("k00007")) == \
            (_img(7).tobytes() if kind == "images" else _small(7))
    monkeypatch.undo()
    # sealing made no copy (the shard is the tail's own file) and no zstd copy
    assert not tail.exists() and not tail.with_name(tail.name + "-lock").exists()
    assert all(e["zst"] is None for e in _manifest(ds)["shards"])
    assert not list((ds / "shards").glob("*.zst")) and not list((ds / "shards").glob("*.tmp"))
    for e in _manifest(ds)["shards"]:
        data = (ds / "shards" / e["name"]).read_bytes()
        assert len(data) == e["bytes"] and hashlib.sha256(data).hexdigest() == e["sha256"]
    assert verify(ds, progress=False)["ok"]


def test_close_seals_the_same_file_the_tail_was(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "w", compress=False) as st:
        st.put_many((f"k{i}", _small(i)) for i in range(200))
        st.commit()
        tail = ds / "shards" / st.manifest.tail.name
        ino = tail.stat().st_ino
    m = _manifest(ds)
    assert m["tail"]["records"] == 0 and len(m["shards"]) == 1
    assert (ds / "shards" / m["shards"][0]["name"]).stat().st_ino == ino  # a link, not a copy


def test_a_few_records_stay_in_the_tail_and_append_mode_keeps_its_tail(tmp_path: Path) -> None:
    """A "w" dataset smaller than SEAL_ON_CLOSE_MIN in all keeps its tail (LMDB reads cost
    microseconds); mode "a" never seals at close (repeated small appends would make many shards)."""
    ds = tmp_path / "ds"
    with kvdata.open(ds, "w") as st:
        st.put_many((f"k{i}", b"x" * 100) for i in range(10))
    assert 10 * 100 < SEAL_ON_CLOSE_MIN and _manifest(ds)["tail"]["records"] == 10
    with kvdata.open(ds, "a") as st:
        st.put_many((f"a{i}", _small(i)) for i in range(200))
    m = _manifest(ds)
    assert m["tail"]["records"] == 210 and not m["shards"]
    with kvdata.open(ds, "w") as st:  # written again from empty: sealed at close
        st.put_many((f"a{i}", _small(i)) for i in range(200))
    m = _manifest(ds)
    assert m["tail"]["records"] == 0 and sum(e["records"] for e in m["shards"]) == 200


def test_error_in_the_with_block_seals_nothing(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "w") as st:
        st.put_many((f"k{i}", _small(i)) for i in range(200))
    with pytest.raises(RuntimeError), kvdata.open(ds, "w") as st:
        st.put_many((f"n{i}", _small(i)) for i in range(200))
        raise RuntimeError("boom")
    m = _manifest(ds)  # "w" committed its empty start at open; the puts were discarded
    assert m["count"] == 0 and not m["shards"] and m["tail"]["records"] == 0
    assert not [p.name for p in (ds / "shards").iterdir() if names.parse_shard_name(p.name)]


@pytest.mark.parametrize("err", [errno.EPERM, errno.EXDEV])
def test_without_hard_links_sealing_copies(tmp_path: Path, err: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses hard links (or protected_hardlinks on another user's tail):
    the tail is copied compacted and renamed, as before; the dataset reads the same."""
    def no_link(*_a: Any, **_k: Any) -> None:
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(sealing_mod.os, "link", no_link)
    ds = tmp_path / "ds"
    with kvdata.open(ds, "w", shard_size="96KB", compress=True) as st:
        st.put_many((f"k{i:04d}", _small(i)) for i in range(300))
        tail = ds / "shards" / st.manifest.tail.name
    monkeypatch.undo()
    m = _manifest(ds)
    assert m["tail"]["records"] == 0 and len(m["shards"]) > 1 and all(e["zst"] for e in m["shards"])
    assert not tail.exists() and not list((ds / "shards").glob("*.tmp"))
    with kvdata.open(ds) as st:
        _assert_sealed_path(st)
        assert [bytes(v) for v in st.get_many(range(300))] == [_small(i) for i in range(300)]
    assert verify(ds, progress=False)["ok"]


def test_a_link_error_that_is_not_about_links_fails_the_commit(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ds = tmp_path / "ds"
    _tail_with_records(ds)
    def full(*_a: Any, **_k: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(sealing_mod.os, "link", full)
    st = kvdata.open(ds, "a")
    st.seal()
    with pytest.raises(KVDataError, match="unchanged at generation"):
        st.commit()
    st.close()
    monkeypatch.undo()
    with kvdata.open(ds) as r:
        assert r.manifest.tail.records == 200 and bytes(r["k1"]) == _small(1)
    assert verify(ds, progress=False)["ok"]


# ---------------------------------------------------------------- recovery of an interrupted seal


def _tail_with_records(ds: Path, n: int = 200) -> dict[str, Any]:
    with kvdata.open(ds, "a", compress=False) as st:
        st.put_many((f"k{i}", _small(i)) for i in range(n))
    m = _manifest(ds)
    assert m["tail"]["records"] == n and not m["shards"]
    return m


def test_recovery_removes_the_link_of_a_seal_that_was_not_committed(tmp_path: Path) -> None:
    """Killed after the tail got its sealed name, before the manifest: the name is the tail's
    own file, so removing it removes no bytes; nothing goes to lost+found."""
    ds = tmp_path / "ds"
    m = _tail_with_records(ds)
    tail = ds / "shards" / m["tail"]["name"]
    shard = ds / "shards" / "000000.mdb"
    os.link(tail, shard)
    before = tail.read_bytes()
    with kvdata.open(ds, "a") as st:  # recovery
        assert len(st) == 200
        assert not shard.exists()
        st.put("more", b"m")
    assert not (ds / "lost+found").exists()
    with kvdata.open(ds) as st:
        assert bytes(st["k3"]) == _small(3) and bytes(st["more"]) == b"m"
    assert len(before) > 0 and verify(ds, progress=False)["ok"]


def test_recovery_moves_aside_a_sealed_name_that_is_another_file(tmp_path: Path) -> None:
    """A file under the tail's sealed name that is not the tail's own file cannot be accounted
    for: it is moved aside, never deleted."""
    ds = tmp_path / "ds"
    m = _tail_with_records(ds)
    stray = ds / "shards" / "000000.mdb"
    stray.write_bytes((ds / "shards" / m["tail"]["name"]).read_bytes())
    with kvdata.open(ds, "a") as st:
        assert len(st) == 200
    kept = list((ds / "lost+found").rglob("*000000.mdb"))
    assert len(kept) == 1 and not stray.exists()


def test_reindex_without_manifest_takes_an_uncommitted_seal_for_the_tail(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    m = _tail_with_records(ds)
    os.link(ds / "shards" / m["tail"]["name"], ds / "shards" / "000000.mdb")
    (ds / "manifest.json").unlink()
    reindex(ds, progress=False)
    with kvdata.open(ds) as st:
        assert len(st) == 200 and bytes(st["k9"]) == _small(9)
    assert verify(ds, progress=False)["ok"]
    with kvdata.open(ds, "a") as st:
        st.seal()
    assert _manifest(ds)["tail"]["records"] == 0 and verify(ds, progress=False)["ok"]


_CHILD = r"""
import sys, numpy as np, kvdata
ds, n, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
val = lambda i: np.random.default_rng([int(tag), i]).integers(0, 256, 4096, dtype=np.uint8).tobytes()
st = kvdata.open(ds, "a", shard_size="256MB", compress=False)
st.put_many((f"k{i:06d}", val(i)) for i in range(n))  # every key again, new values
st.seal()
print("C", flush=True)  # now close(): the seal (link, fsync, offsets, sha256), then the commit
st.close()
print("D", flush=True)
"""


def _value(tag: int, i: int) -> bytes:
    return np.random.default_rng([tag, i]).integers(0, 256, 4096, dtype=np.uint8).tobytes()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_during_the_seal_at_close_leaves_the_old_or_the_new_generation(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    n = 3000  # ~12 MB: sealing takes long enough to be hit
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", _CHILD, str(ds), str(n), "0"], check=True, env=env,
                   stdout=subprocess.DEVNULL, timeout=120)
    with kvdata.open(ds) as st:
        committed = {0: st.generation}
    rng = np.random.default_rng(7)
    cost = None
    outcomes = {"old": 0, "new": 0, "seal_link_left": 0}
    for tag in range(1, 13):
        p = subprocess.Popen([sys.executable, "-c", _CHILD, str(ds), str(n), str(tag)], env=env,
                             stdout=subprocess.PIPE)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == b"C"
        t0 = time.perf_counter()
        if cost is None:  # the first child is let finish: how long close() takes
            assert p.stdout.readline().strip() == b"D"
            cost = time.perf_counter() - t0
            p.wait(60)
        else:
            time.sleep(float(rng.uniform(0, cost * 1.2)))
            p.send_signal(signal.SIGKILL)
        p.wait(60)
        p.stdout.close()
        m = _manifest(ds)
        named = {e["name"] for e in m["shards"]}
        outcomes["seal_link_left"] += any(names.parse_shard_name(q.name) and q.name not in named
                                          for q in (ds / "shards").iterdir())
        live_tag = max(t for t, g in committed.items() if g <= m["generation"])
        if m["generation"] > max(committed.values()):  # the kill came after the commit point
            committed[tag] = m["generation"]
            live_tag = tag
            outcomes["new"] += 1
        else:
            outcomes["old"] += 1
        assert m["tail"]["records"] == 0  # committed generations are always sealed ones
        with kvdata.open(ds) as st:  # a reader, before any writer's recovery
            assert len(st) == n
            for i in (0, n // 2, n - 1):
                assert bytes(st[f"k{i:06d}"]) == _value(live_tag, i)
        assert verify(ds, progress=False)["ok"]
    print(outcomes)
    assert outcomes["old"] >= 1 and outcomes["seal_link_left"] >= 1, outcomes  # kills landed inside the seal
    with kvdata.open(ds, "a") as st:  # recovery after the last kill, then a write on top
        st.put("after", b"ok")
    with kvdata.open(ds) as st:
        assert bytes(st["after"]) == b"ok" and len(st) == n + 1
    assert verify(ds, progress=False)["ok"]


# ---------------------------------------------------------------- push


def test_push_seals_a_committed_tail_and_makes_the_missing_zst(tmp_path: Path) -> None:
    src = tmp_path / "src"
    with kvdata.open(src, "a", shard_size="64KB", compress=False) as st:
        st.put_many((f"k{i:04d}", {"image": _img(i), "label": i % 3}) for i in range(60))
    m = _manifest(src)
    assert m["tail"]["records"] > 0 and m["shards"] and all(e["zst"] is None for e in m["shards"])
    home = tmp_path / "home"
    summary = push(src, str(home), show=False)
    local = _manifest(src)
    assert local["tail"]["records"] == 0  # sealed by push, as a local commit
    assert summary["generation"] == local["generation"]
    assert not list((src / "shards").glob("*.zst"))  # the cold copies are made for the home only
    pushed = _manifest(home)
    assert pushed["tail"]["records"] == 0 and len(pushed["shards"]) == len(local["shards"])
    for e in pushed["shards"]:
        z = e["zst"]
        assert z is not None and z["name"] == e["name"] + ".zst"
        assert z.get("seek") and z["seek"]["bytes"] > 0  # framed with a seek table: readable record by record
        blob = (home / "shards" / z["name"]).read_bytes()
        assert len(blob) == z["bytes"] and hashlib.sha256(blob).hexdigest() == z["sha256"]
        assert not (home / "shards" / e["name"]).exists()  # a home holds cold copies only
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "64MB"))
    with kvdata.open(home, config=cfg, use_daemon=False) as st:  # through a tier, from the .zst copies
        assert len(st) == 60
        got = st.get_batch(np.arange(60), fields=["image"])["image"]
        assert all(np.array_equal(got[i], _img(i)) for i in range(60))
        assert st.source is not None
    assert summary["shards_uploaded"] == len(pushed["shards"])
    again = push(src, str(home), show=False)  # nothing new: every cold copy is already there
    assert again["shards_uploaded"] == 0 and again["shards_skipped"] == len(pushed["shards"])


def test_compress_true_writes_a_framed_zst_at_seal(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "w", shard_size="64KB", compress=True) as st:
        st.put_many((f"k{i:04d}", _small(i)) for i in range(200))
    m = _manifest(ds)
    assert m["tail"]["records"] == 0 and m["shards"]
    for e in m["shards"]:
        z = e["zst"]
        blob = (ds / "shards" / z["name"]).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == z["sha256"] and z.get("seek")
    assert verify(ds, progress=False)["ok"]


def test_push_of_a_shard_without_zst_entry_from_a_local_dataset_read_in_place(tmp_path: Path) -> None:
    """A local dataset whose shards have no zst entry is still stageable from itself (read in place)."""
    src = tmp_path / "src"
    with kvdata.open(src, "w", shard_size="64KB", compress=False) as st:
        st.put_many((f"k{i:04d}", _small(i)) for i in range(200))
    assert all(e["zst"] is None for e in _manifest(src)["shards"])
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "64MB"))
    with kvdata.open(src, config=cfg, use_daemon=False) as st:
        assert st.source is not None
        assert [bytes(v) for v in st.get_many(range(200))] == [_small(i) for i in range(200)]


def test_push_refuses_while_another_writer_holds_a_tail(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tail_with_records(src, 50)
    code = ("import sys, kvdata, time\n"
            "s = kvdata.open(sys.argv[1], 'a')\n"
            "print('L', flush=True)\n"
            "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-c", code, str(src)], stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"L"
        with pytest.raises(KVDataError, match="open tail"):
            push(src, str(tmp_path / "home"), show=False)
    finally:
        p.kill()
        p.wait(30)
        if p.stdout is not None:
            p.stdout.close()
    assert not (tmp_path / "home" / "manifest.json").exists()
    push(src, str(tmp_path / "home"), show=False)  # the writer is gone: push seals and goes on
    assert _manifest(tmp_path / "home")["tail"]["records"] == 0


def test_push_of_a_tail_it_cannot_write_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    _tail_with_records(src, 20)
    import kvdata.sync.push as push_mod
    real = push_mod.Store

    def store(root: Any, mode: str = "r", **kw: Any) -> Any:
        if mode != "r":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(root))
        return real(root, mode, **kw)
    monkeypatch.setattr(push_mod, "Store", store)
    with pytest.raises(KVDataError, match="kvdata seal"):
        push(src, str(tmp_path / "home"), show=False)
    assert not (tmp_path / "home" / "manifest.json").exists()


def test_a_failed_sha256_of_a_sealed_shard_fails_the_commit_and_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sha256 of a sealed shard is computed on a thread while the next tail fills; the
    commit waits for it, and a failure there discards the writes like any failed commit."""
    ds = tmp_path / "ds"
    m = _tail_with_records(ds)

    def broken(*_a: Any, **_k: Any) -> Any:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(sealing_mod, "mapped_file_sha256", broken)
    st = kvdata.open(ds, "a", shard_size="64KB")
    st.put_many((f"n{i}", _small(i)) for i in range(200))  # seals shards on the way
    with pytest.raises(KVDataError, match="unchanged at generation"):
        st.commit()
    st.close()
    monkeypatch.undo()
    assert _manifest(ds)["generation"] == m["generation"]
    assert not [p for p in (ds / "shards").iterdir() if names.parse_shard_name(p.name)]
    with kvdata.open(ds) as r:
        assert len(r) == 200 and "n1" not in r
    assert verify(ds, progress=False)["ok"]
