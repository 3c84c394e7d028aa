"""Reads of a live tail by memory map (store.tail_snapshot): a dataset written with mode "a" keeps
its last shard as an LMDB tail, and its records are read like a sealed shard's once enough of them
are asked for -- the same values as through LMDB, never a row used after the writer committed
again (each read checks, under its own transaction), no reader slot held between reads, forked
children reading by their parent's walk, and a tail swapped in under its name never mapped.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.errors import MissingShardError
from kvdata.store import record_metas, tail_reads, tail_snapshot
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


def test_tail_reads_after_the_writer_commits_again_stay_right_and_hold_no_reader_slot(tmp_path: Path) -> None:
    """A snapshot is used only while nothing was committed to the tail since its walk: the last
    records lie on the leaf page every later write transaction copies and frees, and those pages
    are written over by the next ones. Between reads the reader holds no LMDB reader slot, so an
    idle reader keeps no page from the writer."""
    p = tmp_path / "a.kv"
    _append(p, 0, 200, 2)
    store = kvdata.open(p)
    try:
        first = store.get_many(range(len(store)))
        snap = _tail_snapshot(store)
        assert snap is not None and all(isinstance(v, bytes) for v in first)  # tail records are copies
        tail = p / "shards" / store.manifest.tail.name
        assert str(os.getpid()) not in _readers_of(tail)  # nothing held between reads
        _append(p, 200, 3000, 300)  # 300 write transactions, each freeing the pages it copied
        assert all(bytes(v) == _small(i) for i, v in enumerate(first))
        again = store.get_many(range(200))  # same generation: the snapshot is stale, LMDB reads
        assert _tail_snapshot(store) is None
        assert all(bytes(v) == _small(i) for i, v in enumerate(again))
        assert all(bytes(store[i]) == _small(i) for i in (0, 150, 198, 199))
        store.refresh()
        n = len(store)
        assert n == 3200
        got = store.get_many(range(n))  # a whole pass: a new snapshot, of the new commit
        assert _tail_snapshot(store) is not None and _tail_snapshot(store) is not snap
        assert all(bytes(v) == _small(i) for i, v in enumerate(got))
        assert str(os.getpid()) not in _readers_of(tail)
    finally:
        store.close()


_FORKED: kvdata.Store | None = None


def _child_reads(q: Any, n: int, normal_exit: bool) -> None:
    assert _FORKED is not None
    try:
        got = [bytes(v) == _small(i) for i, v in enumerate(_FORKED.get_many(range(n)))]
        q.put(("ok", all(got) and len(got) == n and _tail_snapshot(_FORKED) is not None))
    except BaseException as e:  # reported to the parent
        q.put(("error", repr(e)))
    if normal_exit:
        sys.exit(0)  # interpreter shutdown in the child


@pytest.mark.parametrize("normal_exit", [False, True])
def test_forked_children_read_the_tail_by_the_parents_snapshot(tmp_path: Path, normal_exit: bool) -> None:
    """A snapshot holds no LMDB handle: forked children use the walk their parent made, each read
    checked under the child's own transaction."""
    global _FORKED
    p = tmp_path / "a.kv"
    _append(p, 0, 300, 3)
    _FORKED = kvdata.open(p)
    try:
        _FORKED.get_many(range(300))
        assert _tail_snapshot(_FORKED) is not None
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        procs = [ctx.Process(target=_child_reads, args=(q, 300, normal_exit)) for _ in range(2)]
        for proc in procs:
            proc.start()
        results = [q.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(60)
        assert results == [("ok", True)] * 2 and all(proc.exitcode == 0 for proc in procs)
        _append(p, 300, 2000, 200)
        assert all(bytes(v) == _small(i) for i, v in enumerate(_FORKED.get_many(range(300))))
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
        with store._reader._tail._env_of(store._reader.gen) as env, ENVS.read(env) as txn:
            txnid, entries = txn.id(), txn.stat()["entries"]
            _append(p, 50, 40, 4)  # four more write transactions: both meta pages rewritten
            with open(store._reader.gen.tail_path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            try:
                assert tail_snapshot._rows_at(mm, txnid, entries, 50) is None
            finally:
                mm.close()
        assert all(bytes(v) == _small(i) for i, v in enumerate(store.get_many(range(50))))
    finally:
        store.close()


def test_a_tail_name_that_is_a_symlink_or_another_file_is_not_mapped(tmp_path: Path) -> None:
    p = tmp_path / "a.kv"
    _append(p, 0, 50, 1)
    store = kvdata.open(p)
    try:
        tail = store._reader.gen.tail_path
        link = tmp_path / "link.mdb"
        link.symlink_to(tail)
        other = tmp_path / "other.mdb"
        other.write_bytes(tail.read_bytes())
        with store._reader._tail._env_of(store._reader.gen) as env:
            assert TailSnapshot.take(env, link, 50) is None  # O_NOFOLLOW: never mapped through a link
            assert TailSnapshot.take(env, other, 50) is None  # another file: not the one the env has open
            assert TailSnapshot.take(env, tail, 50) is not None
    finally:
        store.close()


def test_a_tail_file_swapped_in_under_its_name_is_never_read_by_map(tmp_path: Path) -> None:
    """Someone who may write the directory replaces the tail (same name, a new inode, a value
    changed): the reader's env has the genuine file open, and the swapped-in bytes are never
    mapped and served as if they were the env's."""
    p = tmp_path / "a.kv"
    _append(p, 0, 50, 1)
    store = kvdata.open(p)
    try:
        store.get_many([0])  # the env has the genuine tail open
        tail = store._reader.gen.tail_path
        data = bytearray(tail.read_bytes())
        at = data.find(_small(7))
        assert at > 0
        data[at:at + 5] = b"EVIL!"
        fake = tail.with_name(tail.name + ".new")
        fake.write_bytes(bytes(data))
        os.replace(fake, tail)
        got = store.get_many(range(50))
        assert _tail_snapshot(store) is None
        assert all(bytes(v) == _small(i) for i, v in enumerate(got))
    finally:
        store.close()


def _race_refresh(p: Path, writer_code: str, check: Callable[[kvdata.Store], str | None]) -> None:
    """Two threads run `check(store)` (an error text, or None) over and over while a third calls
    store.refresh() and a writer process runs `writer_code`; fails with the first error seen."""
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(writer_code), str(p)])
    store = kvdata.open(p)
    errors: list[str] = []
    stop = threading.Event()

    def run_check() -> None:
        while not stop.is_set():
            try:
                err = check(store)
            except Exception as e:  # reported below
                err = repr(e)
            if err is not None:
                errors.append(err)
                return

    def refresh() -> None:
        while not stop.is_set():
            store.refresh()

    threads = [threading.Thread(target=run_check) for _ in range(2)] + [threading.Thread(target=refresh)]
    try:
        for t in threads:
            t.start()
        writer.wait(timeout=120)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        store.close()
    assert writer.returncode == 0 and not errors, errors[:5]


def test_threads_reading_while_another_refreshes_never_mix_generations(tmp_path: Path) -> None:
    """Reader threads and a thread calling refresh() share one Store while a writer process
    appends, commits and seals: every read comes from one generation (values name their keys)."""
    p = tmp_path / "a.kv"
    with kvdata.open(p, "a", shard_size="64KB") as w:
        for i in range(100):
            w.put(f"k{i:06d}", f"k{i:06d}|".encode() * 30)

    def read(store: kvdata.Store) -> str | None:
        n = len(store)
        idx = list(range(max(0, n - 300), n))
        for i, v in zip(idx, store.get_many(idx)):
            text = bytes(v).decode()
            if text != f"k{i:06d}|" * 30:
                return f"sample {i}: {text[:8]}"
        return None

    _race_refresh(p, """
        import sys, kvdata
        with kvdata.open(sys.argv[1], "a", shard_size="64KB") as w:
            for i in range(100, 2600):
                w.put(f"k{i:06d}", f"k{i:06d}|".encode() * 30)
                if i % 10 == 0:
                    w.commit()
                if i % 200 == 0:
                    w.seal()
                    w.commit()
    """, read)


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


def test_get_batch_fields_that_are_not_arrays_outlive_the_read(tmp_path: Path) -> None:
    """get_batch stacks array fields into the batch inside the read's transaction; a bytes field
    is handed on as it is, so from a tail snapshot it must be a copy, not a view of the map."""
    p = tmp_path / "a.kv"
    with kvdata.open(p, "a") as w:
        for i in range(200):
            w.put(f"k{i:04d}", {"b": f"record {i:04d} ".encode() * 10, "x": i, "a": np.full(3, i)})
    store = kvdata.open(p)
    try:
        store.get_many(range(200))
        batch = store.get_batch(range(200))
        assert _tail_snapshot(store) is not None
        code = textwrap.dedent("""
            import sys, numpy as np, kvdata
            with kvdata.open(sys.argv[1], "a") as w:
                for i in range(200, 260):
                    w.put(f"k{i:04d}", {"b": b"NEW!" * 40, "x": i, "a": np.full(3, i)})
                    w.commit()
        """)
        subprocess.run([sys.executable, "-c", code, str(p)], check=True, timeout=120)
        assert all(type(v) is bytes for v in batch["b"])  # owned, not a view of the tail's map
        assert [bytes(v) for v in batch["b"]] == [f"record {i:04d} ".encode() * 10 for i in range(200)]
        assert batch["x"].tolist() == list(range(200)) and batch["a"][:, 0].tolist() == list(range(200))
    finally:
        store.close()


def test_a_writer_committing_all_the_time_gets_the_tail_walked_less_and_less(tmp_path: Path) -> None:
    """Each snapshot a commit made stale (or a take refused) doubles the reads asked before the
    next walk, down to one walk per tail's worth of reads; the values stay right meanwhile."""
    p = tmp_path / "a.kv"
    _append(p, 0, 2000, 2)
    store = kvdata.open(p)
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, kvdata
        with kvdata.open(sys.argv[1], "a") as w:
            for i in range(2000, 2400):
                w.put(f"x{i:06d}", b"y" * 100)
                w.commit()
    """), str(p)])
    try:
        rng = np.random.default_rng(0)
        while writer.poll() is None:
            idx = rng.integers(0, 2000, 256)
            assert all(bytes(v) == _small(int(i)) for i, v in zip(idx, store.get_many(idx)))
        assert writer.returncode == 0
        assert store._reader._tail._share < tail_reads.SNAPSHOT_SHARE
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        store.close()


def test_key_lookups_while_another_thread_refreshes_read_one_generation(tmp_path: Path) -> None:
    """keys, key_at and find take the generation once, as get_many does: a refresh() landing
    between their steps (the tail sealed meanwhile) never sends them to another generation's
    files."""
    p = tmp_path / "a.kv"
    with kvdata.open(p, "a", shard_size="64KB") as w:
        for i in range(100):
            w.put(f"k{i:06d}", b"x" * 200)

    def look(store: kvdata.Store) -> str | None:
        st = store._reader.state
        n = st[0].index.count
        for i, (_kind, meta) in zip(range(max(0, n - 50), n),
                                    record_metas.metas(store._reader, range(max(0, n - 50), n), st)):
            if meta["k"] != f"k{i:06d}":
                return f"sample {i}: key {meta['k']}"
        k = f"k{n - 1:06d}"
        if store.find(k) is None and k in {f"k{j:06d}" for j in range(len(store))}:
            return f"{k} not found"
        return None

    _race_refresh(p, """
        import sys, kvdata
        with kvdata.open(sys.argv[1], "a", shard_size="64KB") as w:
            for i in range(100, 1600):
                w.put(f"k{i:06d}", b"x" * 200)
                if i % 10 == 0:
                    w.commit()
                if i % 100 == 0:
                    w.seal()
                    w.commit()
    """, look)


def test_a_reader_follows_a_tail_grown_past_its_map_by_a_larger_shard_size(tmp_path: Path) -> None:
    """A writer that raises shard_size grows the tail past the map a reader opened it with
    (LMDB: MDB_MAP_RESIZED); the reader adopts the new size and reads on, by snapshot or not."""
    p = tmp_path / "a.kv"
    with kvdata.open(p, "a", shard_size="1MB") as w:
        for i in range(300):
            w.put(f"k{i}", b"v" * 100)
    store = kvdata.open(p)
    try:
        n = len(store)
        assert all(bytes(v) == b"v" * 100 for v in store.get_many(range(n)))  # env opened, 65 MB map
        code = textwrap.dedent("""
            import sys, kvdata
            with kvdata.open(sys.argv[1], "a", shard_size="300MB") as w:
                for i in range(75):
                    w.put(f"big{i}", bytes(1 << 20))
        """)
        subprocess.run([sys.executable, "-c", code, str(p)], check=True, timeout=120)
        assert all(bytes(v) == b"v" * 100 for v in store.get_many(range(n)))  # the old generation
        assert bytes(store[5]) == b"v" * 100
        store.refresh()
        assert len(store) == n + 75 and bytes(store["big74"]) == bytes(1 << 20)
    finally:
        store.close()
