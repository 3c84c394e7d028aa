"""`kvdata compact DATASET` (kvdata.store.compact): every record reads the same before and after,
record for record, by index and by key; readers that have the dataset open keep reading their
generation (its files stay until they close, in this process, another process, or a forked
child); a SIGKILL anywhere leaves the old or the new generation, complete; and hostile layouts,
a busy lock or a damaged shard are refused in one line with the dataset untouched."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import select
import shutil
import signal
import struct
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.errors import CorruptDatasetError, MissingShardError, ReadOnlyError, WriterLockedError
from kvdata.format import names
from kvdata.reader.open import verify
from kvdata.store import read_manifest
from kvdata.store.lock import WriterLock

from helpers.cli import Cli
from helpers.forked import run_forked
from helpers.users import User, can_switch_users, cannot_exec_python_as, make_user

SHARD = 64 << 10
CLASSES = ["cat", "dog", "eel"]


# ---------------------------------------------------------------- datasets and snapshots


def _value(rng: np.random.Generator, i: int) -> Any:
    if i % 5 == 4:
        return rng.bytes(int(rng.integers(1, 900)))
    img = rng.integers(0, 255, size=(int(rng.integers(1, 12)), 7, 3), dtype=np.uint8)
    return {"image": img, "score": float(i) / 3, "name": f"n{i}", "id": i, "vec": rng.random(3).astype("<f4")}


def _label(i: int) -> int | None:
    return None if i % 5 == 4 else i % 3


def _put(s: kvdata.Store, rng: np.random.Generator, keys: range | list[int], prefix: str = "k") -> None:
    s.put_many((f"{prefix}{i:05d}", _value(rng, i), _label(i)) for i in keys)


def _overwrites(path: Path) -> None:
    rng = np.random.default_rng(1)
    with kvdata.open(path, "a", shard_size=SHARD) as s:
        _put(s, rng, range(500))
        s.commit()
        _put(s, rng, sorted(rng.choice(500, 250, replace=False).tolist()))  # half overwritten, in place
        s.seal()


def _deletes(path: Path) -> None:
    rng = np.random.default_rng(2)
    with kvdata.open(path, "a", shard_size=SHARD) as s:
        _put(s, rng, range(500))
        s.commit()
        for i in rng.choice(500, 120, replace=False).tolist():
            s.delete(f"k{i:05d}")
        s.seal()


def _small_shards(path: Path) -> None:
    """Appends in mode "a", each sealed: 30 shards of a few records each."""
    rng = np.random.default_rng(3)
    for j in range(30):
        with kvdata.open(path, "a", shard_size=SHARD) as s:
            _put(s, rng, range(j * 7, j * 7 + 7))
            s.seal()


def _mix(path: Path) -> None:
    """Small shards, overwrites (also of a deleted key put again), deletes, a tail with live and
    dead records, classes, an extra, raw and field records."""
    rng = np.random.default_rng(4)
    for j in range(8):
        with kvdata.open(path, "a", shard_size=SHARD) as s:
            _put(s, rng, range(j * 40, j * 40 + 40))
            s.seal()
    with kvdata.open(path, "a", shard_size=SHARD) as s:
        _put(s, rng, range(320, 700))
        s.commit()
        _put(s, rng, sorted(rng.choice(700, 200, replace=False).tolist()))
        for i in rng.choice(700, 90, replace=False).tolist():
            if f"k{i:05d}" in s:
                s.delete(f"k{i:05d}")
        s.put("k00001", b"put again after a delete")
        s.set_classes(CLASSES)
        s.set_extra("source", {"made_by": "test_compact", "n": 3})
        s.commit()
        _put(s, rng, range(700, 730), prefix="t")  # the tail: live records...
        _put(s, rng, range(700, 710), prefix="t")  # ...and dead ones
        s.delete("t00705")


SCENARIOS: dict[str, Callable[[Path], None]] = {"overwrites": _overwrites, "deletes": _deletes,
                                                 "small_shards": _small_shards, "mix": _mix}


def _norm(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, memoryview):
        return bytes(v)
    return v


def _snapshot(path: Path) -> dict[str, Any]:
    """Everything a user can read: every record by index (one at a time and in batches) and by key,
    labels, classes, fields, extras."""
    with kvdata.open(path) as s:
        keys = list(s.keys())
        by_index = [_norm(s.get_one(i, copy=True)) for i in range(len(s))]
        batched = [_norm(v) for start in range(0, len(s), 97)
                   for v in s.get_many(range(start, min(len(s), start + 97)), copy=True)]
        assert batched == by_index
        return {"keys": keys, "values": by_index, "by_key": {k: _norm(s[k]) for k in keys},
                "labels": s.labels.tolist(), "classes": s.classes, "fields": s.fields, "extra": s.manifest.extra}


def _digests(store: kvdata.Store) -> list[tuple[str, str]]:
    """(key, sha256 of the value) of every sample, read through an open store."""
    out = []
    for i in range(len(store)):
        v = _norm(store.get_one(i, copy=True))
        out.append((store.key_at(i), hashlib.sha256(pickle.dumps(v)).hexdigest()))
    return out


def _disk(path: Path) -> int:
    """Bytes the dataset's files take (each file once; the writer lock's owner record left out)."""
    seen: dict[tuple[int, int], int] = {}
    for p in path.rglob("*"):
        st = p.lstat()
        if p.is_file() and not p.is_symlink() and p != path / names.LOCK:
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def _files(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.lstat().st_ino, p.lstat().st_size) for p in sorted(path.rglob("*"))
            if p.name != names.LOCK and not p.is_dir()}


def _named(path: Path) -> set[str]:
    """Shard-directory files the manifest names (with the tail's LMDB lock file, if any)."""
    m = read_manifest(path)
    out = {s.name for s in m.shards} | {s.zst.name for s in m.shards if s.zst}
    return out | ({m.tail.name, names.lmdb_lock_name(m.tail.name)} & set(os.listdir(path / names.SHARDS_DIR)))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each scenario's dataset and its snapshot; tests compact copies."""
    d = tmp_path_factory.mktemp("built")
    out = {}
    for name, make in SCENARIOS.items():
        make(d / name)
        out[name] = (d / name, _snapshot(d / name))
    return out


def _copy(built: dict[str, tuple[Path, dict[str, Any]]], name: str, dest: Path) -> tuple[Path, dict[str, Any]]:
    src, snap = built[name]
    shutil.copytree(src, dest, symlinks=True)
    return dest, snap


# ---------------------------------------------------------------- record for record


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_record_reads_the_same_and_the_space_is_reclaimed(built: Any, tmp_path: Path, cli: Cli,
                                                                 scenario: str) -> None:
    ds, before = _copy(built, scenario, tmp_path / "ds")
    m0 = read_manifest(ds)
    disk0 = _disk(ds)
    s = kvdata.compact(ds)
    m1 = read_manifest(ds)
    assert s.compacted and s.generation_before == m0.generation and s.generation_after == m1.generation == m0.generation + 1
    assert m1.incarnation == m1.generation and m1.tail.records == 0  # new names; the tail ends sealed
    assert _snapshot(ds) == before
    assert verify(ds, progress=False)["ok"]
    # the space: what the summary says is what left the disk, and the old files are gone
    assert s.files_kept_for_readers == [] and s.bytes_kept_for_readers == 0
    assert s.bytes_before == disk0 and s.bytes_after == _disk(ds)
    assert s.bytes_reclaimed == disk0 - _disk(ds) > 0
    assert s["bytes_reclaimed"] == s.bytes_reclaimed and s.to_json()["shards_after"] == s.shards_after
    assert set(os.listdir(ds / names.SHARDS_DIR)) == _named(ds)
    assert sorted(os.listdir(ds)) == sorted([names.LOCK, names.MANIFEST, names.SHARDS_DIR, names.INDEX_DIR,
                                             names.reader_pin_name(m1.incarnation)])
    assert s.shards_before == len(m0.shards) and s.shards_after == len(m1.shards)
    assert s.records_rewritten + s.records_dropped == sum(
        e.records for e in m0.shards if e.name not in {k for k in _kept_names(m0, m1)}) + m0.tail.records
    # shards are full or alone: no two neighbours both under half the shard size
    small = [e.bytes < SHARD // 2 for e in m1.shards]
    assert not any(a and b for a, b in zip(small, small[1:])), [e.bytes for e in m1.shards]
    largest = max([SHARD] + [e.bytes for e in m0.shards])  # LMDB's pages cost a little beyond the records
    assert all(e.bytes <= largest * 1.1 for e in m1.shards), [e.bytes for e in m1.shards]
    # records lie in sample order, so `kvdata reindex` rebuilds the very same dataset
    shutil.rmtree(ds / names.INDEX_DIR)
    (ds / names.INDEX_DIR).mkdir()
    cli.ok("reindex", ds)
    assert _snapshot(ds) == before
    # nothing left to do
    again = kvdata.compact(ds)
    assert not again.compacted and again.bytes_reclaimed == 0 and read_manifest(ds).generation == m1.generation + 1
    # and it is an ordinary dataset again
    with kvdata.open(ds, "a") as w:
        w.put("after", b"compaction")
        if before["keys"]:
            w.delete(before["keys"][0])
    with kvdata.open(ds) as r:
        assert bytes(r["after"]) == b"compaction" and len(r) == len(before["keys"])
    assert verify(ds, progress=False)["ok"]


def _kept_names(m0: Any, m1: Any) -> set[str]:
    """Old shards the new generation kept (same sha256 and records, in order)."""
    new = {e.sha256 for e in m1.shards}
    return {e.name for e in m0.shards if e.sha256 in new}


def test_full_live_shards_are_kept_as_hard_links_not_copied(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    rng = np.random.default_rng(5)
    with kvdata.open(ds, "a", shard_size=SHARD) as s:
        _put(s, rng, range(600))
        s.seal()
    m0 = read_manifest(ds)
    with kvdata.open(ds, "a") as s:  # one overwrite of a record of the last shard
        last = s.describe(len(s) - 1, len(s))[0]["key"]
        s.put(last, b"new value")
    inodes = {e.id: (ds / names.SHARDS_DIR / e.name).stat().st_ino for e in m0.shards}
    before = _snapshot(ds)
    s = kvdata.compact(ds)
    m1 = read_manifest(ds)
    assert s.shards_kept == len(m0.shards) - 1 and s.shards_rewritten == 1 and s.shards_written == 1
    for e in m1.shards[:-1]:  # the same files under names of the new incarnation
        assert (ds / names.SHARDS_DIR / e.name).stat().st_ino == inodes[e.id]
        assert e.sha256 == m0.shards[e.id].sha256
    assert s.records_dropped == 1 and _snapshot(ds) == before
    assert s.bytes_copied < m0.shards[-1].bytes + 4096  # only the last shard's records were copied


def test_cold_copies_are_linked_with_kept_shards_and_made_for_new_ones_when_compress(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    rng = np.random.default_rng(7)
    with kvdata.open(ds, "w", shard_size=SHARD, compress=True) as s:
        _put(s, rng, range(600))
    with kvdata.open(ds, "a") as s:  # dead records in the first and the last shard only
        s.delete(s.key_at(0))
        s.put(s.key_at(len(s) - 1), b"new value")
    m0 = read_manifest(ds)
    zst_inodes = {e.sha256: (ds / names.SHARDS_DIR / e.zst.name).stat().st_ino for e in m0.shards if e.zst}
    before = _snapshot(ds)
    s = kvdata.compact(ds)
    m1 = read_manifest(ds)
    assert s.shards_kept == len(m0.shards) - 2 and all(e.zst is not None for e in m1.shards)
    for e in m1.shards:
        z = ds / names.SHARDS_DIR / e.zst.name
        if e.sha256 in zst_inodes:  # kept: the same cold copy, linked
            assert z.stat().st_ino == zst_inodes[e.sha256]
        else:
            assert z.stat().st_ino not in zst_inodes.values()
    assert verify(ds, progress=False)["ok"] and _snapshot(ds) == before  # (verify checks every .zst's sha256)
    assert set(os.listdir(ds / names.SHARDS_DIR)) == _named(ds)


def test_a_dataset_whose_records_were_all_deleted_compacts_to_nothing(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "a", shard_size=SHARD) as s:
        _put(s, np.random.default_rng(8), range(300))
        s.commit()
        for k in list(s.keys()):
            s.delete(k)
        s.seal()
    s = kvdata.compact(ds)
    assert s.compacted and s.shards_after == 0 and s.bytes_reclaimed == s.bytes_before - s.bytes_after > 0
    assert os.listdir(ds / names.SHARDS_DIR) == [] and verify(ds, progress=False)["ok"]
    with kvdata.open(ds, "a") as w:
        w.put("again", b"1")
    with kvdata.open(ds) as r:
        assert len(r) == 1 and bytes(r["again"]) == b"1"


def test_dry_run_changes_nothing_and_says_what_compaction_would_do(built: Any, tmp_path: Path, cli: Cli) -> None:
    ds, _snap = _copy(built, "overwrites", tmp_path / "ds")
    files = _files(ds)
    d = cli.ok("compact", ds, "--dry-run", "--json").json()
    assert _files(ds) == files
    assert d["dry_run"] is True and d["compacted"] is False and d["generation_after"] == d["generation_before"]
    assert d["shards_rewritten"] > 0 and d["records_dropped"] == 250 and d["bytes_reclaimed"] > 0
    real = kvdata.compact(ds)
    assert real.records_dropped == d["records_dropped"] and real.shards_after == d["shards_after"]
    assert abs(real.bytes_after - d["bytes_after"]) < 0.25 * real.bytes_after  # an estimate, a close one


# ---------------------------------------------------------------- readers are undisturbed


class ReaderProc:
    """A reader in another process (forked; as another uid if given) that opens the dataset at once,
    reads every record on request, and closes on request."""

    def __init__(self, path: Path, user: User | None = None, store: kvdata.Store | None = None) -> None:
        req_r, self._req = os.pipe()
        self._rep, rep_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never return into pytest
            os.close(self._req)
            os.close(self._rep)
            self._child(path, user, store, req_r, rep_w)
        os.close(req_r)
        os.close(rep_w)
        self.generation = self._recv()[1]

    @staticmethod
    def _child(path: Path, user: User | None, store: kvdata.Store | None, req: int, rep: int) -> None:
        def send(obj: Any) -> None:
            data = pickle.dumps(obj)
            os.write(rep, struct.pack("<I", len(data)) + data)

        try:
            if user is not None:
                _become(user)
            # a store inherited across fork, or our own (another uid reads in place: the test's config is not its)
            s = store if store is not None else kvdata.open(path) if user is None else kvdata.Store(path)
            send(("ready", s.generation))
            while cmd := os.read(req, 1):
                if cmd == b"r":
                    send(("read", _digests(s)))
                elif cmd == b"c":
                    s.close()
                    send(("closed", None))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            os._exit(0)

    def _recv(self, timeout: float = 60) -> tuple[str, Any]:
        buf = b""
        deadline = time.monotonic() + timeout
        while len(buf) < 4 or len(buf) < 4 + struct.unpack("<I", buf[:4])[0]:
            ready, _, _ = select.select([self._rep], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self._rep, 1 << 20) if ready else b""
            if not chunk:
                raise AssertionError(f"reader process {self.pid}: no answer")
            buf += chunk
        msg = pickle.loads(buf[4:])
        assert msg[0] != "error", msg[1]
        return msg  # type: ignore[no-any-return]

    def read(self) -> list[tuple[str, str]]:
        os.write(self._req, b"r")
        return self._recv()[1]  # type: ignore[no-any-return]

    def close_store(self) -> None:
        os.write(self._req, b"c")
        self._recv()

    def stop(self) -> None:
        if self.pid:
            os.close(self._req)
            os.waitpid(self.pid, 0)
            os.close(self._rep)
            self.pid = 0


@pytest.fixture
def readers() -> Iterator[list[ReaderProc]]:
    procs: list[ReaderProc] = []
    yield procs
    for p in procs:
        if p.pid:
            os.kill(p.pid, signal.SIGKILL)
            p.stop()


def test_a_reader_process_keeps_its_generation_until_it_closes(built: Any, tmp_path: Path,
                                                               readers: list[ReaderProc]) -> None:
    ds, _snap = _copy(built, "mix", tmp_path / "ds")
    with kvdata.open(ds) as s:
        want = _digests(s)
    m0 = read_manifest(ds)
    old = (ds / names.SHARDS_DIR / m0.shards[0].name)
    r = ReaderProc(ds)
    readers.append(r)
    summary = kvdata.compact(ds)
    assert summary.compacted and r.generation == m0.generation
    kept = set(summary.files_kept_for_readers)
    assert {e.name for e in m0.shards} | {m0.tail.name} <= kept and summary.bytes_reclaimed == 0
    assert summary.bytes_kept_for_readers >= sum(e.bytes for e in m0.shards if e.sha256 not in
                                                 {n.sha256 for n in read_manifest(ds).shards})
    assert all((ds / names.SHARDS_DIR / f).exists() for f in kept)
    assert r.read() == want  # every record of its generation, tail records included, after the commit
    with kvdata.open(ds) as fresh:  # a reader opened now gets the new generation
        assert fresh.generation == m0.generation + 1 and _digests(fresh) == want
    with kvdata.open(ds, "a") as w:  # a commit while it still reads: its files stay
        w.put("during", b"x")
    assert old.exists() and r.read() == want
    r.close_store()
    disk = _disk(ds)
    with kvdata.open(ds, "a") as w:  # the next commit finds no reader: they go
        w.put("after", b"y")
    assert not old.exists() and set(os.listdir(ds / names.SHARDS_DIR)) == _named(ds)
    assert not list(ds.glob("compact-i*.json")) and not (ds / names.reader_pin_name(m0.incarnation)).exists()
    assert _disk(ds) < disk
    assert verify(ds, progress=False)["ok"]


def test_a_forked_worker_inherits_the_pin_of_its_parents_store(built: Any, tmp_path: Path,
                                                               readers: list[ReaderProc]) -> None:
    """A DataLoader worker forked from a process that opened the dataset reads through the
    inherited store: the generation stays pinned while the worker lives, even after the parent
    closed its store, and the next compact removes the old files once the worker is gone."""
    ds, _snap = _copy(built, "overwrites", tmp_path / "ds")
    parent = kvdata.open(ds)
    want = _digests(parent)
    worker = ReaderProc(ds, store=parent)
    readers.append(worker)
    parent.close()
    first = kvdata.compact(ds)
    assert first.compacted and first.files_kept_for_readers
    assert worker.read() == want
    worker.stop()
    second = kvdata.compact(ds)
    assert not second.compacted and sorted(second.files_kept_for_readers) == []
    assert first.bytes_kept_for_readers > 0  # (and the journal that listed them goes too)
    assert 0 <= second.bytes_reclaimed - first.bytes_kept_for_readers < 4096
    assert set(os.listdir(ds / names.SHARDS_DIR)) == _named(ds)


def test_a_reader_in_this_process_refreshes_to_the_compacted_generation(built: Any, tmp_path: Path) -> None:
    ds, snap = _copy(built, "small_shards", tmp_path / "ds")
    with kvdata.open(ds) as r:
        want = _digests(r)
        kept = kvdata.compact(ds)
        assert kept.files_kept_for_readers and _digests(r) == want  # still its own generation
        assert r.refresh() and _digests(r) == want and r.generation == kept.generation_after
        done = kvdata.compact(ds)  # the store moved on: nothing holds the old generation now
    assert 0 <= done.bytes_reclaimed - kept.bytes_kept_for_readers < 4096 and _snapshot(ds) == snap


def test_a_reader_whose_tail_was_sealed_and_then_compacted_still_reads_it(tmp_path: Path) -> None:
    """Its tail's records moved into a sealed shard (a commit), then into the compacted shards:
    the sealed shard of its incarnation is kept for it and read by name."""
    ds = tmp_path / "ds"
    rng = np.random.default_rng(9)
    with kvdata.open(ds, "a", shard_size=SHARD) as w:
        _put(w, rng, range(200))
        w.seal()
        w.commit()
        _put(w, rng, range(200, 230))  # in the tail
    with kvdata.open(ds) as other:
        want = _digests(other)
    with kvdata.open(ds) as r:  # (it has not opened its tail yet)
        assert r.manifest.tail.records == 30
        with kvdata.open(ds, "a") as w:
            w.put("k00003", b"overwritten")  # something to compact
            w.seal()
        assert kvdata.compact(ds).files_kept_for_readers
        assert _digests(r) == want


def test_a_rewrite_with_mode_w_also_keeps_the_old_files_for_their_readers(built: Any, tmp_path: Path,
                                                                          readers: list[ReaderProc]) -> None:
    ds, _snap = _copy(built, "small_shards", tmp_path / "ds")
    with kvdata.open(ds) as s:
        want = _digests(s)
    old = {e.name for e in read_manifest(ds).shards}
    r = ReaderProc(ds)
    readers.append(r)
    with kvdata.open(ds, "w") as w:  # written again from empty: every name new
        w.put("only", b"new dataset")
    assert r.read() == want and all((ds / names.SHARDS_DIR / n).exists() for n in old)
    r.stop()
    with kvdata.open(ds, "a") as w:  # the next writer finds no reader: the old files go
        w.put("more", b"x")
    assert not any((ds / names.SHARDS_DIR / n).exists() for n in old)
    assert set(os.listdir(ds / names.SHARDS_DIR)) == _named(ds) and not list(ds.glob("compact-i*.json"))
    with kvdata.open(ds) as s:
        assert list(s.keys()) == ["only", "more"]


@pytest.mark.skipif(can_switch_users() is not None, reason=str(can_switch_users()))
def test_another_uid_reads_pinned_and_cannot_compact(built: Any, readers: list[ReaderProc]) -> None:
    """A reader that may not write the dataset still pins the generation compaction made (its
    registry is created readable for everyone), and compaction as that uid is refused."""
    user = make_user("compact")
    if (why := cannot_exec_python_as(user)) is not None:
        pytest.skip(why)
    top = Path(tempfile.mkdtemp(prefix="kvc-", dir="/tmp"))
    try:
        os.chmod(top, 0o755)
        ds, _snap = _copy(built, "deletes", top / "ds")
        kvdata.compact(ds)  # as its owner: generation K with its registry
        with kvdata.open(ds, "a") as w:  # and something for the next compaction to do
            w.delete(w.key_at(0))
        with kvdata.open(ds) as s:
            want = _digests(s)
        r = ReaderProc(ds, user=user)
        readers.append(r)
        s = kvdata.compact(ds)
        assert s.compacted and s.files_kept_for_readers
        assert r.read() == want
        line = Cli(top).fail("compact", ds, preexec_fn=lambda: _become(user), names=[str(ds)])
        assert "not writable" in line
        r.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _become(user: User) -> None:
    os.setgroups([])
    os.setresgid(user.gid, user.gid, user.gid)
    os.setresuid(user.uid, user.uid, user.uid)


# ---------------------------------------------------------------- SIGKILL during a compaction

KILLS = 12
SPACED = 8  # kills spread evenly; the others land just after the commit


def _fork_compact(ds: Path, delay: float | None, at_commit: bool = False) -> float | None:
    """Compact in a forked child; with `delay`, SIGKILL it that long after it starts (with
    `at_commit`, as soon as the new manifest is in place, `delay` at the latest), else return
    how long it took."""
    manifest = ds / names.MANIFEST
    first = manifest.stat().st_ino
    return run_forked(lambda: kvdata.compact(ds), delay,
                      until=(lambda: manifest.stat().st_ino != first) if at_commit else None)


@pytest.mark.timeout(180)
def test_sigkill_during_compaction_leaves_the_old_or_the_new_generation(tmp_path: Path) -> None:
    base = tmp_path / "base"
    rng = np.random.default_rng(6)
    with kvdata.open(base, "a", shard_size="256KB") as s:  # enough work that kills land all through it
        s.put_many((f"k{i:05d}", rng.bytes(int(rng.integers(200, 2000)))) for i in range(3000))
        s.commit()
        s.put_many((f"k{i:05d}", rng.bytes(300), i % 7) for i in rng.choice(3000, 1200, replace=False).tolist())
        for i in rng.choice(3000, 200, replace=False).tolist():
            s.delete(f"k{i:05d}")
        s.put_many((f"t{i}", rng.bytes(100)) for i in range(40))  # in the tail
    want = _snapshot(base)
    g = read_manifest(base).generation
    times = []
    for t in range(2):  # the faster of two runs: the first one pays for a cold cache
        timing = tmp_path / f"timing{t}"
        shutil.copytree(base, timing)
        times.append(_fork_compact(timing, None))
        assert _snapshot(timing) == want
    took = min(t for t in times if t is not None)
    seen = {"old": 0, "new": 0, "new, old files still there": 0}
    for i in range(KILLS):
        ds = tmp_path / f"k{i}"
        shutil.copytree(base, ds)
        if i < SPACED:  # all through the compaction, evenly
            _fork_compact(ds, took * (i + 0.5) / SPACED)
        else:  # right after its commit: among the removal of the old files
            _fork_compact(ds, 2 * took + 1, at_commit=True)
        gen = read_manifest(ds).generation
        assert gen in (g, g + 1)
        seen["old" if gen == g else "new, old files still there" if list(ds.glob("compact-i*.json")) else "new"] += 1
        assert _snapshot(ds) == want  # read as it was left: complete, before any recovery
        with kvdata.open(ds, "a"):  # a writer's recovery finishes or undoes it
            pass
        assert not (ds / "lost+found").exists()  # everything accounted for
        assert not list(ds.glob("compact-i*.json"))
        assert set(os.listdir(ds / names.SHARDS_DIR)) == _named(ds)
        assert {p.name for p in (ds / names.INDEX_DIR).iterdir()} == \
            {n for _k, n, _b in read_manifest(ds).index_files()}
        assert verify(ds, progress=False)["ok"] and _snapshot(ds) == want
        if gen == g:  # the compaction can simply run again
            assert kvdata.compact(ds).compacted and _snapshot(ds) == want
        shutil.rmtree(ds)
    print(f"\ncompaction took {took * 1000:.0f} ms; outcomes of {KILLS} kills: {json.dumps(seen)}")
    assert seen["old"] >= 1 and seen["new"] + seen["new, old files still there"] >= 1, seen


# ---------------------------------------------------------------- hostile layouts and bad input


def _unchanged(ds: Path, files: dict[str, tuple[int, int]], gen: int) -> None:
    assert read_manifest(ds).generation == gen
    assert {k: v for k, v in _files(ds).items() if not k.startswith("readers-")} == \
        {k: v for k, v in files.items() if not k.startswith("readers-")}


def test_hostile_layouts_are_refused_in_one_line_and_nothing_changes(built: Any, tmp_path: Path, cli: Cli) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("do not touch")

    def case(name: str, plant: Callable[[Path], Path]) -> None:
        ds, _snap = _copy(built, "overwrites", tmp_path / name)
        what = plant(ds)
        files, gen = _files(ds), read_manifest(ds).generation
        line = cli.fail("compact", ds, names=[str(what)])
        assert "Traceback" not in line
        _unchanged(ds, files, gen)
        assert sorted(os.listdir(outside)) == ["precious"] and (outside / "precious").read_text() == "do not touch"

    def shards_dir_link(ds: Path) -> Path:
        real = tmp_path / "moved-shards"
        shutil.move(ds / names.SHARDS_DIR, real)
        (ds / names.SHARDS_DIR).symlink_to(real)
        return ds / names.SHARDS_DIR

    def shard_file_link(ds: Path) -> Path:
        p = ds / names.SHARDS_DIR / read_manifest(ds).shards[1].name
        shutil.copy(p, tmp_path / "shard-copy")
        p.unlink()
        p.symlink_to(tmp_path / "shard-copy")
        return p

    def lock_link(ds: Path) -> Path:
        (ds / names.LOCK).unlink(missing_ok=True)
        (ds / names.LOCK).symlink_to(outside / "precious")
        return ds / names.LOCK

    def registry_link(ds: Path) -> Path:
        p = ds / names.reader_pin_name(read_manifest(ds).incarnation)
        p.unlink(missing_ok=True)
        p.symlink_to(outside / "precious")
        return p

    def truncated(ds: Path) -> Path:
        p = ds / names.SHARDS_DIR / read_manifest(ds).shards[0].name
        os.truncate(p, p.stat().st_size - 4096)
        return p

    def damaged_record(ds: Path) -> Path:
        m = read_manifest(ds)
        p = ds / names.SHARDS_DIR / m.shards[0].name
        with kvdata.open(ds) as s:  # a live record of a shard that compaction rewrites
            slot = next(d["slot"] for d in s.describe() if d["shard"] == 0)
            row = s._index.records[slot]
            at = int(row["offset"]) + (int(row["head_kind"]) & 0xFFFFFF) + 1
        with open(p, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
        return p

    def next_registry(ds: Path) -> Path:  # the name compaction is about to give the new incarnation's registry
        p = ds / names.reader_pin_name(read_manifest(ds).generation + 1)
        p.symlink_to(outside / "precious")
        return p

    for name, plant in [("shards-link", shards_dir_link), ("shard-link", shard_file_link), ("lock-link", lock_link),
                        ("registry-link", registry_link), ("next-registry", next_registry), ("truncated", truncated),
                        ("damaged", damaged_record)]:
        case(name, plant)

    # a file planted under a shard name of the coming incarnation is moved aside by recovery, never removed
    ds, snap = _copy(built, "overwrites", tmp_path / "planted")
    planted = ds / names.SHARDS_DIR / names.shard_name(0, read_manifest(ds).generation + 1)
    planted.symlink_to(outside / "precious")
    assert kvdata.compact(ds).compacted and _snapshot(ds) == snap and verify(ds, progress=False)["ok"]
    assert [p.name for p in (ds / "lost+found").rglob("*") if p.is_symlink()] == [f"shards-{planted.name}"]
    assert sorted(os.listdir(outside)) == ["precious"] and (outside / "precious").read_text() == "do not touch"


def test_a_second_writer_holding_the_lock_is_named_and_waited_for(built: Any, tmp_path: Path, cli: Cli) -> None:
    ds, snap = _copy(built, "deletes", tmp_path / "ds")
    files, gen = _files(ds), read_manifest(ds).generation
    lock = WriterLock(ds)
    try:
        with pytest.raises(WriterLockedError, match=str(os.getpid())):
            kvdata.compact(ds)
        line = cli.fail("compact", ds, names=[str(ds)])
        assert "open for writing by another process" in line
        _unchanged(ds, files, gen)
    finally:
        lock.release()
    assert kvdata.compact(ds).compacted and _snapshot(ds) == snap


def test_a_forged_journal_deletes_nothing(built: Any, tmp_path: Path) -> None:
    """Journals are read as hostile input: one naming files outside its incarnation (or outside
    the dataset) accounts for nothing and is moved to lost+found/."""
    ds, snap = _copy(built, "mix", tmp_path / "ds")
    m = read_manifest(ds)
    victim = tmp_path / "victim"
    victim.write_text("mine")
    forged = {"format": "kvdata-compact", "to_incarnation": m.generation + 5, "from_generation": m.generation,
              "from_incarnation": m.incarnation, "files": [m.shards[0].name, "../../victim", "manifest.json"]}
    (ds / names.compact_journal_name(m.generation + 5)).write_text(json.dumps(forged))
    with kvdata.open(ds, "a"):
        pass
    assert victim.read_text() == "mine" and _snapshot(ds) == snap and verify(ds, progress=False)["ok"]
    assert not list(ds.glob("compact-i*.json")) and list((ds / "lost+found").rglob("*compact-i*.json"))


def test_cli_json_summary_and_one_line_errors(built: Any, tmp_path: Path, cli: Cli) -> None:
    ds, snap = _copy(built, "mix", tmp_path / "ds")
    d = cli.ok("compact", ds, "--json").json()
    assert set(d) >= {"dataset", "dry_run", "compacted", "generation_before", "generation_after", "shards_before",
                      "shards_after", "shards_kept", "shards_rewritten", "shards_written", "records_rewritten",
                      "records_dropped", "bytes_before", "bytes_after", "bytes_copied", "bytes_reclaimed",
                      "bytes_kept_for_readers", "files_kept_for_readers", "seconds"}
    assert d["compacted"] is True and d["dataset"] == str(ds) and d["bytes_reclaimed"] == d["bytes_before"] - d["bytes_after"]
    assert d["shards_before"] > d["shards_after"] and d["records_dropped"] > 0 and d["files_kept_for_readers"] == []
    assert _snapshot(ds) == snap
    text = cli.ok("compact", ds).text
    assert text.startswith(f"nothing to compact in {ds}")
    (ds / names.SHARDS_DIR / read_manifest(ds).shards[0].name).unlink()
    cli.fail("compact", ds, names=[read_manifest(ds).shards[0].name, "missing"])
    cli.fail("compact", tmp_path / "nope", names=[str(tmp_path / "nope"), "no such dataset"])
    (tmp_path / "plain").mkdir()
    cli.fail("compact", tmp_path / "plain", names=[str(tmp_path / "plain"), "not a kvdata dataset"])
    assert not list((tmp_path / "plain").iterdir())


def test_api_errors_are_kvdata_errors(tmp_path: Path) -> None:
    with pytest.raises(MissingShardError):
        ds = tmp_path / "ds"
        with kvdata.open(ds, "a", shard_size=SHARD) as s:
            _put(s, np.random.default_rng(0), range(300))
            s.seal()
        (ds / names.SHARDS_DIR / read_manifest(ds).shards[0].name).unlink()
        kvdata.compact(ds)
    if os.geteuid() != 0:
        os.chmod(tmp_path / "ds", 0o555)
        with pytest.raises(ReadOnlyError):
            kvdata.compact(tmp_path / "ds")
    with pytest.raises(CorruptDatasetError):
        (tmp_path / "ds2").mkdir()
        (tmp_path / "ds2" / names.MANIFEST).write_text("{}")
        kvdata.compact(tmp_path / "ds2")
