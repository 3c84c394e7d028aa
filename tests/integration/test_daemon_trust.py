"""kvdatad as a shared service, tested as the attacker (issue 11, docs/SECURITY.md).

The daemon runs as root (a real subprocess, fixture `kit`); uid B (kvdtest_b) attacks and
uid C (kvdtest_c) is the victim whose 0700 datasets B must never reach through the daemon.
Clients run as those uids in forked children (helpers.users.as_user), so the daemon sees
their uids through SO_PEERCRED. Tests that need other uids skip when not run as root.
Each regression test is named after the bug it covers.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgpack
import pytest

import kvdata
import kvdata.reader.daemon_client
import kvdata.reader.open
import kvdata.store.verify
import kvdata.tiers.staging
from kvdata.config import ConfigError, DaemonConfig, normalize_home_url
from kvdata.errors import DaemonError, RemoteError
from kvdata.homes.http_home import HTTPHome
from kvdata.protocol import HEADER, MAX_FRAME, Client
from kvdata.sync.mirror import MAX_MANIFEST_BYTES, mirror

from helpers.common import free_port, wait_for
from helpers.daemon import Kit, Raw, assert_error_reply, build_dataset, manifest, same, tier_files
from helpers.users import User, as_user, can_switch_users, give, make_user

NO_USERS = can_switch_users()
needs_users = pytest.mark.skipif(NO_USERS is not None, reason=f"other uids: {NO_USERS}")


# ------------------------------------------------------------------ setup


@dataclass
class Trust:
    kit: Kit
    b: User
    c: User

    def home(self, user: User) -> Path:
        return self.kit.root / "users" / user.name

    def env(self, user: User) -> dict[str, str]:
        """What a job of `user` runs with: its own config (in-process tiers of its own), the daemon's socket."""
        h = self.home(user)
        return {"HOME": str(h), "XDG_CACHE_HOME": str(h / "cache"), "KVDATA_CONFIG": str(h / "kvdata.toml"),
                "KVDATA_SOCKET": str(self.kit.sock)}

    def dataset(self, user: User, name: str, n: int = 48, start: int = 0, noise: int = 4096) -> Path:
        """A sealed dataset of `user`, in its 0700 home."""
        path = self.home(user) / name
        build_dataset(path, n=n, start=start, noise=noise)
        give(path, user)
        return path


def daemon_config(kit: Kit, extra: str = "") -> None:
    kit.config.write_text(kit.config_text(extra="[daemon]\nall_users = true\n" + extra))


@pytest.fixture
def trust(kit: Kit) -> Iterator[Trust]:
    if NO_USERS is not None:
        pytest.skip(f"other uids: {NO_USERS}")
    b, c = make_user("b"), make_user("c")
    os.chmod(kit.root, 0o711)  # every user reaches the socket and its own home, lists nothing
    daemon_config(kit)
    t = Trust(kit, b, c)
    for u in (b, c):
        h = t.home(u)
        h.mkdir(parents=True)
        (h / "kvdata.toml").write_text(f'[[tiers]]\nname = "mine"\npath = "{h / "tiers"}"\nbudget = "512MB"\n')
        give(h, u, 0o700)
    os.chmod(kit.root / "users", 0o711)
    yield t


def loc(p: Path) -> str:
    return str(p.resolve())


def staged(kit: Kit) -> dict[str, int]:
    real: dict[str, int] = {}
    for t in kit.tiers.values():
        real.update(tier_files(t)[0])
    return real


def in_background(result: list[Any], fn: Any) -> threading.Thread:
    """fn() on a daemon thread; its value (or the exception it raised) lands in `result`."""
    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def vm(pid: int, key: str) -> int:
    """A /proc/PID/status value in kB (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


# ------------------------------------------------------------------ what runs as another uid


def read_report(location: str) -> dict[str, Any]:
    """Open a dataset as a job does (kvdata.open: through kvdatad when it answers), read every sample."""
    store = kvdata.open(location)
    try:
        eng = store.engine
        n = len(store)
        bad = []
        for start in range(0, n, 8):
            idx = list(range(start, min(n, start + 8)))
            bad += [i for i, v in zip(idx, store.get_many(idx)) if not same(v, i)]
        return {"count": n, "nbad": len(bad), "via_daemon": type(eng).__name__ == "DaemonStager",
                "daemon_at_end": getattr(eng, "client", None) is not None,
                "fell_back": getattr(eng, "_fallback", None) is not None}
    finally:
        store.close()


def raw_replies(sock: str, msgs: list[dict[str, Any]]) -> list[Any]:
    with Raw(Path(sock)) as r:
        return [r.ask(m) for m in msgs]


def client_calls(sock: str, calls: list[tuple[str, dict[str, Any], list[str]]]) -> list[Any]:
    """Each (type, fields, files to open and pass): the reply, or ("error", code, text)."""
    out: list[Any] = []
    with Client(sock, timeout=30) as c:
        for t, fields, files in calls:
            fds = [os.open(f, os.O_RDONLY) for f in files]
            try:
                reply, got = c.request_fds(t, fds=fds, **fields)
                for fd in got:
                    os.close(fd)
                out.append(reply)
            except DaemonError as e:
                out.append(("error", e.code, str(e)))
            finally:
                for fd in fds:
                    os.close(fd)
    return out


def try_tier(paths: list[str]) -> dict[str, str]:
    """What this uid gets when it lists, reads or plants files in the daemon's tiers."""
    out = {}
    for p in paths:
        for what, fn in (("list", lambda p=p: os.listdir(p)),
                         ("read", lambda p=p: open(p, "rb").read(1)),
                         ("plant", lambda p=p: open(os.path.join(p, "planted.mdb"), "wb").close())):
            try:
                fn()
                out[f"{what} {p}"] = "allowed"
            except OSError as e:
                out[f"{what} {p}"] = type(e).__name__
    return out


# ------------------------------------------------------------------ the honest path


@needs_users
def test_uid_b_reads_its_own_dataset_through_the_daemon_by_passing_its_files(trust: Trust) -> None:
    ds = trust.dataset(trust.b, "mine", n=48)
    d = trust.kit.daemon()
    rep = as_user(trust.b, read_report, loc(ds), env=trust.env(trust.b))
    assert rep == {"count": 48, "nbad": 0, "via_daemon": True, "daemon_at_end": True, "fell_back": False}, rep
    shas = {e["sha256"] for e in manifest(ds)["shards"]}
    assert set(staged(trust.kit)) == shas, "every shard came through the daemon's tiers"
    st = d.status()
    assert st["bytes_from_home"] > 0 and st["shards_staged"] == len(shas)
    for t in trust.kit.tiers.values():  # daemon-owned and private: clients got descriptors, not paths
        for p in (t, t / "shards"):
            s = p.stat()
            assert s.st_uid == 0 and s.st_mode & 0o777 == 0o700, (p, oct(s.st_mode))
    for sha in shas:
        p = trust.kit.tiers["ram"] / "shards" / f"{sha}.mdb"
        assert p.stat().st_mode & 0o077 == 0
    assert d.terminate() == 0


@needs_users
def test_uid_b_stages_its_own_dataset_by_passing_the_shard_files(trust: Trust) -> None:
    ds = trust.dataset(trust.b, "mine", n=48)
    d = trust.kit.daemon()

    def stage(location: str) -> dict[str, Any]:
        from kvdata.reader.daemon_requests import stage_request

        with kvdata.open(location, use_daemon=False) as s, Client(os.environ["KVDATA_SOCKET"]) as c:
            return stage_request(c, location, s.manifest.shards, wait=True)

    r = as_user(trust.b, stage, loc(ds), env=trust.env(trust.b))
    shas = {e["sha256"] for e in manifest(ds)["shards"]}
    assert r == {"shards": len(shas), "queued": 0}, r
    assert set(staged(trust.kit)) == shas
    assert d.terminate() == 0


def run_cli(*args: str) -> tuple[int, str, str]:
    """The `kvdata` command group with its error handling, run by the calling uid (in the forked
    child: the console script under /root is not executable by the test users)."""
    import inspect

    from click.testing import CliRunner

    from kvdata.cli import main

    # click < 8.2 mixes stderr into stdout unless told not to (8.2 removed the option)
    separate = {"mix_stderr": False} if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else {}
    r = CliRunner(**separate).invoke(main, list(args))
    return r.exit_code, r.stdout, r.stderr


@needs_users
def test_cli_stage_and_evict_by_an_unprivileged_uid_pass_its_files(trust: Trust) -> None:
    """Regression: `kvdata stage/evict` sent a local path, which kvdatad refuses for a uid that
    is not root or its own; the CLI now passes the uid's own manifest and shard files."""
    ds = trust.dataset(trust.b, "mine", n=48)
    d = trust.kit.daemon()
    rc, out, err = as_user(trust.b, run_cli, "stage", loc(ds), "--json", env=trust.env(trust.b))
    assert rc == 0 and err == "", (rc, out, err)
    shas = {e["sha256"] for e in manifest(ds)["shards"]}
    assert json.loads(out)["daemon"] is True and json.loads(out)["shards"] == len(shas)
    assert set(staged(trust.kit)) == shas
    rc, out, err = as_user(trust.b, run_cli, "evict", loc(ds), "--json", env=trust.env(trust.b))
    assert rc == 0 and err == "", (rc, out, err)
    assert json.loads(out)["evicted"] >= len(shas) and not set(staged(trust.kit)) & shas
    # uid C cannot evict B's dataset: it cannot open B's manifest to pass it
    rc, out, err = as_user(trust.c, run_cli, "evict", loc(ds), env=trust.env(trust.c))
    assert rc != 0 and len(err.splitlines()) == 1 and "Traceback" not in err, (rc, out, err)
    assert d.terminate() == 0


# ------------------------------------------------------------------ confused deputy


@needs_users
def test_daemon_staged_any_local_path_a_client_named_even_one_it_cannot_read(trust: Trust) -> None:
    """Regression: kvdatad staged a dataset the client could not read. Now a uid that is not
    root or the daemon's never makes it open a path; and the replies for C's private dataset
    and for a path that does not exist are the same (no size, hash or existence)."""
    private = trust.dataset(trust.c, "private", n=48, start=1000)
    missing = private.parent / "no-such-dataset"
    m = manifest(private)
    d = trust.kit.daemon()

    def probes(path: str) -> list[dict[str, Any]]:
        return [{"t": t, "id": i, "dataset": path, "shard": 0, "sha256": m["shards"][0]["sha256"], "reader": "r",
                 "shards": [0] if t != "want" else [[0, m["shards"][0]["sha256"]]], "wait": True}
                for i, t in enumerate(("open", "need", "want", "announce", "stage", "evict"))]

    got = as_user(trust.b, raw_replies, str(trust.kit.sock), probes(loc(private)) + probes(str(missing)))
    half = len(got) // 2
    for reply in got:
        assert_error_reply(reply)
        assert reply["code"] == "NotAllowed", reply
        text = json.dumps(reply)
        for e in m["shards"]:
            assert e["sha256"][:8] not in text and str(e["bytes"]) not in text, reply
    for a, b in zip(got[:half], got[half:]):
        assert a["error"].replace(loc(private), "X") == b["error"].replace(str(missing), "X"), (a, b)
    # B cannot pass what it cannot open
    cannot = as_user(trust.b, try_tier, [str(private)])
    assert set(cannot.values()) == {"PermissionError"}, cannot
    assert staged(trust.kit) == {}, "nothing of C's dataset was staged"
    st = d.status()
    assert st["datasets"] == [] and st["bytes_from_home"] == 0
    assert d.terminate() == 0


@needs_users
def test_shard_symlinked_to_a_private_file_revealed_its_size_and_hash(trust: Trust) -> None:
    """Regression: a shard that is a symlink to another user's private file made replies reveal
    that file's size and hash prefix. B's client cannot open the link, so it has nothing to pass;
    naming it without a descriptor, or passing another file of the right size, is refused with
    a line that says nothing about the private file."""
    private = trust.dataset(trust.c, "private", n=48, start=1000, noise=9000)
    mine = trust.dataset(trust.b, "mine", n=48)
    mm, pm = manifest(mine), manifest(private)
    assert pm["shards"][0]["bytes"] != mm["shards"][0]["bytes"]
    target = private / "shards" / pm["shards"][0]["name"]
    link = mine / "shards" / mm["shards"][0]["name"]
    decoy = mine / "shards" / mm["shards"][1]["name"]
    link.unlink()
    (mine / "shards" / mm["shards"][0]["zst"]["name"]).unlink()  # no other copy of shard 0 at B's home
    link.symlink_to(target)
    os.lchown(link, trust.b.uid, trust.b.gid)
    secret_sha = hashlib.sha256(target.read_bytes()).hexdigest()
    secret_size = target.stat().st_size
    d = trust.kit.daemon()
    sha0 = mm["shards"][0]["sha256"]
    calls: list[tuple[str, dict[str, Any], list[str]]] = [
        ("open", {"dataset": loc(mine)}, [str(mine / "manifest.json")]),
        ("need", {"dataset": loc(mine), "shard": 0, "sha256": sha0}, []),                  # nothing passed
        ("want", {"dataset": loc(mine), "shards": [[0, sha0]]}, []),
        ("need", {"dataset": loc(mine), "shard": 0, "sha256": sha0, "kind": "mdb"}, [str(decoy)]),
    ]
    same_size = decoy.stat().st_size == mm["shards"][0]["bytes"]
    got = as_user(trust.b, client_calls, str(trust.kit.sock), calls)
    assert got[0]["shards"] == len(mm["shards"])
    assert got[1][:2] == ("error", "NotAllowed"), got[1]
    assert got[2] == {"id": got[2]["id"], "ok": True, "started": 0}, got[2]
    # a file of B's own of the wrong content: refused (what it says is about B's own file)
    assert got[3][0] == "error" and got[3][1] in ("ChecksumMismatchError", "BadRequest"), got[3]
    if not same_size:
        assert "size" in got[3][2], got[3]
    text = json.dumps(got)
    assert secret_sha[:8] not in text and str(secret_size) not in text, text
    assert secret_sha not in staged(trust.kit) and pm["shards"][0]["sha256"] not in staged(trust.kit)
    # the reader itself cannot open the link either: the daemon refuses, the in-process fallback fails
    rep = as_user(trust.b, lambda: read_report_partial(loc(mine)), env=trust.env(trust.b))
    assert rep["error"] and secret_sha[:8] not in rep["error"] and str(secret_size) not in rep["error"], rep
    assert d.terminate() == 0


def read_report_partial(location: str) -> dict[str, Any]:
    store = kvdata.open(location)
    try:
        try:
            store.get_many(list(range(len(store))))
            return {"error": None}
        except (OSError, kvdata.KVDataError) as e:
            return {"error": f"{type(e).__name__}: {e}"}
    finally:
        store.close()


# ------------------------------------------------------------------ cross-user claims and copies


@needs_users
def test_any_client_could_list_release_and_evict_other_users_claims(trust: Trust) -> None:
    """Regression: any client could list and evict other users' datasets. C holds a reader's
    claim; B sees neither C's client nor its dataset, releasing C's reader name releases
    nothing, and evicting C's dataset (by path, or through a manifest that names C's shard
    hashes) evicts nothing."""
    private = trust.dataset(trust.c, "private", n=48, start=1000)
    m = manifest(private)
    n = len(m["shards"])
    d = trust.kit.daemon()
    holding, done = trust.home(trust.c) / "holding", trust.kit.root / "done"

    def hold_claim(location: str) -> int:
        store = kvdata.open(location)
        try:
            store.get_many(list(range(len(store))))  # every shard staged through the daemon
            eng = store.engine
            eng.announce("job", list(store.manifest.shards), 0)
            Path(holding).touch()
            deadline = time.monotonic() + 60
            while not os.path.exists(done) and time.monotonic() < deadline:
                time.sleep(0.02)
            return len(store)
        finally:
            store.close()

    result: list[Any] = []
    th = in_background(result, lambda: as_user(trust.c, hold_claim, loc(private), env=trust.env(trust.c)))
    try:
        wait_for(lambda: holding.exists() or result, 60, "C's reader announced")
        assert not result, result
        assert set(staged(trust.kit)) == {e["sha256"] for e in m["shards"]}
        root_view = d.status()
        cpids = [c for c in root_view["clients"] if c["uid"] == trust.c.uid]
        assert len(cpids) == 1 and cpids[0]["readers"] == 1, root_view["clients"]
        assert any(x["dataset"] == loc(private) for x in root_view["datasets"])
        assert root_view["readers"] == 1

        # B learned C's shard hashes somehow: a manifest naming them, with files of its own
        fake = trust.home(trust.b) / "fake"
        (fake / "shards").mkdir(parents=True)
        (fake / "manifest.json").write_text(json.dumps(m))
        for e in m["shards"]:
            (fake / "shards" / e["name"]).write_bytes(os.urandom(int(e["bytes"])))
        give(fake, trust.b)
        sha0 = m["shards"][0]["sha256"]
        got = as_user(trust.b, client_calls, str(trust.kit.sock), [
            ("status", {}, []),
            ("release", {"reader": "job"}, []),
            ("evict", {"dataset": loc(private)}, []),
            ("open", {"dataset": str(fake)}, [str(fake / "manifest.json")]),
            ("need", {"dataset": str(fake), "shard": 0, "sha256": sha0, "kind": "mdb"},
             [str(fake / "shards" / m["shards"][0]["name"])]),
            ("evict", {"dataset": str(fake)}, []),
            ("status", {}, []),
        ])
        st = got[0]
        assert st["clients"] and all(c["uid"] == trust.b.uid for c in st["clients"]), st["clients"]
        assert st["datasets"] == [] and st["errors"] == []
        assert got[1]["ok"] is True  # B's own (empty) reader name: nothing of C's
        assert got[2][:2] == ("error", "NotAllowed"), got[2]
        assert got[4][:2] == ("error", "NotAllowed") and "does not hold the content" in got[4][2], got[4]
        assert (got[5]["evicted"], got[5]["kept"]) == (0, n), got[5]
        assert [x["dataset"] for x in got[6]["datasets"]] == [str(fake)]
        assert set(staged(trust.kit)) == {e["sha256"] for e in m["shards"]}, "C's copies are all still there"
        after = d.status()
        assert after["readers"] == 1 and [c["readers"] for c in after["clients"] if c["uid"] == trust.c.uid] == [1]
    finally:
        done.touch()
        th.join(60)
    assert result == [48]
    assert d.terminate() == 0


@needs_users
def test_shared_tier_was_readable_and_plantable_by_other_users(trust: Trust) -> None:
    """Regression: a tier shared by users accepted any file named <sha256>.mdb (poisoning) and
    was unusable for the second user. Tiers are the daemon's, 0700: clients can neither list,
    read nor plant; a file of another uid that shows up under a copy's name anyway is never
    served, and a verified copy replaces it."""
    ds = trust.dataset(trust.b, "mine", n=48)
    d = trust.kit.daemon()
    assert as_user(trust.b, read_report, loc(ds), env=trust.env(trust.b))["nbad"] == 0
    ram = trust.kit.tiers["ram"]
    some = sorted(staged(trust.kit))[0]
    probes = as_user(trust.c, try_tier, [str(ram), str(ram / "shards"), str(ram / "shards" / f"{some}.mdb")])
    assert set(probes.values()) == {"PermissionError"}, probes

    # plant a same-named file of uid C (as if it got there before the tier was private)
    other = trust.dataset(trust.c, "other", n=24, start=5000)
    e0 = manifest(other)["shards"][0]
    planted = ram / "shards" / f"{e0['sha256']}.mdb"
    planted.write_bytes(os.urandom(int(e0["bytes"])))
    os.chown(planted, trust.c.uid, trust.c.gid)
    assert d.tier("ram")["shards"] == len(manifest(ds)["shards"]), "a foreign file is not counted as a copy"
    rep = as_user(trust.c, read_report_other, loc(other), env=trust.env(trust.c))
    assert rep["ok"] and rep["via_daemon"], rep
    assert planted.stat().st_uid == 0, "the planted file was replaced by a verified copy"
    tier_files(ram)  # every real name matches its content
    assert d.terminate() == 0


def read_report_other(location: str) -> dict[str, Any]:
    store = kvdata.open(location)
    try:
        vals = store.get_many(list(range(len(store))))
        ok = all(same(v, 5000 + i) for i, v in enumerate(vals))
        return {"ok": ok, "via_daemon": type(store.engine).__name__ == "DaemonStager"
                and getattr(store.engine, "_fallback", None) is None}
    finally:
        store.close()


@needs_users
def test_tier_directory_of_another_uid_is_refused_at_start_with_one_line(trust: Trust) -> None:
    ram = trust.kit.tiers["ram"]
    ram.mkdir(parents=True)
    os.chmod(ram.parent, 0o700)
    os.chown(ram, trust.b.uid, trust.b.gid)
    d = trust.kit.daemon(wait=False)
    assert d.proc.wait(20) == 1
    lines = [x for x in d.log_text().splitlines() if "ERROR" in x]
    assert len(lines) == 1 and "owned by uid" in lines[0] and str(ram) in lines[0], d.log_text()
    assert "Traceback" not in d.log_text()


@needs_users
def test_world_writable_tier_with_a_planted_entry_is_refused_else_made_private(trust: Trust) -> None:
    shards = trust.kit.tiers["ram"] / "shards"
    shards.mkdir(parents=True)
    os.chmod(shards, 0o1777)
    plant = shards / ("ab" * 32 + ".mdb")
    plant.write_bytes(b"x")
    os.chown(plant, trust.b.uid, trust.b.gid)
    d = trust.kit.daemon(wait=False)
    assert d.proc.wait(20) == 1
    assert "was writable by others" in d.log_text() and "Traceback" not in d.log_text()
    plant.unlink()
    d = trust.kit.daemon()
    assert shards.stat().st_mode & 0o777 == 0o700
    assert d.terminate() == 0


# ------------------------------------------------------------------ frames


def test_16_mib_frame_was_decoded_to_more_than_1_gb(kit: Kit) -> None:
    """Regression: a 16 MiB frame decoded to over 1 GB. A frame over MAX_FRAME is refused from
    its header: the daemon answers before the body is even sent, and hangs up."""
    d = kit.daemon()
    hwm = vm(d.pid, "VmHWM")
    with Raw(kit.sock) as r:
        r.sock.sendall(HEADER.pack(16 << 20))  # the header alone
        reply = r.recv()
        assert_error_reply(reply, "16 MiB frame")
        assert reply["code"] == "frame" and str(MAX_FRAME) in reply["error"], reply
        assert r.recv() is None
    assert MAX_FRAME <= 1 << 20
    assert vm(d.pid, "VmHWM") - hwm < 16 << 10, "the daemon allocated for a frame it refused"
    assert d.status()["bad_requests"] >= 1
    assert d.terminate() == 0


def test_frame_whose_msgpack_expands_hugely_is_refused(kit: Kit) -> None:
    d = kit.daemon()
    n = MAX_FRAME - 64
    head = b"\x83" + msgpack.packb("t") + msgpack.packb("status") + msgpack.packb("id") + msgpack.packb(1)
    bombs = {
        "empty-arrays": head + msgpack.packb("x") + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n,
        "empty-maps": head + msgpack.packb("x") + b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n,
        "array-claiming-4g": head + msgpack.packb("x") + b"\xdd\xff\xff\xff\xff",
        "nested": head + msgpack.packb("x") + b"\x91" * (n // 2) + b"\xc0",
    }
    hwm = vm(d.pid, "VmHWM")
    with Raw(kit.sock) as r:
        for name, body in bombs.items():
            assert len(body) <= MAX_FRAME, name
            r.send_frame(body)
            assert_error_reply(r.recv(), name)
        assert r.ask({"t": "status", "id": 7})["ok"] is True, "the connection survives refused frames"
    grew = (vm(d.pid, "VmHWM") - hwm) / 1024
    assert grew < 64, f"decoding refused frames took {grew:.0f} MB"
    assert d.terminate() == 0


# ------------------------------------------------------------------ connections


@needs_users
def test_a_thousand_idle_connections_exhausted_the_daemon(trust: Trust) -> None:
    """Regression: a thousand idle connections exhausted the daemon's descriptors. One uid gets
    at most max_connections_per_uid (the rest one error frame each); root and another uid are
    still served within a second."""
    per_uid = 64
    daemon_config(trust.kit, f"max_connections_per_uid = {per_uid}\n")
    d = trust.kit.daemon()
    fds_before = len(os.listdir(f"/proc/{d.pid}/fd"))
    holding, done = trust.home(trust.b) / "holding", trust.kit.root / "done"

    def flood(path: str) -> dict[str, int]:
        socks = []
        try:
            for _ in range(1000):  # bounded: 1,000 connections on the loopback unix socket
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                socks.append(s)
            time.sleep(1.0)  # the daemon accepts (and refuses) them meanwhile
            refused = busy = 0
            for s in socks:
                s.setblocking(False)
                try:
                    data = s.recv(4096)
                except BlockingIOError:
                    continue  # accepted, idle
                refused += 1
                if data:
                    body = msgpack.unpackb(data[HEADER.size:], raw=False)
                    busy += body.get("code") == "busy" and "max_connections_per_uid" in body.get("error", "")
            Path(holding).touch()
            deadline = time.monotonic() + 60
            while not os.path.exists(done) and time.monotonic() < deadline:
                time.sleep(0.02)
            return {"refused": refused, "busy": busy, "accepted": len(socks) - refused}
        finally:
            for s in socks:
                s.close()

    def timed_status(path: str) -> float:
        t0 = time.monotonic()
        with Client(path, timeout=5) as c:
            c.request("status")
        return time.monotonic() - t0

    result: list[Any] = []
    th = in_background(result, lambda: as_user(trust.b, flood, str(trust.kit.sock)))
    try:
        wait_for(lambda: holding.exists() or result, 60, "uid B holding its connections")
        assert not result, result
        assert timed_status(str(trust.kit.sock)) < 1.0
        assert as_user(trust.c, timed_status, str(trust.kit.sock)) < 1.0
        st = d.status()
        assert sum(c["uid"] == trust.b.uid for c in st["clients"]) == per_uid
        assert len(os.listdir(f"/proc/{d.pid}/fd")) < fds_before + per_uid + 16
    finally:
        done.touch()
        th.join(60)
    r = result[0]
    assert r["accepted"] == per_uid and r["refused"] == 1000 - per_uid and r["busy"] == r["refused"], r
    wait_for(lambda: d.status()["connected_clients"] == 1, 10, "B's connections closed")
    assert "Traceback" not in d.log_text()
    assert d.terminate() == 0


@needs_users
def test_one_uid_cannot_grow_the_daemon_with_opened_datasets(trust: Trust) -> None:
    ds = trust.dataset(trust.b, "mine", n=24)
    d = trust.kit.daemon()
    m = str(ds / "manifest.json")
    calls = [("open", {"dataset": f"{loc(ds)}-alias-{i}"}, [m]) for i in range(40)] + [("status", {}, [])]
    got = as_user(trust.b, client_calls, str(trust.kit.sock), calls)
    assert all(isinstance(g, dict) and g["ok"] for g in got), got[:3]
    names = [x["dataset"] for x in got[-1]["datasets"]]
    assert len(names) == 32 and names[-1].endswith("-alias-39"), names
    assert d.terminate() == 0


@needs_users
def test_reload_by_an_unprivileged_uid_is_refused(trust: Trust) -> None:
    d = trust.kit.daemon()
    got = as_user(trust.b, client_calls, str(trust.kit.sock), [("reload", {}, []), ("hello", {"version": 2}, [])])
    assert got[0][:2] == ("error", "NotAllowed"), got[0]
    assert got[1]["uid"] == trust.b.uid and got[1]["paths"] is False
    assert d.request("hello", version=2)["paths"] is True  # root: may name paths
    assert d.terminate() == 0


# ------------------------------------------------------------------ slow and hostile homes


class _Slow(BaseHTTPRequestHandler):
    delay = 4.0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        time.sleep(self.delay)
        self.send_error(404)

    do_HEAD = do_GET

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def slow_home() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Slow)
    server.daemon_threads = True
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        th.join(10)


def test_want_naming_a_slow_home_blocked_the_event_loop(kit: Kit, slow_home: str) -> None:
    """Regression: a want/announce naming a slow home blocked the event loop. Now they run in
    the pool, bounded by request_timeout; another client's status answers within a second."""
    kit.config.write_text(kit.config_text(extra=f'[daemon]\nallow_homes = ["{slow_home}"]\nrequest_timeout = 2\n'))
    d = kit.daemon()
    answers: list[Any] = []

    def slow(t: str, fields: dict[str, Any]) -> None:
        t0 = time.monotonic()
        try:
            with Client(kit.sock, timeout=30) as c:
                c.request(t, dataset=f"{slow_home}/ds", **fields)
            answers.append(("ok", t))
        except DaemonError as e:
            answers.append((str(e), time.monotonic() - t0))

    threads = [threading.Thread(target=slow, args=a, daemon=True) for a in
               [("announce", {"reader": "r", "shards": [0]}), ("want", {"shards": [[0, "a" * 64]]}),
                ("open", {}), ("need", {"shard": 0})]]
    for th in threads:
        th.start()
    time.sleep(0.3)
    worst = 0.0
    with Client(kit.sock, timeout=5) as c:
        for _ in range(10):
            t0 = time.monotonic()
            c.request("status")
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.1)
    assert worst < 1.0, f"status took {worst:.2f} s while a slow home was being read"
    t0 = time.monotonic()
    with pytest.raises(DaemonError, match="allow_homes") as e:
        d.request("open", dataset="http://127.0.0.1:1/other")
    assert e.value.code == "NotAllowed" and time.monotonic() - t0 < 1.0
    for th in threads:
        th.join(30)
    assert len(answers) == 4, answers
    for text, took in answers:
        assert "took more than 2 s" in text and took < 4.0, answers  # answered at the timeout, not the home's pace
    assert d.alive() and "Traceback" not in d.log_text()
    assert d.terminate() == 0


class _Endless(BaseHTTPRequestHandler):
    """A hostile home: every object is endless (no Content-Length, Range ignored)."""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.end_headers()
        chunk = b"{" * (1 << 20)
        try:
            for _ in range(1024):  # bounded: at most 1 GiB if nobody stops reading
                self.wfile.write(chunk)
        except OSError:
            pass

    def log_message(self, *args: Any) -> None:
        pass


def test_remote_manifest_was_read_whole_into_memory(tmp_path: Path) -> None:
    """Regression: a remote manifest was read whole into memory. It is read with a cap and
    the error names the URL and the limit."""
    with _serving(_Endless) as base:
        url = f"{base}/ds"
        home = HTTPHome(url)
        try:
            with pytest.raises(RemoteError) as e:
                mirror(home, tmp_path)
            assert f"{url}/manifest.json" in str(e.value) and str(MAX_MANIFEST_BYTES) in str(e.value), e.value
            assert len(home.read_range("index/x", 10, 100)) == 100  # a ranged read takes only what it asked for
        finally:
            home.close()


@contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 with this handler, for the block: its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    server.daemon_threads = True
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        th.join(10)


def test_remote_index_files_are_streamed_to_their_declared_size_and_checked(tmp_path: Path) -> None:
    """The index files a remote manifest names are fetched as exactly the bytes it declares, in
    parts, never held whole: a home that answers every index request with an endless body
    (Range ignored) gets a one-line CorruptDatasetError naming the file, nothing larger than the
    declared size is written, and no temp file is left."""
    from kvdata.errors import CorruptDatasetError
    from kvdata.sync.push import push

    src = build_dataset(tmp_path / "src", n=24)
    www = tmp_path / "www"
    push(src, str(www / "ds"), show=False)
    declared = {p.name: p.stat().st_size for p in (www / "ds" / "index").iterdir()}

    class Hostile(_Static):
        root = www

        def do_GET(self) -> None:  # noqa: N802
            if "/index/" in self.path:
                _Endless.do_GET(self)  # type: ignore[arg-type]
            else:
                super().do_GET()

    with _serving(Hostile) as base:
        home = HTTPHome(f"{base}/ds")
        try:
            with pytest.raises(CorruptDatasetError) as e:
                mirror(home, tmp_path / "mirrors")
            assert "/index/" in str(e.value) and "\n" not in str(e.value), e.value
            written = {p.name: p.stat().st_size for p in (tmp_path / "mirrors").rglob("*") if p.is_file()}
            assert not [n for n in written if ".tmp" in n], written
            assert all(size <= max(declared.values()) for size in written.values()), (written, declared)
        finally:
            home.close()


def test_remote_home_not_in_allow_homes_is_refused_and_the_reader_stages_in_process(kit: Kit, tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdata.sync.push import push

    src = build_dataset(kit.root / "src", n=24)
    www = tmp_path / "www"
    push(src, str(www / "ds"), show=False)

    class Files(_Static):
        root = www

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Files)
    server.daemon_threads = True
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/ds"
    try:
        d = kit.daemon()  # default: allow_homes empty
        with pytest.raises(DaemonError, match="allow_homes"):
            d.request("open", dataset=url)
        for k, v in kit.env().items():
            monkeypatch.setenv(k, v)
        own = tmp_path / "own.toml"  # the reader's own tiers, not the daemon's
        own.write_text(f'[[tiers]]\nname = "own"\npath = "{tmp_path / "own"}"\nbudget = "512MB"\n')
        monkeypatch.setenv("KVDATA_CONFIG", str(own))
        with kvdata.open(url) as s:
            assert type(s.engine).__name__ != "DaemonStager"  # refused: staged in-process
            assert all(same(v, i) for i, v in enumerate(s.get_many(list(range(24)))))
        assert d.status()["bytes_from_home"] == 0
        assert d.terminate() == 0

        # allowed: the daemon stages it; a reader gets the mirror (here readable) and copies as descriptors
        kit.config.write_text(kit.config_text(extra=f'[daemon]\nallow_homes = ["{url.rsplit("/", 1)[0]}/"]\n'))
        d = kit.daemon()
        with kvdata.open(url) as s:
            assert type(s.engine).__name__ == "DaemonStager"
            assert all(same(v, i) for i, v in enumerate(s.get_many(list(range(24)))))
        assert d.status()["bytes_from_home"] > 0
        assert d.terminate() == 0
    finally:
        server.shutdown()
        server.server_close()
        th.join(10)


class _Static(BaseHTTPRequestHandler):
    """Files under `root`, whole (Range ignored: a 200 like a plain static server)."""

    root: Path = Path("/nonexistent")

    def do_GET(self) -> None:  # noqa: N802
        p = self.root / self.path.lstrip("/")
        if not p.is_file():
            self.send_error(404)
            return
        data = p.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    do_HEAD = do_GET

    def log_message(self, *args: Any) -> None:
        pass


@needs_users
def test_remote_dataset_mirror_reaches_a_reader_that_cannot_read_the_tier(trust: Trust, tmp_path: Path) -> None:
    from kvdata.sync.push import push

    src = build_dataset(trust.kit.root / "src", n=24)
    www = tmp_path / "www"
    push(src, str(www / "ds"), show=False)

    class Files(_Static):
        root = www

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Files)
    server.daemon_threads = True
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/ds"
    try:
        daemon_config(trust.kit, f'allow_homes = ["{url}"]\n')
        d = trust.kit.daemon()
        rep = as_user(trust.b, read_report, url, env=trust.env(trust.b))
        assert rep == {"count": 24, "nbad": 0, "via_daemon": True, "daemon_at_end": True, "fell_back": False}, rep
        own = trust.home(trust.b) / "cache" / "kvdata" / "daemon-mirrors"
        assert any(own.rglob("manifest.json")), "B keeps its own copy of the index the daemon passed"
        assert d.terminate() == 0
    finally:
        server.shutdown()
        server.server_close()
        th.join(10)


# ------------------------------------------------------------------ the allow-list


@pytest.mark.parametrize("url,allowed", [
    ("s3://bucket/prefix", True),
    ("s3://bucket/prefix/ds", True),
    ("S3://BUCKET/prefix//ds/", True),
    ("s3://bucket/prefix2/ds", False),
    ("s3://bucket/prefix/../other", False),
    ("s3://bucket/pre%66ix/ds", False),
    ("s3://other/prefix/ds", False),
    ("https://host.example/path/ds", True),
    ("https://host.example:443/path/ds", True),
    ("https://host.example:8443/path/ds", False),
    ("http://host.example/path/ds", False),
    ("https://user@host.example/path/ds", False),
    ("https://host.example/path/ds?x=1", False),
    ("https://host.example/path/./ds", False),
    ("file:///path/ds", False),
])
def test_allow_homes_prefix_match_on_normalized_urls(url: str, allowed: bool) -> None:
    cfg = DaemonConfig(allow_homes=(normalize_home_url("s3://bucket/prefix/"),
                                    normalize_home_url("https://HOST.example/path")))
    assert cfg.home_allowed(url) is allowed


def test_allow_homes_entries_are_validated() -> None:
    from kvdata.config import parse_config

    base = {"tiers": [{"name": "t", "path": "/tmp/x", "budget": "1MB"}]}
    assert parse_config({**base, "daemon": {}}).daemon.allow_homes == ()
    assert parse_config({**base, "daemon": {"allow_homes": ["s3://b/p/"]}}).daemon.allow_homes == ("s3://b/p",)
    for bad in (["s3://b/../p"], ["ftp://x"], "s3://b", [5], ["https://u:p@h/x"]):
        with pytest.raises(ConfigError, match="allow_homes"):
            parse_config({**base, "daemon": {"allow_homes": bad}})


def test_clients_are_identified_by_so_peercred(kit: Kit) -> None:
    d = kit.daemon()
    with Raw(kit.sock) as r:
        r.send({"t": "hello", "id": 1, "version": 2, "pid": 424242})  # a lying pid
        assert r.recv()["uid"] == os.geteuid()
        st = r.ask({"t": "status", "id": 2})
    mine = [c for c in st["clients"] if c["pid"] == os.getpid()]
    assert len(mine) == 1 and mine[0]["uid"] == os.geteuid(), st["clients"]
    assert not any(c["pid"] == 424242 for c in st["clients"])
    assert d.terminate() == 0
