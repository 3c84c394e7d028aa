#!/usr/bin/env python
"""Fuzz every decoder of outside bytes with 100,000 seeded cases and report what escaped.

The targets are the ones tests/fuzz runs (tests/fuzz/fuzzlib.py: record headers, layouts and
values, manifests, index files, shards and tails, the CLI, protocol frames and the client,
Caffe Datum parsing and import). Each case is generated from random.Random("SEED:TARGET:I"),
so one case is reproduced by its (seed, target, index). The rules: only kvdata.errors.KVDataError
may escape, a failing CLI command prints one `kvdata: error:` line, and nothing is written
outside the case's temp root. Cases run in forked worker processes, so a case that kills its
process (SIGBUS, SIGSEGV) is reported as a failure too and the run goes on.

    python bench/fuzz.py                              # 100,000 cases, seed 0 (about 10 minutes on 2 cores)
    python bench/fuzz.py --quick --json out.json      # 5,000 cases; every number as JSON
    python bench/fuzz.py --cases 20000 --only index_files,cli --jobs 1
    python bench/fuzz.py --target index_files --case 1234            # reproduce one case, with its traceback
    python bench/fuzz.py --list                       # the targets and their share of the cases

Exit status 1 if any case broke a rule.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fuzz"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, machine_line, md_table, write_json  # noqa: E402

import fuzzlib as fl  # noqa: E402

CHUNK = 500          # cases per worker process (a fresh sandbox and dataset each)
CLEAN_EVERY = 100    # remove finished case directories this often
QUICK_CASES = 5000


def shares(total: int, names: list[str]) -> dict[str, int]:
    """Cases per target, in proportion to the targets' weights (every target gets at least one)."""
    weights = {n: fl.TARGETS[n].weight for n in names}
    wsum = sum(weights.values())
    out = {n: max(1, total * w // wsum) for n, w in weights.items()}
    biggest = max(out, key=lambda n: out[n])
    out[biggest] += total - sum(out.values())
    return out


def case_rng(seed: int, name: str, i: int) -> Any:
    import random
    return random.Random(f"{seed}:{name}:{i}")


def _worker(name: str, start: int, stop: int, seed: int, current: Any, conn: Any) -> None:
    """Run cases [start, stop) of one target; send back counts and failures."""
    t = fl.TARGETS[name]
    failures: list[dict[str, Any]] = []
    escapes = 0
    t0 = time.perf_counter()
    fds0 = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1
    with fl.context() as ctx:
        for i in range(start, stop):
            current.value = i
            try:
                case = t.gen(case_rng(seed, name, i), ctx)
            except Exception as e:  # noqa: BLE001 - a bug of the generator, reported apart from kvdata's
                f = fl.describe_exception(name, e)
                failures.append({"case": i, "kind": f"generator {f.kind}", "where": f.where, "message": f.message,
                                 "input": ""})
                continue
            for f in fl.run_case(t, case, ctx):
                escapes += f.kind == "escape"
                failures.append({"case": i, "kind": f.kind, "where": f.where, "message": f.message[:300],
                                 "input": f.detail[:400]})
            if t.files and (i - start) % CLEAN_EVERY == CLEAN_EVERY - 1:
                ctx.sandbox.clean_work()
    fds1 = len(os.listdir("/proc/self/fd")) if fds0 >= 0 else -1
    conn.send({"target": name, "start": start, "stop": stop, "seconds": time.perf_counter() - t0,
               "failures": failures, "escapes": escapes, "fd_growth": fds1 - fds0})
    conn.close()


def run(names: list[str], counts: dict[str, int], seed: int, jobs: int) -> dict[str, Any]:
    """All cases in forked workers, `jobs` at a time; a worker that dies is reported and its chunk resumed."""
    ctx = mp.get_context("fork")
    todo = [(n, a, min(a + CHUNK, counts[n])) for n in names for a in range(0, counts[n], CHUNK)]
    per: dict[str, dict[str, Any]] = {n: {"cases": 0, "failures": [], "escapes": 0, "seconds": 0.0, "fd_growth": 0}
                                      for n in names}
    running: list[tuple[Any, Any, Any, tuple[str, int, int]]] = []
    done_cases = 0
    total = sum(counts.values())
    t0 = time.perf_counter()
    last_print = 0.0
    while todo or running:
        while todo and len(running) < jobs:
            chunk = todo.pop(0)
            current = ctx.Value("q", chunk[1])
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(*chunk, seed, current, child_end), daemon=True)
            p.start()
            child_end.close()
            running.append((p, parent_end, current, chunk))
        time.sleep(0.02)
        for item in list(running):
            p, conn, current, (name, a, b) = item
            res = None
            if conn.poll():
                try:
                    res = conn.recv()
                except EOFError:
                    res = None
            if res is None and p.is_alive():
                continue
            p.join()
            running.remove(item)
            conn.close()
            rec = per[name]
            if res is not None:
                rec["cases"] += res["stop"] - res["start"]
                rec["failures"] += res["failures"]
                rec["escapes"] += res["escapes"]
                rec["seconds"] += res["seconds"]
                rec["fd_growth"] = max(rec["fd_growth"], res["fd_growth"])
                done_cases += res["stop"] - res["start"]
            else:  # the worker died inside a case: that case is a failure; go on after it
                i = int(current.value)
                sig = -p.exitcode if p.exitcode and p.exitcode < 0 else None
                how = f"killed by {signal.Signals(sig).name}" if sig else f"exit status {p.exitcode}"
                rec["failures"].append({"case": i, "kind": "crash", "where": "process", "message": how, "input": ""})
                rec["cases"] += i + 1 - a
                done_cases += i + 1 - a
                if i + 1 < b:
                    todo.insert(0, (name, i + 1, b))
        now = time.perf_counter()
        if now - last_print > 10 or (not todo and not running):
            last_print = now
            nfail = sum(len(r["failures"]) for r in per.values())
            print(f"[{done_cases}/{total}] {nfail} failures, {now - t0:.0f} s", flush=True)
    return per


def signatures(per: dict[str, dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Failures grouped by (target, kind, where), each with its first case as the reproducer."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for name, r in per.items():
        for f in sorted(r["failures"], key=lambda f: f["case"]):
            key = (name, f["kind"], f["where"])
            if key not in out:
                out[key] = {"target": name, "kind": f["kind"], "where": f["where"], "count": 0,
                            "message": f["message"], "input": f["input"], "case": f["case"],
                            "reproduce": f"python bench/fuzz.py --target {name} --case {f['case']} --seed {seed}"}
            out[key]["count"] += 1
    return sorted(out.values(), key=lambda s: -s["count"])


def markdown(args: argparse.Namespace, per: dict[str, dict[str, Any]], sigs: list[dict[str, Any]], seconds: float) -> str:
    rows = [[n, r["cases"], len(r["failures"]), r["escapes"], f"{r['seconds']:.1f}",
             f"{1e3 * r['seconds'] / max(1, r['cases']):.2f}"] for n, r in per.items()]
    cases = sum(r["cases"] for r in per.values())
    fails = sum(len(r["failures"]) for r in per.values())
    outside = sum(r["escapes"] for r in per.values())
    rows.append(["**all**", cases, fails, outside, f"{sum(r['seconds'] for r in per.values()):.1f}", ""])
    lines = [f"## kvdata fuzz ({machine_line(machine_info(('numpy', 'lmdb', 'msgpack', 'kvdata')))})", "",
             f"{cases} cases (seed {args.seed}, {args.jobs} worker processes), {seconds:.0f} s. A failure is an "
             "exception other than KVDataError, a CLI error that is not one `kvdata: error:` line, a worker "
             "killed by a signal, or a file written outside the case's temp root.", "",
             md_table(["target", "cases", "failures", "files outside", "worker s", "ms/case"], rows), ""]
    if sigs:
        failed = [[s["target"], s["kind"], s["where"], s["count"], s["message"][:80].replace("|", "/"),
                   f"`{s['reproduce']}`"] for s in sigs[:40]]
        lines += ["Distinct failures (first case of each; reproduce with the command):", "",
                  md_table(["target", "kind", "where", "count", "message", "reproduce"], failed, left=3), ""]
    lines.append(f"Target: 0 failures and 0 files written outside the temp root: "
                 f"{'met' if not fails and not outside else 'NOT met'}.")
    return "\n".join(lines) + "\n"


def reproduce(name: str, i: int, seed: int) -> int:
    """Run one case in this process and print its input and outcome (with the full traceback)."""
    t = fl.TARGETS[name]
    with fl.context() as ctx:
        case = t.gen(case_rng(seed, name, i), ctx)
        print(f"target {name}, case {i}, seed {seed}\ninput: {fl.abbreviate(case, 4000)}")
        try:
            t.run(case, ctx)
            print("outcome: returned")
        except fl.KVDataError as e:
            print(f"outcome: {type(e).__name__} (allowed): {e}")
        except Exception:  # noqa: BLE001 - this is the failure being reproduced
            print("outcome: FAILURE")
            traceback.print_exc()
            return 1
        if t.files:
            esc = ctx.sandbox.escapes()
            if esc:
                print(f"FAILURE: written outside the temp root: {esc}")
                return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100_000, help="cases in all, shared by target weight (default 100000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of every case (default 0)")
    ap.add_argument("--only", default="", help="comma-separated targets (default: all)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default 2)")
    ap.add_argument("--quick", action="store_true", help=f"a smoke test: {QUICK_CASES} cases")
    ap.add_argument("--json", type=Path, help="also write the results (and the markdown report) here")
    ap.add_argument("--target", help="with --case: reproduce one case of this target")
    ap.add_argument("--case", type=int, help="with --target: the case index to reproduce")
    ap.add_argument("--list", action="store_true", help="list the targets and their weights")
    args = ap.parse_args(argv)
    if args.list:
        for n, t in fl.TARGETS.items():
            print(f"{n:16s} weight {t.weight:3d}{'  (writes files)' if t.files else ''}")
        return 0
    if args.target is not None or args.case is not None:
        if args.target not in fl.TARGETS or args.case is None:
            ap.error(f"--target NAME --case I reproduces one case; targets: {', '.join(fl.TARGETS)}")
        return reproduce(args.target, args.case, args.seed)
    if args.quick:
        args.cases = QUICK_CASES
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(fl.TARGETS)
    unknown = [n for n in names if n not in fl.TARGETS]
    if unknown:
        ap.error(f"unknown targets {unknown}; targets: {', '.join(fl.TARGETS)}")
    if args.cases < len(names) or args.jobs < 1:
        ap.error("--cases must be at least the number of targets and --jobs at least 1")
    counts = shares(args.cases, names)
    t0 = time.perf_counter()
    per = run(names, counts, args.seed, args.jobs)
    seconds = time.perf_counter() - t0
    sigs = signatures(per, args.seed)
    report = markdown(args, per, sigs, seconds)
    print()
    print(report)
    for s in sigs:
        print(f"FAIL {s['target']}: {s['kind']} at {s['where']} x{s['count']}: {s['message'][:200]}\n"
              f"     input: {s['input'][:300]}\n     reproduce: {s['reproduce']}")
    cases = sum(r["cases"] for r in per.values())
    fails = sum(len(r["failures"]) for r in per.values())
    outside = sum(r["escapes"] for r in per.values())
    if args.json:
        write_json(args.json, {
            "config": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(), "seconds": seconds,
            "cases": cases, "failures": fails, "files_outside": outside,
            "targets": {n: {"cases": r["cases"], "failures": len(r["failures"]), "files_outside": r["escapes"],
                            "worker_seconds": r["seconds"], "fd_growth": r["fd_growth"]} for n, r in per.items()},
            "signatures": sigs, "markdown": report})
    return 0 if not fails and not outside else 1


if __name__ == "__main__":
    sys.exit(main())
