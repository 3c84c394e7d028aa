"""kvdatad as a real subprocess: systemd notification, reload, shared staging, claims released
by dead clients, observability, crashes, hostile clients, failing tiers and watched homes.

Every test starts its own daemon (`kvdatad --config ... --socket ...`) in a short temp
directory; readers and the CLI are subprocesses too. Fixture `kit`: tests/integration/conftest.py
(helpers.daemon.Kit).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import pytest

import kvdata
from kvdata.errors import KVDataError
from kvdata.protocol import MAX_FRAME, TYPES, Client
from kvdata.sync.push import push

from helpers.daemon import (
    Kit,
    Raw,
    assert_error_reply,
    build_dataset,
    finish,
    free_port,
    manifest,
    same,
    snapshot,
    tier_files,
    wait_for,
)
from helpers.servers import S3Server, push_s3

# ------------------------------------------------------------------ helpers


def recv_notify(s: socket.socket, timeout: float) -> str | None:
    s.settimeout(timeout)
    try:
        return s.recv(4096).decode()
    except TimeoutError:
        return None


def notify_until(s: socket.socket, want: str, timeout: float) -> list[str]:
    """Datagrams received until one has the line `want` (all of them, that one last)."""
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = recv_notify(s, max(0.01, deadline - time.monotonic()))
        if m is None:
            break
        got.append(m)
        if want in m.splitlines():
            return got
    raise AssertionError(f"no {want!r} notification within {timeout} s; got {got!r}")


def shard_paths(kit: Kit, tier: str) -> dict[str, int]:
    return tier_files(kit.tiers[tier])[0]


def loc(p: Path) -> str:
    return str(p.resolve())


# ------------------------------------------------------------------ 1. sd_notify


def _notify_run(kit: Kit, bind_addr: str, env_value: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ns:
        ns.bind(bind_addr)
        d = kit.daemon(env={"NOTIFY_SOCKET": env_value, "WATCHDOG_USEC": "200000"}, wait=False)
        ready = notify_until(ns, "READY=1", 20)
        # READY only once the socket accepts connections: connecting right now must work
        with Client(kit.sock, timeout=5) as c:
            assert c.request("status")["pid"] == d.pid
        lines = ready[-1].splitlines()
        assert f"MAINPID={d.pid}" in lines, ready
        assert not any("WATCHDOG=1" in m for m in ready[:-1]), f"pings before READY: {ready}"
        # WATCHDOG_USEC=200000: a ping at least every 100 ms (half the interval)
        t0 = time.monotonic()
        pings = 0
        while pings < 4:
            m = recv_notify(ns, 1.0)
            assert m is not None, f"only {pings} watchdog pings in {time.monotonic() - t0:.2f} s"
            pings += "WATCHDOG=1" in m.splitlines()
        assert time.monotonic() - t0 < 1.5
        d.signal(signal.SIGTERM)
        notify_until(ns, "STOPPING=1", 10)
        assert d.proc.wait(10) == 0, d.log_text()
        assert not kit.sock.exists(), "a cleanly stopped daemon leaves its socket behind"


def test_sd_notify_ready_after_listening_watchdog_pings_and_stopping(kit: Kit) -> None:
    path = str(kit.root / "notify.sock")
    _notify_run(kit, path, path)


def test_sd_notify_abstract_namespace(kit: Kit) -> None:
    name = f"kvdata-test-{os.getpid()}-{random.randrange(1 << 30)}"
    _notify_run(kit, "\0" + name, "@" + name)


def test_watchdog_pid_of_another_process_means_no_pings(kit: Kit) -> None:
    path = str(kit.root / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ns:
        ns.bind(path)
        d = kit.daemon(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": "1"}, wait=False)
        notify_until(ns, "READY=1", 20)
        m = recv_notify(ns, 0.5)
        assert m is None or "WATCHDOG=1" not in m.splitlines(), m
        assert d.terminate() == 0


# ------------------------------------------------------------------ 2. reload


def test_reload_on_sighup_and_on_config_edit_keeps_clients(kit: Kit) -> None:
    # The daemon watches its config file's directory; to see SIGHUP (and only SIGHUP) reload,
    # the config is first a symlink to a file elsewhere, whose edits that watch cannot see.
    real = kit.root / "elsewhere" / "real.toml"
    real.parent.mkdir()
    conf_dir = kit.root / "conf"
    conf_dir.mkdir()
    conf = conf_dir / "kvdata.toml"
    kit.write_config(ram="10MB", path=real)
    conf.symlink_to(real)
    d = kit.daemon(config=conf)
    c = Client(kit.sock, timeout=10)  # connected before every reload, kept open throughout
    try:
        assert d.tier("ram")["budget"] == 10_000_000
        kit.write_config(ram="20MB", path=real)
        time.sleep(1.0)
        assert d.tier("ram")["budget"] == 10_000_000, "reloaded without SIGHUP or an edit of the watched file"
        d.signal(signal.SIGHUP)
        wait_for(lambda: d.tier("ram")["budget"] == 20_000_000, 5, "SIGHUP reload")
        st = c.request("status")
        assert d.tier("ram", st)["budget"] == 20_000_000
        assert st["connected_clients"] >= 1

        # a broken config is refused: the old one stays, the daemon stays up
        real.write_text("[[tiers]]\nname = 'ram'\nbudget = 'lots'\n")
        d.signal(signal.SIGHUP)
        time.sleep(0.5)
        assert d.alive()
        assert d.tier("ram", c.request("status"))["budget"] == 20_000_000

        # edits of the watched file reload without a signal: replace the symlink by a new file ...
        tmp = conf_dir / ".kvdata.toml.new"
        tmp.write_text(kit.config_text(ram="30MB"))
        os.replace(tmp, conf)
        wait_for(lambda: d.tier("ram", c.request("status"))["budget"] == 30_000_000, 5, "reload after a rename")
        # ... and write new content into it in place, as an editor does
        conf.write_text(kit.config_text(ram="40MB", ssd="3GB"))
        wait_for(lambda: d.tier("ram", c.request("status"))["budget"] == 40_000_000, 5, "reload after an edit")
        assert d.tier("ssd", c.request("status"))["budget"] == 3_000_000_000
        assert c.request("reload")["tiers"] == ["ram", "ssd"]
    finally:
        c.close()
    assert d.terminate() == 0


# ------------------------------------------------------------------ 3. shared staging


def test_two_jobs_share_one_staged_copy(kit: Kit) -> None:
    src = build_dataset(kit.root / "src", n=96)
    home = kit.root / "home"
    push(src, str(home), show=False)
    m = manifest(home)
    n = len(m["shards"])
    assert n >= 6
    zst_bytes = sum(int(e["zst"]["bytes"]) for e in m["shards"])
    raw_bytes = sum(int(e["bytes"]) for e in m["shards"])
    d = kit.daemon()
    go = kit.root / "go"
    readers = [kit.reader(home, 96, "--ready", str(kit.root / f"ready{i}"), "--go", str(go)) for i in range(2)]
    wait_for(lambda: all((kit.root / f"ready{i}").exists() for i in range(2)), 30, "both readers open")
    st = d.status()
    pids = {c["pid"] for c in st["clients"]}
    assert {p.pid for p in readers} <= pids, f"both readers are connected to the daemon: {st['clients']}"
    assert st["connected_clients"] >= 3
    go.touch()
    reports = [finish(p) for p in readers]
    for r in reports:
        assert r["count"] == 96 and r["nbad"] == 0, r
        assert r["via_daemon"] and r["daemon_at_end"] and not r["fell_back"], r
    st = d.status()
    assert st["bytes_from_home"] == zst_bytes, f"one copy read from home ({zst_bytes} bytes), not {st['bytes_from_home']}"
    assert st["shards_staged"] == n and st["bytes_staged"] == raw_bytes
    assert st["hits"] + st["misses"] >= 2 * n, "both readers asked the daemon for every shard"
    ram, ssd = d.tier("ram", st), d.tier("ssd", st)
    assert (ram["shards"], ram["used"]) == (n, raw_bytes)
    # the ssd holds only the dataset's name record (for `kvdata cache ls`), counted like any metadata
    names = kit.tiers["ssd"] / "datasets" / "names"
    assert (ssd["shards"], ssd["used"]) == (0, sum(f.stat().st_size for f in names.iterdir()))
    assert set(shard_paths(kit, "ram")) == {e["sha256"] for e in m["shards"]}
    assert d.terminate() == 0


# ------------------------------------------------------------------ 4. claims of dead clients

ANNOUNCER = """
import os, sys, time
from kvdata.protocol import Client
c = Client(sys.argv[1])
c.request("announce", dataset=sys.argv[2], reader="r1", shards=list(range(int(sys.argv[3]))), position=0)
print("announced", flush=True)
if sys.argv[4] == "exit":
    sys.stdin.readline()
    os._exit(0)           # no goodbye: the socket closes with the process
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_client_that_goes_away_releases_its_claims(kit: Kit, how: str) -> None:
    home = build_dataset(kit.root / "home", n=48)
    n = len(manifest(home)["shards"])
    d = kit.daemon()
    p = kit.popen([sys.executable, "-c", ANNOUNCER, str(kit.sock), loc(home), str(n), how],
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdin is not None
    assert p.stdout.readline().strip() == b"announced"
    st = d.status()
    assert st["readers"] == 1
    mine = [c for c in st["clients"] if c["pid"] == p.pid]
    assert len(mine) == 1 and mine[0]["readers"] == 1, st["clients"]
    if how == "sigkill":
        p.kill()
    else:
        p.stdin.write(b"bye\n")
        p.stdin.flush()
    p.wait(10)
    st = wait_for(lambda: (lambda s: s if s["readers"] == 0 and p.pid not in {c["pid"] for c in s["clients"]} else None)(
        d.status()), 2.0, "the dead client's reader released", interval=0.02)
    assert all(c["readers"] == 0 for c in st["clients"])
    assert d.terminate() == 0


# ------------------------------------------------------------------ 5. observability


def test_status_json_and_text_through_the_cli(kit: Kit) -> None:
    home = build_dataset(kit.root / "home", n=48)
    d = kit.daemon()
    with d.client() as c:
        c.request("stage", dataset=loc(home), wait=True)
        c.request("announce", dataset=loc(home), reader="job", shards=[0, 1], position=0)
        c.request("progress", reader="job", position=1, stall=1.25)
        c.request("need", dataset=loc(home), shard=0)
        r = kit.kvdata("status", "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["daemon"] is True and st["pid"] == d.pid
        for t in st["tiers"]:
            for k in ("name", "used", "budget", "shards", "path", "ok", "problem"):
                assert k in t, (k, t)
        ram = next(t for t in st["tiers"] if t["name"] == "ram")
        n = len(manifest(home)["shards"])
        assert ram["shards"] == n and ram["used"] == sum(int(e["bytes"]) for e in manifest(home)["shards"])
        for k in ("hit_rate", "bytes_staged", "queue_depth", "in_flight", "stall_seconds", "reader_stall_seconds",
                  "connected_clients", "hits", "misses", "bytes_from_home", "shards_staged"):
            assert k in st, k
        assert st["hit_rate"] == pytest.approx(st["hits"] / (st["hits"] + st["misses"]))
        assert st["hits"] >= 1 and st["bytes_staged"] > 0
        assert st["reader_stall_seconds"] == pytest.approx(1.25)
        assert st["connected_clients"] == 2  # this client and the CLI's
        text = kit.kvdata("status")
        assert text.returncode == 0, text.stderr
        assert f"running (pid {d.pid}" in text.stdout and "tier ram" in text.stdout and "reader stall 1.2" in text.stdout
    assert d.terminate() == 0


def test_metrics_endpoint_serves_prometheus_text(kit: Kit) -> None:
    home = build_dataset(kit.root / "home", n=48)
    port = free_port()
    d = kit.daemon(metrics_port=port)
    d.request("stage", dataset=loc(home), wait=True)
    st = d.status()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        body = resp.read().decode()
    values: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) kvdata_\w+ .+$", line), line
            continue
        mm = re.match(r'^(kvdata_\w+(?:\{\w+="[^"]*"\})?) (\S+)$', line)
        assert mm, f"not a Prometheus sample line: {line!r}"
        values[mm.group(1)] = float(mm.group(2))
    ram = d.tier("ram", st)
    assert values['kvdata_tier_used_bytes{tier="ram"}'] == ram["used"] > 0
    assert values['kvdata_tier_budget_bytes{tier="ram"}'] == ram["budget"]
    assert values['kvdata_tier_shards{tier="ram"}'] == ram["shards"]
    assert values['kvdata_tier_up{tier="ssd"}'] == 1
    assert values["kvdata_staged_bytes_total"] == st["bytes_staged"]
    for name in ("kvdata_hits_total", "kvdata_staging_in_flight", "kvdata_staging_wait_seconds_total",
                 "kvdata_reader_stall_seconds_total", "kvdata_clients_connected", "kvdata_home_read_bytes_total",
                 "kvdata_requests_total"):
        assert name in values, name
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
    assert e.value.code == 404
    e.value.close()  # the error holds the response's socket
    assert d.terminate() == 0


def test_status_without_a_daemon_says_not_running(kit: Kit) -> None:
    r = kit.kvdata("status")
    assert r.returncode == 0, r.stderr
    assert "not running" in r.stdout
    # a socket file left by a daemon that died: still "not running", no hang
    d = kit.daemon()
    assert d.kill() == -signal.SIGKILL
    assert kit.sock.exists()
    r = kit.kvdata("status", "--json", timeout=20)
    assert r.returncode == 0 and json.loads(r.stdout)["daemon"] is False, r.stderr
    assert "not running" in kit.kvdata("status").stdout


# ------------------------------------------------------------------ 6a. crashes


@pytest.mark.timeout(900)  # 20 kill cycles: ~20-30 s on 2 idle cores, far more on a loaded box
def test_sigkill_during_staging_leaves_only_verified_copies(kit: Kit) -> None:
    home = build_dataset(kit.root / "big", n=64, shard_size="2MB", noise=512 << 10, compress=False)
    m = manifest(home)
    n = len(m["shards"])
    assert n >= 12
    ids = {e["sha256"]: e["id"] for e in m["shards"]}
    d = kit.daemon()
    with d.client() as c:
        t0 = time.monotonic()
        c.request("stage", dataset=loc(home), wait=True)
        full = time.monotonic() - t0
        assert c.request("evict", dataset=loc(home))["evicted"] == n
    d.kill()
    rng = random.Random(20240611)
    interrupted = needs_checked = 0
    for i in range(20):
        d = kit.daemon()  # same socket path: the dead daemon's socket file is still there
        real, temps = tier_files(kit.tiers["ram"])
        assert temps == [], f"round {i}: the restarted daemon left the dead one's temp files: {temps}"
        st = d.status()
        assert d.tier("ram", st)["shards"] == len(real), "the restarted daemon sees what is staged"
        with d.client() as c:
            if real:
                sha = sorted(real)[rng.randrange(len(real))]
                r = c.request("need", dataset=loc(home), shard=ids[sha])
                assert r["path"] == str(kit.tiers["ram"] / "shards" / f"{sha}.mdb") and r["staged"], r
                st = c.request("status")
                assert (st["bytes_staged"], st["shards_staged"], st["hits"]) == (0, 0, 1), st
                needs_checked += 1
            assert c.request("evict", dataset=loc(home))["evicted"] == len(real)
            c.request("stage", dataset=loc(home), wait=False)
            time.sleep(rng.uniform(0, 1.2 * full))
            d.kill()
        real, temps = tier_files(kit.tiers["ram"])  # asserts every real name matches its content
        assert tier_files(kit.tiers["ssd"]) == ({}, [])
        if temps or 0 < len(real) < n:
            interrupted += 1
    assert interrupted >= 3, f"only {interrupted} of 20 kills landed while staging ({full:.3f} s for all)"
    assert needs_checked >= 3
    d = kit.daemon()
    d.request("stage", dataset=loc(home), wait=True)
    assert set(tier_files(kit.tiers["ram"])[0]) == set(ids)
    assert d.terminate() == 0


def test_reader_keeps_reading_when_the_daemon_is_killed(kit: Kit) -> None:
    home = build_dataset(kit.root / "home", n=96)
    assert len(manifest(home)["shards"]) >= 8
    d = kit.daemon()
    resume = kit.root / "resume"
    p = kit.reader(home, 96, "--pause-at", "48", "--resume", str(resume))
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"paused"
    assert d.status()["misses"] > 0, "the first half came through the daemon"
    d.kill()
    resume.touch()
    r = finish(p)
    assert r["count"] == 96 and r["nbad"] == 0, r
    assert r["via_daemon"] and not r["daemon_at_end"] and r["fell_back"], r
    for t in kit.tiers.values():
        tier_files(t)


def test_sigterm_during_staging_exits_0_and_leaves_no_partials(kit: Kit) -> None:
    # many small shards: per-copy fsyncs make staging take a while (120 were all staged within
    # one 50 ms status poll on a fast run, and 600 once before SIGTERM landed in a full CI run)
    home = build_dataset(kit.root / "many", n=1500, shard_size="32KB", noise=30_000, compress=False)
    shas = {e["sha256"] for e in manifest(home)["shards"]}
    d = kit.daemon()
    waiter_result: list[object] = []

    def wait_stage() -> None:
        try:
            with Client(kit.sock, timeout=15) as c:
                waiter_result.append(c.request("stage", dataset=loc(home), wait=True))
        except kvdata.KVDataError as e:  # the daemon stopped first: an error, not a hang
            waiter_result.append(e)

    waiter = threading.Thread(target=wait_stage, daemon=True)
    waiter.start()
    wait_for(lambda: d.status()["in_flight"] > 0 or d.tier("ram")["shards"] == len(shas), 10, "staging started",
             interval=0.005)
    assert d.terminate(timeout=10) == 0, d.log_text()
    waiter.join(15)
    assert not waiter.is_alive() and waiter_result, "a client waiting for staging is answered or disconnected"
    real, temps = tier_files(kit.tiers["ram"])
    assert temps == [], "an aborted copy removes its temp file"
    assert set(real) <= shas
    assert not kit.sock.exists()
    assert len(real) < len(shas), "SIGTERM landed while staging (else this test proves little)"


def test_socket_path_that_is_a_regular_file_is_not_deleted(kit: Kit) -> None:
    import stat

    precious = kit.root / "precious.txt"
    precious.write_text("precious\n")
    d = kit.daemon(sock=precious, wait=False)

    def settled() -> bool:  # the daemon gave up, or the file is gone or replaced by its socket
        return not d.alive() or not precious.exists() or stat.S_ISSOCK(os.lstat(precious).st_mode)

    wait_for(settled, 20, "kvdatad exits or listens")
    assert precious.is_file() and precious.read_text() == "precious\n", "kvdatad deleted a regular file"
    assert d.proc.wait(10) != 0


# ------------------------------------------------------------------ 6b. hostile clients


def _hostile_messages(ds: str, bad_ds: str) -> list[dict]:
    out: list[dict] = [
        {"id": 1},
        {"t": "nope", "id": 1},
        {"t": 5, "id": 1},
        {"t": None, "id": 1},
        {"t": "status", "id": "x"},
        {"t": "status", "id": True},
        {"t": "status", "id": 1.5},
        {"t": "hello", "id": 1, "version": 99, "pid": 1},
        {"t": "hello", "id": 1},
        {"t": "reload ", "id": 1},
    ]
    datasets = ["", "ds", "rel/path", "./ds", "../etc", "/etc", "/", "/proc/self", "/dev/null", "/etc/passwd",
                f"{ds}/../{Path(ds).name}", "/tmp/../etc", f"{ds}\0", "a\0b", "\0", "x" * 5000,
                "s3://bucket/../x", "https://host/a/../../b", "file:///etc", bad_ds, 5, None, True, [], {}, b"/etc",
                [ds], 1.5]
    for value in datasets:
        for t in ("open", "need", "stage", "evict", "announce"):
            out.append({"t": t, "id": 2, "dataset": value, "shard": 0, "reader": "r", "shards": [0]})
    for shard in (-1, 10**6, 2**64 - 1, -2**63, True, False, "0", 0.0, None, [0], {"0": 0}, b"\x00"):
        out.append({"t": "need", "id": 3, "dataset": ds, "shard": shard})
        out.append({"t": "announce", "id": 3, "dataset": ds, "reader": "r", "shards": [0, shard]})
    for shards in ("0,1", None, 0, {"0": 1}):
        out.append({"t": "announce", "id": 4, "dataset": ds, "reader": "r", "shards": shards})
    for reader in ("", "x" * 100_000, "x" * 257, None, 5, "a\0b", ["r"], b"r"):
        out.append({"t": "announce", "id": 5, "dataset": ds, "reader": reader, "shards": [0]})
        out.append({"t": "progress", "id": 5, "reader": reader, "position": 0})
        out.append({"t": "release", "id": 5, "reader": reader})
    for next_start in (-1, 2, True, "1", 1.5, [1]):   # an index into shards (here 0..1), or absent
        out.append({"t": "announce", "id": 6, "dataset": ds, "reader": "r", "shards": [0], "next_start": next_start})
    for position in (-1, True, "0", 1.5, None):
        out.append({"t": "announce", "id": 6, "dataset": ds, "reader": "r", "shards": [0], "position": position})
        out.append({"t": "progress", "id": 6, "reader": "r", "position": position})
    for progress in ("r", 5, {"r": 1}, [["r"]], [["r", -1]], [["r", "1"]], [["", 1]], [["r", 1, 2]], [[None, 0]],
                     [["r", 0]] * 65, [["x" * 300, 0]]):  # positions a need/want carries (held-back progress)
        out.append({"t": "need", "id": 8, "dataset": ds, "shard": 0, "progress": progress})
        out.append({"t": "want", "id": 8, "dataset": ds, "shards": [], "progress": progress})
    for tier in ("nope", "../ram", "", 5, ["ram"]):
        out.append({"t": "stage", "id": 7, "dataset": ds, "tier": tier})
        out.append({"t": "evict", "id": 7, "dataset": ds, "tier": tier})
    return out


def test_hostile_fields_get_one_line_errors_and_touch_nothing(kit: Kit) -> None:
    home = build_dataset(kit.root / "data" / "home", n=24)
    n = len(manifest(home)["shards"])
    # a dataset whose manifest names a shard file outside the dataset
    bad = kit.root / "data" / "bad"
    shutil.copytree(home, bad)
    mb = manifest(bad)
    mb["shards"][0]["name"] = "../../../../etc/hostname"
    (bad / "manifest.json").write_text(json.dumps(mb))
    d = kit.daemon()
    skip = (kit.tiers["ram"].parent, kit.sock, d.log)
    before = snapshot(kit.root, skip)
    etc_before = sorted(os.listdir("/etc")), os.stat("/etc").st_mtime_ns
    msgs = _hostile_messages(loc(home), loc(bad))
    with Raw(kit.sock) as r:
        for msg in msgs:
            reply = r.ask(msg)
            assert_error_reply(reply, repr(msg)[:300])
            if isinstance(msg.get("id"), int) and not isinstance(msg.get("id"), bool):
                assert reply["id"] == msg["id"], (msg, reply)
        # frames that are not msgpack maps
        for body in (b"", b"\xc1", b"\x91\xc0", b"\x05", b"\x91" * 100_000 + b"\xc0", b"\xdd\xff\xff\xff\xff",
                     b"\xc6\xff\xff\xff\xff", b"\x81\x01\x02", b"\x82\xa1t\xa6status\xa1t", os.urandom(64)):
            r.send_frame(body)
            assert_error_reply(r.recv(), repr(body[:20]))
        assert r.ask({"t": "status", "id": 9})["ok"] is True, "the connection survives bad frames"
    # an oversized frame header: an error reply then a hang-up (it cannot resynchronize), or just a hang-up
    with Raw(kit.sock) as r:
        r.sock.sendall((MAX_FRAME + 1).to_bytes(4, "big"))
        reply = r.recv()
        if reply is not None:
            assert_error_reply(reply, "oversized frame")
            assert r.recv() is None
    # a truncated frame, then close
    with Raw(kit.sock) as r:
        r.sock.sendall((1000).to_bytes(4, "big") + b"\x81\xa1t")
    with Raw(kit.sock) as r:
        r.sock.sendall(b"\x00\x00")
    # a valid request still works, nothing outside the tiers was written, the daemon never failed inside
    st = wait_for(lambda: (lambda x: x if x["connected_clients"] == 1 else None)(d.status()), 5,
                  "every hostile connection closed")
    assert d.alive() and st["bad_requests"] >= len(msgs)
    assert snapshot(kit.root, skip) == before
    assert (sorted(os.listdir("/etc")), os.stat("/etc").st_mtime_ns) == etc_before
    assert os.listdir(kit.cwd) == []
    assert "Traceback" not in d.log_text()
    assert d.request("need", dataset=loc(home), shard=n - 1)["staged"] is True
    assert d.terminate() == 0


def _random_value(rng: random.Random, depth: int = 0) -> object:
    k = rng.randrange(12 if depth < 2 else 8)
    if k == 0:
        return rng.randrange(-2**63, 2**64)
    if k == 1:
        return rng.choice([0, 1, -1, 2**31, True, False, None])
    if k == 2:
        return rng.random() * 10**rng.randrange(-3, 12)
    if k == 3:
        return "".join(chr(rng.randrange(0, 0x2FF)) for _ in range(rng.randrange(0, 40)))
    if k == 4:
        return rng.choice(["/", "/etc", "..", "../..", "/tmp/x/../y", "\0", "ram", "ssd", "r1", "s3://b/k", ""])
    if k == 5:
        return os.urandom(rng.randrange(0, 40))
    if k == 6:
        return rng.choice(list(TYPES))
    if k == 7:
        return float("nan") if rng.random() < 0.5 else float("inf")
    if k in (8, 9):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    return {str(_random_value(rng, depth + 1))[:20]: _random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))}


FIELDS = ("t", "id", "dataset", "shard", "shards", "reader", "position", "stall", "tier", "wait", "version", "pid")


def test_random_frames_never_take_the_daemon_down(kit: Kit) -> None:
    home = build_dataset(kit.root / "home", n=24)
    n = len(manifest(home)["shards"])
    d = kit.daemon()
    rng = random.Random(7)
    sent = 0
    with Raw(kit.sock) as r:
        for i in range(400):
            kind = rng.randrange(3)
            if kind == 0:  # a random map over the protocol's field names
                msg: dict = {f: _random_value(rng) for f in rng.sample(FIELDS, rng.randrange(0, len(FIELDS)))}
                if rng.random() < 0.7:
                    msg["t"] = rng.choice(list(TYPES) + ["x", "STATUS"])
                if rng.random() < 0.5:
                    msg["dataset"] = rng.choice([loc(home), "/etc", "rel", loc(home) + "/.."])
                if rng.random() < 0.3:
                    msg["shard"] = rng.choice([0, n - 1, n, -1, True, "1"])
                msg["id"] = i
                body = msgpack.packb(msg, use_bin_type=True)
            elif kind == 1:  # random bytes in a correct frame
                body = os.urandom(rng.randrange(0, 200))
            else:  # a random msgpack value that is not a map (or a map with non-string keys)
                body = msgpack.packb(rng.choice([_random_value(rng), {1: 2}, {(1, 2): 3}, [{"t": "status"}]]),
                                     use_bin_type=True)
            r.send_frame(body)
            reply = r.recv()
            assert reply is not None, f"frame {i} ({body[:60]!r}) closed the connection"
            assert isinstance(reply.get("ok"), bool), reply
            if not reply["ok"]:
                assert_error_reply(reply, f"frame {i}: {body[:200]!r}")
            sent += 1
    # truncated frames on fresh connections, then close
    for i in range(20):
        with Raw(kit.sock) as r:
            body = msgpack.packb({"t": "status", "id": i, "pad": "x" * rng.randrange(0, 100)})
            r.sock.sendall(len(body).to_bytes(4, "big") + body[: rng.randrange(0, len(body))])
    assert sent == 400
    assert d.alive()
    st = wait_for(lambda: (lambda x: x if x["connected_clients"] == 1 else None)(d.status()), 5,
                  "every connection closed")
    assert st["requests"] >= 400
    assert "Traceback" not in d.log_text()
    assert d.terminate() == 0


def test_client_that_never_reads_replies_does_not_block_others(kit: Kit) -> None:
    d = kit.daemon()
    greedy = Raw(kit.sock)
    try:
        frames = b"".join(len(b).to_bytes(4, "big") + b for b in
                          (msgpack.packb({"t": "status", "id": i}) for i in range(1000)))
        sender = threading.Thread(target=lambda: greedy.sock.sendall(frames), daemon=True)
        sender.start()
        time.sleep(0.3)
        with d.client(timeout=5) as c:
            for _ in range(10):
                t0 = time.monotonic()
                st = c.request("status")
                assert time.monotonic() - t0 < 2.0
                time.sleep(0.05)
        assert st["connected_clients"] >= 2
        assert st["requests"] < 1000, "the non-reading client is stalled on its own unread replies"
        # stopping with a client stuck on its unread replies: still a prompt, clean exit
        assert d.terminate(timeout=10) == 0
    finally:
        greedy.close()


def test_blocking_requests_of_one_client_do_not_starve_others(kit: Kit) -> None:
    home = build_dataset(kit.root / "home", n=24)
    trap = kit.root / "trap"
    trap.mkdir()
    os.mkfifo(trap / "manifest.json")
    d = kit.daemon()
    hostile = [Raw(kit.sock, timeout=30) for _ in range(20)]
    try:
        for r in hostile:
            r.send({"t": "open", "id": 1, "dataset": str(trap)})
        time.sleep(0.5)
        with d.client(timeout=3) as c:
            assert c.request("status")["ok"]
            t0 = time.monotonic()
            c.request("open", dataset=loc(home))  # DaemonUnavailable (timed out) while the pool is stuck
            c.request("need", dataset=loc(home), shard=0)
            assert time.monotonic() - t0 < 3
    finally:
        for r in hostile:
            r.close()


def test_sigterm_exits_even_with_a_request_stuck_in_a_read(kit: Kit) -> None:
    trap = kit.root / "trap"
    trap.mkdir()
    os.mkfifo(trap / "manifest.json")
    d = kit.daemon()
    with Raw(kit.sock) as r:
        r.send({"t": "open", "id": 1, "dataset": str(trap)})
        time.sleep(0.3)
    assert d.terminate(timeout=5) == 0


# ------------------------------------------------------------------ 6c. tiers that fail


def test_tier_directory_that_disappears_is_reported_and_skipped(kit: Kit) -> None:
    home = build_dataset(kit.root / "home", n=96)
    m = manifest(home)
    d = kit.daemon()
    assert Path(d.request("need", dataset=loc(home), shard=0)["path"]).parent == kit.tiers["ram"] / "shards"
    shutil.rmtree(kit.tiers["ram"])
    ram = d.tier("ram")
    assert ram["ok"] is False and ram["problem"] and "missing" in ram["problem"], ram
    for sid in (0, 1):
        p = Path(d.request("need", dataset=loc(home), shard=sid)["path"])
        assert p == kit.tiers["ssd"] / "shards" / f"{m['shards'][sid]['sha256']}.mdb"
    r = finish(kit.reader(home, 96))
    assert r["count"] == 96 and r["nbad"] == 0 and r["via_daemon"] and r["daemon_at_end"], r
    assert set(shard_paths(kit, "ssd")) == {e["sha256"] for e in m["shards"]}
    assert not kit.tiers["ram"].exists(), "a vanished tier directory is reported, not silently recreated"
    st = d.status()
    assert d.tier("ram", st)["ok"] is False and d.tier("ssd", st)["ok"] is True
    assert d.terminate() == 0


def test_tier_that_fills_up_is_reported_and_skipped(kit: Kit) -> None:
    if not kit.mount_tmpfs(kit.tiers["ram"], "1m"):
        pytest.skip("cannot mount a 1 MiB tmpfs here (needs root and mount permission)")
    home = build_dataset(kit.root / "home", n=160, shard_size="128KB", noise=16 << 10)
    m = manifest(home)
    assert sum(int(e["bytes"]) for e in m["shards"]) > 2 << 20
    d = kit.daemon()  # the ram tier's budget (512MB) is far above what its filesystem holds
    r = finish(kit.reader(home, 160, noise=16 << 10))
    assert r["count"] == 160 and r["nbad"] == 0 and r["via_daemon"] and r["daemon_at_end"], r
    st = d.status()
    ram, ssd = d.tier("ram", st), d.tier("ssd", st)
    assert ram["problem"] and "space" in ram["problem"].lower(), ram
    assert ssd["shards"] > 0
    real_ram, temps = tier_files(kit.tiers["ram"])
    assert temps == [], "a copy that hit a full disk leaves no temp file"
    real_ssd, _ = tier_files(kit.tiers["ssd"])
    assert set(real_ram) | set(real_ssd) == {e["sha256"] for e in m["shards"]}
    assert d.terminate() == 0


# ------------------------------------------------------------------ 7. watched homes


def test_new_generation_at_a_watched_home_is_staged(kit: Kit) -> None:
    home = build_dataset(kit.root / "home", n=64)
    old = manifest(home)
    d = kit.daemon()
    r = kit.kvdata("stage", str(home))
    assert r.returncode == 0 and "all staged" in r.stdout, (r.stdout, r.stderr)
    old_shas = {e["sha256"] for e in old["shards"]}
    assert set(shard_paths(kit, "ram")) == old_shas
    time.sleep(1.2)  # the daemon starts watching homes it has opened within a second
    build_dataset(home, n=32, start=64, mode="a")
    new = manifest(home)
    new_shas = {e["sha256"] for e in new["shards"]}
    assert new["generation"] > old["generation"] and len(new_shas - old_shas) >= 1
    wait_for(lambda: d.tier("ram")["shards"] == len(new_shas | old_shas), 10, "the new shards staged by the daemon")
    real = shard_paths(kit, "ram")  # content-addressed: old copies keep their names, new ones get new ones
    assert set(real) == new_shas | old_shas
    gens = {x["dataset"]: x["generation"] for x in d.status()["datasets"]}
    assert gens[loc(home)] == new["generation"]
    rep = finish(kit.reader(home, 96))
    assert rep["count"] == 96 and rep["nbad"] == 0 and rep["via_daemon"], rep
    assert rep["generation"] == new["generation"]
    assert d.terminate() == 0


def test_home_changed_right_after_the_daemon_opened_it_is_noticed(kit: Kit) -> None:
    """The daemon watches a home from its next once-a-second poll after opening it, and checks
    the manifest when the watch starts: a commit that lands before the watch exists (a fast
    machine) and one that lands after it (a slow one) must both be staged, so the test holds
    whatever the timing (it used to skip itself when the commit came late)."""
    home = build_dataset(kit.root / "home", n=64)
    d = kit.daemon()  # its first poll for homes to watch comes 1 s after it listens
    d.request("stage", dataset=loc(home), wait=True)
    build_dataset(home, n=32, start=64, mode="a")
    new = manifest(home)
    wait_for(lambda: d.tier("ram")["shards"] == len(new["shards"]), 4, "the new generation's shards staged")


def test_reader_opening_right_after_an_append_reads_the_new_samples(kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    home = build_dataset(kit.root / "home", n=64)
    d = kit.daemon()
    d.request("stage", dataset=loc(home), wait=True)
    for k, v in kit.env().items():
        monkeypatch.setenv(k, v)
    total = 64
    for _ in range(3):
        time.sleep(1.2)  # let the daemon watch the home (and refresh after the previous attempt)
        build_dataset(home, n=16, start=total, mode="a")
        total += 16
        with kvdata.open(home) as s:  # through the daemon, right away
            assert type(s.engine).__name__ == "DaemonStager"
            assert len(s) == total
            vals = s.get_many(list(range(total)))
            assert all(same(v, i) for i, v in enumerate(vals))


def test_reader_right_after_a_rewrite_is_never_served_stale_copies(kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    home = kit.root / "home"
    with kvdata.open(home, "w", shard_size="64KB") as s:
        s.put_many((f"k{i:06d}", {"x": bytes([i % 251]) * 4000}) for i in range(64))
        s.seal()
    d = kit.daemon()
    d.request("stage", dataset=loc(home), wait=True)
    for k, v in kit.env().items():
        monkeypatch.setenv(k, v)
    for attempt in range(1, 4):
        time.sleep(1.2)
        with kvdata.open(home, "w", shard_size="64KB") as s:  # same keys and sizes, new content
            s.put_many((f"k{i:06d}", {"x": bytes([(i + attempt) % 251]) * 4000}) for i in range(64))
            s.seal()
        with kvdata.open(home) as s:
            assert type(s.engine).__name__ == "DaemonStager"
            got = [bytes(v["x"][:1])[0] for v in s.get_many(list(range(64)))]
        assert got == [(i + attempt) % 251 for i in range(64)], f"attempt {attempt}: stale samples served"
    for t in kit.tiers.values():
        tier_files(t)  # the copies themselves are all content-addressed


def test_a_need_carries_held_back_progress_and_bad_positions_are_refused(kit: Kit) -> None:
    """A reader reports progress at most every PROGRESS_INTERVAL; positions held back go with
    its next need/want (`progress`: [[reader, position], ...]), validated like `progress`."""
    home = build_dataset(kit.root / "home", n=48)
    d = kit.daemon()
    with d.client() as c:
        c.request("announce", dataset=loc(home), reader="job", shards=[0, 1, 2], position=0)
        c.request("need", dataset=loc(home), shard=1, progress=[["job", 1]])
        c.request("want", dataset=loc(home), shards=[], progress=[["job", 2]])
        for bad in ([["job", -1]], [["job"]], "job", [["", 0]], [["job", 0]] * 65):
            with pytest.raises(KVDataError, match="progress|position|reader"):
                c.request("need", dataset=loc(home), shard=0, progress=bad)
        assert c.request("status")["readers"] == 1
    assert d.terminate() == 0


def test_connections_over_max_connections_get_one_busy_frame_and_the_rest_are_served(kit: Kit) -> None:
    """At most max_connections in all (here below the per-uid limit): each one over it gets one
    `busy` error frame naming the setting and is closed; the connections already admitted stay
    served, and once some close, new ones are admitted again."""
    kit.config.write_text(kit.config_text(extra="[daemon]\nmax_connections = 8\nmax_connections_per_uid = 64\n"))
    d = kit.daemon()
    socks = []
    try:
        for _ in range(20):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(kit.sock))
            socks.append(s)
        time.sleep(1.0)  # the daemon accepts (and refuses) them meanwhile
        refused = []
        for s in socks:
            s.setblocking(False)
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue  # admitted, idle
            body = msgpack.unpackb(data[4:], raw=False) if data else {}
            refused.append((body.get("code"), "max_connections" in body.get("error", "")))
        # 8 admitted (7 while the daemon has not yet seen wait_ready's probe connection close)
        assert 12 <= len(refused) <= 13 and all(r == ("busy", True) for r in refused), refused
        for s in socks:
            s.close()
        socks = []
        deadline = time.monotonic() + 10
        while True:  # the admitted ones closed: a new client is served again
            try:
                with Client(str(kit.sock), timeout=5) as c:
                    assert "tiers" in c.request("status")
                break
            except KVDataError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        for s in socks:
            s.close()
    assert d.terminate() == 0


def test_a_copy_passed_to_its_reader_is_not_pinned_beyond_the_need(kit: Kit) -> None:
    """A `need` pins the shard it stages until its copy is open (so no stager evicts it in
    between); once the descriptor is passed, only readers holding it keep it. A tier with room
    for two shards, two needs whose descriptors the client closes, then a third need: it is
    staged by evicting one of them, not read around a tier full of pins (PIN_SECONDS)."""
    src = build_dataset(kit.root / "src", n=48)
    home = kit.root / "home"
    push(src, str(home), show=False)
    m = manifest(home)
    sizes = sorted(int(e["bytes"]) for e in m["shards"])
    assert len(sizes) >= 3
    cfg = kit.root / "small.toml"
    cfg.write_text(f'[[tiers]]\nname = "ram"\npath = "{kit.tiers["ram"]}"\nbudget = {sizes[-1] + sizes[-2]}\n')
    d = kit.daemon(config=cfg)
    with d.client() as c:
        c.request("announce", dataset=loc(home), reader="job", shards=[0, 1, 2], position=0)  # shard-aware
        for shard in (0, 1, 2):
            c.request("progress", reader="job", position=shard)
            reply = c.request("need", dataset=loc(home), shard=shard)
            assert reply["staged"], (shard, reply)  # nothing read around the tier
        st = c.request("status")
    assert st["evictions"] >= 1 and st["private_copies"] == 0 and st["home_reads"] == 0, st
    assert d.terminate() == 0


# ------------------------------------------------------------------ issue 27: names, clean stop, info of a URL


def test_cache_ls_names_copies_staged_before_a_restart(kit: Kit) -> None:
    home = build_dataset(kit.root / "home", n=48)
    d = kit.daemon()
    assert kit.kvdata("stage", str(home)).returncode == 0
    assert d.terminate() == 0
    d = kit.daemon()  # a restarted daemon has opened nothing yet
    names_dir = kit.tiers["ssd"] / "datasets" / "names"
    # hostile records beside the real one: one others may write, one naming the copies with a
    # terminal escape; both are skipped, never shown
    shas = [e["sha256"] for e in manifest(home)["shards"]]
    planted = names_dir / "planted.json"
    planted.write_text(json.dumps({"dataset": "/evil", "shards": [[s, "x"] for s in shas]}))
    planted.chmod(0o666)
    (names_dir / "escape.json").write_text(json.dumps({"dataset": "/a\x1b[2J", "shards": [[s, "x"] for s in shas]}))
    r = kit.kvdata("cache", "ls", "--json")
    assert r.returncode == 0, r.stderr
    ram = next(t for t in json.loads(r.stdout)["tiers"] if t["name"] == "ram")
    want = {e["sha256"]: [f"{loc(home)}#{e['name']}"] for e in manifest(home)["shards"]}
    assert {s["sha256"]: s["datasets"] for s in ram["shards"]} == want
    text = kit.kvdata("cache", "ls")
    assert text.returncode == 0 and "?" not in text.stdout and "/evil" not in text.stdout, text.stdout
    assert d.terminate() == 0


def test_clean_sigterm_logs_no_error(kit: Kit) -> None:
    home = build_dataset(kit.root / "home", n=96)
    d = kit.daemon()
    assert kit.kvdata("stage", str(home)).returncode == 0
    r = kit.reader(loc(home), 96)  # a watched home being read while SIGTERM lands
    finish(r)
    time.sleep(1.5)  # the watcher has added its watch on the home
    assert d.terminate() == 0
    log = d.log_text()
    assert "stopping" in log and not re.search(r"\bERROR\b|Traceback", log), log


def test_watchdogs_stopped_emitter_message_is_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import kvdata_daemon.watch  # noqa: F401  (installs the filter)

    wlog = logging.getLogger("watchdog.observers.inotify")
    with caplog.at_level(logging.INFO):
        wlog.error("InotifyEmitter.queue_events() called when the thread is inactive")
        wlog.error("something else")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == ["something else"]


def test_info_of_an_s3_url_through_the_daemon_shows_the_url(kit: Kit, s3_server: S3Server) -> None:
    url = push_s3(build_dataset(kit.root / "src", n=24), s3_server, "info27")
    kit.config.write_text(kit.config_text(extra=f'[daemon]\nallow_homes = ["{url}"]\n'))
    d = kit.daemon()
    r = kit.kvdata("info", url, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["dataset"] == url and info["samples"] == 24
    assert info["served_from"] and Path(info["served_from"]).is_relative_to(kit.root), info
    assert d.status()["datasets"], "kvdata info did not go through the daemon"
    text = kit.kvdata("info", url)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["dataset", url] and lines[1].startswith("served from  "), text.stdout
    assert d.terminate() == 0
