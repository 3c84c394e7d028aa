"""Nodes on one machine: network namespaces joined through a home namespace that runs the S3 home.

Shared by tests/integration/test_multinode.py (2 nodes, a few MB, in CI when the machine allows
namespaces) and bench/multinode.py (4 nodes, the measurement; it puts tests/ on sys.path, as
bench/crash_kill.py does for crash_check.py): the namespace plumbing, the servers, one kvdatad
per node, the rank script and the per-epoch checks live here once.

Topology (every address exists only inside the namespaces a Lab creates; nothing is added to
the root namespace, so two labs never collide)::

    netns <tag>-h, the home and the router between nodes (ip_forward=1)
      moto S3 server           127.0.0.1:5000   (its state in memory)
      nginx, one server a node 127.0.0.1:9100+i (keep-alive S3 front; an access log per node:
                               method, status, body bytes -- what the S3 home sent that node)
      delay proxy (rtt_ms > 0) 10.77.i.1:8081 -> 127.0.0.1:9100+i  (else nginx listens there itself)
      h<i> 10.77.i.1/24 ==veth== v0 10.77.i.2/24  in netns <tag>-n<i>, node i: its kvdatad, its ranks
      tbf rate R on both ends of every veth (downstream on h<i>, upstream on v0)

Node i reaches S3 at http://10.77.i.1:8081 and the other nodes through the home (routes via
10.77.i.1), so torch.distributed (gloo, GLOO_SOCKET_IFNAME=v0) joins ranks across namespaces with
MASTER_ADDR = node 0's address. The tag is `kvnl-<owner pid>-<4 hex digits>`: `cleanup_stale()`
removes what an owner that died left (its namespaces, the processes still in them, its work
directory /tmp/<tag>-*), and every Lab calls it before it starts. Latency comes from the
netlab's delay proxy (../shared/netlab/delayproxy.py; this kernel has no netem), optional.

Per epoch, rank 0 takes a `snapshot` at the barriers around the epoch (all ranks wait): the
access logs (S3 bytes and requests per node), the home-side veth counters (wire bytes, gloo's
included) and every kvdatad's status over its socket (bytes from the home, bytes staged).
Every rank writes the sample indices it read per epoch (checked against their content).

    python tests/nodelab.py cleanup        # remove what labs of dead owners left behind
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
PREFIX = "kvnl"
NS_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]{{4}}-(h|n\d+)$")
DIR_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]{{4}}-")
BUCKET = "kvnl"
S3_PORT = 8081            # where a node reaches the home (through the delay proxy when there is one)
MOTO_PORT = 5000
NGINX_BASE_PORT = 9100    # nginx's server for node i: 127.0.0.1:9100+i inside the home namespace
MASTER_PORT = 29500
NODE_IF = "v0"            # every node's end of its veth (GLOO_SOCKET_IFNAME)
_STRIP_ENV = ("KVDATA_CONFIG", "KVDATA_SOCKET", "KVDATA_S3_ADDRESSING", "NOTIFY_SOCKET", "WATCHDOG_USEC",
              "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "MASTER_ADDR", "MASTER_PORT",
              "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME")


class LabError(RuntimeError):
    """A lab step failed: the message names the step and carries its output."""


# ====================================================================== small tools

def _run(argv: Sequence[str], timeout: float = 60, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    if check and p.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-2000:]}")
    return p


def in_ns(ns: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def rate_bytes(rate: str) -> int:
    """'200mbit' -> 25,000,000 bytes/s (kbit, mbit, gbit)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: use e.g. 200mbit or 1gbit")
    return int(float(m.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)] / 8)


def tbf_args(rate: str) -> list[str]:
    """A tbf as netlab.sh sets it: a jiffy's worth of tokens (HZ=250), at least one GSO packet."""
    burst = max(rate_bytes(rate) // 250, 65536)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "25ms"]


def find_nginx() -> str | None:
    for c in ("/usr/sbin/nginx", "/usr/bin/nginx"):
        if os.access(c, os.X_OK):
            return c
    return shutil.which("nginx")


def find_delayproxy(repo: Path) -> Path | None:
    """The netlab's delay proxy: ../shared/netlab beside the checkout (or beside the directory
    of worktrees that holds it, ../../shared/netlab)."""
    for base in (repo.parent, repo.parent.parent):
        p = base / "shared" / "netlab" / "delayproxy.py"
        if p.is_file():
            return p
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def missing() -> str | None:
    """Why a lab cannot run here (None if it can), found by really creating a namespace with a
    veth pair and a tbf qdisc, then deleting it."""
    if os.geteuid() != 0:
        return "needs root: network namespaces, veth pairs and tc qdiscs need CAP_NET_ADMIN and CAP_SYS_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package iproute2)"
    if find_nginx() is None:
        return "nginx is not installed (Debian package nginx): it is the S3 front that counts bytes per node"
    ns = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-h"
    try:
        _run(["ip", "netns", "add", ns], timeout=20)
        _run(["ip", "-n", ns, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1"], timeout=20)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "probe0", "root", *tbf_args("100mbit")], timeout=20)
        _run(in_ns(ns, ["true"]), timeout=20)
    except (LabError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace with a veth pair and a tbf qdisc here ({e})"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20, check=False)
    return None


def _ns_pids(ns: str) -> list[int]:
    p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20, check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def remove_namespace(ns: str) -> None:
    """Kill every process left in a namespace, then delete it (its veths and their qdiscs go with it)."""
    for _ in range(3):
        pids = _ns_pids(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20, check=False)


def namespaces() -> list[str]:
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20, check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def cleanup_stale(tmp: Path = Path("/tmp")) -> list[str]:
    """Remove what labs whose owner process is gone left behind: namespaces named
    kvnl-<pid>-<hex>-..., the processes in them, and their work directories /tmp/kvnl-<pid>-<hex>-*.
    Only names this module makes, and only of dead owners; returns what was removed."""
    removed = []
    for ns in namespaces():
        m = NS_NAME.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            remove_namespace(ns)
            removed.append(ns)
    try:
        entries = list(tmp.iterdir())
    except OSError:
        entries = []
    for d in entries:
        m = DIR_NAME.match(d.name)
        if m and not _pid_alive(int(m.group(1))) and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


# ====================================================================== the lab

@dataclass
class NodeDaemon:
    node: int
    proc: subprocess.Popen[bytes]
    sock: Path
    config: Path
    tier: Path
    log: Path


@dataclass
class Phase:
    """One sampler's run inside a job: each rank's record, rank 0's snapshots at the epoch
    boundaries, and each kvdatad's counters when it was stopped."""

    sampler: str
    ranks: list[dict[str, Any]]
    snaps: list[dict[str, Any]]
    daemons: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Job:
    phases: list[Phase]
    seconds: float


class Lab:
    """`nodes` namespaces and a home; use as a context manager (close() always tears it all down)."""

    def __init__(self, nodes: int, *, rate: str | None = "1gbit", rtt_ms: float = 0.0,
                 delayproxy: Path | None = None, python: str = sys.executable, log=None) -> None:
        if nodes < 1 or nodes > 200:
            raise ValueError(f"nodes must be in [1, 200], got {nodes}")
        if rtt_ms > 0 and (delayproxy is None or not Path(delayproxy).exists()):
            raise LabError(f"rtt_ms={rtt_ms:g} needs the netlab's delay proxy (../shared/netlab/delayproxy.py); "
                           f"not found at {delayproxy}")
        if rate is not None:
            rate_bytes(rate)
        self.nodes, self.rate, self.rtt_ms, self.delayproxy, self.python = nodes, rate, rtt_ms, delayproxy, python
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.home = f"{self.tag}-h"
        self.node_ns = [f"{self.tag}-n{i}" for i in range(nodes)]
        self.root = Path("/")  # set by start()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.daemons: list[NodeDaemon] = []
        self._started = 0
        self._made: list[str] = []
        self._log = log or (lambda msg: None)

    # ---------------------------------------------------------- addresses and environments

    @staticmethod
    def gateway(i: int) -> str:
        return f"10.77.{i}.1"

    @staticmethod
    def address(i: int) -> str:
        return f"10.77.{i}.2"

    def endpoint(self, i: int) -> str:
        return f"http://{self.gateway(i)}:{S3_PORT}"

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def s3_env(self, endpoint: str) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(self.root / "aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(self.root / "aws-credentials"), "AWS_EC2_METADATA_DISABLED": "true",
                "KVDATA_S3_ADDRESSING": "path"}

    def base_env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV and not k.startswith("AWS_")}
        env.update(PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def node_dir(self, i: int) -> Path:
        return self.root / f"n{i}"

    # ---------------------------------------------------------- processes

    def popen(self, ns: str, argv: Sequence[str], env: dict[str, str], log: Path, cwd: Path | None = None
              ) -> subprocess.Popen[bytes]:
        """A process inside a namespace, in its own session (close() kills the group)."""
        with open(log, "ab") as f:
            p = subprocess.Popen(in_ns(ns, argv), env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                 cwd=cwd or self.root, start_new_session=True)
        self.procs.append(p)
        return p

    def wait_port(self, ns: str, host: str, port: int, proc: subprocess.Popen[bytes], log: Path,
                  timeout: float = 60.0) -> None:
        """Until host:port accepts a connection inside `ns`; LabError with the log if `proc` exits."""
        deadline = time.monotonic() + timeout
        probe = in_ns(ns, ["bash", "-c", f"(exec 3<>/dev/tcp/{host}/{port}) 2>/dev/null"])
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise LabError(f"{proc.args[4:6]} exited ({proc.returncode}) before {host}:{port} listened:\n{_tail(log)}")
            if subprocess.run(probe, capture_output=True, timeout=20, check=False).returncode == 0:
                return
            time.sleep(0.05)
        raise LabError(f"{host}:{port} in {ns} did not listen within {timeout:.0f} s:\n{_tail(log)}")

    @staticmethod
    def _stop(p: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass

    # ---------------------------------------------------------- up and down

    def __enter__(self) -> Lab:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        gone = cleanup_stale()
        if gone:
            self._log(f"removed what dead labs left: {', '.join(gone)}")
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/tmp"))
        (self.root / "run").mkdir()
        self._namespaces()
        self._servers()

    def _namespaces(self) -> None:
        h = self.home
        _run(["ip", "netns", "add", h])
        self._made.append(h)
        _run(["ip", "-n", h, "link", "set", "lo", "up"])
        _run(in_ns(h, ["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"]))
        for i, n in enumerate(self.node_ns):
            _run(["ip", "netns", "add", n])
            self._made.append(n)
            _run(["ip", "-n", n, "link", "set", "lo", "up"])
            _run(["ip", "-n", h, "link", "add", "name", f"h{i}", "type", "veth", "peer", "name", NODE_IF, "netns", n])
            _run(["ip", "-n", h, "addr", "add", f"{self.gateway(i)}/24", "dev", f"h{i}"])
            _run(["ip", "-n", h, "link", "set", f"h{i}", "up"])
            _run(["ip", "-n", n, "addr", "add", f"{self.address(i)}/24", "dev", NODE_IF])
            _run(["ip", "-n", n, "link", "set", NODE_IF, "up"])
            _run(["ip", "-n", n, "route", "add", "default", "via", self.gateway(i)])
            if self.rate is not None:
                _run(["tc", "-n", h, "qdisc", "add", "dev", f"h{i}", "root", *tbf_args(self.rate)])
                _run(["tc", "-n", n, "qdisc", "add", "dev", NODE_IF, "root", *tbf_args(self.rate)])

    def _servers(self) -> None:
        run = self.root / "run"
        env = self.base_env(**self.s3_env(f"http://127.0.0.1:{MOTO_PORT}"))
        moto = self.popen(self.home, [self.python, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(MOTO_PORT)], env,
                          run / "moto.log")
        nginx_exe = find_nginx()
        if nginx_exe is None:
            raise LabError("nginx is not installed (Debian package nginx)")
        conf = run / "nginx.conf"
        conf.write_text(self.nginx_conf())
        nginx = self.popen(self.home, [nginx_exe, "-e", str(run / "nginx-error.log"), "-c", str(conf), "-p", str(run)],
                           env, run / "nginx.out")
        self.wait_port(self.home, "127.0.0.1", MOTO_PORT, moto, run / "moto.log")
        for i in range(self.nodes):
            self.wait_port(self.home, "127.0.0.1", NGINX_BASE_PORT + i, nginx, run / "nginx-error.log")
        if self.rtt_ms > 0:
            pairs = [f"{self.gateway(i)}:{S3_PORT}=127.0.0.1:{NGINX_BASE_PORT + i}" for i in range(self.nodes)]
            proxy = self.popen(self.home, [self.python, str(self.delayproxy), "--rtt-ms", f"{self.rtt_ms:g}", *pairs],
                               env, run / "delayproxy.log")
            for i in range(self.nodes):
                self.wait_port(self.home, self.gateway(i), S3_PORT, proxy, run / "delayproxy.log")
        code = (f"import boto3; boto3.session.Session().client('s3', endpoint_url={f'http://127.0.0.1:{MOTO_PORT}'!r})"
                f".create_bucket(Bucket={BUCKET!r})")
        _run(in_ns(self.home, [self.python, "-c", code]), env=env, timeout=120)

    def nginx_conf(self) -> str:
        run = self.root / "run"
        user = "user root;\n" if os.geteuid() == 0 else ""
        servers = []
        for i in range(self.nodes):
            listen = [f"127.0.0.1:{NGINX_BASE_PORT + i}"]
            if self.rtt_ms <= 0:
                listen.append(f"{self.gateway(i)}:{S3_PORT}")
            servers.append(f"""  server {{
{''.join(f'    listen {a};{chr(10)}' for a in listen)}    client_max_body_size 0;
    access_log {run}/s3-n{i}.log kvnl;
    location / {{
      proxy_pass http://127.0.0.1:{MOTO_PORT};
      proxy_set_header Host $http_host;
      proxy_buffering off; proxy_request_buffering off; proxy_buffer_size 1m; proxy_buffers 4 1m;
      proxy_busy_buffers_size 2m; proxy_read_timeout 600s;
    }}
  }}
""")
        return f"""{user}daemon off;
master_process on;
worker_processes 2;
pid {run}/nginx.pid;
error_log {run}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  log_format kvnl '$request_method $status $body_bytes_sent $request_length $request_uri $http_range';
  sendfile on; tcp_nodelay on;
  keepalive_timeout 600s; keepalive_requests 1000000;
  client_body_temp_path {run}/body; proxy_temp_path {run}/proxy;
  fastcgi_temp_path {run}/fcgi; uwsgi_temp_path {run}/uwsgi; scgi_temp_path {run}/scgi;
{''.join(servers)}}}
"""

    def close(self) -> None:
        """Everything down, whatever state start() reached: processes (their sessions), then
        anything still inside our namespaces, the namespaces (veths and qdiscs go with them), the
        work directory."""
        for p in reversed(self.procs):
            self._stop(p, grace=3.0)
        self.procs.clear()
        self.daemons.clear()
        for ns in reversed(self._made):
            remove_namespace(ns)
        left = set(namespaces())
        for ns in self._made:
            if ns in left:  # a namespace whose removal raced with its last process: once more
                time.sleep(0.2)
                remove_namespace(ns)
        self._made.clear()
        if self.root != Path("/") and DIR_NAME.match(self.root.name):
            shutil.rmtree(self.root, ignore_errors=True)

    # ---------------------------------------------------------- datasets

    def push(self, src: Path, prefix: str) -> str:
        """`kvdata push src s3://kvnl/prefix`, run in the home namespace straight to moto (not counted)."""
        url = self.url(prefix)
        env = self.base_env(**self.s3_env(f"http://127.0.0.1:{MOTO_PORT}"))
        code = "import sys; from kvdata.cli import main; sys.argv[0] = 'kvdata'; main()"
        _run(in_ns(self.home, [self.python, "-c", code, "push", str(src), url]), env=env, timeout=1800)
        return url

    # ---------------------------------------------------------- kvdatad per node

    def start_daemons(self, budget: int, allow: str) -> list[NodeDaemon]:
        """One kvdatad per node in its namespace: its own tier directory (empty) of `budget`
        bytes, its own socket and config (readers of that node use the same config)."""
        self.stop_daemons()
        for i in range(self.nodes):
            d = self.node_dir(i)
            (d / "cwd").mkdir(parents=True, exist_ok=True)
            shutil.rmtree(d / "tier", ignore_errors=True)
            (d / "tier").mkdir()
            cfg = d / "kvdata.toml"
            cfg.write_text(f'[[tiers]]\nname = "ssd"\npath = "{d / "tier"}"\nbudget = {int(budget)}\n\n'
                           f'[daemon]\nsocket = "{d / "d.sock"}"\nallow_homes = ["{allow}"]\n')
            env = self.base_env(**self.s3_env(self.endpoint(i)), XDG_CACHE_HOME=str(d / "cache"))
            argv = [str(Path(self.python).parent / "kvdatad"), "--config", str(cfg), "--log-level", "WARNING"]
            if not Path(argv[0]).exists():
                argv = [self.python, "-m", "kvdata_daemon", *argv[1:]]
            self._started += 1
            log = d / f"kvdatad-{self._started}.log"
            p = self.popen(self.node_ns[i], argv, env, log, cwd=d / "cwd")
            self.daemons.append(NodeDaemon(i, p, d / "d.sock", cfg, d / "tier", log))
        for nd in self.daemons:
            _wait_socket(nd)
        return self.daemons

    def stop_daemons(self) -> list[dict[str, Any]]:
        """SIGTERM every kvdatad (status first: what each fetched and staged)."""
        stats = [daemon_status(d.sock) for d in self.daemons]
        for d in self.daemons:
            self._stop(d.proc, grace=15.0)
            if d.proc in self.procs:
                self.procs.remove(d.proc)
        self.daemons = []
        return stats

    # ---------------------------------------------------------- a job

    def meter_spec(self) -> dict[str, Any]:
        return {"home": self.home, "nodes": [
            {"log": str(self.root / "run" / f"s3-n{i}.log"), "veth": f"h{i}", "sock": str(self.node_dir(i) / "d.sock")}
            for i in range(self.nodes)]}

    def run_job(self, url: str, ranks_per_node: int, out: Path, *, phases: Sequence[str], budget: int, seed: int,
                epochs: int, batch_size: int, workers: int, exchange: float = 0.1, window: int = 8,
                timeout: float = 600.0) -> Job:
        """nodes x ranks_per_node ranks (gloo across the namespaces) that read `url` through their
        node's kvdatad, `epochs` epochs per phase; a phase is a sampler ("global" or "locality").
        Before every phase each node gets a fresh kvdatad with an empty tier of `budget` bytes, so
        phases are independent runs that share the ranks' start-up (the ranks close the dataset,
        rank 0 asks through the control directory and waits). Fails with the logs if a rank or a
        kvdatad fails, or the job runs past `timeout`."""
        out.mkdir(parents=True)
        control = out / "control"
        control.mkdir()
        spec = out / "meter.json"
        spec.write_text(json.dumps(self.meter_spec()))
        world = self.nodes * ranks_per_node
        t0 = time.monotonic()
        self.start_daemons(budget, url)
        daemon_stats: list[list[dict[str, Any]]] = []
        procs: list[tuple[int, subprocess.Popen[bytes], Path]] = []
        for i in range(self.nodes):
            d = self.daemons[i]
            for local in range(ranks_per_node):
                r = i * ranks_per_node + local
                env = self.base_env(**self.s3_env(self.endpoint(i)), KVDATA_CONFIG=str(d.config),
                                    KVDATA_SOCKET=str(d.sock), XDG_CACHE_HOME=str(out / f"cache{r}"),
                                    MASTER_ADDR=self.address(0), MASTER_PORT=str(MASTER_PORT), WORLD_SIZE=str(world),
                                    RANK=str(r), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(ranks_per_node),
                                    GLOO_SOCKET_IFNAME=NODE_IF)
                argv = [self.python, str(HERE), "rank", "--url", url, "--out", str(out), "--meter", str(spec),
                        "--control", str(control), "--phases", ",".join(phases), "--seed", str(seed),
                        "--epochs", str(epochs), "--batch-size", str(batch_size), "--workers", str(workers),
                        "--exchange", str(exchange), "--window", str(window), "--timeout", str(int(timeout))]
                log = out / f"rank{r}.log"
                procs.append((r, self.popen(self.node_ns[i], argv, env, log, cwd=out), log))
        failed: list[str] = []
        deadline = t0 + timeout
        try:
            while True:
                states = [(r, p.poll(), log) for r, p, log in procs]
                failed = [f"rank {r} exited {rc}:\n{_tail(log)}" for r, rc, log in states if rc not in (None, 0)]
                if failed or all(rc == 0 for _r, rc, _l in states):
                    break
                if time.monotonic() > deadline:
                    failed = [f"the job ran past {timeout:.0f} s; rank {r}:\n{_tail(log)}" for r, rc, log in states
                              if rc is None][:2]
                    break
                dead = [d for d in self.daemons if d.proc.poll() is not None]
                if dead:
                    failed = [f"kvdatad of node {d.node} exited {d.proc.returncode}:\n{_tail(d.log)}" for d in dead]
                    break
                k = len(daemon_stats) + 1
                if (control / f"done-{k}").exists():  # the ranks closed phase k-1's dataset: fresh daemons
                    daemon_stats.append(self.stop_daemons())
                    self.start_daemons(budget, url)
                    (control / f"go-{k}").touch()
                time.sleep(0.02)
        finally:
            for _r, p, _l in procs:  # a failed rank leaves the others in a barrier: end them now
                self._stop(p, grace=1.0)
                if p in self.procs:
                    self.procs.remove(p)
        if failed:
            raise LabError("\n".join(failed))
        daemon_stats.append(self.stop_daemons())
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        snaps = json.loads((out / "snapshots.json").read_text())
        return Job([Phase(sampler, [r["phases"][k] for r in ranks], snaps[k], daemon_stats[k])
                    for k, sampler in enumerate(phases)], time.monotonic() - t0)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def _wait_socket(d: NodeDaemon, timeout: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise LabError(f"kvdatad of node {d.node} exited ({d.proc.returncode}) before listening:\n{_tail(d.log)}")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(d.sock))
            return
        except OSError:
            time.sleep(0.05)
    raise LabError(f"kvdatad of node {d.node} did not listen on {d.sock} within {timeout:.0f} s:\n{_tail(d.log)}")


# ====================================================================== measuring

DAEMON_KEYS = ("bytes_from_home", "bytes_staged", "shards_staged", "hits", "misses", "evictions", "private_copies",
               "random_misses", "error_count")


def daemon_status(sock: str | Path | None) -> dict[str, Any]:
    """The counters of one kvdatad's status (its Unix socket works from any namespace)."""
    if sock is None:
        return {}
    from kvdata.protocol import Client

    try:
        with Client(Path(sock), timeout=30) as c:
            st = c.request("status")
    except Exception as e:  # noqa: BLE001 -- reported, not raised: a measurement
        return {"error": f"{type(e).__name__}: {e}"}
    out = {k: st.get(k) for k in DAEMON_KEYS}
    out["tier_used"] = sum(int(t.get("used") or 0) for t in st.get("tiers") or [])
    out["errors"] = [str(x)[:300] for x in (st.get("errors") or [])][:5]
    return out


def access_log(path: str | Path) -> dict[str, int]:
    """Requests and response body bytes of one node's S3 access log (method status bytes length)."""
    out = {"requests": 0, "gets": 0, "bytes": 0, "get_bytes": 0, "errors": 0}
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or not parts[2].isdigit():
            continue
        n = int(parts[2])
        out["requests"] += 1
        out["bytes"] += n
        if parts[0] == "GET":
            out["gets"] += 1
            out["get_bytes"] += n
        if not parts[1].startswith(("2", "3")):
            out["errors"] += 1
    return out


def veth_counters(home: str) -> dict[str, dict[str, int]]:
    """{h<i>: {"tx": bytes the home sent node i, "rx": bytes it received}} (wire: headers and gloo too)."""
    p = subprocess.run(["ip", "-n", home, "-s", "-j", "link", "show"], capture_output=True, text=True, timeout=20,
                       check=False)
    out: dict[str, dict[str, int]] = {}
    try:
        for link in json.loads(p.stdout or "[]"):
            s = link.get("stats64") or {}
            out[str(link.get("ifname"))] = {"tx": int(s["tx"]["bytes"]), "rx": int(s["rx"]["bytes"])}
    except (ValueError, KeyError, TypeError):
        pass
    return out


def snapshot(spec: dict[str, Any]) -> dict[str, Any]:
    """Every counter at one instant (rank 0 takes one at each epoch boundary, all ranks waiting)."""
    wire = veth_counters(spec["home"])
    nodes = []
    for n in spec["nodes"]:
        nodes.append({"s3": access_log(n["log"]), "wire": wire.get(n["veth"], {"tx": -1, "rx": -1}),
                      "daemon": daemon_status(n["sock"])})
    return {"t": time.time(), "nodes": nodes}


def _delta(a: dict[str, Any], b: dict[str, Any], key: str) -> int:
    x, y = a.get(key), b.get(key)
    return int(y) - int(x) if isinstance(x, int) and isinstance(y, int) else -1


def exact_once(ranks: Sequence[dict[str, Any]], epoch: int, n: int) -> bool:
    """Whether the ranks together read every sample 0..n-1 exactly once in this epoch."""
    seen = np.concatenate([np.asarray(r["epochs"][epoch], dtype=np.int64) for r in ranks])
    return len(seen) == n and bool(np.array_equal(np.sort(seen), np.arange(n)))


def epoch_rows(job: Phase, n: int) -> list[dict[str, Any]]:
    """Per epoch of a phase: S3 bytes and requests (the access logs), wire bytes (the veths),
    what the daemons fetched and staged, per node; wall time; whether every sample was read once."""
    rows = []
    starts = job.ranks[0]["epoch_start"]
    ends = job.ranks[0]["epoch_end"]
    for e in range(len(job.snaps) - 1):
        a, b = job.snaps[e], job.snaps[e + 1]
        per_node_s3 = [_delta(x["s3"], y["s3"], "bytes") for x, y in zip(a["nodes"], b["nodes"])]
        per_node_gets = [_delta(x["s3"], y["s3"], "gets") for x, y in zip(a["nodes"], b["nodes"])]
        per_node_req = [_delta(x["s3"], y["s3"], "requests") for x, y in zip(a["nodes"], b["nodes"])]
        wire = [_delta(x["wire"], y["wire"], "tx") for x, y in zip(a["nodes"], b["nodes"])]
        staged = [_delta(x["daemon"], y["daemon"], "bytes_staged") for x, y in zip(a["nodes"], b["nodes"])]
        fetched = [_delta(x["daemon"], y["daemon"], "bytes_from_home") for x, y in zip(a["nodes"], b["nodes"])]
        samples = sum(len(r["epochs"][e]) for r in job.ranks)
        rows.append({"sampler": job.sampler, "epoch": e + 1, "s3_bytes": sum(per_node_s3), "s3_requests": sum(per_node_req),
                     "s3_gets": sum(per_node_gets), "epoch_seconds": ends[e] - starts[e],
                     "per_node_s3_bytes": per_node_s3, "per_node_s3_gets": per_node_gets,
                     "per_node_staged_bytes": staged, "per_node_daemon_home_bytes": fetched,
                     "daemon_home_bytes": sum(fetched), "wire_bytes": sum(wire), "per_node_wire_bytes": wire,
                     "samples_seen": samples, "exact_once": exact_once(job.ranks, e, n),
                     "s3_errors": sum(_delta(x["s3"], y["s3"], "errors") for x, y in zip(a["nodes"], b["nodes"]))})
    return rows


def sequences(job: Phase) -> list[list[list[int]]]:
    """Every rank's index sequence of every epoch (what must repeat from the same seed)."""
    return [r["epochs"] for r in job.ranks]


# ====================================================================== datasets

def build_dataset(path: Path, samples: int, sample_bytes: int, shard_size: str | int, seed: int = 0) -> Path:
    """A sealed dataset of `samples` records {"i": i, "x": sample_bytes random bytes whose first 8
    are i (little-endian)}: incompressible, and every read can be checked against its index. Its
    cold copies (.zst) are made at seal, so the manifest gives the S3 objects' sizes too."""
    import kvdata

    if sample_bytes < 8:
        raise ValueError("sample_bytes must be >= 8")
    rng = np.random.default_rng(seed)
    chunk = max(1, (16 << 20) // sample_bytes)
    with kvdata.open(path, "w", shard_size=shard_size, compress=True) as s:
        for start in range(0, samples, chunk):
            m = min(chunk, samples - start)
            arr = rng.integers(0, 256, size=(m, sample_bytes), dtype=np.uint8)
            arr[:, :8] = np.arange(start, start + m, dtype="<i8").view(np.uint8).reshape(m, 8)
            s.put_many((f"{start + k:08d}", {"i": start + k, "x": arr[k]}) for k in range(m))
        s.seal()
    return path


def expected_sequences(dataset: Path, *, nodes: int, ranks_per_node: int, sampler: str, seed: int, epochs: int,
                       exchange: float = 0.1, window: int = 8) -> list[list[list[int]]]:
    """What every rank must read, computed here in one process with explicit rank, world and
    node (the job's samplers take them from torch.distributed and LOCAL_WORLD_SIZE)."""
    import kvdata

    ds = kvdata.Dataset(dataset)
    world = nodes * ranks_per_node
    out = []
    for r in range(world):
        kw: dict[str, Any] = {"locality": True, "exchange": exchange, "nodes": nodes,
                              "node": r // ranks_per_node} if sampler == "locality" else {}
        s = kvdata.ShardShuffleSampler(ds, seed=seed, window=window, rank=r, world_size=world, **kw)
        per = []
        for e in range(epochs):
            s.set_epoch(e)
            per.append([int(i) for i in s])
        out.append(per)
    ds.store.close()
    return out


# ====================================================================== one rank (run as a script)

def rank_main(argv: Sequence[str]) -> int:
    """One rank of a job: joins the gloo group (env://); for each phase opens the dataset (through
    its node's kvdatad), reads it with ShardShuffleSampler + DataLoader for the epochs, checking
    every sample's content, and closes it; writes rank<r>.json. Rank 0 takes the snapshots around
    every epoch and, between phases, asks the job (control/done-k) for fresh daemons (go-k)."""
    ap = argparse.ArgumentParser(prog="nodelab rank")
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--meter", type=Path, required=True)
    ap.add_argument("--control", type=Path, required=True)
    ap.add_argument("--phases", required=True, help="samplers, comma-separated: global, locality")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--exchange", type=float, default=0.1)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=600)
    a = ap.parse_args(argv)
    phases = a.phases.split(",")
    if not phases or any(p not in ("global", "locality") for p in phases):
        ap.error(f"--phases {a.phases!r}: global or locality, comma-separated")
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=a.timeout))
    try:
        rank = dist.get_rank()
        spec = json.loads(a.meter.read_text())
        recs, snaps = [], []
        for k, sampler in enumerate(phases):
            if k:  # fresh daemons for this phase: every rank has closed the dataset
                dist.barrier()
                if rank == 0:
                    (a.control / f"done-{k}").touch()
                    _wait_file(a.control / f"go-{k}", a.timeout)
                dist.barrier()
            rec, snap = _phase(a, sampler, rank, spec)
            recs.append(rec)
            snaps.append(snap)
        tmp = a.out / f".rank{rank}.json.tmp"
        tmp.write_text(json.dumps({"rank": rank, "world_size": dist.get_world_size(), "phases": recs}))
        tmp.rename(a.out / f"rank{rank}.json")
        if rank == 0:
            tmp = a.out / ".snapshots.json.tmp"
            tmp.write_text(json.dumps(snaps))
            tmp.rename(a.out / "snapshots.json")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.02)


def _phase(a: argparse.Namespace, sampler_kind: str, rank: int, spec: dict[str, Any]
           ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One phase of one rank: (its record, rank 0's snapshots; [] on the other ranks)."""
    import torch
    import torch.distributed as dist
    import torch.utils.data as tud

    import kvdata

    ds = kvdata.Dataset(a.url)
    eng = ds.store.engine
    via_daemon = type(eng).__name__ == "DaemonStager" and getattr(eng, "client", None) is not None
    sampler = kvdata.ShardShuffleSampler(ds, seed=a.seed, window=a.window, locality=sampler_kind == "locality",
                                         exchange=a.exchange)
    # fresh workers every epoch (no persistent_workers): nothing of the dataset outlives the phase
    dl = tud.DataLoader(ds, batch_size=a.batch_size, sampler=sampler, num_workers=a.workers, collate_fn=kvdata.collate)
    rec: dict[str, Any] = {"sampler": sampler_kind, "node": sampler.nodes and sampler.node, "nodes": sampler.nodes,
                           "via_daemon": via_daemon, "epochs": [], "bad": [], "epoch_start": [], "epoch_end": []}
    snaps = []
    for e in range(a.epochs):
        sampler.set_epoch(e)
        dist.barrier()
        if e:
            rec["epoch_end"].append(time.time())
        if rank == 0:
            snaps.append(snapshot(spec))
        dist.barrier()
        rec["epoch_start"].append(time.time())
        seen: list[int] = []
        for batch in dl:
            idx = batch["i"].to(torch.int64)
            head = batch["x"][:, :8].contiguous().numpy().view("<i8").reshape(-1)
            wrong = np.nonzero(head != idx.numpy())[0]
            rec["bad"] += idx[wrong].tolist()[:20]
            seen += idx.tolist()
        rec["epochs"].append(seen)
    dist.barrier()
    rec["epoch_end"].append(time.time())
    if rank == 0:
        snaps.append(snapshot(spec))
    rec["fell_back"] = getattr(ds.store.engine, "_fallback", None) is not None
    del dl
    ds.store.close()
    return rec, snaps


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["rank"]:
        return rank_main(args[1:])
    if args[:1] == ["cleanup"]:
        for x in cleanup_stale():
            print(f"removed {x}")
        return 0
    print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
