#!/usr/bin/env python
"""kvdatad benchmark: four training readers through one daemon vs each with its own engine,
and the latency of the socket protocol.

Two sealed datasets of N images 227x227x3 uint8 are pushed to local home directories (shards
only as .mdb.zst, as after `kvdata push`). Then, per repeat, in an order alternating between
repeats:

  daemon     one `kvdatad --config FILE` subprocess (one tier, fresh directory); 4 reader
             subprocesses at once (2 jobs per dataset, KVDATA_CONFIG = that file, whose [daemon]
             socket names the daemon), each iterating kvdata.Dataset(home) with
             DataLoader(batch_size, ShardShuffleSampler(seed=job), num_workers=0,
             collate_fn=kvdata.collate) for E epochs. Home traffic = the daemon's
             bytes_from_home (+ any reader's fallback engine); peak tier usage = max of the tier's
             used bytes, polled through the `status` request every 0.2 s.
  no daemon  the same 4 readers, each with its own tier directory (same budget) and
             KVDATA_SOCKET naming a path where nothing listens, so each stages through its own
             in-process Engine. Home traffic = sum of the readers' engines' bytes_from_home;
             peak tier usage = max of the summed tier directories, polled every 0.2 s.

After the daemon run's readers finish (everything staged, daemon still up), one client sends
--requests `need` requests (dataset, shard id, sha256) for staged shards and --status-requests
`status` requests, timing each with perf_counter; an in-process Engine.locate of the same staged
copies is timed after the daemon stops, for scale.

Markdown tables go to stdout, progress to stderr; --json FILE writes every number.
  python bench/daemon.py --quick              # smoke test, tiny sizes
  python bench/daemon.py --json daemon.json   # defaults: 2 x 800 images, 16 MB shards, 2 epochs, 2 repeats
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    MB,
    built,
    log,
    machine_info,
    machine_line,
    make_images,
    mark_built,
    md_table,
    median,
    quantile_sorted,
    work_dir,
    write_image_dataset,
    write_json,
)

HERE = Path(__file__).resolve()
_STRIP_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "KVDATA_SOCKET", "KVDATA_CONFIG", "LISTEN_FDS")
PROCS: list[subprocess.Popen[bytes]] = []   # every process this script started (cleaned up in finally)


# ====================================================================== common

def machine() -> str:
    return machine_line(machine_info(("numpy", "lmdb", "zstandard", "torch", "kvdata")))


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


def popen(argv: list[str], env: dict[str, str], out: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """A subprocess in its own session (so cleanup reaches anything it starts), output to a file."""
    with open(out, "wb") as f:
        p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                             cwd=cwd, start_new_session=True)
    PROCS.append(p)
    return p


def stop(p: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the process's group, then SIGKILL it if it is still there after `grace`."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            p.terminate()
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            log(f"process {p.pid} did not exit after SIGKILL")


def cleanup_all() -> None:
    for p in PROCS:
        stop(p, grace=5.0)
    PROCS.clear()


def kvdatad_argv() -> list[str]:
    exe = Path(sys.executable).parent / "kvdatad"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kvdata_daemon"]


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# ====================================================================== datasets

def images(rng: np.random.Generator, start: int, n: int, ds_id: int, content: str) -> np.ndarray:
    """n images; pixel (0,0) encodes (sample index low byte, high byte, dataset id) so readers can
    check every sample they get. 'photo': a base colour plus 48 noise levels (zstd ~1.15x, like
    raw photo pixels); 'random': incompressible."""
    out = make_images(rng, n, "random" if content == "random" else "photo")
    idx = np.arange(start, start + n)
    out[:, 0, 0, 0] = idx & 255
    out[:, 0, 0, 1] = (idx >> 8) & 255
    out[:, 0, 0, 2] = ds_id
    return out


def build(work: Path, ds_id: int, a: argparse.Namespace) -> Path:
    """Dataset ds_id written (sealed, compressed) and pushed to a local home; reused if built with the same params."""
    from kvdata.sync.push import push

    src, home = work / f"ds{ds_id}", work / f"home{ds_id}"
    params = {"n": a.samples, "shard_size": a.shard_size, "seed": a.seed, "content": a.content, "id": ds_id}
    done = work / f"home{ds_id}.DONE.json"
    if built(done, params, home / "manifest.json") is not None:
        return home.resolve()
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)
    done.unlink(missing_ok=True)
    rng = np.random.default_rng([a.seed, ds_id])
    chunks = ((start, images(rng, start, min(256, a.samples - start), ds_id, a.content))
              for start in range(0, a.samples, 256))
    write_image_dataset(src, chunks, shard_size=a.shard_size, compress=True,
                        record=lambda i, img: {"image": img, "label": i})
    push(src, str(home), show=False)
    shutil.rmtree(src, ignore_errors=True)  # readers use the home only
    mark_built(done, params)
    return home.resolve()


def shards_of(home: Path) -> list[Any]:
    """The home's shard entries, as Engine.locate takes them (they also answer e["sha256"], ...)."""
    import kvdata

    with kvdata.Store(home, "r") as st:  # the manifest only: no daemon, no engine
        return list(st.manifest["shards"])


# ====================================================================== the reader subprocess

def reader_main(argv: list[str]) -> int:
    """One training job: kvdata.Dataset(home) + ShardShuffleSampler + DataLoader, E epochs,
    every sample checked against its index. Prints a JSON report as its last stdout line."""
    ap = argparse.ArgumentParser(prog="daemon.py _reader")
    ap.add_argument("home")
    ap.add_argument("--ds-id", type=int, required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--window", type=int, required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--go", required=True)
    a = ap.parse_args(argv)

    import torch
    import torch.utils.data as tud

    import kvdata

    torch.set_num_threads(1)
    ds = kvdata.Dataset(a.home)
    store = ds.store
    eng = store.engine
    via_daemon = type(eng).__name__ == "DaemonStager" and getattr(eng, "client", None) is not None
    sampler = kvdata.ShardShuffleSampler(ds, seed=a.job, window=a.window)
    dl = tud.DataLoader(ds, batch_size=a.batch_size, sampler=sampler, num_workers=0, collate_fn=kvdata.collate)
    Path(a.ready).touch()
    deadline = time.monotonic() + 600
    while not os.path.exists(a.go):
        if time.monotonic() > deadline:
            raise SystemExit("reader: no go signal within 600 s")
        time.sleep(0.002)
    wall0, t0 = time.time(), time.perf_counter()
    epochs, bad, total = [], 0, 0
    for e in range(a.epochs):
        sampler.set_epoch(e)
        te, n, waits = time.perf_counter(), 0, []
        tb = te
        for batch in dl:
            now = time.perf_counter()
            waits.append(now - tb)
            img, lab = batch["image"], batch["label"].to(torch.int64)
            px = img[:, 0, 0, :].to(torch.int64)
            ok = (px[:, 0] == (lab & 255)) & (px[:, 1] == ((lab >> 8) & 255)) & (px[:, 2] == a.ds_id)
            bad += int((~ok).sum())
            n += len(lab)
            tb = time.perf_counter()
        dt = time.perf_counter() - te
        w = sorted(waits) or [0.0]
        epochs.append({"samples": n, "seconds": dt, "samples_per_s": n / dt if dt else float("nan"),
                       "wait_p99_s": quantile_sorted(w, 0.99), "wait_max_s": w[-1]})
        total += n
    seconds = time.perf_counter() - t0
    wall1 = time.time()
    own = getattr(eng, "_fallback", None) if via_daemon or type(eng).__name__ == "DaemonStager" else eng
    st = own.stats if own is not None else None
    report = {"pid": os.getpid(), "ds_id": a.ds_id, "job": a.job, "samples": total, "expected": a.epochs * len(ds),
              "bad": bad, "seconds": seconds, "samples_per_s": total / seconds, "wall_start": wall0, "wall_end": wall1,
              "epochs": epochs, "engine": type(eng).__name__, "via_daemon": via_daemon,
              "daemon_at_end": getattr(eng, "client", None) is not None if via_daemon else False,
              "fell_back": via_daemon and getattr(eng, "_fallback", None) is not None,
              "own_bytes_from_home": st.bytes_from_home if st is not None else 0,
              "own_shards_staged": st.shards_staged if st is not None else 0,
              "own_misses": st.misses if st is not None else 0,
              "own_stall_seconds": round(st.stall_seconds, 3) if st is not None else 0.0}
    store.close()
    print(json.dumps(report), flush=True)
    return 0


# ====================================================================== one measured run

class Poller(threading.Thread):
    """Calls `sample()` every `interval` s; keeps the max of its total and of each part."""

    def __init__(self, sample: Any, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.sample, self.interval = sample, interval
        self.peak_total = 0
        self.peak_parts: dict[str, int] = {}
        self.polls = 0
        self.errors: list[str] = []
        self._halt = threading.Event()

    def poll_once(self) -> None:
        try:
            parts = self.sample()
        except Exception as e:  # noqa: BLE001 -- a failed poll is reported, not fatal
            self.errors.append(f"{type(e).__name__}: {e}")
            return
        self.polls += 1
        self.peak_total = max(self.peak_total, sum(parts.values()))
        for k, v in parts.items():
            self.peak_parts[k] = max(self.peak_parts.get(k, 0), v)

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.poll_once()

    def finish(self) -> None:
        self._halt.set()
        self.join(10)
        self.poll_once()


def dir_used(tier_root: Path) -> int:
    """Bytes on disk in a tier: the copies <sha>.mdb and in-flight temp files (what Tier.used() counts)."""
    total = 0
    try:
        with os.scandir(tier_root / "shards") as it:
            for e in it:
                if e.name.endswith(".mdb") or e.name.endswith(".tmp"):
                    try:
                        total += e.stat().st_size
                    except FileNotFoundError:
                        pass
    except FileNotFoundError:
        pass
    return total


def tier_toml(tier: Path, budget: int, sock: Path | None) -> str:
    text = f'[[tiers]]\nname = "bench"\npath = {json.dumps(str(tier))}\nbudget = {budget}\n'
    if sock is not None:
        text += f'\n[daemon]\nsocket = {json.dumps(str(sock))}\n'
    return text


def start_readers(a: argparse.Namespace, homes: list[Path], run_dir: Path,
                  envs: list[dict[str, str]]) -> tuple[list[subprocess.Popen[bytes]], list[Path], Path]:
    """2 jobs per dataset; returns once every reader has opened its dataset (before the go signal)."""
    procs, outs, readies = [], [], []
    go = run_dir / "go"
    j = 0
    for d, home in enumerate(homes):
        for job in range(a.jobs):
            ready, out = run_dir / f"ready{j}", run_dir / f"reader{j}.out"
            argv = [sys.executable, str(HERE), "_reader", str(home), "--ds-id", str(d), "--job", str(job),
                    "--epochs", str(a.epochs), "--batch-size", str(a.batch_size), "--window", str(a.window),
                    "--ready", str(ready), "--go", str(go)]
            procs.append(popen(argv, envs[j], out, run_dir))
            outs.append(out)
            readies.append(ready)
            j += 1
    deadline = time.monotonic() + a.start_timeout
    while not all(r.exists() for r in readies):
        for p, out in zip(procs, outs):
            if p.poll() is not None:
                raise SystemExit(f"reader {p.pid} exited with {p.returncode} before reading:\n{tail(out)}")
        if time.monotonic() > deadline:
            raise SystemExit(f"readers not ready within {a.start_timeout} s")
        time.sleep(0.02)
    return procs, outs, go


def finish_readers(a: argparse.Namespace, procs: list[subprocess.Popen[bytes]],
                   outs: list[Path]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + a.reader_timeout
    reports = []
    for p, out in zip(procs, outs):
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"reader {p.pid} did not finish within {a.reader_timeout} s:\n{tail(out)}") from None
        text = out.read_text(errors="replace")
        if p.returncode != 0:
            raise SystemExit(f"reader {p.pid} exited with {p.returncode}:\n{text[-3000:]}")
        reports.append(json.loads(text.strip().splitlines()[-1]))
    for r in reports:
        if r["bad"] or r["samples"] != r["expected"]:
            raise SystemExit(f"reader {r['pid']} (dataset {r['ds_id']}, job {r['job']}) read {r['samples']} samples "
                             f"(expected {r['expected']}), {r['bad']} wrong: {r}")
    return reports


def summarize(mode: str, reports: list[dict[str, Any]], go_wall: float, home_bytes: int, peak: int,
              per_reader_peak: list[int] | None, extra: dict[str, Any]) -> dict[str, Any]:
    total = sum(r["samples"] for r in reports)
    span = max(r["wall_end"] for r in reports) - go_wall
    out = {"mode": mode, "home_bytes": home_bytes, "peak_tier_bytes": peak, "samples": total, "span_s": span,
           "aggregate_samples_per_s": total / span,
           "reader_samples_per_s": [r["samples_per_s"] for r in reports],
           "min_reader_samples_per_s": min(r["samples_per_s"] for r in reports),
           "min_reader_epoch_samples_per_s": [min(r["epochs"][e]["samples_per_s"] for r in reports)
                                              for e in range(len(reports[0]["epochs"]))],
           "max_batch_wait_s": max(ep["wait_max_s"] for r in reports for ep in r["epochs"]),
           "per_reader_home_bytes": [r["own_bytes_from_home"] for r in reports],
           "per_reader_peak_tier_bytes": per_reader_peak, "readers": reports}
    out.update(extra)
    return out


def run_daemon_mode(a: argparse.Namespace, homes: list[Path], tier_parent: Path, budget: int, r: int) -> dict[str, Any]:
    from kvdata.protocol import Client

    run_dir = Path(tempfile.mkdtemp(prefix=f"daemon{r}-", dir=tier_parent))
    sock_dir = Path(tempfile.mkdtemp(prefix="kvdd-", dir="/tmp"))  # Unix socket paths: 108 bytes at most
    sock = sock_dir / "d.sock"
    daemon = None
    try:
        tier = run_dir / "tier"
        cfg = run_dir / "kvdata.toml"
        cfg.write_text(tier_toml(tier, budget, sock))
        dlog = run_dir / "kvdatad.log"
        daemon = popen(kvdatad_argv() + ["--config", str(cfg), "--log-level", "WARNING"], clean_env(), dlog, run_dir)
        deadline = time.monotonic() + 30
        client = None
        while client is None:
            if daemon.poll() is not None:
                raise SystemExit(f"kvdatad exited with {daemon.returncode}:\n{tail(dlog)}")
            try:
                client = Client(sock, timeout=30)
            except Exception:  # noqa: BLE001 -- not listening yet
                if time.monotonic() > deadline:
                    raise SystemExit(f"kvdatad did not listen on {sock} within 30 s:\n{tail(dlog)}") from None
                time.sleep(0.02)
        env = clean_env(KVDATA_CONFIG=str(cfg))  # the socket comes from the config's [daemon] socket
        procs, outs, go = start_readers(a, homes, run_dir, [env] * (len(homes) * a.jobs))

        def sample() -> dict[str, int]:
            st = client.request("status")
            return {t["name"]: int(t["used"]) for t in st["tiers"]}

        poller = Poller(sample)
        poller.start()
        go_wall = time.time()
        go.touch()
        try:
            reports = finish_readers(a, procs, outs)
        finally:
            poller.finish()
        status = client.request("status")
        not_via = [x["pid"] for x in reports if not x["via_daemon"]]
        if not_via:
            raise SystemExit(f"daemon mode: readers {not_via} did not use the daemon (socket {sock})")
        home_bytes = int(status["bytes_from_home"]) + sum(x["own_bytes_from_home"] for x in reports)
        lat = latency(a, client, homes)
        client.close()
        stop(daemon, grace=15.0)
        if daemon.returncode not in (0, None):
            log(f"kvdatad exited with {daemon.returncode} on SIGTERM:\n{tail(dlog)}")
        lat["engine_locate"] = engine_locate_latency(a, tier, budget, homes)
        return summarize("daemon", reports, go_wall, home_bytes, poller.peak_total, None, {
            "daemon_bytes_from_home": int(status["bytes_from_home"]), "daemon_shards_staged": status["shards_staged"],
            "daemon_hits": status["hits"], "daemon_misses": status["misses"], "daemon_errors": status["errors"],
            "daemon_stall_seconds": status["stall_seconds"], "polls": poller.polls, "poll_errors": poller.errors[:5],
            "fell_back": [x["pid"] for x in reports if x["fell_back"]], "latency": lat})
    finally:
        if daemon is not None:
            stop(daemon, grace=15.0)
        for p in list(PROCS):
            if p.poll() is None and p is not daemon:
                stop(p, grace=2.0)
        PROCS[:] = [p for p in PROCS if p.poll() is None]
        shutil.rmtree(sock_dir, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def run_plain_mode(a: argparse.Namespace, homes: list[Path], tier_parent: Path, budget: int, r: int) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"plain{r}-", dir=tier_parent))
    try:
        n = len(homes) * a.jobs
        tiers = [run_dir / f"tier{j}" for j in range(n)]
        envs = []
        for j, tier in enumerate(tiers):
            cfg = run_dir / f"kvdata{j}.toml"
            cfg.write_text(tier_toml(tier, budget, None))
            envs.append(clean_env(KVDATA_CONFIG=str(cfg), KVDATA_SOCKET=str(run_dir / "no-daemon.sock")))
        procs, outs, go = start_readers(a, homes, run_dir, envs)
        poller = Poller(lambda: {str(j): dir_used(t) for j, t in enumerate(tiers)})
        poller.start()
        go_wall = time.time()
        go.touch()
        try:
            reports = finish_readers(a, procs, outs)
        finally:
            poller.finish()
        via = [x["pid"] for x in reports if x["via_daemon"]]
        if via:
            raise SystemExit(f"no-daemon mode: readers {via} found a daemon")
        per_reader_peak = [poller.peak_parts.get(str(j), 0) for j in range(n)]
        return summarize("no daemon", reports, go_wall, sum(x["own_bytes_from_home"] for x in reports),
                         poller.peak_total, per_reader_peak, {"polls": poller.polls})
    finally:
        for p in list(PROCS):
            stop(p, grace=2.0)
        PROCS.clear()
        if not a.keep:
            shutil.rmtree(run_dir, ignore_errors=True)


# ====================================================================== protocol latency

def pct(xs: list[float]) -> dict[str, float]:
    arr = np.asarray(xs) * 1000.0
    return {"n": len(xs), "p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99)),
            "max_ms": float(arr.max()), "mean_ms": float(arr.mean())}


def latency(a: argparse.Namespace, client: Any, homes: list[Path]) -> dict[str, Any]:
    """need (staged shards, both datasets, round robin) and status, one request at a time."""
    targets = [(str(h), int(e["id"]), e["sha256"]) for h in homes for e in shards_of(h)]
    perf = time.perf_counter
    for i in range(min(200, a.requests)):  # warm-up (not timed)
        loc, sid, sha = targets[i % len(targets)]
        client.request("need", dataset=loc, shard=sid, sha256=sha)
    need, unstaged = [], 0
    for i in range(a.requests):
        loc, sid, sha = targets[i % len(targets)]
        t = perf()
        reply = client.request("need", dataset=loc, shard=sid, sha256=sha)
        need.append(perf() - t)
        unstaged += not reply["staged"] or not reply["path"].endswith(f"{sha}.mdb")
    status = []
    for _ in range(a.status_requests):
        t = perf()
        client.request("status")
        status.append(perf() - t)
    return {"need": pct(need), "need_not_staged": unstaged, "status": pct(status), "shards": len(targets)}


def engine_locate_latency(a: argparse.Namespace, tier: Path, budget: int, homes: list[Path]) -> dict[str, float]:
    """In-process Engine.locate of the same staged copies (what a reader without the daemon pays), for scale."""
    from kvdata.config import Config, TierConfig
    from kvdata.homes import open_home
    from kvdata.tiers.staging import Engine

    eng = Engine(Config(tiers=(TierConfig("bench", tier, budget),), stage_local=True), prefetch=False)
    hs = [open_home(str(h)) for h in homes]
    try:
        targets = [(hs[d], e) for d, h in enumerate(homes) for e in shards_of(h)]
        out, perf = [], time.perf_counter
        for i in range(a.requests):
            home, e = targets[i % len(targets)]
            t = perf()
            eng.locate(home, e)
            out.append(perf() - t)
        if eng.stats.misses:
            log(f"engine locate: {eng.stats.misses} misses (copies not staged?)")
        return pct(out)
    finally:
        eng.close()
        for h in hs:
            h.close()


# ====================================================================== report

def report(a: argparse.Namespace, homes: list[Path], runs: list[dict[str, Any]],
           budget: int) -> tuple[str, dict[str, Any]]:
    d = [x for x in runs if x["mode"] == "daemon"]
    p = [x for x in runs if x["mode"] == "no daemon"]
    E = a.epochs

    def m(rs: list[dict[str, Any]], key: str) -> float:
        return median([float(x[key]) for x in rs])

    def me(rs: list[dict[str, Any]], e: int) -> float:
        return median([x["min_reader_epoch_samples_per_s"][e] for x in rs])

    # "one job's" traffic and tier usage: per dataset, the median over its no-daemon jobs, summed over datasets
    njobs = a.jobs
    one_home = median([sum(median([x["per_reader_home_bytes"][di * njobs + j] for j in range(njobs)])
                        for di in range(len(homes))) for x in p])
    one_peak = median([sum(median([x["per_reader_peak_tier_bytes"][di * njobs + j] for j in range(njobs)])
                        for di in range(len(homes))) for x in p])
    unc = sum(int(e["bytes"]) for h in homes for e in shards_of(h))
    zst = sum(int(e["zst"]["bytes"]) for h in homes for e in shards_of(h))
    cols = ["mode", "home MB (fetched)", "peak tier MB", "aggregate samples/s", "min reader samples/s"]
    cols += [f"min reader epoch {e + 1}" for e in range(E)] + ["max batch wait (ms)"]

    def row(name: str, rs: list[dict[str, Any]]) -> list[Any]:
        return ([name, f"{m(rs, 'home_bytes') / MB:,.1f}", f"{m(rs, 'peak_tier_bytes') / MB:,.1f}",
                 f"{m(rs, 'aggregate_samples_per_s'):,.0f}", f"{m(rs, 'min_reader_samples_per_s'):,.0f}"]
                + [f"{me(rs, e):,.0f}" for e in range(E)] + [f"{1000 * m(rs, 'max_batch_wait_s'):,.0f}"])

    def ratio(key: str) -> str:
        return f"{m(d, key) / m(p, key):.2f}x"

    rows = [row(f"{len(homes) * njobs} readers, one kvdatad", d), row(f"{len(homes) * njobs} readers, own engines", p),
            ["daemon / no daemon", ratio("home_bytes"), ratio("peak_tier_bytes"), ratio("aggregate_samples_per_s"),
             ratio("min_reader_samples_per_s")] + [f"{me(d, e) / me(p, e):.2f}x" for e in range(E)]
            + [f"{m(d, 'max_batch_wait_s') / m(p, 'max_batch_wait_s'):.2f}x"],
            ["one job per dataset (no daemon)", f"{one_home / MB:,.1f}", f"{one_peak / MB:,.1f}", "-", "-"]
            + ["-"] * E + ["-"]]
    lats = [x["latency"] for x in d]

    def lm(kind: str, key: str) -> float:
        return median([x[kind][key] for x in lats])

    lrows = []
    for kind, name in (("need", "need (staged shard), through kvdatad"), ("status", "status, through kvdatad"),
                       ("engine_locate", "Engine.locate (staged), in process, no daemon")):
        lrows.append([name, int(lm(kind, "n")), f"{lm(kind, 'p50_ms'):.3f}", f"{lm(kind, 'p99_ms'):.3f}",
                      f"{max(x[kind]['max_ms'] for x in lats):.3f}"])
    home_r = m(d, "home_bytes") / one_home if one_home else float("nan")
    peak_r = m(d, "peak_tier_bytes") / one_peak if one_peak else float("nan")
    need_p99 = lm("need", "p99_ms")
    slow = [m(d, "min_reader_samples_per_s") / m(p, "min_reader_samples_per_s")] + \
        [me(d, e) / me(p, e) for e in range(E)]
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    tg = [f"home traffic = one job's: {verdict(home_r <= 1.01)} ({home_r:.2f}x)",
          f"peak tier usage = one job's: {verdict(peak_r <= 1.01)} ({peak_r:.2f}x)",
          f"need p99 < 1 ms: {verdict(need_p99 < 1.0)} ({need_p99:.3f} ms)",
          f"readers never slower than without the daemon (slowest reader, whole run and each epoch): "
          f"{verdict(min(slow) >= 1.0)} ({', '.join(f'{s:.2f}x' for s in slow)})"]
    notes = []
    fb = sorted({pid for x in d for pid in x["fell_back"]})
    if fb:
        notes.append(f"_readers {fb} fell back to their own engine during a daemon run "
                     "(their home bytes are counted)._")
    if any(x["latency"]["need_not_staged"] for x in d):
        notes.append("_some need replies were not staged copies: the latency is not of a staged shard._")
    if any(x["daemon_errors"] for x in d):
        notes.append(f"_daemon errors: {d[0]['daemon_errors'][:3]}_")
    text = [f"## kvdata bench/daemon.py ({machine()})", "",
            f"{len(homes)} datasets x {a.samples} images 227x227x3 uint8 ({a.content}), shards <= {a.shard_size}: "
            f"{unc / MB:,.1f} MB uncompressed, {zst / MB:,.1f} MB as .zst in local homes; {a.jobs} jobs per dataset, "
            f"each DataLoader(batch_size={a.batch_size}, ShardShuffleSampler(seed=job, window={a.window}), "
            f"num_workers=0, collate_fn=kvdata.collate), {E} epochs, started together; one tier of "
            f"{budget / MB:,.0f} MB per engine under {tier_parent_of(a)}; median of {a.repeats} repeat(s), "
            f"daemon/no-daemon order alternating.", "",
            md_table(cols, rows),
            f"Protocol latency, one client, one request at a time, {a.requests} need requests round robin over the "
            f"{lats[0]['shards']} staged shards (+200 warm-up) and {a.status_requests} status requests, "
            "idle daemon:", "",
            md_table(["request", "n", "p50 ms", "p99 ms", "max ms"], lrows),
            "Targets: " + "; ".join(tg) + ".", ""] + notes
    return "\n".join(text), {"home_vs_one_job": home_r, "peak_vs_one_job": peak_r, "need_p99_ms": need_p99,
                             "slowest_reader_ratios": slow, "one_job_home_bytes": one_home,
                             "one_job_peak_tier_bytes": one_peak, "uncompressed_bytes": unc, "zst_bytes": zst}


def tier_parent_of(a: argparse.Namespace) -> str:
    return str(a.tier_dir) if a.tier_dir else "the work dir"


# ====================================================================== main

def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_reader":
        sys.exit(reader_main(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=800, help="images per dataset (default 800, ~124 MB)")
    p.add_argument("--shard-size", default="16MB")
    p.add_argument("--content", choices=("photo", "random"), default="photo")
    p.add_argument("--datasets", type=int, default=2)
    p.add_argument("--jobs", type=int, default=2, help="readers per dataset")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--window", type=int, default=8, help="ShardShuffleSampler window")
    p.add_argument("--budget", help="tier budget per engine (default: 1.5x both datasets, uncompressed)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=5000, help="timed need requests")
    p.add_argument("--status-requests", type=int, default=1000, help="timed status requests")
    p.add_argument("--tier-dir", type=Path, help="parent of the tier directories (default: --dir; e.g. /dev/shm)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds for readers to open their datasets")
    p.add_argument("--reader-timeout", type=float, default=3600.0)
    p.add_argument("--dir", type=Path, help="work directory (default: a temp dir under /tmp, removed)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (datasets are reused by a later run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write every number here")
    p.add_argument("--quick", action="store_true", help="smoke test: 2 x 96 images, 4 MB shards, 1 repeat")
    a = p.parse_args()
    if a.quick:
        a.samples, a.shard_size, a.repeats, a.requests, a.status_requests = 96, "4MB", 1, 1000, 200
    from kvdata._util.sizes import parse_size

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    work, made = work_dir(a.dir.resolve() if a.dir else None, "kvdata-daemon-")
    tier_parent = (a.tier_dir or work).resolve()
    tier_parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        homes = [build(work, d, a) for d in range(a.datasets)]
        unc = sum(int(e["bytes"]) for h in homes for e in shards_of(h))
        budget = parse_size(a.budget, "--budget") if a.budget else int(unc * 1.5)
        log(f"{a.datasets} datasets ready: {sum(len(shards_of(h)) for h in homes)} shards, {unc / MB:.0f} MB "
            f"({time.perf_counter() - t0:.1f}s); budget {budget / MB:.0f} MB per engine")
        for r in range(a.repeats):
            order = ("daemon", "plain") if r % 2 == 0 else ("plain", "daemon")
            for mode in order:
                t = time.perf_counter()
                fn = run_daemon_mode if mode == "daemon" else run_plain_mode
                res = fn(a, homes, tier_parent, budget, r)
                res["repeat"] = r
                runs.append(res)
                log(f"repeat {r} {res['mode']}: home {res['home_bytes'] / MB:.1f} MB, peak tier "
                    f"{res['peak_tier_bytes'] / MB:.1f} MB, {res['aggregate_samples_per_s']:.0f} samples/s aggregate, "
                    f"min reader {res['min_reader_samples_per_s']:.0f}"
                    + (f", need p50/p99 {res['latency']['need']['p50_ms']:.3f}/"
                       f"{res['latency']['need']['p99_ms']:.3f} ms" if "latency" in res else "")
                    + f" ({time.perf_counter() - t:.1f}s)")
        text, verdicts = report(a, homes, runs, budget)
    finally:
        cleanup_all()
        if not a.keep:
            if made:
                shutil.rmtree(work, ignore_errors=True)
            else:
                for d in range(a.datasets):
                    shutil.rmtree(work / f"home{d}", ignore_errors=True)
                    shutil.rmtree(work / f"ds{d}", ignore_errors=True)
                    (work / f"home{d}.DONE.json").unlink(missing_ok=True)
    print(text)
    if a.json:
        write_json(a.json, {"config": {k: str(v) for k, v in vars(a).items()}, "machine": machine_info(),
                            "budget": budget, "verdicts": verdicts, "runs": runs, "markdown": text})


if __name__ == "__main__":
    main()
