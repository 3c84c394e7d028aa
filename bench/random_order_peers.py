#!/usr/bin/env python
"""Row (d) of bench/random_order.py: litdata and mosaicml-streaming in random order from the same S3 home.

Same setting as bench/random_order.py: inside ../shared/netlab (an S3 server behind a 1 Gbit
link with 25 ms RTT; needs root), 1,200 samples of 227x227x3 uint8 (the same seeded bytes as
random_order.py: _common.image_chunks, chunk 256) are written in each peer's own format locally,
uploaded to the netlab's S3 server through the direct endpoint (rate limit only), and read for
3 epochs from s3:// through the delayed endpoint, each peer's local cache limited to 25% of the
dataset's bytes (the budget kvdata gets in (a)):

  litdata   `litdata.optimize(fn, range(n), dir, chunk_bytes=4MB)`; read with
            `StreamingDataset("s3://...", cache_dir=..., shuffle=True, max_cache_size=budget,
            storage_options={"endpoint_url": delayed})` + `StreamingDataLoader(batch_size=32,
            num_workers=2)` (litdata's own shuffle: chunk order per epoch, items within chunks);
  mosaic    `streaming.MDSWriter(columns={"image": "ndarray:uint8:227,227,3", "label": "int"},
            size_limit=4MB)`; read with `StreamingDataset(remote="s3://...", local=...,
            shuffle=True, cache_limit=budget, batch_size=32)` (shuffle_algo default) +
            `streaming.StreamingDataLoader(batch_size=32, num_workers=2)`, S3_ENDPOINT_URL set;
  kvdata    for reference, (a) of random_order.py in the same netlab session (`--only` without
            it skips it; the report also compares with bench/out/random_order.json's (a)).

Neither peer's dataset is random-access over S3 in the DataLoader(shuffle=True) sense: both are
IterableDatasets whose shuffle permutes shards (chunks) and the samples within the shards that
are local, so `DataLoader(shuffle=True)` itself cannot be used; their own loaders are.

Per epoch: samples/s; home wire bytes (rx_bytes of the root-side veth nlab0, everything the
netlab namespace sent, as datasets); GETs the S3 server logged; the local cache's peak bytes
(random_order.TierSampler on the cache directory, every 10 ms, plus unlinked files still mapped).
Each peer's reader runs in its own subprocess (fresh imports, shared memory and caches), under
--reader-timeout.

  python bench/random_order_peers.py --quick
  python bench/random_order_peers.py --json bench/out/random_order_peers.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import random_order as ro  # noqa: E402
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
BUCKET = ro.BUCKET
PEERS = ("litdata", "mosaic")
MODULES = ("numpy", "torch", "boto3", "litdata", "streaming", "kvdata")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[:-len(unit)]) * mult)
    return int(s)


# ====================================================================== mosaic's import

TORCHVISION_NOTE: list[str] = []


def import_streaming() -> Any:
    """`import streaming` (mosaicml-streaming). Its __init__ imports streaming.vision, which imports
    torchvision at import time; the torchvision that pip resolves from PyPI for torch 2.13.0 is a
    CUDA build whose C ops do not load next to torch 2.13.0+cpu (libc10_cuda.so missing: "operator
    torchvision::nms does not exist"), and the CPU build is only on PyTorch's own index. The MDS
    reader and writer never use torchvision, so where that import fails a stub stands in for it
    (recorded in the report)."""
    try:
        import streaming
        return streaming
    except (RuntimeError, OSError, ImportError) as e:
        if "torchvision" not in f"{e} {traceback.format_exc()}":
            raise
        err = f"{type(e).__name__}: {e}"
    import types
    for m in [m for m in sys.modules if m.split(".")[0] in ("torchvision", "streaming")]:
        del sys.modules[m]
    tv = types.ModuleType("torchvision")
    tv.__path__ = []
    dsets, tr, trf = (types.ModuleType(f"torchvision.{n}") for n in ("datasets", "transforms", "transforms.functional"))

    class VisionDataset:  # noqa: D401 -- only a base class name for streaming.vision
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("torchvision stub (see bench/random_order_peers.py import_streaming)")

    def to_tensor(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torchvision stub (see bench/random_order_peers.py import_streaming)")

    dsets.VisionDataset = VisionDataset  # type: ignore[attr-defined]
    trf.to_tensor = to_tensor  # type: ignore[attr-defined]
    tv.datasets, tv.transforms, tr.functional = dsets, tr, trf  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": tv, "torchvision.datasets": dsets, "torchvision.transforms": tr,
                        "torchvision.transforms.functional": trf})
    import streaming
    TORCHVISION_NOTE.append(f"`import streaming` failed in torchvision ({err.splitlines()[0][:160]}); "
                            "a torchvision stub stood in (streaming.vision only)")
    return streaming


# ====================================================================== writing

def images_file(work: Path, n: int, seed: int, content: str) -> Path:
    """The n seeded samples (random_order.py's bytes) in one raw uint8 file (memmapped by the writers)."""
    p = work / "images.npy"
    mm = np.lib.format.open_memmap(p, mode="w+", dtype=np.uint8, shape=(n, *SHAPE))
    for start, arr in image_chunks(np.random.default_rng(seed), n, 256, content, SHAPE):
        mm[start:start + len(arr)] = arr
    mm.flush()
    del mm
    return p


_IMAGES: dict[str, np.ndarray] = {}


def _litdata_sample(index: int, path: str = "") -> dict[str, Any]:
    """litdata.optimize's fn (top level: its workers import it)."""
    if path not in _IMAGES:
        _IMAGES[path] = np.load(path, mmap_mode="r")
    return {"index": index, "image": np.array(_IMAGES[path][index]), "label": index % 1000}


def write_litdata(images: Path, out: Path, n: int, chunk_bytes: str) -> dict[str, Any]:
    from functools import partial

    import litdata
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    litdata.optimize(fn=partial(_litdata_sample, path=str(images)), inputs=list(range(n)), output_dir=str(out),
                     chunk_bytes=chunk_bytes, num_workers=1, mode="overwrite", start_method="fork")
    return {"write_s": time.perf_counter() - t0}


def write_mosaic(images: Path, out: Path, n: int, size_limit: int) -> dict[str, Any]:
    MDSWriter = import_streaming().MDSWriter
    shutil.rmtree(out, ignore_errors=True)
    arr = np.load(images, mmap_mode="r")
    t0 = time.perf_counter()
    cols = {"image": f"ndarray:uint8:{','.join(map(str, SHAPE))}", "label": "int", "index": "int"}
    with MDSWriter(out=str(out), columns=cols, size_limit=size_limit, compression=None) as w:
        for i in range(n):
            w.write({"image": np.array(arr[i]), "label": i % 1000, "index": i})
    return {"write_s": time.perf_counter() - t0}


def upload_dir(local: Path, url: str, endpoint: str) -> dict[str, Any]:
    """Every file under `local` to url/<relative path> through `endpoint` (boto3, 8 at a time)."""
    import urllib.parse

    import boto3
    u = urllib.parse.urlparse(url)
    cl = boto3.session.Session().client("s3", endpoint_url=endpoint)
    files = [p for p in sorted(local.rglob("*")) if p.is_file()]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: cl.upload_file(str(p), u.netloc, f"{u.path.strip('/')}/{p.relative_to(local)}"),
                      files))
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files), "upload_s": time.perf_counter() - t0,
            "largest_file": max((p.stat().st_size for p in files), default=0)}


# ====================================================================== reading (in the --reader subprocess)

def epochs_loop(make_iter: Any, epochs: int, smp: ro.TierSampler, per_shard: int) -> list[dict[str, Any]]:
    """`per_shard`: samples per shard (chunk); each batch's distinct shards are counted from its
    "index" field (how random the order is: DataLoader(shuffle=True) of 32 from 1,200 samples in
    48 shards of 25 touches about 23.5)."""
    out = []
    for e in range(epochs):
        smp.reset()
        rx0, lo = ro.rx_bytes(), ro.log_offset()
        n = 0
        t0 = time.perf_counter()
        first = None
        shards = []
        for batch in make_iter(e):
            if first is None:
                first = time.perf_counter() - t0
            idx = np.asarray(batch["index"])
            n += len(idx)
            shards.append(len(set((idx // per_shard).tolist())))
        dt = time.perf_counter() - t0
        rec = {"epoch": e + 1, "samples": n, "seconds": dt, "samples_per_s": n / dt if dt > 0 else 0.0,
               "first_batch_s": first or 0.0, "home_wire_bytes": ro.rx_bytes() - rx0, "gets": ro.gets_since(lo),
               "shards_per_batch": float(np.mean(shards)) if shards else 0.0,
               "cache_peak": smp.peak, "cache_peak_files": smp.peak_files,
               "cache_peak_mapped_deleted": smp.peak_mapped_deleted, "cache_end": smp.files()}
        out.append(rec)
        log(f"  epoch {e + 1}: {json.dumps(rec)}")
    return out


def litdata_allow_http() -> str | None:
    """litdata (0.2.7x) GETs chunks with obstore, whose client options are litdata's module constant
    `litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS` (timeout and pool settings, no
    allow_http): against an http:// endpoint every chunk GET fails with "HTTP error: builder
    error ... BadScheme", and neither storage_options nor AWS_ALLOW_HTTP reach it. Adds
    allow_http there (DataLoader workers fork and inherit it); returns a note for the report, or
    None where litdata has no such constant."""
    try:
        from litdata.streaming import downloader
    except ImportError:
        return None
    opts = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if not isinstance(opts, dict) or opts.get("allow_http"):
        return None
    downloader._OBSTORE_CLIENT_OPTIONS = {**opts, "allow_http": "true"}
    return ("litdata fetches chunks with obstore, whose client options (litdata.streaming.downloader."
            "_OBSTORE_CLIENT_OPTIONS) lack allow_http, so an http:// S3 endpoint fails (\"builder error\", "
            "BadScheme) whatever storage_options or AWS_ALLOW_HTTP say; the bench added allow_http=true to them")


def read_litdata(a: argparse.Namespace, url: str, cache: Path) -> dict[str, Any]:
    import litdata
    from litdata import StreamingDataLoader, StreamingDataset
    note = litdata_allow_http()
    t0 = time.perf_counter()
    ds = StreamingDataset(url, cache_dir=str(cache), shuffle=True, seed=a.seed, max_cache_size=a.budget,
                          storage_options={"endpoint_url": ro.DELAYED})
    dl = StreamingDataLoader(ds, batch_size=a.batch_size, num_workers=a.workers)
    open_s = time.perf_counter() - t0
    with ro.TierSampler(cache) as smp:
        # StreamingDataLoader advances the dataset's epoch on each iter() (a new shuffle each time)
        eps = epochs_loop(lambda e: iter(dl), a.epochs, smp, a.per_shard)
    return {"version": litdata.__version__, "open_s": open_s, "samples_in_dataset": len(ds), "epochs": eps,
            "cache_samples": smp.samples, "endpoint_patch": note}


def read_mosaic(a: argparse.Namespace, url: str, cache: Path) -> dict[str, Any]:
    streaming = import_streaming()
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    clean_stale_shared_memory()
    t0 = time.perf_counter()
    ds = StreamingDataset(remote=url, local=str(cache), shuffle=True, shuffle_seed=a.seed, cache_limit=a.budget,
                          batch_size=a.batch_size)
    dl = StreamingDataLoader(ds, batch_size=a.batch_size, num_workers=a.workers)
    open_s = time.perf_counter() - t0
    with ro.TierSampler(cache) as smp:
        # each iter() is the next epoch (the dataset counts them in shared memory)
        eps = epochs_loop(lambda e: iter(dl), a.epochs, smp, a.per_shard)
    return {"version": streaming.__version__, "open_s": open_s, "samples_in_dataset": len(ds),
            "torchvision_stub": TORCHVISION_NOTE[0] if TORCHVISION_NOTE else None,
            "shuffle_algo": ds.shuffle_algo, "epochs": eps, "cache_samples": smp.samples}


def reader_main(a: argparse.Namespace) -> None:
    ro.s3_env(ro.DELAYED)
    os.environ["S3_ENDPOINT_URL"] = ro.DELAYED       # mosaic's S3 downloader reads only this one
    os.environ.setdefault("AWS_ALLOW_HTTP", "true")  # obstore (litdata's chunk GETs): http:// endpoints
    cache = Path(a.cache_dir)
    import warnings
    warnings.simplefilter("ignore")  # torch's non-writable-array warning, once per worker and epoch
    try:
        res = (read_litdata if a.reader == "litdata" else read_mosaic)(a, a.url, cache)
    except BaseException as e:  # noqa: BLE001 -- recorded, the parent reports it
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    write_json(Path(a.json), res)


def run_reader(a: argparse.Namespace, peer: str, url: str, cache: Path, out: Path) -> dict[str, Any]:
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--reader", peer, "--url", url, "--cache-dir", str(cache),
           "--json", str(out), "--epochs", str(a.epochs), "--batch-size", str(a.batch_size),
           "--workers", str(a.workers), "--seed", str(a.seed), "--budget", str(a.budget),
           "--per-shard", str(max(1, parse_size(a.shard_size) // IMG))]
    try:
        p = subprocess.run(cmd, timeout=a.reader_timeout, stderr=sys.stderr, stdin=subprocess.DEVNULL,
                           start_new_session=True)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        return {"error": f"reader timed out after {a.reader_timeout:g} s"}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if not out.exists():
        return {"error": f"reader exited {rc} without a result"}
    res = json.loads(out.read_text())
    if rc != 0 and "error" not in res:
        res["error"] = f"reader exited {rc}"
    return res


# ====================================================================== report

def kvdata_reference(path: Path) -> dict[str, Any] | None:
    """(a) from random_order.py's JSON: per-epoch samples/s and home datasets."""
    try:
        d = json.loads(path.read_text())
        eps = d["runs"]["a"]["epochs"]
        ds = d["dataset_bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"file": str(path), "mtime": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime)),
            "epochs": [{"epoch": e["epoch"], "samples_per_s": e["samples_per_s"],
                        "home": e["home_wire_bytes"] / ds} for e in eps]}


def expected_shards(a: argparse.Namespace) -> float:
    """Distinct shards a uniform random batch touches on average (shards of equal size)."""
    per = max(1, parse_size(a.shard_size) // IMG)
    m = -(-a.samples // per)
    return m * (1 - (1 - 1 / m) ** a.batch_size)


def report(a: argparse.Namespace, res: dict[str, Any]) -> str:
    ds_bytes, budget = res["dataset_bytes"], res["budget"]
    same = {e["epoch"]: e for e in (res["runs"].get("kvdata") or {}).get("epochs", [])}
    ref = res.get("kvdata_file") or {}
    refe = {e["epoch"]: e for e in ref.get("epochs", [])}
    labels = (("kvdata", "kvdata (a), in-process, DataLoader(shuffle=True) (same session)"),
              ("litdata", "(d) litdata StreamingDataset(shuffle=True) + StreamingDataLoader"),
              ("mosaic", "(d) mosaic StreamingDataset(shuffle=True) + StreamingDataLoader"))
    rows = []
    for k, lbl in labels:
        r = res["runs"].get(k)
        if r is None:
            continue
        if "error" in r:
            rows.append([lbl, "-", "failed: " + r["error"].splitlines()[0][:120], "", "", "", "", ""])
            continue
        for e in r["epochs"]:
            home = e["home_wire_bytes"] / ds_bytes
            peak = e.get("cache_peak", e.get("tier_peak", 0))
            gets = f"{e['gets']:,}" if e.get("gets", -1) >= 0 else "-"
            vs_same = vs_file = "-"
            if k != "kvdata" and e["epoch"] in same:
                s = same[e["epoch"]]
                vs_same = f"{e['samples_per_s'] / s['samples_per_s']:.2f}x / {home / (s['home_wire_bytes'] / ds_bytes):.2f}x"
            if k != "kvdata" and e["epoch"] in refe:
                s = refe[e["epoch"]]
                vs_file = f"{e['samples_per_s'] / s['samples_per_s']:.2f}x / {home / s['home']:.2f}x"
            spb = f"{e['shards_per_batch']:.1f}" if "shards_per_batch" in e else "-"
            rows.append([lbl, e["epoch"], f"{e['samples']:,}", f"{e['samples_per_s']:,.0f}", f"{home:.2f}", gets,
                         f"{peak / MB:,.1f} MB ({peak / budget:.2f}x)", spb, vs_same, vs_file])
    for r in rows:
        while len(r) < 10:
            r.append("")
    text = [f"### (d) peers, random order over a network home ({machine_line(res['machine'])})", "",
            f"netlab S3 server (moto behind nginx, {ro.DELAYED}), rate {a.rate}, RTT {a.rtt_ms:g} ms; {a.samples} "
            f"samples of {'x'.join(map(str, SHAPE))} uint8 ({IMG / 1024:,.1f} KiB, {a.content}, random_order.py's "
            f"bytes), {ds_bytes / MB:,.1f} MB; shards / chunks <= {a.shard_size} in every format; local cache "
            f"budget {budget / MB:,.1f} MB ({budget / ds_bytes:.0%} of the dataset: litdata max_cache_size, "
            f"mosaic cache_limit, kvdata tier budget); batch_size {a.batch_size}, num_workers {a.workers}, "
            f"{a.epochs} epochs. Home: veth rx_bytes per epoch (headers included) in datasets; GETs: requests the "
            f"S3 server logged; cache peak: files under the cache directory plus unlinked files still mapped, "
            f"sampled every 10 ms. Shards per batch: distinct runs of "
            f"{max(1, parse_size(a.shard_size) // IMG)} consecutive sample indices (one shard's worth) in a batch, from "
            f"the peers' index field: how random the order is (a uniform shuffle of {a.batch_size} from {a.samples} "
            f"touches {expected_shards(a):.1f}; kvdata (a) is DataLoader(shuffle=True), uniform). "
            f"vs kvdata: samples/s ratio / home-bytes ratio, against (a) in the same session "
            f"and against (a) in {ref.get('file', 'bench/out/random_order.json')}"
            + (f" ({ref['mtime']})" if ref.get("mtime") else " (not readable)") + ".", "",
            md_table(["reader", "epoch", "samples", "samples/s", "home (datasets, wire)", "GETs",
                      "cache peak (vs budget)", "shards per batch", "vs kvdata (a) same session",
                      "vs kvdata (a) random_order.json"],
                     rows, left=1)]
    for k in PEERS:
        r = res["runs"].get(k) or {}
        up = (res.get("uploads") or {}).get(k)
        if up:
            text.append(f"- {k}: {up['files']} objects, {up['bytes'] / MB:,.1f} MB (largest {up['largest_file'] / MB:.1f} "
                        f"MB), written in {up.get('write_s', 0):.1f} s, uploaded in {up['upload_s']:.1f} s"
                        + (f"; version {r['version']}" if r.get("version") else "")
                        + (f"; shuffle_algo {r['shuffle_algo']}" if r.get("shuffle_algo") else "") + ".")
        if r.get("endpoint_patch"):
            text.append(f"- {k}: {r['endpoint_patch']}.")
        if r.get("torchvision_stub"):
            text.append(f"- {k}: {r['torchvision_stub']}.")
        if "error" in r:
            text.append(f"- {k} FAILED: {r['error']}")
    for k, why in (res.get("skipped") or {}).items():
        text.append(f"- {k} not run: {why}")
    return "\n".join(text) + "\n"


# ====================================================================== main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="300 samples, 2 MB shards (smoke test)")
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--budget-frac", type=float, default=0.25)
    p.add_argument("--shard-size", default="4MB", help="litdata chunk_bytes, mosaic size_limit, kvdata shard_size")
    p.add_argument("--content", default="random", choices=["random", "photo", "smooth"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rtt-ms", type=float, default=25.0)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="kvdata,litdata,mosaic", help="which of kvdata, litdata, mosaic to run")
    p.add_argument("--reader-timeout", type=float, default=420.0, help="seconds per peer's 3 epochs")
    p.add_argument("--kvdata-json", type=Path, default=HERE / "out" / "random_order.json",
                   help="random_order.py's JSON to compare with")
    p.add_argument("--netlab-sh", default=str(ro.NETLAB_SH))
    p.add_argument("--dir", type=Path, help="work directory (default: a temp dir, removed)")
    p.add_argument("--json", type=Path)
    p.add_argument("--reader", choices=PEERS, help=argparse.SUPPRESS)   # internal: one peer's subprocess
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    p.add_argument("--per-shard", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()

    if a.reader:
        reader_main(a)
        return
    if a.quick:
        a.samples = min(a.samples, 300)
        a.shard_size = "2MB"
    if os.geteuid() != 0:
        raise SystemExit("random_order_peers needs root (../shared/netlab: network namespaces and tc)")
    sh = Path(a.netlab_sh)
    if not sh.exists():
        raise SystemExit(f"{sh} not found")
    only = [k for k in a.only.split(",") if k]
    skipped: dict[str, str] = {}
    for k, mod in (("litdata", "litdata"), ("mosaic", "streaming")):
        if k in only:
            try:
                import_streaming() if mod == "streaming" else __import__(mod)
            except Exception as e:  # noqa: BLE001
                skipped[k] = f"import {mod} failed: {type(e).__name__}: {e}"
                only.remove(k)
    made = a.dir is None
    work = Path(tempfile.mkdtemp(prefix="kvdata-peers-", dir="/tmp")) if made else a.dir
    work.mkdir(parents=True, exist_ok=True)
    ds_bytes = a.samples * IMG
    a.budget = int(ds_bytes * a.budget_frac)
    out: dict[str, Any] = {"config": {k: str(v) for k, v in vars(a).items()}, "machine": machine_info(MODULES),
                           "runs": {}, "uploads": {}, "skipped": skipped, "dataset_bytes": ds_bytes,
                           "budget": a.budget}
    t_all = time.perf_counter()
    try:
        images = images_file(work, a.samples, a.seed, a.content)
        local: dict[str, Path] = {}
        for k in only:
            try:
                if k == "litdata":
                    local[k] = work / "litdata"
                    out["uploads"][k] = write_litdata(images, local[k], a.samples, a.shard_size)
                elif k == "mosaic":
                    local[k] = work / "mosaic"
                    out["uploads"][k] = write_mosaic(images, local[k], a.samples, parse_size(a.shard_size))
                elif k == "kvdata":
                    local[k] = work / "ds"
                    write_image_dataset(local[k], image_chunks(np.random.default_rng(a.seed), a.samples, 256,
                                                               a.content, SHAPE), shard_size=a.shard_size,
                                        compress=False)
                log(f"{k}: written")
            except Exception as e:  # noqa: BLE001
                log(f"{k}: writing failed: {type(e).__name__}: {e}")
                out["runs"][k] = {"error": f"writing failed: {type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()[-4000:]}

        print(ro.netlab("up", "--rtt-ms", f"{a.rtt_ms:g}", "--rate", a.rate, sh=sh), file=sys.stderr)
        ro.s3_env(ro.DIRECT)
        import boto3
        boto3.session.Session().client("s3", endpoint_url=ro.DIRECT).create_bucket(Bucket=BUCKET)
        for k in only:
            if k not in local or k in out["runs"]:
                continue
            url = f"s3://{BUCKET}/{k}" if k != "kvdata" else f"s3://{BUCKET}/ds.kv"
            try:
                if k == "kvdata":
                    out["push_s"] = ro.prepare(local[k], url, a.samples, ro.DIRECT)
                else:
                    out["uploads"][k].update(upload_dir(local[k], url, ro.DIRECT))
                log(f"{k}: uploaded to {url}")
            except Exception as e:  # noqa: BLE001
                out["runs"][k] = {"error": f"upload failed: {type(e).__name__}: {e}"}
                continue
            ro.s3_env(ro.DELAYED)
            log(f"({k}) reading ...")
            if k == "kvdata":
                tdir = work / "tiers-now"
                shutil.rmtree(tdir, ignore_errors=True)
                os.environ["KVDATA_CONFIG"] = str(ro.write_config(tdir, a.budget))
                try:
                    out["runs"][k] = ro.kvdata_reader(url, tdir / "tier", a.epochs, a.batch_size, a.workers, a.seed)
                except Exception as e:  # noqa: BLE001
                    out["runs"][k] = {"error": f"{type(e).__name__}: {e}"}
                finally:
                    os.environ.pop("KVDATA_CONFIG", None)
                    shutil.rmtree(tdir, ignore_errors=True)
            else:
                out["runs"][k] = run_reader(a, k, url, work / f"cache-{k}", work / f"{k}.json")
            if "error" in out["runs"][k]:
                log(f"({k}) failed: {out['runs'][k]['error']}\n{out['runs'][k].get('traceback', '')}")
            ro.s3_env(ro.DIRECT)
    finally:
        try:
            print(ro.netlab("down", sh=sh), file=sys.stderr)
        except Exception as e:  # noqa: BLE001
            print(f"netlab down failed: {e}", file=sys.stderr)
        if made:
            shutil.rmtree(work, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t_all
    out["kvdata_file"] = kvdata_reference(a.kvdata_json)
    md = "## kvdata bench/random_order_peers.py\n\n" + report(a, out)
    out["markdown"] = md
    print(md)
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
