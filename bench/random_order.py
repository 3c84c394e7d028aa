#!/usr/bin/env python
"""Random-order reads from a far-away S3 home (issue 12, item 5): kvdata vs one GET per sample.

Inside ../shared/netlab (an S3 server behind a 1 Gbit link with 25 ms RTT; needs root), a
dataset of 151 KB samples (227x227x3 uint8) that is 4x the tier budget is read for 3 epochs by
`DataLoader(dataset, shuffle=True, num_workers=2, batch_size=32)` through:

  (a) kvdata now: the dataset pushed to the S3 home with `kvdata push`, read with
      kvdata.Dataset(url) in-process (no kvdatad), one tier with a budget of 25% of the
      dataset (KVDATA_CONFIG pointing to a temp config and tier directory); and the same
      through one kvdatad (the tier config plus a socket and allow_homes = [url]);
  (b) kvdata before issue 12 (--before REV, default bab32a3): the same reader run in a
      subprocess with PYTHONPATH pointing to a `git worktree` of that commit, reading a copy
      pushed by that commit's own `push`; --no-before skips it;
  (c) one GET per sample, 32 in flight: every sample its own object in the same S3 server,
      a Dataset whose __getitems__ fetches the batch with a ThreadPoolExecutor(32) through
      boto3 (the ConcurrentDataloader technique);
  (d) litdata and mosaic-streaming: not run (not installed here);
  for reference: (a) with DataLoader(sampler=kvdata.ShardShuffleSampler(ds)) instead of
      shuffle=True, in-process and through kvdatad (the shard-aware order against 1 - budget).

Per epoch: samples/s; bytes that came from the home (the root-side veth's rx_bytes, i.e.
everything the namespace sent, TCP/IP and HTTP headers included; for (c) also the sum of the
object sizes), as datasets; and the tier's peak bytes against its budget (a sampler thread
summing the sizes of the files in the tier directory every 10 ms, plus files under it that a
reader process still maps after they were unlinked); the GETs the S3 server logged. Before the
readers: the server's own rate for whole sample objects and for ranged GETs inside shards.

  python bench/random_order.py --quick
  python bench/random_order.py --json bench/out/random_order.json     # 1,200 samples, ~180 MB
  python bench/random_order.py --home s3rver --no-before              # a second S3 server (npm install -g s3rver)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    IMG,
    MB,
    SHAPE,
    image_chunks,
    log,
    machine_info,
    machine_line,
    md_table,
    write_image_dataset,
    write_json,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# ../shared/netlab from the main checkout, ../../shared/netlab from a worktree under wt/
NETLAB_SH = next((p for p in (REPO.parent / "shared" / "netlab" / "netlab.sh",
                              REPO.parent.parent / "shared" / "netlab" / "netlab.sh") if p.exists()),
                 REPO.parent / "shared" / "netlab" / "netlab.sh")
NETLAB_IP = "10.200.0.2"
VETH = "nlab0"                           # the root-namespace end of the netlab veth pair
DELAYED = f"http://{NETLAB_IP}:15000"    # S3 with RTT + rate limit (--home s3rver: s3rver's delayed port)
DIRECT = f"http://{NETLAB_IP}:8081"      # S3 with rate limit only (used to prepare the home)
S3RVER_PORT, S3RVER_DELAYED_PORT = 4568, 14568  # --home s3rver: s3rver in the namespace, and its delay proxy
NGINX_URL = f"http://{NETLAB_IP}:18080"  # nginx static files with RTT + rate limit (--home http)
BUCKET = "kvrandom"


# ====================================================================== helpers

def netlab(cmd: str, *args: str, sh: Path) -> str:
    env = dict(os.environ)
    env.setdefault("NETLAB_PY", sys.executable)
    p = subprocess.run(["bash", str(sh), cmd, *args], env=env, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"netlab.sh {cmd} {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


def s3_env(endpoint: str) -> None:
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")  # s3rver: S3RVER (main sets it; moto takes any)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("KVDATA_S3_ADDRESSING", "path")
    os.environ.pop("KVDATA_DAEMON", None)


def rx_bytes() -> int:
    """Bytes the root namespace has received from the netlab namespace (the home's sends)."""
    try:
        return int(Path(f"/sys/class/net/{VETH}/statistics/rx_bytes").read_text())
    except OSError:
        return -1


def moto_log() -> Path:
    return Path(os.environ.get("NETLAB_DIR") or Path(os.environ.get("TMPDIR") or "/tmp") / "netlab") / "run" / "moto.log"


COUNT_GETS = True  # False for --home http: nginx's access log is off, nothing counts its requests


def log_offset() -> int:
    if not COUNT_GETS:
        return -1
    try:
        return moto_log().stat().st_size
    except OSError:
        return -1


def gets_since(offset: int) -> int:
    """GET requests the S3 server (moto) logged since `offset` of its log; -1 if unknown."""
    if offset < 0:
        return -1
    time.sleep(0.05)  # let the last lines land
    try:
        with open(moto_log(), "rb") as f:
            f.seek(offset)
            return f.read().count(b'GET /')
    except OSError:
        return -1


def parse_rate_mbps(rate: str) -> float:
    r = rate.strip().lower()
    for unit, mult in (("gbit", 1000.0), ("mbit", 1.0), ("kbit", 0.001)):
        if r.endswith(unit):
            return float(r[:-len(unit)]) * mult
    raise SystemExit(f"--rate {rate}: use e.g. 1gbit or 200mbit")


def sample_name(i: int) -> str:
    return f"{i:08d}.bin"


class TierSampler:
    """Every `period` s: the bytes of the files under `root`, plus files under it that this
    process or its children still map after they were unlinked (Linux keeps those bytes).
    Keeps the peak and the last value."""

    def __init__(self, root: Path, period: float = 0.01) -> None:
        self.root, self.period = str(root), period
        self.peak = self.peak_files = self.peak_mapped_deleted = 0
        self.samples = 0
        self.last_kinds: dict[str, int] = {}
        self.peak_kinds: dict[str, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TierSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()

    def reset(self) -> None:
        self.peak = self.peak_files = self.peak_mapped_deleted = 0

    def files(self) -> int:
        total = 0
        sizes: dict[str, int] = {}
        for dirpath, _dirs, names in os.walk(self.root):
            for n in names:
                try:
                    size = os.lstat(os.path.join(dirpath, n)).st_size
                except OSError:
                    continue
                total += size
                kind = "copies" if n.endswith(".mdb") else ("temps" if ".tmp" in n or n.startswith(".") else n[-12:])
                kind = f"{os.path.basename(dirpath)}/{kind}"
                sizes[kind] = sizes.get(kind, 0) + size
        self.last_kinds = sizes
        return total

    def _pids(self) -> list[int]:
        out, todo = [], [os.getpid()]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for t in os.listdir(f"/proc/{p}/task"):
                    kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
                    todo.extend(int(k) for k in kids)
            except OSError:
                pass
        return out

    def mapped_deleted(self) -> int:
        """Sizes of unlinked files under root that a process of this tree still maps (each once)."""
        seen: dict[tuple[int, int], int] = {}
        root = self.root.encode()
        for p in self._pids():
            try:
                with open(f"/proc/{p}/maps", "rb") as f:
                    text = f.read()
            except OSError:
                continue
            # (a torch process maps thousands of regions: skip its maps at C speed when nothing of
            # the tier is there unlinked -- this thread runs beside the reader it measures)
            if b"(deleted)" not in text or root not in text:
                continue
            for raw in text.splitlines():
                line = raw.decode(errors="replace")
                if not line.endswith("(deleted)") or self.root not in line:
                    continue
                parts = line.split()
                try:
                    st = os.stat(f"/proc/{p}/map_files/{parts[0]}")
                    seen[(st.st_dev, st.st_ino)] = st.st_size
                except OSError:
                    continue
        return sum(seen.values())

    def _run(self) -> None:
        k = 0
        md = 0
        while not self._stop.is_set():
            f = self.files()
            if k % 5 == 0:  # /proc scans every 50 ms: cheaper on 2 cores
                md = self.mapped_deleted()
            k += 1
            self.samples += 1
            if f > self.peak_files:  # what the tier held at its peak, by kind of file (the report's JSON)
                self.peak_kinds = dict(self.last_kinds)
            self.peak_files = max(self.peak_files, f)
            self.peak_mapped_deleted = max(self.peak_mapped_deleted, md)
            self.peak = max(self.peak, f + md)
            self._stop.wait(self.period)


# ====================================================================== (c): one GET per sample

class GetDataset:
    """One object per sample; __getitems__ fetches a batch with `threads` GETs in flight (boto3)."""

    def __init__(self, url: str, n: int, threads: int) -> None:
        u = urllib.parse.urlparse(url)
        self.bucket, self.prefix, self.n, self.threads = u.netloc, u.path.strip("/"), n, threads
        self._pid = -1
        self.fetched = None

    def _setup(self) -> None:
        if self._pid == os.getpid():
            return
        import boto3
        from botocore.config import Config as BotoConfig
        self.client = boto3.session.Session().client("s3", config=BotoConfig(
            max_pool_connections=max(10, self.threads), s3={"addressing_style": "path"}))
        self.pool = ThreadPoolExecutor(self.threads)
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("client", "pool", "_pid")} | {"_pid": -1}

    def __len__(self) -> int:
        return self.n

    def _get(self, i: int) -> np.ndarray:
        body = self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{sample_name(i)}")["Body"]
        try:
            data = body.read()
        finally:
            body.close()
        return np.frombuffer(data, np.uint8).reshape(SHAPE)

    def __getitem__(self, i: int) -> dict[str, Any]:
        self._setup()
        return {"image": self._get(int(i))}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        self._setup()
        return [{"image": a} for a in self.pool.map(self._get, [int(i) for i in indices])]


class HttpGetDataset:
    """(c) over HTTP: one file per sample under `url`; __getitems__ fetches a batch with
    `threads` GETs in flight (urllib3, one keep-alive pool per worker)."""

    def __init__(self, url: str, n: int, threads: int) -> None:
        self.url, self.n, self.threads = url.rstrip("/"), n, threads
        self._pid = -1

    def _setup(self) -> None:
        if self._pid == os.getpid():
            return
        import urllib3
        self.http = urllib3.PoolManager(maxsize=max(10, self.threads), retries=False)
        self.pool = ThreadPoolExecutor(self.threads)
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("http", "pool", "_pid")} | {"_pid": -1}

    def __len__(self) -> int:
        return self.n

    def _get(self, i: int) -> np.ndarray:
        r = self.http.request("GET", f"{self.url}/{sample_name(i)}")
        if r.status != 200:
            raise RuntimeError(f"GET {self.url}/{sample_name(i)}: HTTP {r.status}")
        return np.frombuffer(r.data, np.uint8).reshape(SHAPE)

    def __getitem__(self, i: int) -> dict[str, Any]:
        self._setup()
        return {"image": self._get(int(i))}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        self._setup()
        return [{"image": a} for a in self.pool.map(self._get, [int(i) for i in indices])]


def www_dir() -> Path:
    """nginx's document root in the netlab (served at NGINX_URL)."""
    return Path(os.environ.get("NETLAB_DIR") or Path(os.environ.get("TMPDIR") or "/tmp") / "netlab") / "www"


class S3rver:
    """--home s3rver: a second S3-protocol server (s3rver, `npm install -g s3rver`) inside the
    netlab namespace, behind its own instance of the netlab's delay proxy (same RTT; the
    namespace's tbf applies as to everything there). s3rver keeps each object as a file and
    answers a ranged GET by reading that range of it (fs.createReadStream with start/end),
    where moto reads the whole object for every ranged GET. Started after `netlab.sh up`,
    stopped (by pid) before `netlab.sh down`. It accepts only its own credentials (S3RVER)."""

    NS = "netlab"

    def __init__(self, data: Path, rtt_ms: float, sh: Path) -> None:
        self.data, self.rtt_ms, self.proxy = data, rtt_ms, sh.parent / "delayproxy.py"
        self.procs: list[subprocess.Popen[bytes]] = []

    @staticmethod
    def available() -> str | None:
        """Why s3rver cannot run here, or None."""
        return None if shutil.which("s3rver") else "s3rver not found (npm install -g s3rver)"

    def _spawn(self, argv: list[str], log: Path) -> None:
        with open(log, "wb") as f:
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", self.NS, *argv], stdin=subprocess.DEVNULL,
                                               stdout=f, stderr=subprocess.STDOUT, start_new_session=True))

    def start(self) -> None:
        shutil.rmtree(self.data, ignore_errors=True)
        self.data.mkdir(parents=True)
        self._spawn([shutil.which("s3rver") or "s3rver", "-d", str(self.data / "objects"), "-a", "0.0.0.0",
                     "-p", str(S3RVER_PORT), "--silent"], self.data / "s3rver.log")
        self._spawn([os.environ.get("NETLAB_PY", sys.executable), str(self.proxy), "--rtt-ms", f"{self.rtt_ms:g}",
                     f"{NETLAB_IP}:{S3RVER_DELAYED_PORT}=127.0.0.1:{S3RVER_PORT}"], self.data / "proxy.log")
        import socket
        for port in (S3RVER_PORT, S3RVER_DELAYED_PORT):
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection((NETLAB_IP, port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                        self.stop()
                        raise RuntimeError(f"s3rver lab: port {port} did not open; see {self.data}/*.log") from None
                    time.sleep(0.1)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)  # its own session (start_new_session): ip netns exec and the server
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    p.wait()
        self.procs = []


# ====================================================================== the epochs

def run_epochs(ds: Any, epochs: int, batch_size: int, workers: int, seed: int, collate: Any,
               sampler: TierSampler | None, order: Any = None) -> list[dict[str, Any]]:
    """`order`: None for shuffle=True, else a sampler with set_epoch (ShardShuffleSampler)."""
    import torch
    import torch.utils.data as tud

    g = torch.Generator()
    g.manual_seed(seed)
    if order is None:
        dl = tud.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, collate_fn=collate,
                            generator=g)
    else:
        dl = tud.DataLoader(ds, batch_size=batch_size, sampler=order, num_workers=workers, collate_fn=collate)
    out = []
    for e in range(epochs):
        if order is not None:
            order.set_epoch(e)
        if sampler is not None:
            sampler.reset()
        rx0, lo = rx_bytes(), log_offset()
        n = 0
        t0 = time.perf_counter()
        first = None
        for batch in dl:
            if first is None:
                first = time.perf_counter() - t0
            n += len(batch["image"])
        dt = time.perf_counter() - t0
        rec = {"epoch": e + 1, "samples": n, "seconds": dt, "samples_per_s": n / dt,
               "first_batch_s": first or 0.0, "home_wire_bytes": rx_bytes() - rx0,
               "gets": gets_since(lo)}
        if sampler is not None:
            rec.update(tier_peak=sampler.peak, tier_peak_files=sampler.peak_files,
                       tier_peak_mapped_deleted=sampler.peak_mapped_deleted, tier_end=sampler.files(),
                       tier_peak_kinds=sampler.peak_kinds)
        out.append(rec)
        log(f"  epoch {e + 1}: {json.dumps(rec)}")
    return out


def kvdata_reader(url: str, tier_dir: Path, epochs: int, batch_size: int, workers: int, seed: int,
                  shard_aware: bool = False) -> dict[str, Any]:
    """kvdata.Dataset(url) + DataLoader(shuffle=True) with the tier sampler (KVDATA_CONFIG already set);
    shard_aware: DataLoader(sampler=kvdata.ShardShuffleSampler(ds)) instead."""
    import warnings

    import kvdata
    warnings.simplefilter("ignore")  # the RandomAccessWarning: noted in the report, not printed per worker
    t0 = time.perf_counter()
    ds = kvdata.Dataset(url)
    open_s = time.perf_counter() - t0
    eng = getattr(ds.store, "engine", None)
    via_daemon = type(eng).__name__ == "DaemonStager" and getattr(eng, "client", None) is not None
    with TierSampler(tier_dir) as smp:
        order = kvdata.ShardShuffleSampler(ds, seed=seed) if shard_aware else None
        eps = run_epochs(ds, epochs, batch_size, workers, seed, getattr(kvdata, "collate", None), smp, order)
    return {"kvdata_file": kvdata.__file__, "open_s": open_s, "epochs": eps, "tier_samples": smp.samples,
            "engine": type(eng).__name__, "via_daemon": via_daemon}


def write_config(tdir: Path, budget: int, sock: Path | None = None, allow: str | None = None) -> Path:
    tdir.mkdir(parents=True, exist_ok=True)
    (tdir / "tier").mkdir(exist_ok=True)
    cfgp = tdir / "kvdata.toml"
    text = f'[[tiers]]\nname = "bench"\npath = "{tdir / "tier"}"\nbudget = "{budget}"\n'
    if sock is not None:
        text += f'\n[daemon]\nsocket = "{sock}"\n'
        if allow:
            text += f'allow_homes = ["{allow}"]\n'
    cfgp.write_text(text)
    return cfgp


def kvdatad_argv() -> list[str]:
    exe = Path(sys.executable).parent / "kvdatad"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kvdata_daemon"]


def run_daemon(a: argparse.Namespace, url: str, work: Path, budget: int, shard_aware: bool = False) -> dict[str, Any]:
    """(a) through one kvdatad (its own subprocess, the same tier config plus a socket)."""
    from kvdata.protocol import Client

    tdir = work / "tiers-daemon"
    shutil.rmtree(tdir, ignore_errors=True)
    sock_dir = Path(tempfile.mkdtemp(prefix="kvdd-", dir="/tmp"))  # Unix socket paths: 108 bytes at most
    sock = sock_dir / "d.sock"
    cfgp = write_config(tdir, budget, sock, allow=url)  # kvdatad fetches a remote home only if allowed
    dlog = tdir / "kvdatad.log"
    env = {k: v for k, v in os.environ.items() if k not in ("KVDATA_SOCKET", "KVDATA_CONFIG", "NOTIFY_SOCKET")}
    with open(dlog, "wb") as f:
        daemon = subprocess.Popen(kvdatad_argv() + ["--config", str(cfgp), "--log-level", "WARNING"], env=env,
                                  stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, cwd=tdir,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        client = None
        while client is None:
            if daemon.poll() is not None:
                raise RuntimeError(f"kvdatad exited with {daemon.returncode}:\n{dlog.read_text()[-2000:]}")
            try:
                client = Client(sock, timeout=30)
            except Exception:  # noqa: BLE001 -- not listening yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvdatad did not listen on {sock} within 30 s") from None
                time.sleep(0.02)
        os.environ["KVDATA_CONFIG"] = str(cfgp)
        try:
            res = kvdata_reader(url, tdir / "tier", a.epochs, a.batch_size, a.workers, a.seed, shard_aware)
        finally:
            os.environ.pop("KVDATA_CONFIG", None)
        try:
            st = client.request("status")
            res["daemon_status"] = {k: st.get(k) for k in ("bytes_from_home", "shards_staged", "hits", "misses",
                                                             "errors", "stall_seconds", "private_copies",
                                                             "evictions", "random_misses")}
            res["daemon_status"]["datasets"] = st.get("datasets")
        except Exception as e:  # noqa: BLE001
            res["daemon_status"] = {"error": str(e)}
        client.close()
        if not res["via_daemon"]:
            res["note"] = "the reader did not go through kvdatad"
        return res
    finally:
        daemon.terminate()
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(tdir, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)


# ====================================================================== main

def prepare(src: Path, url: str, n: int, endpoint: str, env_extra: dict[str, str] | None = None) -> float:
    """`kvdata push` src to url (through `endpoint`); returns seconds."""
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, **(env_extra or {}))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", "import sys; from kvdata.cli import main; sys.argv[0] = 'kvdata'; main()",
                        "push", str(src), url], env=env,
                       capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"kvdata push {src} {url} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return time.perf_counter() - t0


def put_samples(src: Path, url: str, n: int) -> None:
    import boto3

    import kvdata
    u = urllib.parse.urlparse(url)
    cl = boto3.session.Session().client("s3", endpoint_url=DIRECT)
    with kvdata.open(src) as st, ThreadPoolExecutor(16) as pool:
        def put(i: int) -> None:
            cl.put_object(Bucket=u.netloc, Key=f"{u.path.strip('/')}/{sample_name(i)}", Body=st[i]["image"].tobytes())
        list(pool.map(put, range(n)))


def server_rates(url: str, samples_url: str, n: int, threads: int, seed: int) -> dict[str, Any]:
    """The S3 server's request rate with `threads` GETs in flight (through the delayed endpoint):
    whole sample objects vs ranged GETs of one sample's size inside the pushed shard objects."""
    import boto3
    from botocore.config import Config as BotoConfig
    cl = boto3.session.Session().client("s3", endpoint_url=DELAYED, config=BotoConfig(
        max_pool_connections=threads, s3={"addressing_style": "path"}))
    rng = np.random.default_rng(seed + 11)
    u, su = urllib.parse.urlparse(url), urllib.parse.urlparse(samples_url)
    objs = [o for o in cl.list_objects_v2(Bucket=u.netloc, Prefix=u.path.strip("/") + "/").get("Contents", [])
            if o["Size"] > 4 * IMG]
    out: dict[str, Any] = {}

    def rate(fn: Any, args: list[Any]) -> dict[str, float]:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, args[:threads]))  # connections up, not timed
            t0 = time.perf_counter()
            nbytes = sum(pool.map(fn, args))
            dt = time.perf_counter() - t0
        return {"requests": len(args), "per_s": len(args) / dt, "MBps": nbytes / dt / MB}

    def whole(i: int) -> int:
        return len(cl.get_object(Bucket=su.netloc, Key=f"{su.path.strip('/')}/{sample_name(i)}")["Body"].read())

    def ranged(ko: tuple[str, int]) -> int:
        k, off = ko
        return len(cl.get_object(Bucket=u.netloc, Key=k, Range=f"bytes={off}-{off + IMG - 1}")["Body"].read())

    m = min(n, 300)
    out["whole_objects"] = rate(whole, [int(i) for i in rng.choice(n, m, replace=False)])
    if objs:
        args = []
        for _ in range(m):
            o = objs[int(rng.integers(len(objs)))]
            args.append((o["Key"], int(rng.integers(0, o["Size"] - IMG))))
        out["ranged_in_shards"] = rate(ranged, args)
        out["shard_object_bytes"] = int(np.median([o["Size"] for o in objs]))
    return out


def before_worktree(rev: str, path: Path) -> Path:
    if not (path / "kvdata" / "__init__.py").exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                       capture_output=True, text=True)
    return path


def run_before(a: argparse.Namespace, src: Path, work: Path, budget: int) -> dict[str, Any]:
    wt = before_worktree(a.before, Path(a.before_dir))
    env_extra = {"PYTHONPATH": str(wt)}
    url = f"s3://{BUCKET}/before.kv"
    log(f"(b) push with kvdata at {a.before}")
    push_s = prepare(src, url, a.samples, DIRECT, env_extra)
    tdir = work / "tiers-before"
    shutil.rmtree(tdir, ignore_errors=True)
    cfgp = write_config(tdir, budget)
    out = work / "before.json"
    env = dict(os.environ, KVDATA_CONFIG=str(cfgp), **env_extra)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--reader", url, "--tier-dir", str(tdir / "tier"),
           "--epochs", str(a.epochs), "--batch-size", str(a.batch_size), "--workers", str(a.workers),
           "--seed", str(a.seed), "--json", str(out), "--record-bytes", str(a.record_bytes)]
    p = subprocess.run(cmd, env=env, timeout=3600, stderr=sys.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"(b) reader failed ({p.returncode})")
    res = json.loads(out.read_text())
    res["push_s"] = push_s
    shutil.rmtree(tdir, ignore_errors=True)
    return res


def report(a: argparse.Namespace, res: dict[str, Any]) -> str:
    n, ds_bytes, budget = a.samples, res["dataset_bytes"], res["budget"]
    link = parse_rate_mbps(a.rate) * 1e6 / 8
    link_sps = link / IMG
    rows = []
    labels = (("a", "(a) kvdata now, in-process"), ("ad", "(a) kvdata now, through kvdatad"),
              ("b", f"(b) kvdata before issue 12 ({a.before}), in-process"),
              ("c", f"(c) one GET per sample, {a.threads} in flight"),
              ("as", "for reference: kvdata now, in-process, ShardShuffleSampler instead of shuffle=True"),
              ("asd", "for reference: kvdata now, through kvdatad, ShardShuffleSampler instead of shuffle=True"))
    runs = [(k, lbl) for k, lbl in labels if k in res["runs"]]
    c_sps = {e["epoch"]: e["samples_per_s"] for e in res["runs"]["c"]["epochs"]} if "c" in res["runs"] else {}
    for k, lbl in runs:
        r = res["runs"][k]
        if "error" in r:
            rows.append([lbl, "-", r["error"][:80], "", "", "", "", "", ""])
            continue
        for e in r["epochs"]:
            home = e["home_wire_bytes"] / ds_bytes
            payload = f"{e['payload_bytes'] / ds_bytes:.2f}" if "payload_bytes" in e else "-"
            tier = (f"{e['tier_peak'] / MB:,.1f} MB ({e['tier_peak'] / budget:.2f}x)" if "tier_peak" in e else "-")
            vs_c = f"{e['samples_per_s'] / c_sps[e['epoch']]:.2f}x" if k != "c" and e["epoch"] in c_sps else "-"
            gets = f"{e['gets']:,}" if e.get("gets", -1) >= 0 else "-"
            rows.append([lbl, e["epoch"], f"{e['samples_per_s']:,.0f}", f"{e['samples_per_s'] / link_sps:.0%}",
                         f"{home:.2f}", payload, gets, tier, vs_c])
    text = [f"### random order over a network home ({machine_line(res['machine'])})", "",
            (f"netlab S3 server (moto behind nginx, {DELAYED})" if getattr(a, "home", "s3") == "s3" else
             f"s3rver in the netlab namespace behind its own delay proxy ({DELAYED}; objects as files, a ranged GET "
             "reads just its range; no GET count: its log has no method)" if a.home == "s3rver" else
             f"netlab nginx static files ({NGINX_URL}; the dataset pushed into its root, (c)'s samples one file "
             "each beside it; no GET count: its access log is off)")
            + f", rate {a.rate}, RTT {a.rtt_ms:g} ms; {n} samples of "
            f"{'x'.join(map(str, SHAPE))} uint8 ({IMG / 1024:,.1f} KiB, {a.content}), {ds_bytes / MB:,.1f} MB, "
            f"kvdata shards <= "
            f"{a.shard_size}; tier budget {budget / MB:,.1f} MB ({budget / ds_bytes:.0%} of the dataset); "
            f"`DataLoader(ds, shuffle=True, num_workers={a.workers}, batch_size={a.batch_size})`, {a.epochs} "
            f"epochs, fresh workers each epoch; (a) with in-process engines and through one kvdatad (its own tier "
            f"directory, same budget). Link limit: {link / MB:,.0f} MB/s "
            f"nominal = {link_sps:,.0f} samples/s (iperf3 measured 955 Mbit/s here: {0.955 * link_sps:,.0f}/s). "
            f"Home bytes: what the netlab namespace sent (veth rx_bytes, headers included) per epoch, in datasets; "
            f"payload: for (c) the sum of the object sizes; GETs: requests the S3 server logged. "
            f"Tier peak: files in the tier directory plus unlinked "
            f"files still mapped, sampled every 10 ms.", "",
            md_table(["reader", "epoch", "samples/s", "% of link", "home (datasets, wire)",
                      "payload (datasets)", "GETs", "tier peak (vs budget)", "vs (c)"], rows, left=1),
            "(d) litdata and mosaic-streaming: bench/random_order_peers.py (bench/results/random_order.md)."]
    sv = res.get("server") or {}
    if "ranged_in_shards" in sv:
        w, r = sv["whole_objects"], sv["ranged_in_shards"]
        text.append(f"The S3 server alone, {a.threads} GETs in flight from one process: whole {IMG / 1024:,.1f} KiB "
                    f"objects {w['per_s']:,.0f}/s ({w['MBps']:,.0f} MB/s); ranged GETs of {IMG / 1024:,.1f} KiB inside "
                    f"the pushed shard objects (median {sv['shard_object_bytes'] / MB:.1f} MB) {r['per_s']:,.0f}/s "
                    f"({r['MBps']:,.0f} MB/s).")
    if "b" in a.skipped:
        text.append(f"(b) skipped: {a.skipped['b']}")
    tg = []
    for k, who in (("a", "in-process"), ("ad", "through kvdatad")):
        r = res["runs"].get(k) or {}
        if "epochs" not in r:
            continue
        eps, t = r["epochs"], []
        warm = eps[1:]
        if warm:
            h = max(e["home_wire_bytes"] for e in warm) / ds_bytes
            t.append(f"home traffic per warm epoch <= 0.85 datasets: {'met' if h <= 0.85 else 'NOT met'} "
                     f"(worst warm epoch {h:.2f}, wire bytes)")
        if c_sps:
            q = min(e["samples_per_s"] / c_sps[e["epoch"]] for e in eps if e["epoch"] in c_sps)
            t.append(f"samples/s >= 1.2x (c): {'met' if q >= 1.2 else 'NOT met'} (worst epoch {q:.2f}x)")
        pk = max(e["tier_peak"] for e in eps) / budget
        t.append(f"tier peak <= budget: {'met' if pk <= 1.0 else 'NOT met'} ({pk:.2f}x)")
        if k == "ad" and not r.get("via_daemon"):
            t.append("NOTE: the reader did not go through kvdatad")
        tg.append(f"(a) {who}: " + "; ".join(t))
    for k, who in (("as", "in-process"), ("asd", "through kvdatad")):
        r = res["runs"].get(k) or {}
        if len(r.get("epochs") or []) > 1:
            h = max(e["home_wire_bytes"] for e in r["epochs"][1:]) / ds_bytes
            ideal = 1 - budget / ds_bytes
            tg.append(f"shard-aware order ({who}) end to end within 0.05 of 1 - budget = {ideal:.2f}: "
                      f"{'met' if abs(h - ideal) <= 0.05 else 'NOT met'} (worst warm epoch {h:.2f}, wire bytes)")
    if tg:
        text += ["", "Targets (issue 12):", ""] + [f"- {x}." for x in tg]
    return "\n".join(text) + "\n"


def main() -> None:
    global SHAPE, IMG, COUNT_GETS, DELAYED, DIRECT  # set from the options (every function reads them)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="300 samples (smoke test)")
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--budget-frac", type=float, default=0.25, help="tier budget as a fraction of the dataset")
    p.add_argument("--shard-size", default="4MB")
    p.add_argument("--content", default="random", choices=["random", "photo", "smooth"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=32, help="(c): GETs in flight per worker")
    p.add_argument("--rtt-ms", type=float, default=25.0)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--before", default="bab32a3", help="(b): the commit before issue 12")
    p.add_argument("--before-dir", default="/tmp/kvbefore", help="(b): where its git worktree goes")
    p.add_argument("--no-before", action="store_true", help="skip (b)")
    p.add_argument("--only", default="a,ad,as,asd,b,c",
                   help="which of a, ad (a through kvdatad), as / asd (a / ad with ShardShuffleSampler), b, c to run")
    p.add_argument("--no-daemon", action="store_true", help="skip (a) through kvdatad")
    p.add_argument("--home", choices=["s3", "http", "s3rver"], default="s3",
                   help="the home: the netlab's S3 server (moto), nginx's static files (a ranged GET costs it what "
                        "a whole-file GET does, as on S3; skips (b) and the server calibration), or s3rver, a second "
                        "S3-protocol server started in the netlab behind its own delay proxy (ranged GETs read just "
                        "the range from its file; needs `npm install -g s3rver`)")
    p.add_argument("--netlab-sh", default=str(NETLAB_SH))
    p.add_argument("--dir", type=Path, help="work directory (default: a temp dir, removed)")
    p.add_argument("--json", type=Path)
    p.add_argument("--record-bytes", type=int, default=0,
                   help="samples of this many random bytes instead of 227x227x3 images (the 1 KiB variant: 1024)")
    p.add_argument("--reader", help=argparse.SUPPRESS)       # internal: (b)'s subprocess
    p.add_argument("--tier-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.record_bytes:  # every function here reads the sample shape from these two names
        SHAPE, IMG = (a.record_bytes,), a.record_bytes

    if a.reader:  # (b): run the kvdata reader with whatever kvdata PYTHONPATH gives
        s3_env(os.environ.get("AWS_ENDPOINT_URL") or DELAYED)  # the parent's home (moto or s3rver)
        res = kvdata_reader(a.reader, Path(a.tier_dir), a.epochs, a.batch_size, a.workers, a.seed)
        write_json(a.json, res)
        return

    if a.quick:
        a.samples = min(a.samples, 300)
        a.shard_size = "2MB"
    if os.geteuid() != 0:
        raise SystemExit("random_order needs root (../shared/netlab: network namespaces and tc)")
    sh = Path(a.netlab_sh)
    if not sh.exists():
        raise SystemExit(f"{sh} not found")
    only = set(a.only.split(","))
    a.skipped = {}
    if a.no_before:
        only.discard("b")
        a.skipped["b"] = "--no-before"
    if a.no_daemon:
        only -= {"ad", "asd"}
    lab: S3rver | None = None
    if a.home in ("http", "s3rver"):  # neither logs its requests here (s3rver's log has no method): no GET count
        COUNT_GETS = False
    if a.home == "s3rver":
        why = S3rver.available()
        if why is not None:
            raise SystemExit(f"--home s3rver: {why}")
        DELAYED, DIRECT = f"http://{NETLAB_IP}:{S3RVER_DELAYED_PORT}", f"http://{NETLAB_IP}:{S3RVER_PORT}"
        os.environ["AWS_ACCESS_KEY_ID"] = os.environ["AWS_SECRET_ACCESS_KEY"] = "S3RVER"  # the only ones it takes
    if a.home == "http" and "b" in only:
        only.discard("b")
        a.skipped["b"] = "--home http (the comparison before issue 12 is made on S3)"
    made = a.dir is None
    work = Path(tempfile.mkdtemp(prefix="kvdata-random-", dir="/tmp")) if made else a.dir
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"config": {k: str(v) for k, v in vars(a).items()}, "machine": machine_info(), "runs": {}}
    t_all = time.perf_counter()
    try:
        src = work / "ds"
        shutil.rmtree(src, ignore_errors=True)
        write_image_dataset(src, image_chunks(np.random.default_rng(a.seed), a.samples, 256, a.content, SHAPE),
                            shard_size=a.shard_size, compress=False)
        ds_bytes = a.samples * IMG
        budget = int(ds_bytes * a.budget_frac)
        out.update(dataset_bytes=ds_bytes, budget=budget)
        log(f"dataset: {a.samples} samples, {ds_bytes / MB:.1f} MB; budget {budget / MB:.1f} MB")

        print(netlab("up", "--rtt-ms", f"{a.rtt_ms:g}", "--rate", a.rate, sh=sh), file=sys.stderr)
        if a.home == "s3rver":
            lab = S3rver(work / "s3rver", a.rtt_ms, sh)
            lab.start()
        s3_env(DIRECT)
        import boto3
        boto3.session.Session().client("s3", endpoint_url=DIRECT).create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/ds.kv"
        if a.home == "http":  # the same dataset pushed into nginx's root, the samples as files beside it
            www = www_dir()
            shutil.rmtree(www / "ds.kv", ignore_errors=True)
            shutil.rmtree(www / "samples", ignore_errors=True)
            url = f"{NGINX_URL}/ds.kv"
            if only & {"a", "ad", "as", "asd"}:
                out["push_s"] = prepare(src, str(www / "ds.kv"), a.samples, DIRECT)
            if "c" in only:
                (www / "samples").mkdir(parents=True)
                import kvdata
                with kvdata.open(src) as st:
                    for i in range(a.samples):
                        (www / "samples" / sample_name(i)).write_bytes(st[i]["image"].tobytes())
        elif only & {"a", "ad", "as", "asd"}:
            out["push_s"] = prepare(src, url, a.samples, DIRECT)
            log(f"pushed in {out['push_s']:.1f}s")
        if "c" in only and a.home != "http":
            put_samples(src, f"s3://{BUCKET}/samples", a.samples)
            log("samples put as objects")
        s3_env(DELAYED)
        if "c" in only and only & {"a", "ad"} and a.home != "http":
            try:
                out["server"] = server_rates(url, f"s3://{BUCKET}/samples", a.samples, a.threads, a.seed)
                log(f"server: {out['server']}")
            except Exception as e:  # noqa: BLE001 -- a calibration only
                log(f"server rates failed: {type(e).__name__}: {e}")

        for k in ("a", "ad", "as", "asd", "c", "b"):
            if k not in only:
                continue
            log(f"({k}) ...")
            try:
                if k in ("a", "as"):
                    tdir = work / "tiers-now"
                    shutil.rmtree(tdir, ignore_errors=True)
                    os.environ["KVDATA_CONFIG"] = str(write_config(tdir, budget))
                    try:
                        out["runs"][k] = kvdata_reader(url, tdir / "tier", a.epochs, a.batch_size, a.workers, a.seed,
                                                       shard_aware=k == "as")
                    finally:
                        os.environ.pop("KVDATA_CONFIG", None)
                        shutil.rmtree(tdir, ignore_errors=True)
                elif k in ("ad", "asd"):
                    out["runs"][k] = run_daemon(a, url, work, budget, shard_aware=k == "asd")
                elif k == "c":
                    ds = (GetDataset(f"s3://{BUCKET}/samples", a.samples, a.threads) if a.home != "http"
                          else HttpGetDataset(f"{NGINX_URL}/samples", a.samples, a.threads))
                    eps = run_epochs(ds, a.epochs, a.batch_size, a.workers, a.seed, None, None)
                    for ep in eps:
                        ep["payload_bytes"] = ep["samples"] * IMG
                    out["runs"]["c"] = {"epochs": eps}
                else:
                    out["runs"]["b"] = run_before(a, src, work, budget)
            except Exception as e:  # noqa: BLE001 -- one reader failing still reports the others
                log(f"({k}) failed: {type(e).__name__}: {e}")
                out["runs"][k] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        if lab is not None:
            lab.stop()
        try:
            print(netlab("down", sh=sh), file=sys.stderr)
        except Exception as e:  # noqa: BLE001
            print(f"netlab down failed: {e}", file=sys.stderr)
        if made:
            shutil.rmtree(work, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t_all
    md = "## kvdata bench/random_order.py\n\n" + report(a, out)
    out["markdown"] = md
    print(md)
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
