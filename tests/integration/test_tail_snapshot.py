"""Reads of a live tail by memory map (store.tail_snapshot): a dataset written with mode "a" keeps
its last shard as an LMDB tail, and its records are read like a sealed shard's once enough of them
are asked for -- the same values as through LMDB, views that stay valid while the writer goes on
appending (the snapshot's read transaction pins their pages), and forked children that neither
lose their parent's pin nor fail to read the tail themselves.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.errors import MissingShardError
from kvdata.store import tail_snapshot
from kvdata.store.shards import ENVS
from kvdata.store.tail_snapshot import TailSnapshot


def _value(i: int, rnd: int = 0) -> Any:
    """Sample i: raw bytes or fields (arrays of varied shapes, a str, a label), all derived from i."""
    rng = np.random.default_rng(i * 7919 + rnd)
    if i % 3 == 0:
        return rng.bytes(200 + (i * 37) % 3000)
    shape = (1 + i % 5, 1 + (i * 3) % 7, 3)
    return {"image": rng.integers(0, 255, shape, dtype=np.uint8), "x": rng.random(i % 4 + 1),
            "name": f"sample {i}/{rnd}"}


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, dict):
        return set(got) == set(want) and all(
            np.array_equal(np.asarray(got[k]), np.asarray(want[k])) if not isinstance(want[k], str)
            else got[k] == want[k] for k in want)
    return bytes(got) == bytes(want)


def _write(path: Path, n: int, commits: int = 4) -> None:
    with kvdata.open(path, "a") as w:
        per = -(-n // commits)
        for i in range(n):
            w.put(f"k{i:06d}", _value(i), label=i)
            if i % per == per - 1:
                w.commit()


def _tail_snapshot(store: kvdata.Store) -> TailSnapshot | None:
    return store._reader._tail._snap


def _readers_of(tail: Path) -> str:
    """LMDB's reader table of a tail, as another process sees it (pid, thread, txnid per line)."""
    code = "import lmdb,sys; print(lmdb.open(sys.argv[1], subdir=False, readonly=True, lock=True).readers())"
    return subprocess.run([sys.executable, "-c", code, str(tail)], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def test_tail_records_read_by_map_equal_the_lmdb_reads(tmp_path: Path) -> None:
    p = tmp_path / "a.kv"
    _write(p, 900)
    with kvdata.open(p, "a") as w:  # overwrites and deletes go to the tail too
        for i in range(0, 900, 11):
            w.put(f"k{i:06d}", _value(i, 1), label=-i)
        for i in range(5, 900, 13):
            w.delete(f"k{i:06d}")
    store = kvdata.open(p)
    try:
        m = store.manifest
        assert not m.shards and m.tail.records > 900  # all of it is tail
        order = np.random.default_rng(0).permutation(len(store))
        lmdb_reads = store.get_many(order[:20])  # a few: through LMDB
        assert _tail_snapshot(store) is None
        by_map = store.get_many(order)  # a whole pass: worth a snapshot
        assert _tail_snapshot(store) is not None
        for a, b in zip(lmdb_reads, by_map):
            assert _same(b, a)
        for i, v in zip(order.tolist(), by_map):
            key = store.key_at(i)
            k = int(key[1:])
            want = _value(k, 1) if k % 11 == 0 else _value(k)
            assert _same(v, want), key
            assert _same(store[i], want) and _same(store[key], want)
        copies = store.get_many(order[:50], copy=True)
        assert all(_same(c, v) for c, v in zip(copies, by_map))
        fields = [i for i in order.tolist() if isinstance(by_map[order.tolist().index(i)], dict)][:64]
        shaped = [i for i in fields if _value(int(store.key_at(i)[1:]))["image"].shape == (1, 1, 3)]
        if shaped:
            batch = store.get_batch(shaped)
            assert batch["image"].shape == (len(shaped), 1, 1, 3)
    finally:
        store.close()
    with kvdata.open(p, "a") as w:  # the same records read from a sealed shard
        w.seal()
    with kvdata.open(p) as s:
        assert s.manifest.tail.records == 0
        assert all(_same(a, b) for a, b in zip(s.get_many(order), by_map))


WRITER = textwrap.dedent("""
    import sys, kvdata, numpy as np
    path, start, n, commits = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    with kvdata.open(path, "a") as w:
        for i in range(start, start + n):
            w.put(f"k{i:06d}", np.random.default_rng(i).bytes(1000))
            if (i - start) % max(1, n // commits) == 0:
                w.commit()
""")


def _append(path: Path, start: int, n: int, commits: int) -> None:
    subprocess.run([sys.executable, "-c", WRITER, str(path), str(start), str(n), str(commits)], check=True,
                   timeout=120)


def _small(i: int) -> bytes:
    return np.random.default_rng(i).bytes(1000)


def test_views_of_tail_records_stay_valid_while_the_writer_appends(tmp_path: Path) -> None:
    """The last records of a tail lie on the leaf page that every later write transaction copies
    and frees; without the snapshot's pin, those freed pages are written over by the next ones."""
    p = tmp_path / "a.kv"
    _append(p, 0, 200, 2)
    store = kvdata.open(p)
    views = store.get_many(range(len(store)))
    assert _tail_snapshot(store) is not None and all(isinstance(v, memoryview) for v in views)
    tail = p / "shards" / store.manifest.tail.name
    mine = _readers_of(tail)
    assert str(os.getpid()) in mine  # the pin: a reader slot of this process
    store.refresh()
    store.close()  # the reader lets go of its snapshot; the views still hold its map, and the pin
    _append(p, 200, 3000, 300)  # 300 write transactions, each freeing the pages it copied
    for i, v in enumerate(views):
        assert bytes(v) == _small(i), f"view of sample {i} changed under the reader"
    assert str(os.getpid()) in _readers_of(tail)
    del views, v
    assert str(os.getpid()) not in _readers_of(tail)  # the last view gone: the pin is ended
    with kvdata.open(p) as s:
        assert all(bytes(v) == _small(i) for i, v in enumerate(s.get_many(range(len(s)))))


_FORKED: kvdata.Store | None = None


def _child_reads(q: Any, n: int, normal_exit: bool) -> None:
    assert _FORKED is not None
    try:
        got = [bytes(v) == _small(i) for i, v in enumerate(_FORKED.get_many(range(n)))]
        q.put(("ok", all(got) and len(got) == n))
    except BaseException as e:  # reported to the parent
        q.put(("error", repr(e)))
    if normal_exit:
        sys.exit(0)  # interpreter shutdown in the child: nothing of the parent's pin may end


@pytest.mark.parametrize("normal_exit", [False, True])
def test_forked_child_reads_the_tail_and_the_parents_pin_holds(tmp_path: Path, normal_exit: bool) -> None:
    global _FORKED
    p = tmp_path / "a.kv"
    _append(p, 0, 300, 3)
    _FORKED = kvdata.open(p)
    try:
        views = _FORKED.get_many(range(300))
        assert _tail_snapshot(_FORKED) is not None
        tail = p / "shards" / _FORKED.manifest.tail.name
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        procs = [ctx.Process(target=_child_reads, args=(q, 300, normal_exit)) for _ in range(2)]
        for proc in procs:
            proc.start()
        results = [q.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(60)
        assert results == [("ok", True)] * 2 and all(proc.exitcode == 0 for proc in procs)
        assert str(os.getpid()) in _readers_of(tail)  # the children did not end the parent's pin
        _append(p, 300, 2000, 200)
        assert all(bytes(v) == _small(i) for i, v in enumerate(views))
    finally:
        _FORKED.close()
        _FORKED = None


def test_dataloader_workers_read_a_tail_the_parent_mapped(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    p = tmp_path / "a.kv"
    with kvdata.open(p, "a") as w:
        for i in range(256):
            w.put(f"k{i:04d}", {"x": np.full((4,), i, np.int64)}, label=i)
    ds = kvdata.Dataset(p)
    assert int(ds[5]["x"][0]) == 5
    ds.store.get_many(range(256))  # the parent takes the snapshot before the workers fork
    dl = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=2, multiprocessing_context="fork")
    seen = sorted(int(v) for b in dl for v in b["x"][:, 0].tolist())
    assert seen == list(range(256))


def test_a_snapshot_whose_meta_was_overwritten_is_refused(tmp_path: Path) -> None:
    """A read transaction whose meta page the writer has since written twice over cannot give its
    root: the walk is refused (never walked from another transaction's root), and reads go
    through LMDB."""
    p = tmp_path / "a.kv"
    _append(p, 0, 50, 1)
    store = kvdata.open(p)
    try:
        env = store._reader._tail._open(store._reader.gen)
        key, txn = ENVS.pin(env)
        try:
            _append(p, 50, 40, 4)  # four more write transactions: both meta pages rewritten
            import mmap
            with open(store._reader.gen.tail_path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            try:
                assert tail_snapshot._rows_at(mm, txn, 50) is None
            finally:
                mm.close()
        finally:
            ENVS.unpin(key, os.getpid())
        assert all(bytes(v) == _small(i) for i, v in enumerate(store.get_many(range(50))))
    finally:
        store.close()


def test_a_tail_name_that_is_a_symlink_is_not_mapped(tmp_path: Path) -> None:
    p = tmp_path / "a.kv"
    _append(p, 0, 50, 1)
    store = kvdata.open(p)
    try:
        env = store._reader._tail._open(store._reader.gen)
        link = tmp_path / "link.mdb"
        link.symlink_to(store._reader.gen.tail_path)
        assert TailSnapshot.take(env, link, 50) is None  # O_NOFOLLOW: never mapped through a link
        other = tmp_path / "other.mdb"
        other.write_bytes(store._reader.gen.tail_path.read_bytes())
        assert TailSnapshot.take(env, other, 50) is None  # another file under the name: not the env's
    finally:
        store.close()


def test_readers_reading_whole_tails_while_a_writer_commits_seals_and_rewrites(tmp_path: Path) -> None:
    """Every open reads every tail record (so by snapshot) while a writer appends, seals and
    rewrites with mode "w"; each value names its key and round, so a wrong one is caught."""
    from test_reader_during_writes import WRITER as REWRITER

    path = tmp_path / "ds"
    with kvdata.open(path, "a") as s:
        s.put("k000000", ("k000000|0|" * 40).encode())
    writer = subprocess.Popen([sys.executable, "-c", REWRITER, str(path), "30"])
    rng = random.Random(0)
    checked = opens = 0
    try:
        while opens < 300:
            assert writer.poll() is None, "the writer died"
            try:
                with kvdata.open(path) as store:
                    n = len(store)
                    tail_at = [i for i in range(n) if int(store._reader.gen.index.samples[i]["shard"])
                               >= store._reader.gen.index.n_sealed]
                    idx = tail_at + [rng.randrange(n) for _ in range(8)] if n else []
                    rounds = set()
                    for i, v in zip(idx, store.get_many(idx)):
                        key = store.key_at(i)
                        text = bytes(v).decode()
                        head, r, _ = text.split("|", 2)
                        assert head == key and text == (key + "|" + r + "|") * 40, f"sample {i} ({key})"
                        rounds.add(r)
                    assert len(rounds) <= 1, rounds
                    checked += len(idx)
            except MissingShardError:
                pass
            opens += 1
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert checked > 0
