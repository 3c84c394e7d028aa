"""A tier directory shared by processes and users (issue 11, kvdata/tiers/tier.py).

- Concurrent stagers overshot a budget (8.2 MB in a 5 MB tier on main): real processes
  stage different shards of one dataset into one small tier at once while a sampler
  thread polls the sizes of every file in it (temp files included); the maximum stays
  within the budget.
- A stager SIGKILLed mid-copy left a temp file that was never counted or removed: the
  next stager counts it and removes it (its owner is dead), the budget holds, and a temp
  file of a live stager is never taken.
- A shared tier served any file named `<sha256>.mdb` of the right size: planted copies
  (another uid's, a writable one, a symlink, one swapped in a directory others may
  write) are never served; with other real uids (as root) an attacker's plants in a
  shared sticky tier never reach a victim's reads.

Stagers are real subprocesses whose home reads are throttled (a slow source), so copies
overlap and a kill lands mid-copy.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import kvdata
from kvdata.format import ShardEntry
from kvdata.reader.open import open_dataset
from kvdata.tiers.staging import Engine
from kvdata.tiers.tier import Tier

from helpers.servers import S3Server, build_dataset, push_s3, tiers_config, write_toml
from helpers.users import as_user, can_switch_users, give, make_user

N_SAMPLES = 160  # 12 sealed shards of ~124 KiB
NO_USERS = can_switch_users()
needs_users = pytest.mark.skipif(NO_USERS is not None, reason=f"other uids: {NO_USERS}")


def shard_digest(store: Any, entry: Any, start: int) -> str:
    """A digest of one shard's samples (the same code runs in the stager subprocesses)."""
    h = hashlib.sha256()
    for v in store.get_many(list(range(start, start + int(entry.records)))):
        h.update(v["image"].tobytes() + v["noise"].tobytes() + str(int(v["label"])).encode() + str(v["name"]).encode())
    return h.hexdigest()


# a stager process: home reads throttled to KVT_DELAY seconds per 16 KiB; modes:
#   read  IDS...  read these shards' samples ROUNDS times (the reader path: locate, map, hold)
#   stage IDS...  prefetch-stage these shards (eng.stage, as the planner does)
#   need  ID      stage one shard as a reader needing it now
STAGER = "import hashlib\nfrom typing import Any\n" + inspect.getsource(shard_digest) + r'''
import json, os, sys, time
import kvdata.tiers.fetch as fetch
from kvdata.config import load_config
from kvdata.errors import NoRoomError
from kvdata.reader.open import open_dataset
from kvdata.tiers.staging import Engine

delay = float(os.environ.get("KVT_DELAY", "0"))
if delay:
    fetch.CHUNK = 16384
    plain = fetch._source

    def slow(chunks, where):
        for c in plain(chunks, where):
            time.sleep(delay)
            yield c

    fetch._source = slow

mode, home, ids = sys.argv[1], sys.argv[2], [int(a) for a in sys.argv[3:]]
eng = Engine(load_config(), prefetch=False)
store = open_dataset(home, engine=eng, use_daemon=False)
shards = store.manifest.shards
starts = [sum(int(e.records) for e in shards[:i]) for i in range(len(shards))]
print("ready", flush=True)
out = {}
if mode == "read":
    for _ in range(int(os.environ.get("KVT_ROUNDS", "2"))):
        for i in ids:
            out[str(i)] = shard_digest(store, shards[i], starts[i])
elif mode == "stage":
    for i in ids:
        try:
            eng.stage(store.home, shards[i], "ssd").result()
            out[str(i)] = "staged"
        except NoRoomError:
            out[str(i)] = "no room"
else:
    eng.stage(store.home, shards[ids[0]], "ssd", need_now=True).result()
    out[str(ids[0])] = "staged"
st = eng.status()
store.close()
eng.close()
print(json.dumps({"out": out, "errors": st["errors"], "private": st.get("private_copies")}), flush=True)
'''


@dataclass
class Src:
    path: Path
    home: Path
    entries: list[ShardEntry]
    digests: list[str]

    @property
    def largest(self) -> int:
        return max(e.bytes for e in self.entries)

    def full(self) -> list[ShardEntry]:
        """The shards of the largest size (all but the last, usually)."""
        return [e for e in self.entries if e.bytes == self.largest]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Src:
    root = tmp_path_factory.mktemp("src")
    p = build_dataset(root / "src.kv", n=N_SAMPLES)
    home = p  # a local home with its .mdb files (staged from them, or read in place)
    with kvdata.open(p) as s:
        entries = list(s.manifest.shards)
        starts = [sum(int(e.records) for e in entries[:i]) for i in range(len(entries))]
        digests = [shard_digest(s, e, starts[i]) for i, e in enumerate(entries)]
    assert len(entries) == 12
    return Src(p, home, entries, digests)


class Sampler(threading.Thread):
    """Polls the bytes of every file in a tier's shards/ directory (temp files included)."""

    def __init__(self, shards: Path) -> None:
        super().__init__(daemon=True)
        self.shards, self.max, self.samples = shards, 0, 0
        self._halt = threading.Event()

    def poll(self) -> int:
        """Bytes of the distinct files seen (by inode: a file renamed while the directory is
        listed may show under both names)."""
        sizes: dict[int, int] = {}
        try:
            with os.scandir(self.shards) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    sizes[st.st_ino] = st.st_size
        except FileNotFoundError:
            pass
        return sum(sizes.values())

    def run(self) -> None:
        while not self._halt.is_set():
            self.max = max(self.max, self.poll())
            self.samples += 1
            time.sleep(0.0005)

    def stop(self) -> int:
        self._halt.set()
        self.join(10)
        self.max = max(self.max, self.poll())
        return self.max


def _env(toml: Path, delay: float, rounds: int = 2) -> dict[str, str]:
    return dict(os.environ, KVDATA_CONFIG=str(toml), KVT_DELAY=str(delay), KVT_ROUNDS=str(rounds),
                PYTHONDONTWRITEBYTECODE="1")


def _start(mode: str, home: Path | str, ids: list[int], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", STAGER, mode, str(home), *map(str, ids)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"stager failed ({proc.returncode}): {err[-3000:]}"
    return dict(json.loads(out.strip().splitlines()[-1]))


def _temps(shards: Path) -> list[str]:
    return sorted(n for n in os.listdir(shards) if n.startswith(".")) if shards.exists() else []


def _verified(shards: Path) -> set[str]:
    """Every real-named file is a verified copy of its name; the shas."""
    out = set()
    for n in os.listdir(shards):
        if n.startswith("."):
            continue
        digest = hashlib.sha256((shards / n).read_bytes()).hexdigest()
        assert n == f"{digest}.mdb", f"{shards / n} holds other bytes (sha256 {digest})"
        out.add(digest)
    return out


# ------------------------------------------------------------------ (1) concurrent stagers and the budget


@pytest.mark.timeout(300)
def test_concurrent_stagers_never_overshoot_the_budget(src: Src, tmp_path: Path) -> None:
    """Four reader processes (each mapping and holding what it reads) and two prefetching
    stagers, all on one 5-shard tier, home reads throttled so copies overlap: the files in
    the tier (copies and temp files) never exceed the budget, and every read is right."""
    budget = 5 * src.largest
    toml = write_toml(tmp_path / "kvdata.toml", tmp_path / "tiers", ("ssd", budget))
    shards = tmp_path / "tiers" / "ssd" / "shards"
    env = _env(toml, delay=0.002)
    n = len(src.entries)
    sampler = Sampler(shards)
    sampler.start()
    procs = [_start("read", src.home, list(range(i, n, 4)), env) for i in range(4)]
    procs += [_start("stage", src.home, [(j * 5 + k) % n for k in range(n)], env) for j in range(2)]
    try:
        results = [_finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        peak = sampler.stop()
    print(f"\nconcurrent stagers: max {peak} bytes in the tier, budget {budget} ({sampler.samples} samples)")
    assert sampler.samples > 100
    assert peak <= budget, f"the tier held {peak} bytes, over its budget of {budget}"
    for i, r in enumerate(results[:4]):
        assert r["errors"] == [], r
        for sid, digest in r["out"].items():
            assert digest == src.digests[int(sid)], f"reader {i}: shard {sid} read wrong values"
    assert any(v == "staged" for r in results[4:] for v in r["out"].values())
    assert _temps(shards) == []
    assert _verified(shards) <= {e.sha256 for e in src.entries}
    assert Tier(tiers_config(tmp_path / "tiers", ("ssd", budget)).tiers[0]).used() <= budget


def test_a_reader_holding_the_whole_tier_reads_around_it(src: Src, s3_server: S3Server, tmp_path: Path) -> None:
    """A one-shard tier whose copy a reader holds: the next shard it needs is not staged
    over budget (main did) -- a local home is read in place, a remote one into a private
    copy in memory -- and every value is right."""
    budget = src.largest
    url = push_s3(src.path, s3_server, "held")
    for kind, home in (("local", str(src.home)), ("s3", url)):
        cfg = tiers_config(tmp_path / kind, ("ssd", budget))
        sampler = Sampler(tmp_path / kind / "ssd" / "shards")
        sampler.start()
        with open_dataset(home, config=cfg, use_daemon=False) as st:
            assert st.source is not None and st.source.max_open == 1
            start = 0
            for e, want in zip(src.entries, src.digests):
                assert shard_digest(st, e, start) == want, f"{kind}: shard {e.id}"
                start += e.records
            status = st.engine.status()
        peak = sampler.stop()
        assert peak <= budget, f"{kind}: {peak} bytes in a tier of {budget}"
        assert status["errors"] == [], status
        if kind == "local":
            assert status["home_reads"] > 0 and status["private_copies"] == 0, status
        else:  # not staged over budget: read into a private copy, or record by record (random mode)
            assert status["private_copies"] > 0 or status["datasets"][0]["mode"] == "random", status


# ------------------------------------------------------------------ (2) temp files of killed stagers


def _wait_temp(proc: subprocess.Popen[str], shards: Path, sha: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = [n for n in _temps(shards) if n.startswith(f".{sha}.")]
        if names:
            return names[0]
        if proc.poll() is not None:
            raise AssertionError(f"the stager ended ({proc.returncode}) before its temp file appeared: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.001)
    raise AssertionError("no temp file appeared")


@pytest.mark.timeout(300)
def test_a_sigkilled_stagers_temp_file_is_counted_then_removed(src: Src, tmp_path: Path) -> None:
    """Two copies in a three-shard tier, a third shard's stager SIGKILLed mid-copy: its temp
    file stays, at the full size it reserved, and counts as used; the next stage (another
    engine, already running) removes it -- its owner is dead -- instead of evicting a copy,
    and the budget holds throughout."""
    full = src.full()
    assert len(full) >= 4
    budget = 3 * src.largest
    cfg = tiers_config(tmp_path / "tiers", ("ssd", budget))
    toml = write_toml(tmp_path / "kvdata.toml", tmp_path / "tiers", ("ssd", budget))
    tier = Tier(cfg.tiers[0])
    sampler = Sampler(tier.dir)
    eng = Engine(cfg, prefetch=False)
    st = open_dataset(src.home, engine=eng, use_daemon=False)
    try:
        sampler.start()
        for e in full[:2]:
            eng.stage(st.home, e, "ssd").result()
        victim = full[2]
        proc = _start("need", src.home, [victim.id], _env(toml, delay=0.05))
        try:
            temp = _wait_temp(proc, tier.dir, victim.sha256)
            time.sleep(0.1)  # well into the copy (a chunk per 50 ms)
            assert proc.poll() is None, "the stager finished before it was killed"
            proc.send_signal(signal.SIGKILL)
            proc.wait(20)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        assert _temps(tier.dir) == [temp], "the kill should leave the temp file"
        assert os.path.getsize(tier.dir / temp) == victim.bytes  # reserved at full size from the start
        assert tier.temps() == {temp: victim.bytes}
        assert tier.used() == 3 * src.largest  # copies + the leftover: the tier is full
        kept = {e.sha256: os.stat(tier.path(e.sha256)).st_ino for e in full[:2]}
        eng.stage(st.home, full[3], "ssd").result()  # needs room: the dead stager's temp is reclaimed
        assert _temps(tier.dir) == [], "the dead stager's temp file was not removed"
        assert eng.stats.evictions == 0, "a copy was evicted instead of the abandoned temp file"
        for sha, ino in kept.items():
            assert os.stat(tier.path(sha)).st_ino == ino
        assert set(tier.resident()) == {e.sha256 for e in (*full[:2], full[3])}
        assert tier.used() <= budget
        # the killed shard stages again (a reader needs it: an old copy goes, not the budget)
        eng.stage(st.home, victim, "ssd", need_now=True).result()
        assert tier.has(victim.sha256) and tier.used() <= budget
    finally:
        st.close()
        eng.close()
        peak = sampler.stop()
    assert peak <= budget, f"{peak} bytes in a tier of {budget}"
    assert _verified(tier.dir) <= {e.sha256 for e in src.entries}


@pytest.mark.timeout(300)
def test_a_live_stagers_temp_file_is_never_removed(src: Src, tmp_path: Path) -> None:
    """While a (slow) stager copies, its temp file is counted but never taken: neither a
    reclaim nor a new engine's start-up cleaning removes it, and the stager finishes."""
    budget = 4 * src.largest
    cfg = tiers_config(tmp_path / "tiers", ("ssd", budget))
    toml = write_toml(tmp_path / "kvdata.toml", tmp_path / "tiers", ("ssd", budget))
    tier = Tier(cfg.tiers[0])
    e = src.full()[0]
    proc = _start("need", src.home, [e.id], _env(toml, delay=0.25))
    try:
        temp = _wait_temp(proc, tier.dir, e.sha256)
        with tier.budget_lock():
            assert tier.reclaim_abandoned() == 0
        assert tier.clean_partials() == 0
        Engine(cfg, prefetch=False).close()  # start-up cleaning
        assert proc.poll() is None, "the stager should still be copying"
        assert _temps(tier.dir) == [temp] and tier.used() == e.bytes
        result = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert result["out"] == {str(e.id): "staged"} and result["errors"] == []
    assert _temps(tier.dir) == [] and _verified(tier.dir) == {e.sha256}


# ------------------------------------------------------------------ (3) planted copies


def _plant(tier: Tier, entry: ShardEntry, data: bytes, mode: int = 0o644, uid: int | None = None) -> Path:
    tier.ensure()
    p = tier.path(entry.sha256)
    p.write_bytes(data)
    os.chmod(p, mode)
    if uid is not None:
        os.chown(p, uid, uid)
    return p


def _wrong(src: Src, entry: ShardEntry) -> bytes:
    """Bytes of the right size that are not the shard: another shard's copy, or noise."""
    other = next((e for e in src.entries if e.bytes == entry.bytes and e.id != entry.id), None)
    if other is not None:
        return (src.home / "shards" / other.name).read_bytes()
    return os.urandom(entry.bytes)


def _read_all(home: str | Path, cfg: Any) -> tuple[list[str], dict[str, Any]]:
    with open_dataset(home, config=cfg, use_daemon=False) as st:
        out, start = [], 0
        for e in st.manifest.shards:
            out.append(shard_digest(st, e, start))
            start += e.records
        return out, st.engine.status()


@pytest.mark.parametrize("plant", ["other-uid", "writable", "symlink", "hardlinked"])
def test_a_planted_copy_is_never_served(plant: str, src: Src, tmp_path: Path) -> None:
    """A file under a shard's copy name with the right size and the wrong bytes: another
    uid's, one others could write, a symlink to another shard, or another copy linked
    under the name. None is served: reads are right, and what the tier ends up holding
    under real names is verified."""
    if plant == "other-uid" and os.geteuid() != 0:
        pytest.skip("needs root (to give a file to another uid)")
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "16MB"))
    tier = Tier(cfg.tiers[0])
    targets = src.full()[:3]
    for e in targets:
        if plant == "other-uid":
            _plant(tier, e, _wrong(src, e), uid=54321)
        elif plant == "writable":
            _plant(tier, e, _wrong(src, e), mode=0o666)
        elif plant == "symlink":
            tier.ensure()
            other = next(x for x in src.entries if x.bytes == e.bytes and x.id != e.id)
            os.symlink(src.home / "shards" / other.name, tier.path(e.sha256))
        else:
            other = next(x for x in src.entries if x.bytes == e.bytes and x not in targets)
            _plant(tier, other, (src.home / "shards" / other.name).read_bytes())  # a real copy of another shard
            os.link(tier.path(other.sha256), tier.path(e.sha256))
        assert not tier.has(e.sha256)
    digests, status = _read_all(src.home, cfg)
    assert digests == src.digests
    assert status["errors"] == [], status
    assert _verified(tier.dir) == {e.sha256 for e in src.entries}  # the plants were replaced by verified copies


def test_a_tier_others_may_write_is_not_trusted(src: Src, s3_server: S3Server, tmp_path: Path) -> None:
    """In a shards directory others may write (not sticky), another user could rename our
    copies under each other's names; here two real copies are swapped. The tier is not
    used (its problem says why), and reads come right from the home or a private copy."""
    url = push_s3(src.path, s3_server, "unsafe")
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "16MB"))
    a, b = src.full()[:2]
    with open_dataset(src.home, config=cfg, use_daemon=False) as st:  # stage everything properly first
        st.engine.stage(st.home, a, "ssd").result()
        st.engine.stage(st.home, b, "ssd").result()
    tier = Tier(cfg.tiers[0])
    swap = tier.dir / "swap"
    os.rename(tier.path(a.sha256), swap)
    os.rename(tier.path(b.sha256), tier.path(a.sha256))
    os.rename(swap, tier.path(b.sha256))
    os.chmod(tier.dir, 0o777)
    assert not tier.has(a.sha256) and tier.resident() == {}
    assert not tier.healthy() and "writable by other users" in str(tier.problem)
    for home in (str(src.home), url):
        digests, status = _read_all(home, cfg)
        assert digests == src.digests, home
        assert status["tiers"][0]["ok"] is False and "writable by other users" in status["tiers"][0]["problem"]
        assert status["shards_staged"] == 0
        assert (status["home_reads"] if home == str(src.home) else status["private_copies"]) == len(src.entries)
    os.chmod(tier.dir, 0o755)


# ------------------------------------------------------------------ (3b) real other users


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A directory others may enter, for a tier shared by users (/tmp/kvtrust-*, 0755)."""
    d = Path(tempfile.mkdtemp(prefix="kvtrust-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _victim_reads(home: str, cfg: Any) -> tuple[list[str], dict[str, Any]]:
    return _read_all(home, cfg)


def _attacker_plants(tier_root: str, plants: list[tuple[str, bytes]]) -> list[str]:
    """As the attacker: put bytes of the right size under the victim's copy names."""
    out = []
    for sha, data in plants:
        p = Path(tier_root) / "shards" / f"{sha}.mdb"
        p.write_bytes(data)
        os.chmod(p, 0o644)
        out.append(str(p))
    return out


@needs_users
def test_another_users_plants_in_a_shared_tier_never_reach_a_victims_reads(src: Src, shared_root: Path) -> None:
    """A root-owned shared tier (shards/ and locks/ 1777, like /tmp): uid C plants wrong
    bytes under every full shard's copy name, then uid B reads the dataset through the
    same tier. B never serves C's files (nor can it replace them: it reads around them),
    every value is right, and B's own copies are 0600; as root, the plants are replaced."""
    b, c = make_user("b"), make_user("c")
    home = shared_root / "home-b"
    shutil.copytree(src.path, home, ignore=shutil.ignore_patterns("*-lock", ".lock"))
    give(home, b, 0o700)
    tier_root = shared_root / "tier"
    for d in (tier_root, tier_root / "shards", tier_root / "locks"):
        d.mkdir()
    os.chmod(tier_root, 0o755)
    os.chmod(tier_root / "shards", 0o1777)
    os.chmod(tier_root / "locks", 0o1777)
    cfg = tiers_config(shared_root, ("tier", "16MB"))
    targets = src.full()
    planted = as_user(c, _attacker_plants, str(tier_root), [(e.sha256, _wrong(src, e)) for e in targets])
    assert all(os.stat(p).st_uid == c.uid for p in planted)
    digests, status = as_user(b, _victim_reads, str(home), cfg, timeout=120)
    assert digests == src.digests
    assert status["errors"] == [], status
    assert status["home_reads"] == len(targets)  # read where they lie: C holds the names
    owners: dict[int, set[str]] = {}
    for n in os.listdir(tier_root / "shards"):
        st = os.lstat(tier_root / "shards" / n)
        owners.setdefault(st.st_uid, set()).add(n)
        if st.st_uid == b.uid:
            assert st.st_mode & 0o777 == 0o600, f"{n}: B's copy in a shared tier is readable by others"
    assert owners.get(c.uid) == {f"{e.sha256}.mdb" for e in targets}  # untouched, and never served
    assert {n[:-4] for n in owners.get(b.uid, set())} == {e.sha256 for e in src.entries} - {e.sha256 for e in targets}
    # root's engine replaces C's files with verified copies
    assert _read_all(home, cfg)[0] == src.digests
    root_files = {n for n in os.listdir(tier_root / "shards") if os.lstat(tier_root / "shards" / n).st_uid == 0}
    for n in root_files:
        assert hashlib.sha256((tier_root / "shards" / n).read_bytes()).hexdigest() == n[:-4]
    assert {f"{e.sha256}.mdb" for e in targets} <= root_files
