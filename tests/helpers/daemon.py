"""kvdatad as a real subprocess, readers as real subprocesses (fixture `kit` in
tests/integration/conftest.py).

Every process a test starts goes through `Kit.popen` (its own session, so a kill reaches
its children) and is SIGKILLed in the fixture's teardown if it is still alive; the
work directory is a short path under /tmp (Unix socket paths are limited to 108 bytes)
that is removed afterwards, tmpfs mounts first.

The reader subprocess is `reader_main` below, started with `python -c` so it imports
the installed kvdata exactly like a training job would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import kvdata
from kvdata.protocol import HEADER, Client

from .common import free_port, wait_for  # noqa: F401  (re-exported for the daemon tests)

TESTS = Path(__file__).resolve().parents[1]  # on sys.path, so `helpers` imports as a package
BIN = Path(sys.executable).parent
KVDATAD = str(BIN / "kvdatad")
KVDATA = str(BIN / "kvdata")
SHARD_FILE = re.compile(r"^[0-9a-f]{64}\.mdb$")
TEMP_FILE = re.compile(r"^\..+\.tmp$")
_STRIP_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "KVDATA_SOCKET", "KVDATA_CONFIG", "LISTEN_FDS")

READER_BOOT = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
               "from helpers.daemon import reader_main; sys.exit(reader_main(sys.argv[1:]))")


# ------------------------------------------------------------------ datasets


def sample(i: int, noise: int = 4096) -> dict[str, Any]:
    """A deterministic record: an image-like array, incompressible noise, a label and a name."""
    rng = np.random.default_rng(i)
    return {"image": np.full((16, 16, 3), i % 251, dtype=np.uint8),
            "noise": rng.integers(0, 256, size=noise, dtype=np.uint8),
            "label": i % 7, "name": f"n{i}"}


def same(v: Any, i: int, noise: int = 4096) -> bool:
    want = sample(i, noise)
    return (np.array_equal(v["image"], want["image"]) and np.array_equal(v["noise"], want["noise"])
            and int(v["label"]) == want["label"] and str(v["name"]) == want["name"])


def build_dataset(path: Path, n: int = 96, start: int = 0, mode: str = "w", shard_size: str = "64KB",
                  noise: int = 4096, compress: bool = True) -> Path:
    """Samples start..start+n-1 written (mode "w") or appended ("a"), then sealed."""
    kw: dict[str, Any] = {"shard_size": shard_size} if mode == "w" else {}
    with kvdata.open(path, mode, compress=compress, **kw) as s:
        s.put_many((f"k{i:06d}", sample(i, noise), i % 7) for i in range(start, start + n))
        s.seal()
    return path


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tier_files(tier_root: Path) -> tuple[dict[str, int], list[str]]:
    """({sha: size} of the real-named copies, [temp file names]) of one tier, asserting that
    every real name is `<sha256>.mdb` of its content and every other file is a `.<...>.tmp`."""
    real: dict[str, int] = {}
    temps: list[str] = []
    d = tier_root / "shards"
    if not d.is_dir():
        return real, temps
    for name in sorted(os.listdir(d)):
        p = d / name
        if SHARD_FILE.match(name):
            got = sha256_file(p)
            assert got == name[:-4], f"{p} holds content with sha256 {got}: a staged copy under a wrong name"
            real[name[:-4]] = p.stat().st_size
        else:
            assert TEMP_FILE.match(name), f"{p}: a file that is neither <sha256>.mdb nor a .<...>.tmp temp file"
            temps.append(name)
    return real, temps


def snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple[int, int, bool]]:
    """{relative path: (size, mtime_ns, is_dir)} of everything under root except `skip` subtrees."""
    out: dict[str, tuple[int, int, bool]] = {}
    skipped = {str(p) for p in skip}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skipped]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if p in skipped:
                continue
            st = os.lstat(p)
            isdir = os.path.isdir(p) and not os.path.islink(p)
            out[os.path.relpath(p, root)] = (0 if isdir else st.st_size, 0 if isdir else st.st_mtime_ns, isdir)
    return out


# ------------------------------------------------------------------ raw protocol


class Raw:
    """A bare socket to the daemon, for frames the Client would never send."""

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))

    def send_frame(self, body: bytes) -> None:
        self.sock.sendall(HEADER.pack(len(body)) + body)

    def send(self, msg: Any) -> None:
        import msgpack

        self.send_frame(msgpack.packb(msg, use_bin_type=True))

    def recv(self) -> dict[str, Any] | None:
        """The next reply, or None when the daemon closed the connection."""
        import msgpack

        head = self._exact(HEADER.size)
        if head is None:
            return None
        (n,) = HEADER.unpack(head)
        assert n <= 16 << 20, f"reply frame of {n} bytes"
        body = self._exact(n)
        assert body is not None, "the daemon closed the connection in the middle of a reply"
        reply = msgpack.unpackb(body, raw=False)
        assert isinstance(reply, dict), f"reply is not a map: {reply!r}"
        return reply

    def ask(self, msg: Any) -> dict[str, Any] | None:
        self.send(msg)
        return self.recv()

    def _exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def assert_error_reply(reply: Any, what: str = "") -> dict[str, Any]:
    """ok False with a one-line, non-empty error and a code that is not an internal error."""
    assert isinstance(reply, dict), f"{what}: no reply ({reply!r})"
    assert reply.get("ok") is False, f"{what}: accepted: {reply!r}"
    err = reply.get("error")
    assert isinstance(err, str) and err and "\n" not in err, f"{what}: error is not one line: {reply!r}"
    assert reply.get("code") != "internal", f"{what}: the daemon failed internally: {reply!r}"
    return reply


# ------------------------------------------------------------------ processes


class Daemon:
    """One kvdatad subprocess."""

    def __init__(self, kit: Kit, proc: subprocess.Popen[bytes], sock: Path, log: Path) -> None:
        self.kit, self.proc, self.sock, self.log = kit, proc, sock, log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 20.0) -> Daemon:
        """Until the socket accepts a connection; fail with the daemon's log if it exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"kvdatad exited with {self.proc.returncode} before listening:\n{self.log_text()[-3000:]}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(str(self.sock))
                return self
            except OSError:
                time.sleep(0.02)
        raise AssertionError(f"kvdatad did not listen on {self.sock} within {timeout:.0f} s:\n{self.log_text()[-3000:]}")

    def client(self, timeout: float = 30.0) -> Client:
        return Client(self.sock, timeout=timeout)

    def request(self, t: str, **fields: Any) -> dict[str, Any]:
        with self.client() as c:
            return c.request(t, **fields)

    def status(self) -> dict[str, Any]:
        return self.request("status")

    def tier(self, name: str, st: dict[str, Any] | None = None) -> dict[str, Any]:
        st = self.status() if st is None else st
        return next(t for t in st["tiers"] if t["name"] == name)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(10)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM and the exit status (fails the test if it does not exit in time)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"kvdatad did not exit within {timeout:.0f} s of SIGTERM:\n{self.log_text()[-3000:]}") from None


class Kit:
    """A work directory with two tiers (ram, ssd), a config, a socket path and the processes started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tiers = {"ram": root / "tiers" / "ram", "ssd": root / "tiers" / "ssd"}
        self.config = root / "kvdata.toml"
        self.sock = root / "d.sock"
        self.cwd = root / "cwd"          # the daemon's working directory: must stay empty
        self.cwd.mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.mounts: list[Path] = []
        self._logs = 0
        self.write_config()

    # ---------------------------------------------------------- config

    def config_text(self, ram: str | int = "512MB", ssd: str | int = "2GB", extra: str = "") -> str:
        lines = []
        for name, budget in (("ram", ram), ("ssd", ssd)):
            b = f'"{budget}"' if isinstance(budget, str) else str(budget)
            lines += ["[[tiers]]", f'name = "{name}"', f'path = "{self.tiers[name]}"', f"budget = {b}", ""]
        return "\n".join(lines) + extra

    def write_config(self, ram: str | int = "512MB", ssd: str | int = "2GB", path: Path | None = None) -> Path:
        p = self.config if path is None else path
        p.write_text(self.config_text(ram, ssd))
        return p

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV}
        env.update(KVDATA_CONFIG=str(self.config), KVDATA_SOCKET=str(self.sock), PYTHONDONTWRITEBYTECODE="1")
        env.update(extra)
        return env

    # ---------------------------------------------------------- processes

    def popen(self, argv: list[str], env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen[bytes]:
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(argv, env=self.env() if env is None else env, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def daemon(self, *, config: Path | None = None, sock: Path | None = None, metrics_port: int | None = None,
               env: dict[str, str] | None = None, wait: bool = True) -> Daemon:
        self._logs += 1
        log = self.root / f"kvdatad-{self._logs}.log"
        argv = [KVDATAD, "--config", str(config or self.config), "--socket", str(sock or self.sock)]
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port)]
        base = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV}
        base["PYTHONDONTWRITEBYTECODE"] = "1"
        base.update(env or {})
        with open(log, "ab") as f:
            proc = self.popen(argv, env=base, stdout=f, stderr=subprocess.STDOUT, cwd=self.cwd)
        d = Daemon(self, proc, sock or self.sock, log)
        return d.wait_ready() if wait else d

    def reader(self, location: Path | str, count: int, *opts: str, noise: int = 4096) -> subprocess.Popen[bytes]:
        """A reader subprocess (see reader_main) with the daemon's socket and config in its environment."""
        argv = [sys.executable, "-c", READER_BOOT, str(location), "--count", str(count), "--noise", str(noise), *opts]
        return self.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.cwd)

    def kvdata(self, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([KVDATA, *args], env=self.env() if env is None else env, capture_output=True, text=True,
                           cwd=self.cwd, timeout=timeout, stdin=subprocess.DEVNULL)
        assert "Traceback" not in r.stderr, r.stderr
        return r

    def mount_tmpfs(self, path: Path, size: str) -> bool:
        """Mount a small tmpfs (root only); False if this machine does not allow it."""
        if os.geteuid() != 0 or shutil.which("mount") is None:
            return False
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if r.returncode != 0:
            return False
        self.mounts.append(path)
        return True

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:  # stdin: a pipe to a process that is gone (EPIPE on flush)
                        pass
        for m in reversed(self.mounts):
            if subprocess.run(["umount", str(m)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(m)], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def finish(p: subprocess.Popen[bytes], timeout: float = 60) -> dict[str, Any]:
    """Wait for a reader subprocess; its JSON report (fails with its stderr if it failed)."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"reader did not finish within {timeout:.0f} s: {err.decode(errors='replace')[-3000:]}") from None
    text = out.decode(errors="replace")
    assert p.returncode == 0, f"reader exited {p.returncode}:\n{err.decode(errors='replace')[-3000:]}\n{text[-1000:]}"
    return json.loads(text.strip().splitlines()[-1])


# ------------------------------------------------------------------ the reader subprocess


def _wait_file(path: str | None, timeout: float = 60.0) -> None:
    if path is None:
        return
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"reader: {path} did not appear")
        time.sleep(0.01)


def reader_main(argv: list[str]) -> int:
    """Open a dataset the way a job does (kvdata.open: through kvdatad when it answers) and
    read every sample in order, checking each against `sample(i)`. Prints a JSON report."""
    ap = argparse.ArgumentParser()
    ap.add_argument("location")
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--noise", type=int, default=4096)
    ap.add_argument("--ready", help="touch this file once the dataset is open")
    ap.add_argument("--go", help="wait for this file before reading")
    ap.add_argument("--pause-at", type=int, help="after this many samples, print 'paused' and wait for --resume")
    ap.add_argument("--resume")
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args(argv)
    store = kvdata.open(a.location)
    eng = store.engine
    via_daemon = type(eng).__name__ == "DaemonStager" and getattr(eng, "client", None) is not None
    if a.ready:
        Path(a.ready).touch()
    _wait_file(a.go)
    n = len(store)
    bad: list[int] = []
    paused = False
    for start in range(0, n, a.batch):
        if a.pause_at is not None and not paused and start >= a.pause_at:
            print("paused", flush=True)
            _wait_file(a.resume)
            paused = True
        idx = list(range(start, min(n, start + a.batch)))
        for i, v in zip(idx, store.get_many(idx)):
            if not same(v, i, a.noise):
                bad.append(i)
    report = {"pid": os.getpid(), "count": n, "expected": a.count, "bad": bad[:20], "nbad": len(bad),
              "via_daemon": via_daemon,
              "daemon_at_end": getattr(eng, "client", None) is not None,
              "fell_back": getattr(eng, "_fallback", None) is not None,
              "generation": store.generation}
    store.close()
    print(json.dumps(report), flush=True)
    return 0
