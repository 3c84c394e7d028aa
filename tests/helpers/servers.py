"""Real servers for the tier tests: moto's S3 server and Debian's nginx, on 127.0.0.1
(fixtures `s3_server` and `nginx_home` in tests/integration/conftest.py).

Each is a subprocess started on a free loopback port with its own state under a temp
directory, waited for, and stopped after (terminate, then kill; no orphan). Nothing
here talks to a real network or reads the user's AWS settings.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.config import Config, parse_config
from kvdata.sync.push import push

from .common import free_port

BUCKET = "kvdata-test"
NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/bin/nginx")


# ------------------------------------------------------------------ processes


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 20.0) -> None:
    """Until 127.0.0.1:port accepts a connection; fail with the server's log if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}:\n"
                               f"{_tail(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    stop(proc)
    raise RuntimeError(f"{proc.args[0]} did not listen on 127.0.0.1:{port} within {timeout:.0f}s:\n{_tail(log)}")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Stop a server we started (its whole process group: nginx has workers) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-3000:]
    except OSError:
        return "(no log)"


def _start(argv: list[str], log: Path, port: int, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # own process group: stop() reaches every worker
    wait_port(port, proc, log)
    return proc


# ------------------------------------------------------------------ S3 (moto server mode)


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    env: dict[str, str]          # what a process needs to reach it (boto3 reads these)
    log: Path | None = None      # the server's log: one line per request ("GET /bucket/key HTTP/1.1" 206)

    def requests_since(self, offset: int) -> list[str]:
        """The request lines the server logged after `offset` bytes of its log (len of an earlier read)."""
        assert self.log is not None
        return [line for line in self.log.read_text(errors="replace")[offset:].splitlines() if '"' in line]

    def log_size(self) -> int:
        assert self.log is not None
        return len(self.log.read_text(errors="replace"))

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def client(self) -> Any:
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                              aws_access_key_id="testing", aws_secret_access_key="testing")

    def put_bytes(self, prefix: str, name: str, data: bytes) -> None:
        self.client().put_object(Bucket=self.bucket, Key=f"{prefix}/{name}", Body=data)

    def get_bytes(self, prefix: str, name: str) -> bytes:
        return self.client().get_object(Bucket=self.bucket, Key=f"{prefix}/{name}")["Body"].read()


def s3_env(endpoint: str, state: Path) -> dict[str, str]:
    """AWS settings that point boto3 at the local server and away from the user's files."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(state / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(state / "aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@contextmanager
def running_s3_server(state: Path) -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 with one bucket, its state in `state`; the AWS
    environment of this process points at it while the context is open. Skips the test where
    moto or boto3 is not installed (the core-only run of .ci/lowest-versions: S3 is kvdata[s3])."""
    pytest.importorskip("moto", reason="the S3 tests need moto and boto3 (pip install 'kvdata[test]')")
    pytest.importorskip("boto3", reason="the S3 tests need boto3 (pip install 'kvdata[s3]')")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = state / "moto.log"
    proc = _start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], log, port)
    env = s3_env(endpoint, state)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            mp.delenv("AWS_PROFILE", raising=False)
            mp.delenv("AWS_SESSION_TOKEN", raising=False)
            server = S3Server(endpoint, BUCKET, env, log)
            server.client().create_bucket(Bucket=BUCKET)
            yield server
    finally:
        stop(proc)


# ------------------------------------------------------------------ HTTP (nginx)


@dataclass
class NginxHome:
    base: str         # http://127.0.0.1:PORT
    www: Path         # its document root
    log: Path | None = None  # its access log: one "<bytes sent> <uri>" line per request

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def bytes_sent(self) -> int:
        """Every byte nginx has sent so far (responses with their headers), from its access log."""
        if self.log is None or not self.log.exists():
            return 0
        return sum(int(line.split(None, 1)[0]) for line in self.log.read_text().splitlines() if line)


def find_nginx() -> str | None:
    for c in NGINX_CANDIDATES:
        if os.access(c, os.X_OK):
            return c
    return shutil.which("nginx")


def nginx_conf(root: Path, www: Path, port: int) -> str:
    """A self-contained config: every path nginx writes is under `root`, one loopback port."""
    user = "user root;\n" if os.geteuid() == 0 else ""  # as root, workers would switch to nobody
    tmp = root / "tmp"
    return f"""{user}daemon off;
master_process on;
worker_processes 2;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 256; }}
http {{
  log_format sent "$bytes_sent $request_uri";
  access_log {root}/access.log sent;
  sendfile on; tcp_nodelay on;
  keepalive_timeout 60s;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  types {{ application/json json; }}
  default_type application/octet-stream;
  server {{
    listen 127.0.0.1:{port};
    root {www};
  }}
}}
"""


@contextmanager
def running_nginx(root: Path) -> Iterator[NginxHome]:
    """nginx serving `root`/www on a free loopback port (skips the test without nginx, except on CI)."""
    exe = find_nginx()
    if exe is None:
        msg = "nginx is not installed (Debian package `nginx`, installed by .ci/run)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    www = root / "www"
    www.mkdir()
    (root / "tmp").mkdir()
    port = free_port()
    conf = root / "nginx.conf"
    conf.write_text(nginx_conf(root, www, port))
    log = root / "stderr.log"
    # -e: the error log before the config is read (else nginx tries /var/log/nginx as any user)
    proc = _start([exe, "-e", str(root / "error.log"), "-c", str(conf), "-p", str(root)], log, port)
    try:
        yield NginxHome(f"http://127.0.0.1:{port}", www, root / "access.log")
    finally:
        stop(proc, signal.SIGQUIT if proc.poll() is None else signal.SIGTERM)


# ------------------------------------------------------------------ datasets and tiers


def sample(i: int) -> dict[str, Any]:
    """A record: a deterministic image-like array, incompressible noise, a label and a name."""
    rng = np.random.default_rng(i)
    return {"image": np.full((32, 32, 3), i % 251, dtype=np.uint8),
            "noise": rng.integers(0, 256, size=1024, dtype=np.uint8),
            "label": i % 7, "name": f"n{i}"}


def build_dataset(path: Path, n: int = 120, shard_size: str = "64KB", compress: bool = True) -> Path:
    """A sealed dataset of `n` samples in ~64 KB shards (120 samples: about 12 shards), with
    cold copies made at seal unless `compress` is False (then push makes them)."""
    with kvdata.open(path, "w", shard_size=shard_size, compress=compress) as s:
        s.put_many((f"k{i:05d}", sample(i), i % 7) for i in range(n))
        s.seal()
    return path


def records(store: kvdata.Store, indices: Any = None) -> list[tuple]:
    """Comparable copies of samples (all by default)."""
    idx = range(len(store)) if indices is None else indices
    out = []
    for v in store.get_many(list(idx)):
        out.append((v["image"].tobytes(), v["noise"].tobytes(), int(v["label"]), str(v["name"])))
    return out


def push_local(src: Path, dest: Path) -> Path:
    push(src, str(dest), show=False)
    return dest


def push_s3(src: Path, server: S3Server, prefix: str) -> str:
    url = server.url(prefix)
    push(src, url, show=False)
    return url


def publish_http(src: Path, nginx: NginxHome, name: str, staging: Path) -> str:
    """HTTP homes are read-only: push to a local directory, then copy it under nginx's root."""
    local = staging / f"{name}-pushed"
    if not local.exists():
        push_local(src, local)
    shutil.copytree(local, nginx.www / name)
    return nginx.url(name)


def tiers_config(root: Path, *budgets: tuple[str, str | int]) -> Config:
    """Tiers named and sized as given (fastest first), each a directory under root."""
    return parse_config({"tiers": [{"name": name, "path": str(root / name), "budget": budget}
                                   for name, budget in budgets]})


def metadata_bytes(dataset: Path) -> int:
    """About what a remote copy of this dataset's manifest and index takes in the last tier
    (kvdata.sync.mirror: counted against its budget), rounded up: add it to a budget meant
    to hold a given number of shards."""
    files = [dataset / "manifest.json", *(dataset / "index").iterdir()]
    return sum(f.stat().st_size for f in files) + 4096


def write_toml(path: Path, root: Path, *budgets: tuple[str, str | int]) -> Path:
    lines = []
    for name, budget in budgets:
        b = f'"{budget}"' if isinstance(budget, str) else str(budget)
        lines += ["[[tiers]]", f'name = "{name}"', f'path = "{root / name}"', f"budget = {b}", ""]
    path.write_text("\n".join(lines))
    return path


def wait_idle(engine: Any, timeout: float = 20.0) -> None:
    """Until no staging job is in flight (and none was started by the last one's replan)."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        if engine.status()["in_flight"] == 0:
            quiet += 1
            if quiet >= 3:
                return
        else:
            quiet = 0
        time.sleep(0.03)
    raise AssertionError(f"staging still in flight after {timeout}s: {engine.status()}")
