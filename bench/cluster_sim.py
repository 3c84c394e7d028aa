#!/usr/bin/env python
"""Cluster simulation: N nodes x G GPUs reading one dataset from S3 through kvdata (issue 14, item 5).

Every rank's order comes from the real kvdata.order functions (bench/_cluster_plan.py: the calls
ShardShuffleSampler makes, on a dataset whose shards hold `--slots` virtual samples), and every
staging, eviction and bypass decision from the real kvdata.tiers.policy, called as the Engine
calls it (bench/_cluster_node.py). The simulation models the physics around them: GPUs consuming
samples, staging jobs of ranged GETs, the node's link, S3's request limit per prefix.

Per epoch it reports S3 bytes and GETs (mean and peak GET/s over 1 s bins), per-node staging
bandwidth, time to first batch, stall per GPU and epoch time, for the global and the locality
order, through kvdatad (`daemon`) or without it (`shared`: an Engine per rank over the node's
tiers; `private`: a tier per rank).

  python bench/cluster_sim.py                           # N = 8, 64, 1000 at D = 100 TB: its results page's tables
  python bench/cluster_sim.py --quick                   # N = 8, 64 at 1 TB, 2 epochs (a smoke test, ~30 s)
  python bench/cluster_sim.py --nodes 64 --samplers locality --modes daemon --prefixes 0,1
  python bench/cluster_sim.py --nodes 1000 --part-mib 64 --prefixes 0   # any parameter: what-ifs
  python bench/cluster_sim.py --calibrate run.json      # predicted vs measured (a multi-node run's JSON)

Scaling: nodes are alike (the same rates, their parts drawn alike), so `--detail` of them are
simulated and the cluster's totals are theirs times nodes/detail; with `--scale K` (auto: a
simulated node part of at most `--max-node-shards`) 1/K of the shards and of every tier are
simulated and totals and times multiplied by K (rates, peaks and time to first batch are not).
The report prints both. Defaults and their sources: see DEFAULTS below and bench/results/cluster_sim.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cluster_node import MODES, Node, Params  # noqa: E402
from _cluster_plan import SAMPLERS, Layout, RankEpoch, announced_next, epoch_rows  # noqa: E402
from _common import machine_info, machine_line, md_table, write_json  # noqa: E402

TB, GB, MB = 1e12, 1e9, 1e6
STUCK_TICKS = 20000   # ticks in a row in which nothing moved: the model is wedged (a bug or absurd parameters)

# Where each default comes from (the report prints this list).
DEFAULTS = [
    ("dataset 100 TB of 256 MB shards (~390,625) of 110 KB samples", "issue 14; ImageNet's mean JPEG is ~110 KB; "
     "256 MB is kvdata's default shard size"),
    ("tier 4.34 TB per node (3.84 TB NVMe + 0.5 TB RAM), one budget", "issue 14; kvdata's keep set uses the sum of "
     "a node's tiers (Engine.keep_set), which tier holds a copy does not change S3 traffic"),
    ("link 100 Gbit/s per node", "issue 14 (25 Gbit/s: --link-gbps 25)"),
    ("5,500 GET/s per partitioned prefix; one prefix", "AWS S3 user guide, 'Optimizing performance': at least "
     "3,500 PUT and 5,500 GET/HEAD per second per partitioned prefix; a dataset is one prefix (<url>/shards/)"),
    ("first byte 30 ms", "issue 14 (20-50 ms in-region); AWS quotes 100-200 ms for small objects end to end"),
    ("90 MB/s per connection", "an assumption: the single-stream S3 rate commonly measured in-region "
     "(e.g. dvassallo/s3-benchmark); not published by AWS"),
    ("8 MiB ranged GETs, 8 in flight per job, 3 jobs per Engine", "kvdata.tiers.staging.Engine defaults (part_size, "
     "parts_in_flight, workers); AWS recommends 8-16 MB byte ranges"),
    ("1 GB/s decompress + sha256 per staging job", "an assumption: one core's sha256 with SHA extensions "
     "(~1.5-2 GB/s) plus zstd of incompressible JPEG payloads"),
    ("2,500 samples/s per GPU, batch 256, 8 DataLoader workers", "issue 14 (2,000-3,000 ImageNet samples/s per "
     "GPU); a record read is one GET per sample (frames of <= 128 KB: kvdata.format.frames), 32 in flight per "
     "process (kvdata.tiers.records.IN_FLIGHT)"),
    ("window 8, exchange 0.1, lookahead 16", "ShardShuffleSampler and Engine defaults"),
]


# ====================================================================== the simulation

def detail_nodes(p: Params) -> list[int]:
    """The nodes simulated: `detail` of them spread over 0..nodes-1."""
    d = max(1, min(p.detail, p.nodes))
    return sorted(set(np.linspace(0, p.nodes - 1, d).round().astype(int).tolist()))


def auto_scale(p: Params, max_node_shards: int) -> int:
    part = p.shards_total / p.nodes
    return max(1, int(part // max_node_shards))


def auto_dt(p: Params) -> float:
    """A tick short against a rank's time per shard and a staging job's time (at most 0.25 s);
    up to 8x longer when S3's request limit slows everything down by more than that (the
    node's whole-shard GETs alone against its share), so a throttled run takes as many ticks."""
    rate = p.gpu_rate if p.gpu_rate > 0 else p.read_rate
    per_shard = p.samples_per_shard / rate
    job = p.latency + p.zst_shard / min(p.link_bps / 8, p.parts_in_flight * p.conn_bps, p.verify_bps)
    dt = max(1e-3, min(0.25, per_shard / 2, job / 2))
    if p.prefixes > 0:
        need = p.gpus * rate * p.sample_bytes / p.compression       # bytes/s a node reads
        by_record = max(0.0, 1.0 - p.tier_bytes / (p.dataset_bytes / p.nodes))  # a node's part beyond its tiers
        gets = need * (1 - by_record) / p.part_bytes + by_record * p.gpus * rate * p.record_gets_per_sample
        dt *= min(8.0, max(1.0, gets / (p.prefixes * p.get_limit / p.nodes)))
    return dt


def simulate(p: Params, sampler: str, mode: str, show: bool = False) -> dict[str, Any]:
    """Run the epochs; per epoch the cluster's estimates (see the module docstring)."""
    layout = Layout(p.sim_shards, p.sim_slots, p.nodes, p.gpus, p.window, p.seed, p.exchange)
    groups = layout.groups()
    detail = detail_nodes(p)
    ranks = {n: [n * p.gpus + i for i in range(p.gpus)] for n in detail}
    flat = [r for n in detail for r in ranks[n]]
    sizes = dict.fromkeys(range(p.sim_shards), int(p.shard_bytes))
    nodes = {n: Node(p, mode, sizes) for n in detail}

    def epochs_of(e: int) -> dict[int, RankEpoch]:
        rows = epoch_rows(layout, groups, sampler, e, flat)
        return {r: RankEpoch.of(layout, rows[r]) for r in flat}

    t0 = time.perf_counter()
    eps = {0: epochs_of(0)}
    t = 0.0
    out = []
    group = [nodes[n] for n in detail]
    for e in range(p.epochs):
        eps[e + 1] = epochs_of(e + 1)
        this, nxt = eps.pop(e), eps[e + 1]
        for n in detail:
            nodes[n].start_epoch(t, [this[r] for r in ranks[n]],
                                 [announced_next(layout, groups, sampler, e, r, nxt[r]) for r in ranks[n]])
        end = _run(group, t, p.dt, p.lockstep)
        out.append(_epoch_result(p, e, t, end, group))
        if show:
            r = out[-1]
            print(f"  {sampler}/{mode} epoch {e}: {r['s3_bytes'] / TB:.2f} TB from S3, {r['epoch_s']:.0f} s, "
                  f"peak {r['gets_peak']:,.0f} GET/s ({time.perf_counter() - t0:.0f} s so far)", file=sys.stderr)
        t = end
    return {"sampler": sampler, "mode": mode, "params": asdict(p), "detail_nodes": detail, "epochs": out,
            "seconds": time.perf_counter() - t0}


def _run(nodes: list[Node], t: float, dt: float, lockstep: bool) -> float:
    """Tick the nodes together until every reader is done with the epoch (an epoch ends for
    all at once: DDP's last step); the end time. In lockstep every reader of every node reads
    as far as the one that got least this tick (DDP: a step needs every GPU's batch)."""
    stuck = 0
    while not all(n.done() for n in nodes):
        before = sum(r.cursor for n in nodes for r in n.readers)
        common = min(n.propose(t, dt) for n in nodes)
        for n in nodes:
            n.advance(common if lockstep else None)
        t += dt
        moved = sum(r.cursor for n in nodes for r in n.readers) != before or any(n.log.s3_bytes[-1] > 0 for n in nodes)
        stuck = 0 if moved else stuck + 1
        if stuck > STUCK_TICKS:
            raise RuntimeError(f"the simulation made no progress for {STUCK_TICKS} ticks at t={t:.1f}s "
                               f"(readers at {[r.cursor for n in nodes for r in n.readers]}); check the parameters")
    return t


def _bins(nodes: list[Node], t0: float, t1: float, dt: float, per_bin: int) -> dict[str, np.ndarray]:
    """Sums over the nodes' tick logs within [t0, t1) in bins of `per_bin` ticks (by tick
    number: times summed tick by tick drift, and a bin of one tick too many reads as a peak)."""
    nb = max(1, math.ceil(round((t1 - t0) / dt) / per_bin))
    out = {k: np.zeros(nb) for k in ("gets", "s3_bytes", "staged")}
    per_node = []
    for node in nodes:
        a = node.log.arrays()
        m = (a["t"] >= t0 - dt / 2) & (a["t"] < t1 - dt / 2)
        idx = np.minimum(np.rint((a["t"][m] - t0) / dt).astype(np.int64) // per_bin, nb - 1)
        for k in out:
            out[k] += np.bincount(idx, weights=a[k][m], minlength=nb)
        per_node.append(np.bincount(idx, weights=a["staged"][m], minlength=nb))
    out["node_staged_max"] = np.max(per_node, axis=0) if per_node else np.zeros(nb)
    return out


def _epoch_result(p: Params, epoch: int, t0: float, t1: float, nodes: list[Node]) -> dict[str, Any]:
    k = p.nodes / len(nodes)            # nodes each simulated one stands for
    s = p.scale
    per_bin = max(1, round(1.0 / p.dt))        # bins of about 1 s, a whole number of ticks
    width = p.dt * per_bin
    b = _bins(nodes, t0, t1, p.dt, per_bin)
    readers = [r for n in nodes for r in n.readers]
    # with 1/s of the shards simulated, what scales with the dataset is multiplied by s; the
    # start of an epoch (up to the first batch: the first windows staged) does not scale
    first = max((r.ttfb or 0.0) for r in readers)

    def scaled(x: float, x0: float) -> float:
        return x0 + max(0.0, x - x0) * s
    s3 = sum(n.whole_bytes + n.record_bytes for n in nodes) * k * s
    gets = sum(n.gets for n in nodes) * k * s
    sim_s = t1 - t0
    epoch_s = scaled(sim_s, min(first, sim_s))
    hits = sum(r.hits for r in readers)
    recs = sum(r.records for r in readers)
    return {
        "epoch": epoch,
        "epoch_s": epoch_s,
        "s3_bytes": s3,
        "s3_datasets": s3 / (p.dataset_bytes / p.compression),
        "whole_bytes": sum(n.whole_bytes for n in nodes) * k * s,
        "record_bytes": sum(n.record_bytes for n in nodes) * k * s,
        "s3_gets": gets,
        "gets_mean": gets / epoch_s if epoch_s else 0.0,
        "gets_peak": float(b["gets"].max()) * k / width,
        "s3_bps_peak": float(b["s3_bytes"].max()) * k / width,
        "node_stage_bps_mean": sum(n.whole_bytes for n in nodes) / len(nodes) / sim_s if sim_s else 0.0,
        "node_stage_bps_peak": float(b["node_staged_max"].max()) / width,
        "per_node_staged_bytes": [n.whole_bytes * s for n in nodes],
        "ttfb_mean": float(np.mean([r.ttfb or 0.0 for r in readers])),
        "ttfb_max": float(np.max([r.ttfb or 0.0 for r in readers])),
        "stall_mean": float(np.mean([scaled(r.stall, r.stall0) for r in readers])),
        "stall_max": float(np.max([scaled(r.stall, r.stall0) for r in readers])),
        "waited_mean": float(np.mean([scaled(r.waited, r.waited0) for r in readers])),
        "tier_fraction": hits / (hits + recs) if hits + recs else 0.0,   # read from a whole copy in a tier
        "record_fraction": recs / (hits + recs) if hits + recs else 0.0,
        "evictions": sum(n.evictions for n in nodes),
        "private_copies": sum(n.private_copies for n in nodes),
        "samples": int(sum(len(r.ep.shards) for r in readers if r.ep is not None) * p.samples_per_slot * k),
    }


# ====================================================================== reports

def limits(p: Params, runs: list[dict[str, Any]]) -> list[tuple[str, float, str]]:
    """What limits first: each resource's need (peak over the runs' epochs) against its capacity."""
    node_need = p.gpus * (p.gpu_rate or p.read_rate) * p.sample_bytes
    part = p.dataset_bytes / p.nodes
    peak_gets = max(e["gets_peak"] for r in runs for e in r["epochs"])
    peak_node = max(e["node_stage_bps_peak"] for r in runs for e in r["epochs"])
    stage_cap = min(p.parts_in_flight * p.part_bytes / (p.latency + p.part_bytes / p.conn_bps),
                    p.verify_bps / p.compression) * p.workers
    return [
        ("S3 GET/s, peak over all runs / one prefix", peak_gets / p.get_limit,
         f"{peak_gets:,.0f} GET/s = {math.ceil(peak_gets / p.get_limit)} prefixes of {p.get_limit:,.0f}"),
        ("node link: what 8 GPUs read / link", node_need / (p.link_bps / 8),
         f"{node_need / GB:.2f} GB/s of {p.link_bps / 8 / GB:.2f} GB/s"),
        ("node link: peak whole-shard staging / link", peak_node / (p.link_bps / 8),
         f"{peak_node / GB:.2f} GB/s"),
        ("kvdatad staging (3 jobs) / what 8 GPUs read", node_need / stage_cap,
         f"{stage_cap / GB:.2f} GB/s from {p.workers} jobs x {p.parts_in_flight} x {p.part_bytes / 2**20:g} MiB"),
        ("SSD budget: a node's locality part / its tiers", part / p.tier_bytes,
         f"{part / TB:.2f} TB part, {p.tier_bytes / TB:.2f} TB tiers"),
    ]


def table(runs: list[dict[str, Any]], p: Params) -> str:
    rows = []
    for r in runs:
        for e in r["epochs"]:
            rows.append([r["sampler"], r["mode"], e["epoch"], f"{e['s3_bytes'] / TB:,.1f}", f"{e['s3_datasets']:.2f}",
                         f"{e['record_fraction']:.0%}", f"{e['gets_mean']:,.0f}", f"{e['gets_peak']:,.0f}",
                         math.ceil(e["gets_peak"] / p.get_limit) if e["gets_peak"] else 0,
                         f"{e['node_stage_bps_mean'] / GB:.2f} / {e['node_stage_bps_peak'] / GB:.2f}",
                         f"{e['ttfb_mean']:.1f} / {e['ttfb_max']:.1f}", f"{e['stall_mean']:,.0f} / {e['stall_max']:,.0f}",
                         f"{e['waited_mean']:,.0f}", f"{e['epoch_s']:,.0f}"])
    return md_table(["sampler", "mode", "epoch", "S3 TB", "datasets", "by record", "GET/s mean", "GET/s peak",
                     "prefixes needed", "node staging GB/s mean / peak", "first batch s mean / max",
                     "stall s/GPU mean / max", "waited in step s/GPU", "epoch s"], rows, left=2)


def describe(p: Params) -> str:
    return (f"{p.nodes} nodes x {p.gpus} GPUs, {p.dataset_bytes / TB:g} TB in {p.shards_total:,} shards of "
            f"{p.shard_bytes / MB:g} MB ({p.samples_per_shard:,.0f} samples of {p.sample_bytes / 1e3:g} KB), tiers "
            f"{p.tier_bytes / TB:g} TB per node, link {p.link_bps / 1e9:g} Gbit/s, "
            f"{f'{p.gpu_rate:g} samples/s per GPU' if p.gpu_rate else f'GPUs as fast as the data comes (<= {p.read_rate:g}/s)'}, "
            f"S3 {'unlimited' if p.prefixes == 0 else f'{p.prefixes} prefix(es) x {p.get_limit:,.0f} GET/s'}, "
            f"first byte {p.latency * 1e3:g} ms, {p.part_bytes / 2**20:g} MiB ranged GETs, "
            f"{'GPUs in step (DDP)' if p.lockstep else 'ranks at their own pace'}, {p.epochs} epochs"
            f"{f', {p.start_s:g} s to start each epoch' if p.start_s else ''}"
            f"{f', S3 server {p.server_bps / MB:g} MB/s in all' if p.server_bps else ''}"
            f"{'; WHAT-IF: bypassed shards read whole, not by record' if p.bypass_whole else ''}; simulated: "
            f"{len(detail_nodes(p))} node(s), 1/{p.scale} of the shards ({p.sim_shards:,}) and tiers, "
            f"{p.sim_slots} slots per shard, tick {p.dt:.3g} s")


def run_scale(a: argparse.Namespace, base: Params) -> tuple[str, dict[str, Any]]:
    md = ["## Cluster simulation (simulated, not measured)", "",
          f"Command: `python bench/cluster_sim.py {' '.join(sys.argv[1:])}`".rstrip(), ""]
    results: dict[str, Any] = {"machine": machine_info(), "config": {"quick": str(a.quick)}, "runs": []}
    for n in a.nodes:
        for pref in a.prefixes:
            p = replace(base, nodes=n, prefixes=pref)
            if a.scale == "auto":
                p = replace(p, scale=auto_scale(p, a.max_node_shards))
            if a.dt is None:
                p = replace(p, dt=auto_dt(p))
            p = replace(p, keep_ticks=a.keep_ticks or (8 if p.scale > 1 else 1))
            print(f"N={n}, prefixes={pref}: {describe(p)}", file=sys.stderr)
            runs = [simulate(p, s, m, show=not a.quiet) for s in a.samplers for m in a.modes]
            results["runs"].extend(runs)
            s3 = "S3 not limiting (the demand)" if pref == 0 else f"S3 limited to {pref} prefix(es)"
            md += [f"### N = {n} nodes, {s3}", "", describe(p) + ".", "", table(runs, p), ""]
            if pref == 0:
                md += [md_table(["what", "need / capacity", "figures"],
                                [[w, f"{x:.2f}", f] for w, x, f in limits(p, runs)]), ""]
    md += ["Assumptions and sources:", ""] + [f"- {w}: {s}" for w, s in DEFAULTS]
    results["markdown"] = "\n".join(md)
    return results["markdown"], results


# ====================================================================== calibration

REQUIRED = ("nodes", "ranks_per_node", "samples", "sample_bytes", "shard_bytes", "shards", "dataset_bytes",
            "tier_budget_bytes", "link_rate_bps", "rtt_ms", "epochs", "seed", "exchange", "batch_size", "num_workers")
BYTES_TOL, TIME_TOL = 0.10, 0.20


class CalibrationError(ValueError):
    """A measured-run file that cannot be used; the message names the file, the key and the fix."""


def _num(where: str, key: str, v: Any, lo: float = 0.0, integer: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo \
            or (integer and int(v) != v):
        kind = "an integer" if integer else "a number"
        raise CalibrationError(f"{where}: {key} is {v!r}; it must be {kind} >= {lo:g}")
    return float(v)


def load_measured(path: Path) -> dict[str, Any]:
    """The measured run (schema in bench/results/cluster_sim.md), checked before anything is simulated."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CalibrationError(f"{path}: cannot read it as JSON ({e}); pass the file the multi-node run wrote") from None
    if not isinstance(data, dict) or not isinstance(data.get("params"), dict) or not isinstance(data.get("runs"), list):
        raise CalibrationError(f"{path}: needs an object with 'params' (an object) and 'runs' (a list)")
    pr = data["params"]
    for key in REQUIRED:
        if key not in pr:
            raise CalibrationError(f"{path}: params.{key} is missing; the run must record it")
    ints = {"nodes", "ranks_per_node", "samples", "shards", "epochs", "seed", "batch_size", "num_workers"}
    for key in REQUIRED:
        if key != "exchange":
            _num(f"{path}", f"params.{key}", pr[key], 0 if key in ("seed", "num_workers", "rtt_ms") else 1,
                 key in ints)
    _num(f"{path}", "params.exchange", pr["exchange"])
    if pr["exchange"] > 1:
        raise CalibrationError(f"{path}: params.exchange is {pr['exchange']}; it must be in [0, 1]")
    for key in ("zst_dataset_bytes", "dataset_s3_bytes"):
        if key in pr:
            _num(f"{path}", f"params.{key}", pr[key], 1)
    if "gpu_samples_per_s" in pr:
        _num(f"{path}", "params.gpu_samples_per_s", pr["gpu_samples_per_s"])
    if "daemon" in pr and not isinstance(pr["daemon"], bool):
        raise CalibrationError(f"{path}: params.daemon is {pr['daemon']!r}; it must be true or false")
    if not data["runs"]:
        raise CalibrationError(f"{path}: runs is empty; nothing to compare")
    for i, r in enumerate(data["runs"]):
        where = f"{path}: runs[{i}]"
        if not isinstance(r, dict):
            raise CalibrationError(f"{where} is not an object")
        if r.get("sampler") not in SAMPLERS:
            raise CalibrationError(f"{where}.sampler is {r.get('sampler')!r}; it must be one of {', '.join(SAMPLERS)}")
        _num(where, "epoch", r.get("epoch"), 1, True)          # numbered from 1, as multinode.py numbers them
        if r["epoch"] > pr["epochs"]:
            raise CalibrationError(f"{where}.epoch is {r['epoch']}, but params.epochs is {pr['epochs']} "
                                   "(epochs are numbered 1..epochs)")
        _num(where, "s3_bytes", r.get("s3_bytes"))
        _num(where, "epoch_seconds", r.get("epoch_seconds"), 1e-9)
    return data


def calibration_params(data: dict[str, Any], base: Params) -> Params:
    """The simulation's parameters for a measured run: its own numbers, exactly (no scaling,
    every node simulated, a virtual sample per real sample up to 4,096 per shard)."""
    pr = data["params"]
    shards = int(pr["shards"])
    per_shard = pr["samples"] / shards
    shard_bytes = pr["dataset_bytes"] / shards
    extra: dict[str, Any] = {}
    zst = pr.get("zst_dataset_bytes", pr.get("dataset_s3_bytes"))   # the bytes at the home (multinode.py's name)
    if zst:
        extra["compression"] = pr["dataset_bytes"] / zst
    if "gpu_samples_per_s" in pr:       # 0: the ranks only read (no compute): as fast as the data comes
        extra["gpu_rate"] = float(pr["gpu_samples_per_s"])
    p = replace(base, nodes=int(pr["nodes"]), gpus=int(pr["ranks_per_node"]), dataset_bytes=float(pr["dataset_bytes"]),
                shard_bytes=shard_bytes, sample_bytes=shard_bytes / per_shard, tier_bytes=float(pr["tier_budget_bytes"]),
                link_bps=float(pr["link_rate_bps"]), latency=float(pr["rtt_ms"]) / 1e3, epochs=int(pr["epochs"]),
                seed=int(pr["seed"]), exchange=float(pr["exchange"]), batch_size=int(pr["batch_size"]),
                num_workers=int(pr["num_workers"]), slots=min(4096, max(1, round(per_shard))), scale=1,
                detail=int(pr["nodes"]), **extra)
    return p


def compare(data: dict[str, Any], sims: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """Predicted against measured per (sampler, epoch): relative errors and PASS/FAIL. Repeats
    of a (sampler, epoch) (separate jobs on the same data) are averaged: the simulation has no
    noise, and one prediction cannot be within 20% of two runs 70% apart; their range is kept."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in data["runs"]:
        groups.setdefault((r["sampler"], int(r["epoch"])), []).append(r)
    rows = []
    ok = True
    for (sampler, epoch), rs in sorted(groups.items()):
        sim = sims[sampler]["epochs"][epoch - 1]
        mb = float(np.mean([r["s3_bytes"] for r in rs]))
        ms = float(np.mean([r["epoch_seconds"] for r in rs]))
        eb = (sim["s3_bytes"] - mb) / mb if mb else (0.0 if not sim["s3_bytes"] else math.inf)
        et = (sim["epoch_s"] - ms) / ms
        passed = abs(eb) <= BYTES_TOL and abs(et) <= TIME_TOL
        ok = ok and passed
        per_node = [r.get("per_node_staged_bytes") for r in rs if r.get("per_node_staged_bytes")]
        rows.append({"sampler": sampler, "epoch": epoch, "repeats": len(rs), "measured_bytes": mb,
                     "measured_bytes_range": [min(r["s3_bytes"] for r in rs), max(r["s3_bytes"] for r in rs)],
                     "predicted_bytes": sim["s3_bytes"], "bytes_error": eb, "measured_s": ms,
                     "measured_s_range": [min(r["epoch_seconds"] for r in rs), max(r["epoch_seconds"] for r in rs)],
                     "predicted_s": sim["epoch_s"], "time_error": et, "pass": passed,
                     "measured_per_node": [float(x) for x in np.mean(per_node, axis=0)] if per_node else None,
                     "predicted_per_node": sim["per_node_staged_bytes"]})
    return rows, ok


def _mean_range(mean: float, rng: list[float], unit: float, digits: int) -> str:
    lo, hi = rng[0] / unit, rng[1] / unit
    m = f"{mean / unit:,.{digits}f}"
    return m if f"{lo:,.{digits}f}" == f"{hi:,.{digits}f}" else f"{m} ({lo:,.{digits}f}-{hi:,.{digits}f})"


def run_calibration(a: argparse.Namespace, base: Params) -> tuple[str, dict[str, Any], bool]:
    data = load_measured(Path(a.calibrate))
    p = replace(calibration_params(data, base), prefixes=a.prefixes[0])   # default 0: a test S3 server does not throttle
    if a.dt is None:
        p = replace(p, dt=auto_dt(p))
    mode = a.modes[0] if "daemon" not in data["params"] else ("daemon" if data["params"]["daemon"] else "shared")
    print(f"calibration: {describe(p)}; mode {mode}", file=sys.stderr)
    sims = {s: simulate(p, s, mode, show=not a.quiet) for s in sorted({r["sampler"] for r in data["runs"]})}
    rows, ok = compare(data, sims)
    md = ["## Calibration: predicted vs measured", "", f"Measured: `{a.calibrate}`; {describe(p)}; mode {mode}.", "",
          md_table(["sampler", "epoch", "S3 MB measured (mean; range)", "predicted", "error",
                    "epoch s measured (mean; range)", "predicted", "error", f"within {BYTES_TOL:.0%} / {TIME_TOL:.0%}"],
                   [[x["sampler"], x["epoch"], _mean_range(x["measured_bytes"], x["measured_bytes_range"], MB, 1),
                     f"{x['predicted_bytes'] / MB:,.1f}", f"{x['bytes_error']:+.1%}",
                     _mean_range(x["measured_s"], x["measured_s_range"], 1, 2), f"{x['predicted_s']:.2f}",
                     f"{x['time_error']:+.1%}", "PASS" if x["pass"] else "FAIL"] for x in rows], left=2),
          "", f"Calibration: {'PASS' if ok else 'FAIL'} (bytes within {BYTES_TOL:.0%}, epoch time within {TIME_TOL:.0%})."]
    return "\n".join(md), {"machine": machine_info(), "params": asdict(p), "mode": mode, "rows": rows, "pass": ok,
                           "runs": list(sims.values()), "markdown": "\n".join(md)}, ok


# ====================================================================== command line

def _csv(kind: type, allowed: tuple[str, ...] | None = None, lo: float | None = None) -> Any:
    def parse(s: str) -> list[Any]:
        try:
            vals = [kind(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of {kind.__name__}") from None
        if not vals:
            raise argparse.ArgumentTypeError("give at least one value")
        for v in vals:
            if allowed is not None and v not in allowed:
                raise argparse.ArgumentTypeError(f"{v!r} is not one of {', '.join(allowed)}")
            if lo is not None and v < lo:
                raise argparse.ArgumentTypeError(f"{v} is below {lo:g}")
        return vals
    return parse


def _pos(kind: type, lo: float = 0.0, strict: bool = True) -> Any:
    def parse(s: str) -> Any:
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a {kind.__name__}") from None
        if not math.isfinite(v) or (v <= lo if strict else v < lo):
            raise argparse.ArgumentTypeError(f"{s} must be {'>' if strict else '>='} {lo:g}")
        return v
    return parse


def parser() -> argparse.ArgumentParser:
    d = Params()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=_csv(int, lo=1), default=[8, 64, 1000], help="node counts (default 8,64,1000)")
    ap.add_argument("--gpus", type=_pos(int), default=d.gpus, help="GPUs (ranks) per node")
    ap.add_argument("--samplers", type=_csv(str, SAMPLERS), default=list(SAMPLERS))
    ap.add_argument("--modes", type=_csv(str, MODES), default=list(MODES),
                    help="daemon (kvdatad per node), shared (no daemon, the node's tiers), private (a tier per rank)")
    ap.add_argument("--prefixes", type=_csv(int, lo=0), default=[0, 1],
                    help="S3 prefixes serving the dataset, one run each; 0 = S3 never throttles (default 0,1)")
    ap.add_argument("--dataset-tb", type=_pos(float), default=d.dataset_bytes / TB)
    ap.add_argument("--shard-mb", type=_pos(float), default=d.shard_bytes / MB)
    ap.add_argument("--sample-kb", type=_pos(float), default=d.sample_bytes / 1e3)
    ap.add_argument("--compression", type=_pos(float), default=d.compression, help=".mdb / .mdb.zst bytes")
    ap.add_argument("--tier-tb", type=_pos(float), default=d.tier_bytes / TB, help="tier budget per node (all tiers)")
    ap.add_argument("--link-gbps", type=_pos(float), default=d.link_bps / 1e9, help="per node")
    ap.add_argument("--gpu-rate", type=_pos(float, strict=False), default=d.gpu_rate,
                    help="samples/s per GPU; 0 = as fast as the data comes (--read-rate)")
    ap.add_argument("--read-rate", type=_pos(float), default=d.read_rate)
    ap.add_argument("--start-s", type=_pos(float, strict=False), default=d.start_s,
                    help="seconds from an epoch's start to a rank's first read (workers started per epoch)")
    ap.add_argument("--server-mbps", type=_pos(float, strict=False), default=d.server_bps / MB,
                    help="MB/s the S3 server sends to all nodes together; 0 = no limit (a test server has one)")
    ap.add_argument("--batch-size", type=_pos(int), default=d.batch_size)
    ap.add_argument("--num-workers", type=_pos(int, strict=False), default=d.num_workers)
    ap.add_argument("--get-limit", type=_pos(float), default=d.get_limit, help="GET/s per prefix")
    ap.add_argument("--latency-ms", type=_pos(float, strict=False), default=d.latency * 1e3)
    ap.add_argument("--conn-mbps", type=_pos(float), default=d.conn_bps / MB, help="MB/s per connection")
    ap.add_argument("--part-mib", type=_pos(float), default=d.part_bytes / 2**20, help="ranged GET size of staging")
    ap.add_argument("--parts-in-flight", type=_pos(int), default=d.parts_in_flight)
    ap.add_argument("--workers", type=_pos(int), default=d.workers, help="staging jobs per Engine")
    ap.add_argument("--verify-gbps", type=_pos(float), default=d.verify_bps / GB, help="GB/s per staging job")
    ap.add_argument("--record-gets", type=_pos(float), default=d.record_gets_per_sample, help="GETs per sample read by record")
    ap.add_argument("--keep-ticks", type=_pos(int), default=None,
                    help="take the keep set again at most every this many ticks (default: 1 when every shard "
                         "is simulated, 8 when --scale > 1: the engine's KEEP_TTL is finer than a tick there)")
    ap.add_argument("--lookahead", type=_pos(int), default=d.lookahead)
    ap.add_argument("--window", type=_pos(int), default=d.window)
    ap.add_argument("--exchange", type=_pos(float, strict=False), default=d.exchange)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--epochs", type=_pos(int), default=d.epochs)
    ap.add_argument("--slots", type=_pos(int), default=d.slots, help="virtual samples per shard")
    ap.add_argument("--scale", default="auto", help="simulate 1/K of the shards: an integer, or auto")
    ap.add_argument("--max-node-shards", type=_pos(int), default=2000, help="auto scale: a simulated node part at most this")
    ap.add_argument("--detail", type=_pos(int), default=d.detail, help="nodes simulated")
    ap.add_argument("--dt", type=_pos(float), default=None, help="tick seconds (default: auto)")
    ap.add_argument("--bypass-whole", action="store_true",
                    help="what-if, not what kvdata does: read a bypassed shard as one whole stream into memory "
                         "(its GETs: compressed / part size) instead of record by record (a GET per sample)")
    ap.add_argument("--free-ranks", action="store_true",
                    help="ranks read at their own pace (default: in step, as DDP's per-batch all-reduce makes them)")
    ap.add_argument("--quick", action="store_true",
                    help="N = 8, 64 at 1 TB (tiers scaled alike), 2 epochs, 2 nodes simulated (a smoke test)")
    ap.add_argument("--calibrate", metavar="FILE.json", help="compare against a measured multi-node run")
    ap.add_argument("--json", metavar="FILE", help="write every number here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    return ap


def params_from(a: argparse.Namespace) -> Params:
    if a.exchange > 1:
        raise SystemExit("cluster_sim: error: --exchange must be in [0, 1]")
    scale = 1 if a.scale == "auto" else a.scale
    try:
        scale = int(scale)
    except ValueError:
        raise SystemExit(f"cluster_sim: error: --scale {a.scale!r} is not an integer or 'auto'") from None
    if scale < 1:
        raise SystemExit("cluster_sim: error: --scale must be >= 1")
    return Params(gpus=a.gpus, dataset_bytes=a.dataset_tb * TB, shard_bytes=a.shard_mb * MB,
                  sample_bytes=a.sample_kb * 1e3, compression=a.compression, tier_bytes=a.tier_tb * TB,
                  link_bps=a.link_gbps * 1e9, gpu_rate=a.gpu_rate, read_rate=a.read_rate,
                  start_s=a.start_s, server_bps=a.server_mbps * MB, batch_size=a.batch_size,
                  num_workers=a.num_workers, get_limit=a.get_limit, latency=a.latency_ms / 1e3,
                  conn_bps=a.conn_mbps * MB, part_bytes=a.part_mib * 2**20, parts_in_flight=a.parts_in_flight,
                  workers=a.workers, verify_bps=a.verify_gbps * GB, record_gets_per_sample=a.record_gets,
                  lookahead=a.lookahead, window=a.window, exchange=a.exchange, seed=a.seed, epochs=a.epochs,
                  slots=a.slots, scale=scale, detail=a.detail, dt=a.dt or 0.25, lockstep=not a.free_ranks,
                  bypass_whole=a.bypass_whole)


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.quick:
        a.nodes = [8, 64] if a.nodes == [8, 64, 1000] else a.nodes
        a.dataset_tb = 1.0 if a.dataset_tb == Params().dataset_bytes / TB else a.dataset_tb
        a.tier_tb = a.tier_tb * a.dataset_tb / (Params().dataset_bytes / TB) if a.tier_tb == Params().tier_bytes / TB \
            else a.tier_tb
        a.epochs = min(a.epochs, 2)
        a.detail = min(a.detail, 2)
    base = params_from(a)
    ok = True
    if a.calibrate:
        try:
            md, data, ok = run_calibration(a, base)
        except CalibrationError as e:
            raise SystemExit(f"cluster_sim: error: {e}") from None
    else:
        md, data = run_scale(a, base)
    data["machine_line"] = machine_line(data["machine"])
    print(md)
    if a.json:
        write_json(Path(a.json), data)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
