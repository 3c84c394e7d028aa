"""Announced orders shared between processes through a tier (kvdata/tiers/orders.py).

A DataLoader worker stages on demand through an engine of its own while the sampler that
announced the order runs in the main process: the worker must evict by that order
(furthest next use first), not in an arbitrary one. Orders are files in the tier's claims
directory held by their publisher's flock; real subprocesses publish, move, withdraw and
die (SIGKILL), and a worker-like subprocess makes room while the test process holds the
order.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvdata.reader.open import open_dataset
from kvdata.tiers import orders
from kvdata.tiers.orders import SharedOrders
from kvdata.tiers.staging import Engine
from kvdata.tiers.tier import Tier

from helpers.servers import build_dataset, tiers_config, write_toml

SHAS = [f"{i:02x}" * 32 for i in range(5)]

PUBLISHER = r"""
import sys
from kvdata.tiers.orders import SharedOrders
from kvdata.tiers.tier import Tier
from kvdata.config import TierConfig
tier = Tier(TierConfig(name="ram", path=__import__("pathlib").Path(sys.argv[1]), budget=1 << 30))
tier.ensure()
o = SharedOrders()
o.publish([tier], "r1", sys.argv[2].split(","), 1, int(sys.argv[3]) if len(sys.argv) > 3 else None)
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "move":
        o.move("r1", int(arg))
    elif cmd == "withdraw":
        o.withdraw("r1")
    print("ok", flush=True)
"""


def make_tier(root: Path) -> Tier:
    cfg = tiers_config(root, ("ram", 1 << 30))
    t = Tier(cfg.tiers[0])
    t.ensure()
    return t


def claims_dir(t: Tier) -> Path:
    return t.locks / f"claims-{os.geteuid()}"


def start_publisher(t: Tier, shas: list[str], next_start: int | None = None) -> subprocess.Popen[str]:
    extra = [] if next_start is None else [str(next_start)]
    p = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(t.root), ",".join(shas), *extra], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    return p


def ask(p: subprocess.Popen[str], line: str) -> None:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "ok"


def stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
    p.communicate(timeout=10)


def test_another_process_order_is_seen_moved_withdrawn_and_gone_when_it_dies(tmp_path: Path) -> None:
    t = make_tier(tmp_path)
    mine = SharedOrders()
    p = start_publisher(t, SHAS)
    try:
        assert [(d.sequence, d.position) for d in mine.others(t)] == [(tuple(SHAS), 1)]
        ask(p, "move 3")
        assert [d.position for d in mine.others(t)] == [3]
        ask(p, "withdraw")
        assert mine.others(t) == []
        assert not [n for n in os.listdir(claims_dir(t)) if n.startswith("order-")]
    finally:
        stop(p)
    # published again, then the publisher is killed: its order no longer counts, its file goes
    p = start_publisher(t, SHAS[:2])
    try:
        assert [d.sequence for d in mine.others(t)] == [tuple(SHAS[:2])]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert mine.others(t) == []
        assert not [n for n in os.listdir(claims_dir(t)) if n.startswith("order-")], "a dead process's order stayed"
    finally:
        stop(p)


def test_malformed_orders_are_ignored_and_own_orders_are_not_others(tmp_path: Path) -> None:
    t = make_tier(tmp_path)
    mine = SharedOrders()
    mine.publish([t], "mine", SHAS, 0)
    assert mine.others(t) == []  # this process's own order is not another's
    d = claims_dir(t)
    uid = os.geteuid()
    bad = {
        "header": b"garbage".ljust(orders.HEADER) + bytes(32),
        "count": orders._header(0, 5) + bytes(32),               # says 5 sha256s, holds 1
        "position": orders._header(9, 1) + bytes(32),            # beyond its sequence
        "huge": orders._header(0, orders.MAX_SHARDS + 1),
        "next_start": orders._header(0, 1, 2) + bytes(32),      # a next pass beyond its sequence
        "fields": b"kvorder1 0 1 1 1".ljust(orders.HEADER) + bytes(32),
        "sign": b"kvorder1 0 1 -1".ljust(orders.HEADER) + bytes(32),
    }
    held = []
    try:
        for i, body in enumerate(bad.values()):
            p = d / f"order-{uid}-{999990 + i}-0"
            p.write_bytes(body)
            fd = os.open(p, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)  # "held by a live process"
            held.append(fd)
        good = d / f"order-{uid}-999999-0"
        good.write_bytes(orders._header(1, 2) + bytes.fromhex(SHAS[3] + SHAS[4]))
        fd = os.open(good, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        held.append(fd)
        got = mine.others(t)
        assert [(x.sequence, x.position, x.next_start) for x in got] == [((SHAS[3], SHAS[4]), 1, None)]
    finally:
        for fd in held:
            os.close(fd)
    mine.close()
    assert mine.others(t) == []
    assert not [n for n in os.listdir(d) if n.startswith("order-")]


def test_an_orders_next_pass_boundary_travels_with_it(tmp_path: Path) -> None:
    """The boundary ShardShuffleSampler announces (Demand.next_start) reaches the other
    processes' planners, and stays as the reader moves."""
    t = make_tier(tmp_path)
    mine = SharedOrders()
    p = start_publisher(t, SHAS, next_start=2)
    try:
        assert [(d.sequence, d.position, d.next_start) for d in mine.others(t)] == [(tuple(SHAS), 1, 2)]
        ask(p, "move 3")
        assert [(d.position, d.next_start) for d in mine.others(t)] == [(3, 2)]
    finally:
        stop(p)


def test_a_forked_child_sees_its_parents_order_and_leaves_it_alone(tmp_path: Path) -> None:
    t = make_tier(tmp_path)
    parent = SharedOrders()
    parent.publish([t], "r", SHAS, 2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: sees the parent's order, publishes and closes its own
        try:
            seen = [(list(x.sequence), x.position) for x in parent.others(t)]
            parent.publish([t], "child", SHAS[:1], 0)
            parent.close()
            os.write(w, json.dumps(seen).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        seen = json.loads(f.read())
    os.waitpid(pid, 0)
    assert seen == [[SHAS, 2]]
    names = [n for n in os.listdir(claims_dir(t)) if n.startswith("order-")]
    assert len(names) == 1 and f"-{os.getpid()}-" in names[0], names  # the parent's is still there
    parent.close()


WORKER = r"""
import json, sys
from kvdata.config import load_config
from kvdata.reader.open import open_dataset
from kvdata.tiers.staging import Engine
eng = Engine(load_config(), prefetch=False)
store = open_dataset(sys.argv[1], engine=eng, use_daemon=False)
entry = store.manifest.shards[int(sys.argv[2])]
eng.stage(store.home, entry, need_now=True).result()
print(json.dumps(sorted(eng.tiers[0].resident())), flush=True)
store.close()
eng.close()
"""


def test_a_worker_process_makes_room_by_the_main_processes_order(tmp_path: Path) -> None:
    ds = build_dataset(tmp_path / "ds", n=60, compress=False)
    probe = open_dataset(ds, use_daemon=False)
    shards = list(probe.manifest.shards)
    probe.close()
    assert len(shards) >= 4
    budget = 3 * max(e.bytes for e in shards[:4])
    cfg_path = write_toml(tmp_path / "k.toml", tmp_path / "tiers", ("ram", budget))
    cfg = tiers_config(tmp_path / "tiers", ("ram", budget))
    main = Engine(cfg, prefetch=False)
    store = open_dataset(ds, engine=main, use_daemon=False)
    try:
        staged = sorted(shards[:3], key=lambda e: e.sha256)
        for e in staged:
            main.stage(store.home, e).result()
        old = time.time() - 3600  # staged long ago: no grace period for another process's copies
        for e in staged:
            os.utime(main.tiers[0].path(e.sha256), (old, old))
        # the order reads the residents in sha256 order, then shard 3: the furthest is the
        # largest sha256 (an engine without the order would drop the smallest first)
        main.announce("sampler", store.home, [*staged, shards[3]], 0)
        env = dict(os.environ, KVDATA_CONFIG=str(cfg_path), KVDATA_SOCKET=str(tmp_path / "none.sock"))
        out = subprocess.run([sys.executable, "-c", WORKER, str(ds), "3"], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        left = json.loads(out.stdout.strip().splitlines()[-1])
        assert left == sorted([staged[0].sha256, staged[1].sha256, shards[3].sha256]), \
            "the worker evicted a shard the main process's order reads sooner"
    finally:
        store.close()
        main.close()


def test_a_publisher_killed_before_naming_its_file_leaves_nothing_behind(tmp_path: Path) -> None:
    t = make_tier(tmp_path)
    mine = SharedOrders()
    mine.publish([t], "r", SHAS, 0)  # creates the claims directory
    d = claims_dir(t)
    stale = d / f".order-{os.geteuid()}-999999-0.abcd1234"
    stale.write_bytes(b"half written")
    old = time.time() - 60
    os.utime(stale, (old, old))
    fresh = d / f".order-{os.geteuid()}-999998-0.abcd1234"  # maybe being published right now: left alone
    fresh.write_bytes(b"")
    SharedOrders().others(t)
    assert not stale.exists() and fresh.exists()
    mine.close()
