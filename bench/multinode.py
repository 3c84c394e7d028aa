#!/usr/bin/env python
"""A real multi-node run on one machine (issue 14, item 4): S3 bytes per epoch, global vs locality.

N nodes (default 4) are network namespaces, each joined to a home namespace by a veth pair with a
per-node rate limit (tbf, both ways) and round-trip latency (the netlab's delay proxy; this kernel
has no netem). The home runs one moto S3 server behind nginx (one server per node, whose access log
counts what the home sent that node) and routes between the nodes. Each node runs its own kvdatad
with its own tier directory (a budget of --budget-frac of the dataset) and allow_homes for the
dataset; 2 ranks per node join one torch.distributed group (gloo) across the namespaces
(MASTER_ADDR = node 0's veth address, LOCAL_WORLD_SIZE = ranks per node, as torchrun sets it) and
read the pushed dataset with kvdata.Dataset + ShardShuffleSampler + DataLoader for 3 epochs: the
global order (locality=False) and the locality order (locality=True, exchange=0.1), each on fresh
daemons with empty tiers. Each repeat is a separate job (fresh processes), the samplers in a
rotated order.

Per epoch: S3 bytes and requests (the nginx access logs; cross-checked with kvdatad's bytes from
the home, which leave out the readers' own record reads, and with the home-side veth counters, which
add TCP/IP headers and gloo), epoch wall time (rank 0, between the barriers around the epoch),
bytes staged per node (kvdatad). Checked: every sample index exactly once per epoch over all ranks
(and each sample's content), the same sequences from the same seed in every repeat, equal to the
sampler computed in one process. Everything is torn down at the end, also on errors and SIGTERM;
`--cleanup` removes what a killed run left (namespaces kvnl-<pid>-*, their processes, /tmp dirs).
The plumbing is tests/nodelab.py, shared with tests/integration/test_multinode.py.

  sudo python bench/multinode.py --quick                     # 2 nodes, 4 MB: a smoke test (~30 s)
  sudo python bench/multinode.py --json bench/out/multinode.json   # 4 nodes x 2 ranks, ~160 MB
"""
from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))   # nodelab.py: the lab, shared with the CI test
sys.path.insert(0, str(HERE))
from _common import IMG, MB, log, machine_info, machine_line, md_table, median, rotated, write_json  # noqa: E402

import nodelab as nl  # noqa: E402

SAMPLERS = ("global", "locality")


def _mb(x: float) -> str:
    return f"{x / MB:,.1f}"


def report(a: argparse.Namespace, out: dict[str, Any]) -> str:
    p, runs = out["params"], out["runs"]
    s3_ds = out["dataset_s3_bytes"]
    rows = []
    for sampler in SAMPLERS:
        for e in range(1, a.epochs + 1):
            rs = [r for r in runs if r["sampler"] == sampler and r["epoch"] == e]
            rs.sort(key=lambda r: r["repeat"])
            j = lambda f, rs=rs: " / ".join(f(r) for r in rs)  # noqa: E731 -- one cell, every repeat
            rows.append([sampler, e, j(lambda r: f"{r['s3_bytes'] / s3_ds:.2f}"), j(lambda r: _mb(r["s3_bytes"])),
                         j(lambda r: f"{r['s3_gets']:,}"), j(lambda r: f"{r['epoch_seconds']:.2f}"),
                         j(lambda r: ", ".join(f"{b / MB:.1f}" for b in r["per_node_staged_bytes"])),
                         j(lambda r: f"{r['daemon_home_bytes'] / s3_ds:.2f}"),
                         j(lambda r: "yes" if r["exact_once"] else "NO")])
    warm = {s: [r["s3_bytes"] / s3_ds for r in runs if r["sampler"] == s and r["epoch"] > 1] for s in SAMPLERS}
    g, loc = median(warm["global"]), median(warm["locality"])
    c = out["checks"]
    text = [f"### {p['nodes']} nodes x {p['ranks_per_node']} ranks, one S3 home ({machine_line(out['machine'])})", "",
            f"{p['samples']:,} samples of {p['sample_bytes'] / 1024:,.1f} KiB (random bytes) in {p['shards']} shards of "
            f"~{p['shard_bytes'] / MB:.1f} MB: {p['dataset_bytes'] / MB:,.1f} MB ({s3_ds / MB:,.1f} MB as S3 objects, "
            f"zstd); per node one kvdatad with one tier of {p['tier_budget_bytes'] / MB:,.1f} MB "
            f"({p['tier_budget_bytes'] / p['dataset_bytes']:.0%} of the dataset) and a link of "
            f"{p['link_rate_bps'] / 1e6:,.0f} Mbit/s with {p['rtt_ms']:g} ms RTT to the home; "
            f"`DataLoader(batch_size={p['batch_size']}, num_workers={p['num_workers']})` over "
            f"`ShardShuffleSampler(seed={p['seed']}, window={a.window})`, locality: `exchange={p['exchange']}`; "
            f"{p['epochs']} epochs; {a.repeats} repeat(s), each a separate job (cells: repeat 1 / 2 ...). "
            "S3: the bytes and GETs the S3 front served the nodes (nginx access logs), in datasets of S3 objects "
            "and MB; kvdatad: what the daemons fetched (the readers' own record reads are the difference); "
            "staged: MB each node's kvdatad staged.", "",
            md_table(["sampler", "epoch", "S3 (datasets)", "S3 MB", "S3 GETs", "epoch s", "staged per node (MB)",
                      "kvdatad (datasets)", "exactly once"], rows, left=1),
            f"Warm epochs (2-{a.epochs}), median over repeats: global {g:.2f} datasets per epoch from S3, locality "
            f"{loc:.2f}: **locality / global = {loc / g:.2f}**. Every sample exactly once per epoch over all "
            f"{p['nodes'] * p['ranks_per_node']} ranks: {'yes' if c['exact_once'] else 'NO'}; the same seed gave the "
            f"same index sequences in every repeat: {'yes' if c['same_seed_same_sequences'] else 'NO'} (and the "
            f"sampler computed in one process: {'yes' if c['matches_in_process_sampler'] else 'NO'}); every rank read "
            f"through its node's kvdatad: {'yes' if c['via_daemon'] else 'NO'}. Wire bytes (home-side veths, "
            f"headers and gloo included) / S3 front bytes: {c['wire_over_s3']:.3f}."]
    return "\n".join(text) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 nodes, 64 samples of 64 KiB, 1 Gbit, no RTT")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--sample-bytes", type=int, default=IMG, help="bytes per sample (default 227x227x3)")
    ap.add_argument("--samples-per-shard", type=int, default=16)
    ap.add_argument("--budget-frac", type=float, default=0.3, help="each node's tier budget, of the dataset")
    ap.add_argument("--rate", default="200mbit", help="each node's link to the home (tbf, both ways)")
    ap.add_argument("--rtt-ms", type=float, default=10.0, help="0: no delay proxy")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exchange", type=float, default=0.1)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    ap.add_argument("--repeats", type=int, default=2, help="separate jobs (same seed: the same sequences)")
    ap.add_argument("--delayproxy", type=Path, default=nl.find_delayproxy(REPO),
                    help="the netlab's delayproxy.py (default: ../shared/netlab or ../../shared/netlab)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cleanup", action="store_true", help="only remove what killed runs left, then exit")
    a = ap.parse_args()
    if a.cleanup:
        for x in nl.cleanup_stale():
            print(f"removed {x}")
        return
    if a.quick:
        a.nodes, a.samples, a.sample_bytes, a.samples_per_shard = 2, 64, 64 << 10, 2
        a.budget_frac, a.rate, a.rtt_ms, a.workers = 0.7, "1gbit", 0.0, 0
    world = a.nodes * a.ranks_per_node
    if a.samples % world:
        raise SystemExit(f"--samples {a.samples} must be a multiple of nodes x ranks ({world}): no padding, so "
                         "'exactly once' is exact")
    why = nl.missing()
    if why:
        raise SystemExit(f"multinode: {why}")
    if a.rtt_ms > 0 and (a.delayproxy is None or not a.delayproxy.is_file()):
        raise SystemExit(f"multinode: --rtt-ms {a.rtt_ms:g} needs the netlab's delayproxy.py (--delayproxy; not found "
                         f"at {a.delayproxy or '../shared/netlab or ../../shared/netlab'}); or --rtt-ms 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_all's timeout: tear the lab down on the way out

    import kvdata

    t_all = time.perf_counter()
    out: dict[str, Any] = {"config": {k: str(v) for k, v in vars(a).items()}, "machine": machine_info(),
                           "command": "python bench/multinode.py " + " ".join(map(shlex.quote, sys.argv[1:])),
                           "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")}
    runs: list[dict[str, Any]] = []
    seqs: dict[str, list[Any]] = {s: [] for s in SAMPLERS}
    checks = {"exact_once": True, "via_daemon": True, "same_seed_same_sequences": True,
              "matches_in_process_sampler": True}
    wire = s3 = 0
    with nl.Lab(a.nodes, rate=a.rate, rtt_ms=a.rtt_ms, delayproxy=a.delayproxy, log=log) as lab:
        log(f"lab up: {lab.tag}, {a.nodes} nodes, {a.rate}, RTT {a.rtt_ms:g} ms")
        src = nl.build_dataset(lab.root / "src.kv", a.samples, a.sample_bytes,
                               a.samples_per_shard * (a.sample_bytes + 4096), seed=a.seed)
        with kvdata.open(src) as st:
            shards = st.manifest.shards
        ds_bytes = sum(e.bytes for e in shards)
        s3_bytes = sum(e.zst.bytes if e.zst is not None else e.bytes for e in shards)
        budget = int(a.budget_frac * ds_bytes)
        t0 = time.perf_counter()
        url = lab.push(src, "ds.kv")
        log(f"dataset: {a.samples} samples, {len(shards)} shards, {ds_bytes / MB:.1f} MB; pushed in "
            f"{time.perf_counter() - t0:.1f} s; budget per node {budget / MB:.1f} MB")
        out["dataset_s3_bytes"] = s3_bytes
        out["params"] = {"nodes": a.nodes, "ranks_per_node": a.ranks_per_node, "samples": a.samples,
                         "sample_bytes": a.sample_bytes, "shard_bytes": ds_bytes // len(shards), "shards": len(shards),
                         "dataset_bytes": ds_bytes, "tier_budget_bytes": budget,
                         "link_rate_bps": nl.rate_bytes(a.rate) * 8, "rtt_ms": a.rtt_ms, "epochs": a.epochs,
                         "seed": a.seed, "exchange": a.exchange, "batch_size": a.batch_size, "num_workers": a.workers,
                         "window": a.window, "budget_frac": a.budget_frac, "dataset_s3_bytes": s3_bytes,
                         "repeats": a.repeats, "daemon": True, "gpu_samples_per_s": 0}
        for rep in range(a.repeats):
            phases = rotated(SAMPLERS, rep)
            log(f"repeat {rep + 1}: {', '.join(phases)}")
            job = lab.run_job(url, a.ranks_per_node, lab.root / f"job{rep}", phases=phases, budget=budget,
                              seed=a.seed, epochs=a.epochs, batch_size=a.batch_size, workers=a.workers,
                              exchange=a.exchange, window=a.window, timeout=a.timeout)
            log(f"  job: {job.seconds:.1f} s")
            for ph in job.phases:
                for r in nl.epoch_rows(ph, a.samples):
                    r["repeat"] = rep + 1
                    runs.append(r)
                    wire += r["wire_bytes"]
                    s3 += r["s3_bytes"]
                    checks["exact_once"] &= r["exact_once"] and r["samples_seen"] == a.samples
                    log(f"  {ph.sampler} epoch {r['epoch']}: S3 {r['s3_bytes'] / s3_bytes:.2f} datasets, "
                        f"{r['s3_gets']} GETs, {r['epoch_seconds']:.1f} s, exactly once: {r['exact_once']}")
                checks["via_daemon"] &= all(x["via_daemon"] and not x["fell_back"] and not x["bad"] for x in ph.ranks)
                seqs[ph.sampler].append(nl.sequences(ph))
        for sampler in SAMPLERS:
            got = seqs[sampler]
            checks["same_seed_same_sequences"] &= all(x == got[0] for x in got)
            want = nl.expected_sequences(src, nodes=a.nodes, ranks_per_node=a.ranks_per_node, sampler=sampler,
                                         seed=a.seed, epochs=a.epochs, exchange=a.exchange, window=a.window)
            checks["matches_in_process_sampler"] &= got[0] == want
    checks["wire_over_s3"] = wire / s3 if s3 else float("nan")
    out.update(runs=runs, checks=checks, seconds=time.perf_counter() - t_all)
    md = "## kvdata bench/multinode.py\n\n" + report(a, out)   # the date and command: in the JSON, and run_all's line
    out["markdown"] = md
    print(md)
    if a.json:
        write_json(a.json, out)
    if not all(v for k, v in checks.items() if k != "wire_over_s3"):
        raise SystemExit(f"multinode: a check failed: {checks}")


if __name__ == "__main__":
    main()
