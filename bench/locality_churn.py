#!/usr/bin/env python
"""How many shards the locality order makes new to a node each epoch, and what that costs a tier.

From the order alone (kvdata.order.locality.locality_shares, the rows ShardShuffleSampler(locality=True)
yields; no dataset, no network), for a grid of node counts, shards per node and shard sizes:

- new: the fraction of the shards a node's ranks read in epoch e+1 that they did not read in
  epoch e (mean over nodes and warm epochs; max: the worst node-epoch). A tier that holds what
  its node read last epoch fetches at least these, so this is the floor of a node's S3 traffic
  per epoch, in shards; issue 14 wants it near `exchange`;
- split: shards read by more than one node in an epoch, per node (mean and max): each is staged
  whole by every node that reads part of it;
- S3: a per-node tier simulation with kvdata.tiers.policy's real functions (plan_eviction on
  the announced sequence: this epoch's shards in first-use order, then the next epoch's, as the
  sampler announces them), a budget of `--budget` x a node's part of the dataset, every miss
  staged whole: bytes fetched per warm epoch over the cluster, in datasets. The global order
  (every rank a slice of one permutation) is the reference row of each layout.

    python bench/locality_churn.py                    # the grid (about a minute on 2 cores)
    python bench/locality_churn.py --quick            # a smaller grid (seconds)
    python bench/locality_churn.py --json out.json    # and the numbers as JSON
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvdata.order import blocked, locality
from kvdata.tiers.policy import Demand, plan_eviction

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, machine_line, md_table, write_json  # noqa: E402


def layout(nodes: int, per_node: int, sizes: str, mean: int, seed: int) -> np.ndarray:
    """The shard of every sample: nodes x per_node shards of `mean` samples ("equal") or of
    mean/2 .. 3*mean/2 samples ("unequal", seeded)."""
    k = nodes * per_node
    if sizes == "equal":
        counts = np.full(k, mean)
    else:
        counts = np.random.default_rng(seed).integers(mean // 2, mean + mean // 2 + 1, size=k)
    return np.repeat(np.arange(k, dtype=np.int64), counts)


def node_sequences(shares: np.ndarray, sample_shards: np.ndarray, nodes: int) -> list[np.ndarray]:
    """Each node's shards in the order its ranks first read them, the ranks advancing together."""
    per_node = shares.shape[0] // nodes
    out = []
    for j in range(nodes):
        merged = shares[j * per_node:(j + 1) * per_node].T.ravel()   # rank 0's i-th, rank 1's i-th, ...
        out.append(blocked.first_use_order(sample_shards[merged]))
    return out


def tier_traffic(seqs: list[list[np.ndarray]], sizes: np.ndarray, budget: int) -> list[int]:
    """Samples fetched per epoch by one node's tier: staged whole on a miss, evicted by
    plan_eviction against the announced sequence (this epoch and the next)."""
    resident: dict[int, int] = {}
    fetched = []
    for e in range(len(seqs) - 1):
        seq = seqs[e].tolist()
        announced = tuple(seq + seqs[e + 1].tolist())
        got = 0
        for p, s in enumerate(seq):
            if s in resident:
                continue
            size = int(sizes[s])
            got += size
            for v in plan_eviction(budget, resident, [Demand(announced, p)], size, in_use={s}):
                del resident[v]
            if sum(resident.values()) + size <= budget:
                resident[s] = size
        fetched.append(got)
    return fetched


def measure_one(nodes: int, per_node: int, sizes: str, args: argparse.Namespace, exchange: float | None,
                tiers: bool) -> dict[str, Any]:
    """One layout, one sampler (exchange None: the global order)."""
    sample_shards = layout(nodes, per_node, sizes, args.samples_per_shard, args.seed)
    g = blocked.group_by_shard(sample_shards)
    world = nodes * args.ranks_per_node
    n = len(sample_shards)
    seqs: list[list[np.ndarray]] = [[] for _ in range(nodes)]
    reads: list[list[set[int]]] = []
    splits = []
    t_plan = 0.0
    for e in range(args.epochs + 1):                     # one more: the last epoch's announcement
        t0 = time.perf_counter()
        if exchange is None:
            full = blocked.epoch_order(g, args.seed, e, args.window)
            shares = np.stack([blocked.rank_share(full, r, world, False) for r in range(world)])
        else:
            shares = locality.locality_shares(g, args.seed, e, nodes, world, exchange, window=args.window)
        t_plan += time.perf_counter() - t0
        for j, s in enumerate(node_sequences(shares, sample_shards, nodes)):
            seqs[j].append(s)
        if e < args.epochs:
            sets = [set(s.tolist()) for s in (x[e] for x in seqs)]
            reads.append(sets)
            count = np.zeros(len(g.shard_ids), dtype=np.int64)
            for s in sets:
                count[list(s)] += 1
            splits.append([sum(1 for x in s if count[x] > 1) for s in sets])
    new = np.array([[len(b[j] - a[j]) / max(1, len(b[j])) for j in range(nodes)]
                    for a, b in zip(reads[args.warm - 1:], reads[args.warm:])])
    split = np.array(splits[args.warm:])
    row: dict[str, Any] = {"nodes": nodes, "shards_per_node": per_node, "sizes": sizes,
                           "sampler": "global" if exchange is None else f"locality {exchange:g}",
                           "new_mean": float(new.mean()), "new_max": float(new.max()),
                           "new_p90_node": float(np.quantile(new.mean(axis=0), 0.9)),
                           "split_mean": float(split.mean()), "split_max": int(split.max()),
                           "plan_seconds": t_plan / (args.epochs + 1)}
    if tiers:
        counts = np.bincount(sample_shards)
        budget = int(args.budget * n / nodes)
        per_epoch = np.sum([tier_traffic(seqs[j], counts, budget) for j in range(nodes)], axis=0) / n
        row["s3_warm"] = float(per_epoch[args.warm:].mean())
        row["s3_warm_max"] = float(per_epoch[args.warm:].max())
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 64])
    p.add_argument("--shards-per-node", type=int, nargs="+", default=[16, 64, 160])
    p.add_argument("--sizes", nargs="+", default=["equal", "unequal"], choices=["equal", "unequal"])
    p.add_argument("--samples-per-shard", type=int, default=16, help="mean samples per shard")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--exchanges", type=float, nargs="+", default=[0.1])
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--epochs", type=int, default=12, help="epochs measured (the first --warm are warm-up)")
    p.add_argument("--warm", type=int, default=2, help="epochs before the measured transitions")
    p.add_argument("--budget", type=float, default=1.2, help="tier budget, in a node's part of the dataset")
    p.add_argument("--tier-max-shards", type=int, default=4096,
                   help="simulate tiers only for layouts of at most this many shards (the simulation is Python)")
    p.add_argument("--no-global", action="store_true", help="leave out the global-order reference rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="nodes 2 4 8, shards per node 16 64, 5 epochs")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.shards_per_node, args.epochs = [2, 4, 8], [16, 64], 5
    if not 1 <= args.warm < args.epochs:
        p.error("--warm must be in [1, --epochs)")
    t0 = time.perf_counter()
    rows = []
    for nodes in args.nodes:
        for per_node in args.shards_per_node:
            for sizes in args.sizes:
                tiers = nodes * per_node <= args.tier_max_shards
                for ex in ([] if args.no_global else [None]) + list(args.exchanges):
                    r = measure_one(nodes, per_node, sizes, args, ex, tiers)
                    rows.append(r)
                    print(f"{nodes:3d} nodes x {per_node:3d} shards {sizes:7s} {r['sampler']:13s} new {r['new_mean']:.3f} "
                          f"(max {r['new_max']:.2f}) split/node {r['split_mean']:.2f} (max {r['split_max']})"
                          + (f" S3 {r['s3_warm']:.3f}" if "s3_warm" in r else ""), file=sys.stderr, flush=True)
    table = md_table(["nodes", "shards per node", "shard sizes", "sampler", "new shards per node-epoch: mean (max)",
                      "90th pct node", "split shards per node: mean (max)", "S3 per warm epoch (datasets)"],
                     [[r["nodes"], r["shards_per_node"], r["sizes"], r["sampler"],
                       f"{r['new_mean']:.3f} ({r['new_max']:.2f})", f"{r['new_p90_node']:.3f}",
                       f"{r['split_mean']:.2f} ({r['split_max']})",
                       f"{r['s3_warm']:.3f} (max {r['s3_warm_max']:.3f})" if "s3_warm" in r else "-"] for r in rows])
    cmd = "python bench/locality_churn.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    md = ("## kvdata bench/locality_churn.py\n\n"
          f"### New shards per node and epoch, from the order alone ({machine_line()})\n\n"
          f"{args.ranks_per_node} ranks per node, window {args.window}, {args.samples_per_shard} samples per shard "
          f"(unequal: {args.samples_per_shard // 2}-{args.samples_per_shard * 3 // 2}), epochs {args.warm}-"
          f"{args.epochs - 1} measured, tiers of {args.budget:g}x a node's part (simulated for layouts of at most "
          f"{args.tier_max_shards} shards).\n\n"
          f"{table}\nProduced by `{cmd.strip()}` in {time.perf_counter() - t0:.0f} s.\n")
    print(md)
    if args.json:
        write_json(args.json, {"rows": rows, "markdown": md, "command": cmd, "machine": machine_info(),
                               "config": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    main()
