#!/usr/bin/env python
"""SIGKILL a kvdata writer N times (default 1,000) and check every commit survives.

The long version of tests/integration/test_crash.py, with the same child
(tests/crash_writer.py) and the same checker (tests/crash_check.py). After each kill:
the dataset must open, `verify` must pass, and every record whose commit() returned
must read back with its exact bytes (deleted keys absent, len equal). Datasets are
started afresh every --per-dataset kills (verify re-reads every shard, so one ever-growing
dataset would make cycles ever slower), alternating the shard sizes of --shard-sizes.

    python bench/crash_kill.py                         # 1,000 kills, about 10-15 minutes on 2 cores
    python bench/crash_kill.py --kills 30 --seed 7     # a quick look
    python bench/crash_kill.py --dir /data/crash --keep
    python bench/crash_kill.py --quick --json out.json  # 20 kills, about 15 s; every number as JSON

Exit status 1 if any check failed (verify failure, lost record, dataset that won't open).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, machine_line, md_table, median, write_json  # noqa: E402

import crash_check as cc  # noqa: E402


def summary_row(name: str, s: Any) -> list[Any]:
    return [name, s.kills, s.in_commit, s.verify_failures, s.open_failures, s.lost, s.resurrected, s.extra,
            s.child_errors, f"{median(s.seconds):.3f}" if s.seconds else "-"]


def summary_json(s: Any) -> dict[str, Any]:
    return {"kills": s.kills, "in_commit": s.in_commit, "landed": s.landed, "verify_failures": s.verify_failures,
            "open_failures": s.open_failures, "lost": s.lost, "resurrected": s.resurrected, "unknown": s.extra,
            "child_errors": s.child_errors, "modes": s.modes, "files_left": s.where,
            "median_cycle_s": median(s.seconds), "max_generation": s.max_generation, "live_keys": s.live,
            "failures": s.failures[:100], "ok": s.ok}


def markdown(args: argparse.Namespace, total: Any, by_size: dict[str, Any], seconds: float) -> str:
    rows = [summary_row(f"shard size {size}", summ) for size, summ in by_size.items() if summ.kills]
    rows.append(summary_row("**all**", total))
    return "\n".join([
        f"## kvdata crash_kill ({machine_line(machine_info(('numpy', 'lmdb', 'kvdata')))})", "",
        f"{total.kills} SIGKILLs of a writer (seed {args.seed}, a fresh dataset every {args.per_dataset} kills, "
        f"shard sizes {args.shard_sizes}), {seconds:.0f} s.", "",
        md_table(["datasets", "kills", "in a commit", "verify failures", "open failures", "lost committed records",
                  "resurrected", "unknown", "child errors", "median cycle (s)"], rows),
        "```", total.report(), "```", "",
        f"Target: 0 lost commits and 0 verify failures: {'met' if total.ok else 'NOT met'}.", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=1000, help="kill cycles in all (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of kill moments and of the writers' batches")
    ap.add_argument("--dir", type=Path, default=None,
                    help="work directory (default: a new temp dir, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the datasets and journals")
    ap.add_argument("--per-dataset", type=int, default=50, help="kills per dataset before starting a fresh one")
    ap.add_argument("--shard-sizes", default="64KB,4MB",
                    help="comma-separated shard sizes, one per dataset in turn (default 64KB,4MB)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: 20 kills, a fresh dataset every 10")
    ap.add_argument("--json", type=Path, help="also write the summary (and the markdown report) here")
    args = ap.parse_args(argv)
    if args.quick:
        args.kills, args.per_dataset = 20, 10
    if args.kills < 1 or args.per_dataset < 1:
        ap.error("--kills and --per-dataset must be at least 1")
    sizes = [s.strip() for s in args.shard_sizes.split(",") if s.strip()]
    if args.dir is None:
        work = Path(tempfile.mkdtemp(prefix="kvdata-crash-"))
    else:
        work = args.dir
        work.mkdir(parents=True, exist_ok=True)
        if any(work.iterdir()):
            ap.error(f"--dir {work} is not empty; give an empty or new directory")
    rng = np.random.default_rng(args.seed)
    total = cc.Summary()
    by_size = {s: cc.Summary() for s in sizes}
    t0 = time.perf_counter()
    try:
        i = 0
        part = 0
        while i < args.kills:
            size = sizes[part % len(sizes)]
            ds, journal = work / f"ds-{part:03d}", work / f"ds-{part:03d}.journal"
            cc.prepare(ds, journal, size)
            for _ in range(min(args.per_dataset, args.kills - i)):
                cy = cc.kill_cycle(ds, journal, rng, args.seed * 1000 + part)
                total.add(i, cy)
                by_size[size].add(i, cy)
                if cy.check.problems:
                    print(f"kill {i}: FAIL {' | '.join(cy.check.problems)}", flush=True)
                i += 1
            print(f"[{i}/{args.kills}] dataset {ds.name} ({size} shards): generation {total.max_generation}, "
                  f"{total.in_commit} kills in a commit so far, {len(total.failures)} failures, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            if not args.keep and not by_size[size].failures and not total.failures:
                shutil.rmtree(ds)
            part += 1
    finally:
        if not args.keep and args.dir is None and not total.failures:
            shutil.rmtree(work, ignore_errors=True)
    print()
    for size, summ in by_size.items():
        if summ.kills:
            print(f"--- shard size {size}: {summ.kills} kills, {summ.in_commit} in a commit, "
                  f"{len(summ.failures)} failed, median cycle {float(np.median(summ.seconds)):.3f} s")
    seconds = time.perf_counter() - t0
    print(f"=== all ({seconds:.0f} s, seed {args.seed})")
    print(total.report())
    if total.failures and not args.keep:
        print(f"failing datasets kept under {work}")
    if args.json:
        write_json(args.json, {"config": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(),
                               "seconds": seconds, "all": summary_json(total),
                               "by_shard_size": {k: summary_json(v) for k, v in by_size.items()},
                               "markdown": markdown(args, total, by_size, seconds)})
    return 0 if total.ok else 1


if __name__ == "__main__":
    sys.exit(main())
