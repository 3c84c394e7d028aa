"""Full disks, on a real small tmpfs (issue 11 item 8).

A writer that runs out of space (blocks or inodes) must fail with one CommitError line that
names the dataset and says to free space; every record committed before must still read back
exactly, `verify` must pass, and once space is freed a later writer appends and commits. The
`kvdata put` CLI fails with one `kvdata: error:` line, no traceback. An in-process engine
whose tier directory is on a full filesystem reads from the home instead of failing the read.

Every test mounts its own tmpfs of TMPFS_SIZE (root only: skipped with the reason otherwise)
and unmounts it in a finalizer. "Leaving N blocks" means filling the rest of the filesystem
with a filler file, so the next writes find exactly that much room: scanning N from 0 moves
the failure through every step of opening and committing (the lock file, the tail's LMDB
pages, the index files, the manifest).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvdata
from kvdata.config import parse_config
from kvdata.errors import CommitError, KVDataError
from kvdata.format import names
from kvdata.reader.open import open_dataset, verify
from kvdata.tiers.staging import Engine

from helpers.cli import ERROR_PREFIX, Cli

TMPFS_SIZE = 4 << 20
BLOCK = 4096
LOST_FOUND = "lost+found"


class Tmpfs:
    """A mounted tmpfs and a filler file that takes whatever room is left."""

    def __init__(self, mnt: Path) -> None:
        self.mnt = mnt
        self.filler = mnt / "filler"

    def free(self) -> int:
        st = os.statvfs(self.mnt)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int = 0) -> None:
        """Grow the filler until the filesystem is full, then give back `leave` bytes."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in (1 << 16, BLOCK):
                try:
                    while True:
                        os.write(fd, bytes(chunk))
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
        finally:
            os.close(fd)
        if leave:
            os.truncate(self.filler, max(0, self.filler.stat().st_size - leave))
        assert self.free() <= leave

    def unfill(self) -> None:
        self.filler.unlink(missing_ok=True)

    def inodes_used(self) -> int:
        st = os.statvfs(self.mnt)
        return st.f_files - st.f_ffree

    def remount(self, options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(self.mnt)], check=True, capture_output=True)


@pytest.fixture
def tmpfs(tmp_path: Path, request: pytest.FixtureRequest) -> Tmpfs:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mount/umount are not installed")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0755", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on {mnt}: {r.stderr.strip() or f'exit status {r.returncode}'}")

    def unmount() -> None:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # something still holds a file

    request.addfinalizer(unmount)
    return Tmpfs(mnt)


# ------------------------------------------------------------------ helpers

def fill_with_commits(path: Path, mode: str, rng: random.Random, *, shard_size: str, per_commit: int, max_value: int,
                      compress: bool = True, start: int = 0) -> tuple[dict[str, bytes], KVDataError]:
    """Put and commit random records until the writer fails; (what was committed, the error)."""
    committed: dict[str, bytes] = {}
    n = start
    with pytest.raises(KVDataError) as ei:
        with kvdata.open(path, mode, shard_size=shard_size, compress=compress) as s:
            for _ in range(100_000):  # TMPFS_SIZE fills long before
                batch = {}
                for _ in range(per_commit):
                    key = f"k{n:06d}"
                    batch[key] = rng.randbytes(rng.randint(1, max_value))
                    s.put(key, batch[key])
                    n += 1
                s.commit()
                committed.update(batch)
    return committed, ei.value


def assert_disk_full_error(e: BaseException, path: Path) -> str:
    """A CommitError of one line that names the dataset and says to free space."""
    msg = str(e)
    assert isinstance(e, CommitError), f"{type(e).__name__}: {msg}"
    assert "\n" not in msg and str(path) in msg and "free space" in msg, msg
    return msg


def assert_holds(path: Path, records: dict[str, bytes]) -> None:
    """The dataset holds exactly `records`, in order, byte for byte, and verify passes."""
    with kvdata.open(path) as s:
        assert len(s) == len(records)
        assert [s.key_at(i) for i in range(len(s))] == list(records)
        if records:
            got = s.get_many(list(range(len(s))))
            bad = [k for (k, want), v in zip(records.items(), got) if bytes(v) != want]
            assert not bad, f"{len(bad)} record(s) read back wrong, first {bad[:5]}"
    report = verify(path)
    assert report["ok"], report


def append_after(path: Path, records: dict[str, bytes], n: int = 20) -> dict[str, bytes]:
    """A later writer appends n records in two commits; the dataset then holds both sets."""
    more = {f"later{i:03d}": f"later record {i}".encode() * (i + 1) for i in range(n)}
    with kvdata.open(path, "a") as s:
        for i, (k, v) in enumerate(more.items()):
            s.put(k, v)
            if i == n // 2:
                s.commit()
    want = {**records, **more}
    assert_holds(path, want)
    return want


def template(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A small dataset on the ordinary disk, to copy onto the tmpfs: a sealed shard, and a tail
    with room to spare (one more small record never seals it)."""
    path = tmp_path / "template"
    rng = random.Random(7)
    records = {f"t{i:04d}": rng.randbytes(rng.randint(100, 3000)) for i in range(40)}
    records.update({f"u{i:04d}": rng.randbytes(rng.randint(10, 300)) for i in range(10)})
    with kvdata.open(path, "a", shard_size="64KB") as s:
        for k, v in records.items():
            s.put(k, v)
            if k == "t0039":
                s.seal()
    return path, records


def fresh_copy(tmpfs: Tmpfs, src: Path, leave_blocks: int) -> Path:
    tmpfs.unfill()
    dest = tmpfs.mnt / "ds"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest)
    tmpfs.fill(leave=leave_blocks * BLOCK)
    return dest


# ------------------------------------------------------------------ a writer that fills the disk

@pytest.mark.parametrize("mode,shard_size,per_commit,max_value,compress", [
    ("a", "64KB", 10, 3000, True),        # many small sealed shards, each with a .zst
    ("a", "1MB", 4, 40_000, False),       # large values, a seal that cannot fit its copy
    ("a", "8MB", 30, 2000, False),        # never seals: the tail's LMDB pages fill the disk
    ("w", "256KB", 10, 3000, True),       # a rewrite of an existing dataset
], ids=["a-64KB-zst", "a-1MB-large", "a-tail-only", "w-256KB"])
def test_writer_that_fills_the_disk_keeps_every_commit(tmpfs: Tmpfs, mode: str, shard_size: str, per_commit: int,
                                                       max_value: int, compress: bool) -> None:
    spare = tmpfs.mnt / "spare"
    spare.write_bytes(bytes(1536 << 10))  # freed later, so a later writer has room
    path = tmpfs.mnt / "ds"
    rng = random.Random(f"{mode}{shard_size}")
    if mode == "w":
        with kvdata.open(path, "a", shard_size=shard_size) as s:
            for i in range(50):
                s.put(f"old{i:03d}", b"old" * 500)
    committed, err = fill_with_commits(path, mode, rng, shard_size=shard_size, per_commit=per_commit,
                                       max_value=max_value, compress=compress)
    assert tmpfs.free() < (1 << 20)
    assert len(committed) >= 2 * per_commit
    assert_disk_full_error(err, path)
    assert_holds(path, committed)
    spare.unlink()
    append_after(path, committed)


def test_writer_out_of_inodes_fails_at_the_index_and_keeps_every_commit(tmpfs: Tmpfs, cli: Cli, tmp_path: Path) -> None:
    """No inode left: the tail's LMDB commit still fits, creating the next key-run index file
    does not -- the failure lands between the tail and the manifest."""
    path = tmpfs.mnt / "ds"
    records = {f"k{i:04d}": f"value {i}".encode() * 20 for i in range(30)}
    with kvdata.open(path, "a", shard_size="8MB") as s:
        for k, v in records.items():
            s.put(k, v)
    tmpfs.remount(f"nr_inodes={tmpfs.inodes_used()}")
    with pytest.raises(KVDataError) as ei:
        with kvdata.open(path, "a") as s:
            s.put("one-more", b"x" * 100)
    msg = assert_disk_full_error(ei.value, path)
    assert "the disk is full" in msg and "unchanged" in msg, msg
    assert_holds(path, records)
    small = tmp_path / "small.txt"
    small.write_bytes(b"hello")
    cli.fail("put", "-k", "cli-key", path, small, names=[str(path), "free space"])
    assert_holds(path, records)
    assert not (path / LOST_FOUND).exists()
    tmpfs.remount("nr_inodes=100000")
    append_after(path, records)


@pytest.mark.parametrize("mode", ["a", "w"])
def test_every_margin_of_free_space_fails_cleanly(tmpfs: Tmpfs, tmp_path: Path, mode: str) -> None:
    """From 0 free blocks up: a writer that puts one record and commits either commits it or
    fails with one CommitError line, and the dataset is exactly the old one or the new one."""
    src, records = template(tmp_path)
    outcomes = []
    for leave in range(0, 8):
        path = fresh_copy(tmpfs, src, leave)
        try:
            with kvdata.open(path, mode) as s:
                s.put("new", b"n" * 200)
        except KVDataError as e:
            msg = assert_disk_full_error(e, path)
            outcomes.append(msg.split("(", 1)[0])
            if mode == "a" or "cannot open it for writing" in msg:
                assert_holds(path, records)
            else:  # "w" wrote its empty generation when it opened; the first commit failed
                assert_holds(path, {})
            continue
        outcomes.append("committed")
        assert_holds(path, {**records, "new": b"n" * 200} if mode == "a" else {"new": b"n" * 200})
    assert outcomes[0].endswith("cannot open it for writing, the disk is full "), outcomes
    assert outcomes[-1] == "committed", outcomes


def test_cli_put_on_a_full_disk_prints_one_line(tmpfs: Tmpfs, cli: Cli, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(random.Random(1).randbytes(TMPFS_SIZE + (1 << 20)))  # more than the whole tmpfs
    small = tmp_path / "small.txt"
    small.write_bytes(b"hello")
    spare = tmpfs.mnt / "spare"
    spare.write_bytes(bytes(1 << 20))  # freed at the end
    path = tmpfs.mnt / "ds"
    cli.ok("put", "-k", "first", path, small)
    # the tail's LMDB pages do not fit
    cli.fail("put", "-k", "big", path, big, names=[str(path), "free space"])
    with kvdata.open(path) as s:
        assert len(s) == 1 and bytes(s.get("first")) == b"hello"
    # nothing left at all: the writer cannot even take its lock
    tmpfs.fill()
    cli.fail("put", "-k", "second", path, small, names=[str(path), "the disk is full", "free space"])
    cli.fail("put", tmpfs.mnt / "new", small, names=[str(tmpfs.mnt / "new"), "the disk is full", "free space"])
    with kvdata.open(path) as s:
        assert len(s) == 1 and bytes(s.get("first")) == b"hello"
    assert cli.ok("get", path, "first").out == b"hello"  # reading needs no space
    spare.unlink()
    cli.ok("put", "-k", "second", path, small)
    with kvdata.open(path) as s:
        assert [s.key_at(i) for i in range(len(s))] == ["first", "second"]
    assert verify(path)["ok"]


# ------------------------------------------------------------------ bugs these tests found (fixed)

def test_a_failed_commit_leaves_nothing_in_lost_found(tmpfs: Tmpfs, tmp_path: Path, cli: Cli,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    src, records = template(tmp_path)
    small = tmp_path / "small.txt"
    small.write_bytes(b"hello")
    for leave in range(1, 8):
        path = fresh_copy(tmpfs, src, leave)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvdata"):
            try:
                with kvdata.open(path, "a") as s:
                    s.put("new", b"n" * 200)
            except CommitError:
                pass
        assert not (path / LOST_FOUND).exists(), f"{leave} block(s) free: {sorted((path / LOST_FOUND).rglob('*'))}"
        assert not caplog.records, f"{leave} block(s) free: {[r.getMessage() for r in caplog.records]}"
        path = fresh_copy(tmpfs, src, leave)
        r = cli.run("put", "-k", "new", path, small)
        assert r.rc == 0 or (len(r.err.splitlines()) == 1 and r.err.startswith(ERROR_PREFIX)), str(r)


def test_a_failed_commit_gives_its_space_back(tmpfs: Tmpfs) -> None:
    path = tmpfs.mnt / "ds"
    with kvdata.open(path, "a") as s:
        s.put("first", b"hello")
    before = tmpfs.free()
    with pytest.raises(CommitError):
        with kvdata.open(path, "a") as s:
            s.put("big", random.Random(1).randbytes(TMPFS_SIZE))
    assert_holds(path, {"first": b"hello"})
    tail = path / names.SHARDS_DIR / "tail-000000.mdb"
    assert tmpfs.free() >= before - (64 << 10), f"{before - tmpfs.free()} bytes still taken; {tail.stat().st_size=}"


def test_a_new_dataset_on_a_nearly_full_disk_never_kills_the_writer(tmpfs: Tmpfs, tmp_path: Path) -> None:
    script = ("import sys, kvdata\n"
              "from kvdata.errors import KVDataError\n"
              "try:\n"
              "    with kvdata.open(sys.argv[1], 'a') as s:\n"
              "        s.put('a', b'x' * 100)\n"
              "except KVDataError as e:\n"
              "    print(e, file=sys.stderr)\n"
              "    sys.exit(1)\n")
    for leave in range(0, 8):
        tmpfs.unfill()
        path = tmpfs.mnt / f"new{leave}"
        tmpfs.fill(leave=leave * BLOCK)
        r = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
        assert r.returncode in (0, 1), f"{leave} block(s) free: exit status {r.returncode}, stderr {r.stderr!r}"
        if r.returncode:
            assert str(path) in r.stderr and "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------ a tier on a full filesystem

def tier_files_ok(tier_dir: Path) -> list[str]:
    """Every file in the tier's shard directory is a verified `<sha256>.mdb`; their names."""
    out = []
    for p in sorted((tier_dir / "shards").iterdir()):
        sha = names.parse_staged_name(p.name)
        assert sha is not None, f"{p.name}: not a staged copy (a partial or temp file left behind?)"
        assert hashlib.sha256(p.read_bytes()).hexdigest() == sha, f"{p.name}: content does not match its name"
        out.append(p.name)
    return out


@pytest.mark.parametrize("room", [0, 600_000], ids=["tier-full", "room-for-one-shard"])
def test_staging_into_a_full_tier_reads_from_the_home(tmpfs: Tmpfs, tmp_path: Path, room: int, cli: Cli,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    rng = random.Random(3)
    ref = {f"k{i:04d}": rng.randbytes(5000) for i in range(200)}
    with kvdata.open(home, "a", shard_size="256KB") as s:
        for k, v in ref.items():
            s.put(k, v)
        s.seal()
    with kvdata.open(home) as s:
        shards = s.manifest.shards
    assert len(shards) >= 3
    assert not room or max(e.bytes for e in shards) <= room < 2 * min(e.bytes for e in shards)
    tier_dir = tmpfs.mnt / "tier"
    cfg = parse_config({"tiers": [{"name": "ssd", "path": str(tier_dir), "budget": "64MB"}]})
    Engine(cfg).close()  # the tier's directories exist (a tier in use), then its filesystem fills
    tmpfs.fill(leave=room)
    with open_dataset(home, config=cfg) as st:
        assert st.source is not None  # staged through the engine, not read in place
        keys = list(ref)
        order = list(range(len(keys)))
        random.Random(4).shuffle(order)
        for lo in range(0, len(order), 25):
            batch = order[lo:lo + 25]
            got = st.get_many(batch)
            assert [bytes(v) for v in got] == [ref[keys[i]] for i in batch]
        status = st.source.engine.status()
    assert status["home_reads"] >= 1, status
    tier = status["tiers"][0]
    assert not tier["ok"] and "No space left" in (tier["problem"] or ""), status
    staged = tier_files_ok(tier_dir)
    assert len(staged) < len(shards)
    if room:
        assert staged, "the tier had room for one shard: it should have been staged"
    # the CLI with the same tier configured: reads succeed, quietly
    config = tmp_path / "kvdata.toml"
    config.write_text(f'[[tiers]]\nname = "ssd"\npath = "{tier_dir}"\nbudget = "64MB"\n')
    monkeypatch.setenv("KVDATA_CONFIG", str(config))
    for i in (0, len(keys) // 2, len(keys) - 1):
        assert cli.ok("get", home, keys[i]).out == ref[keys[i]]
    assert cli.ok("verify", home).rc == 0
    assert tier_files_ok(tier_dir) == staged
