#!/usr/bin/env python
"""Readers open and read a dataset 20,000 times while a writer commits, seals and rewrites it.

The long version of tests/integration/test_reader_during_writes.py (2,000 opens there). One
writer process loops over rounds: the first appends (mode "a"), every later one writes the
dataset again from empty (mode "w", a new incarnation); each round makes --commits commits of
7 records, with seal() + commit() after every fifth. Meanwhile --readers processes open it
(`kvdata.open(path)`), read 12 random samples plus the first and the newest through
`get_many`, and close, over and over. Every value encodes its key and the writer's round
(`"k000123|7|" * 40`), so a wrong value is detected, not only a crash:

- wrong value: a sample whose key is not `k%06d` of its position, whose value is not its own
  key's, is damaged, or one open that mixes rounds; a generation whose length is not a whole
  number of commits; one incarnation seen holding two rounds (names reused across "w");
- error: any exception, except a MissingShardError for a generation that "w" has replaced
  since the open (the documented outcome for a reader still on the old generation; counted
  as "old generation gone", and an error if the dataset was not in fact rewritten).

After the readers finish, the writer is stopped between commits (SIGTERM), and the dataset must
pass `verify` and hold no file its manifest does not name (no orphan tail, no lost+found).

    python bench/reader_opens.py                       # 20,000 opens (about 20 s on 2 cores)
    python bench/reader_opens.py --quick --json out.json   # 2,000 opens (run_all --quick); every number as JSON
    python bench/reader_opens.py --opens 5000 --readers 1 --seed 3
    python bench/reader_opens.py --dir /data/ro --keep     # keep the dataset

Exit status 1 if any error or wrong value was seen, the writer died, or the final checks failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, machine_line, md_table, quantile_sorted, write_json  # noqa: E402

PER_COMMIT = 7       # records per commit: a generation holds a whole number of them
SAMPLES = 12         # random samples read per open (plus the first and the newest)
REPEAT = 40          # a value is (key + "|" + round + "|") * REPEAT
QUICK_OPENS = 2000
MAX_MESSAGES = 20    # distinct error / wrong-value messages kept


def value_of(key: str, rnd: int) -> bytes:
    return ((key + "|" + str(rnd) + "|") * REPEAT).encode()


# ====================================================================== the writer (a child process)

def writer_main(path: Path, commits: int, shard_size: str) -> int:
    """Rounds of `commits` commits; round 1 appends, every later round rewrites ("w"). Stops
    between commits on SIGTERM. Prints one line per event: open/rewrite, commit, seal."""
    import kvdata

    stop = False

    def on_term(_sig: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    out = sys.stdout
    rnd = 0
    while not stop:
        rnd += 1
        mode = "w" if rnd > 1 else "a"
        with kvdata.open(path, mode, shard_size=shard_size) as s:
            print("rewrite" if mode == "w" else "open", flush=True, file=out)
            n = 0
            for c in range(commits):
                for _ in range(PER_COMMIT):
                    key = f"k{n:06d}"
                    s.put(key, value_of(key, rnd))
                    n += 1
                s.commit()
                print("commit", flush=True, file=out)
                if c % 5 == 4:
                    s.seal()
                    s.commit()
                    print("seal", flush=True, file=out)
                if stop:
                    break
    print(f"rounds {rnd}", flush=True, file=out)
    return 0


# ====================================================================== a reader (a child process)

def check_open(store: Any, rng: random.Random, rounds_of: dict[int, int]) -> tuple[int, list[str]]:
    """Read one open generation; (values read, problems found)."""
    n = len(store)
    problems: list[str] = []
    if n % PER_COMMIT and n != 1:  # 1: the seed record, before the writer's first commit
        problems.append(f"a generation of {n} records, not a whole number of {PER_COMMIT}-record commits")
    if n == 0:
        return 0, problems
    idx = sorted({0, n - 1, *(rng.randrange(n) for _ in range(SAMPLES))})
    rounds = set()
    for i, v in zip(idx, store.get_many(idx)):
        key = store.key_at(i)
        if key != f"k{i:06d}":
            problems.append(f"sample {i} has key {key!r}, expected 'k{i:06d}'")
            continue
        try:
            text = bytes(v).decode()
            head, r, _ = text.split("|", 2)
            rnd = int(r)
        except (UnicodeDecodeError, ValueError):
            problems.append(f"sample {i} ({key}): a damaged value {bytes(v)[:40]!r}")
            continue
        if head != key:
            problems.append(f"sample {i} ({key}) holds the value of {head!r}")
        elif bytes(v) != value_of(key, rnd):
            problems.append(f"sample {i} ({key}): a damaged value of round {rnd}")
        rounds.add(rnd)
    if len(rounds) > 1:
        problems.append(f"one generation mixes values of rounds {sorted(rounds)}")
    inc = store.manifest.incarnation
    for rnd in rounds:
        if rounds_of.setdefault(inc, rnd) != rnd:
            problems.append(f"incarnation {inc} held round {rounds_of[inc]} and later round {rnd} (names reused)")
    return len(idx), problems


def reader_main(path: Path, opens: int, seed: int, label: str, out: Path) -> int:
    """Open and read `opens` times; write the counts to `out` as JSON."""
    import kvdata
    from kvdata.errors import MissingShardError
    from kvdata.store.generation import read_manifest

    def same(msg: str) -> str:  # one line per kind of failure: no temp path, no incarnation number
        return re.sub(r"-i\d{8}", "-iN", msg.replace(str(path), "DATASET"))

    rng = random.Random(seed)
    stats: dict[str, Any] = {"opens": 0, "reads": 0, "errors": 0, "wrong": 0, "gone": 0, "empty": 0}
    messages: Counter[str] = Counter()
    rounds_of: dict[int, int] = {}
    generations: set[tuple[int, int]] = set()
    tail_reads = 0
    lat: list[float] = []
    t0 = time.perf_counter()
    for k in range(opens):
        t = time.perf_counter()
        before = read_manifest(path).incarnation
        inc = before
        try:
            with kvdata.open(path) as store:
                m = store.manifest
                inc = m.incarnation
                generations.add((inc, m.generation))
                tail_reads += m.tail.records > 0
                got, problems = check_open(store, rng, rounds_of)
                stats["reads"] += got
                stats["empty"] += len(store) == 0
            if problems:
                stats["wrong"] += 1
                messages.update(same(f"wrong: {p}") for p in problems)
        except MissingShardError as e:
            if read_manifest(path).incarnation != inc:
                stats["gone"] += 1  # "w" replaced the generation this reader was on: the allowed outcome
            else:
                stats["errors"] += 1
                messages[same(f"error: MissingShardError with no rewrite: {e}")] += 1
        except Exception as e:  # noqa: BLE001 -- every other failure is counted and named
            stats["errors"] += 1
            messages[same(f"error: {type(e).__name__}: {e}")] += 1
        lat.append(time.perf_counter() - t)
        stats["opens"] += 1
        if (k + 1) % 1000 == 0:
            print(f"  [{label}] {k + 1}/{opens} opens, {stats['errors']} errors, {stats['wrong']} wrong, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    stats.update(seconds=time.perf_counter() - t0, generations=len(generations),
                 incarnations=len({g[0] for g in generations}), tail_opens=tail_reads, latencies=lat,
                 messages=dict(messages.most_common(MAX_MESSAGES)))
    write_json(out, stats)
    return 0


# ====================================================================== the run

class Writer:
    """The writer subprocess and the events it printed."""

    def __init__(self, path: Path, commits: int, shard_size: str) -> None:
        self.events: Counter[str] = Counter()
        self.rounds = 0
        self.proc = subprocess.Popen([sys.executable, __file__, "--child-writer", str(path), "--commits", str(commits),
                                      "--shard-size", shard_size], stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "rounds":
                self.rounds = int(rest)
            else:
                self.events[word] += 1

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (it finishes the commit in hand and closes the dataset); SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._thread.join(10)
        return rc


def final_checks(path: Path) -> list[str]:
    """The dataset after the writer stopped: verify passes, no file the manifest does not name."""
    import kvdata
    from kvdata.format import names
    from kvdata.reader.open import verify

    problems = []
    report = verify(path)
    if not report.get("ok"):
        problems.append(f"verify failed: {json.dumps(report, default=str)[:500]}")
    with kvdata.open(path) as st:
        m = st.manifest
    want = {s.name for s in m.shards} | {s.zst.name for s in m.shards if s.zst} \
        | {m.tail.name, names.lmdb_lock_name(m.tail.name)}
    stray = sorted(set(os.listdir(path / names.SHARDS_DIR)) - want)
    want_index = {n for n in (m.index.samples, m.index.records) if n} | {r.name for r in m.index.keys}
    stray += sorted(f"{names.INDEX_DIR}/{n}" for n in set(os.listdir(path / names.INDEX_DIR)) - want_index)
    if stray:
        problems.append(f"{len(stray)} file(s) the manifest does not name: {', '.join(stray[:10])}")
    if (path / "lost+found").exists():
        problems.append(f"files were moved aside to {path / 'lost+found'}: {sorted(os.listdir(path / 'lost+found'))}")
    return problems


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import kvdata

    path = work / "ds"
    with kvdata.open(path, "a", shard_size=args.shard_size) as s:
        s.put("k000000", value_of("k000000", 0))
    writer = Writer(path, args.commits, args.shard_size)
    time.sleep(0.2)
    per = [args.opens // args.readers + (j < args.opens % args.readers) for j in range(args.readers)]
    outs = [work / f"reader-{j}.json" for j in range(args.readers)]
    readers = [subprocess.Popen([sys.executable, __file__, "--child-reader", str(path), "--opens", str(n),
                                 "--seed", str(args.seed * 1000 + j), "--label", f"reader {j}", "--out", str(out)])
               for j, (n, out) in enumerate(zip(per, outs))]
    t0 = time.perf_counter()
    writer_died = None
    try:
        while any(r.poll() is None for r in readers):
            if writer.proc.poll() is not None:
                writer_died = f"the writer exited with status {writer.proc.returncode} while readers were reading"
                break
            time.sleep(0.2)
    finally:
        for r in readers:
            if r.poll() is None:
                r.kill()
            r.wait()
    seconds = time.perf_counter() - t0
    rc = writer.stop()
    if writer_died is None and rc != 0:
        writer_died = f"the writer exited with status {rc}"
    results = []
    for j, (r, out) in enumerate(zip(readers, outs)):
        try:
            results.append(json.loads(out.read_text()))
        except (OSError, ValueError):
            results.append({"opens": 0, "reads": 0, "errors": 1, "wrong": 0, "gone": 0, "empty": 0, "generations": 0,
                            "incarnations": 0, "tail_opens": 0, "latencies": [],
                            "messages": {f"error: reader {j} exited with status {r.returncode} and no result": 1}})
    checks = final_checks(path) if writer_died is None else []
    tot: dict[str, Any] = {k: sum(x[k] for x in results) for k in ("opens", "reads", "errors", "wrong", "gone", "empty",
                                                                   "tail_opens")}
    lat = sorted(v for x in results for v in x["latencies"])
    messages: Counter[str] = Counter()
    for x in results:
        messages.update(x["messages"])
    tot.update(
        seconds=seconds, opens_per_s=tot["opens"] / seconds if seconds else 0.0,
        open_ms_p50=1e3 * quantile_sorted(lat, 0.5), open_ms_p99=1e3 * quantile_sorted(lat, 0.99),
        open_ms_max=1e3 * (lat[-1] if lat else float("nan")),
        generations_seen=max((x["generations"] for x in results), default=0),
        incarnations_seen=max((x["incarnations"] for x in results), default=0),
        writer={"commits": writer.events["commit"], "seals": writer.events["seal"],
                "rewrites": writer.events["rewrite"], "rounds": writer.rounds, "exit_status": rc},
        writer_died=writer_died, final_checks=checks, messages=dict(messages.most_common(MAX_MESSAGES)),
        per_reader=[{k: v for k, v in x.items() if k != "latencies"} for x in results])
    tot["ok"] = tot["errors"] == 0 and tot["wrong"] == 0 and writer_died is None and not checks \
        and tot["opens"] == args.opens
    return tot


def markdown(args: argparse.Namespace, r: dict[str, Any]) -> str:
    w = r["writer"]
    rows = [[f"{args.readers} reader process(es), 1 writer", f"{r['opens']:,}", f"{r['reads']:,}", r["errors"], r["wrong"],
             r["gone"], f"{r['seconds']:.1f}", f"{r['opens_per_s']:.0f}",
             f"{r['open_ms_p50']:.1f} / {r['open_ms_p99']:.1f} / {r['open_ms_max']:.0f}"]]
    lines = [
        f"## kvdata reader_opens ({machine_line(machine_info(('numpy', 'lmdb', 'kvdata')))})", "",
        f"{r['opens']:,} opens by {args.readers} reader process(es) (seed {args.seed}), each reading {SAMPLES} random "
        f"samples plus the first and the newest, while one writer made {w['commits']:,} commits ({PER_COMMIT} records "
        f"each), {w['seals']:,} explicit seals and {w['rewrites']:,} rewrites with mode \"w\" ({args.commits} commits "
        f"per round, shards <= {args.shard_size}). The readers saw {r['generations_seen']:,} generations of "
        f"{r['incarnations_seen']:,} incarnations (per reader, at most); {r['tail_opens']:,} opens had records in the "
        f"open tail, {r['empty']:,} found the dataset empty (just rewritten).", "",
        md_table(["run", "opens", "values read", "errors", "wrong values", "old generation gone", "seconds", "opens/s",
                  "open+read ms p50 / p99 / max"], rows),
        "\"Old generation gone\": a MissingShardError after \"w\" replaced the generation the reader had opened "
        "(checked: the dataset's incarnation had changed); the reader opens again.", ""]
    if r["messages"]:
        lines += ["Errors and wrong values (most frequent first; DATASET is the dataset's path, iN an incarnation "
                  "number):", "", "```",
                  *[f"{n:6d}  {msg[:300]}" for msg, n in r["messages"].items()], "```", ""]
    if r["writer_died"]:
        lines += [f"Writer: {r['writer_died']}.", ""]
    after = "passed" if not r["final_checks"] else "FAILED: " + "; ".join(r["final_checks"])
    lines += [f"After the run: verify and the file check {after}.",
              "", f"Target: 0 errors and 0 wrong values in at least {args.opens:,} opens: {'met' if r['ok'] else 'NOT met'}.",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--opens", type=int, default=20000, help="opens in all, split over the readers (default 20000)")
    ap.add_argument("--readers", type=int, default=2, help="reader processes (default 2)")
    ap.add_argument("--commits", type=int, default=30, help="commits per writer round before a rewrite (default 30)")
    ap.add_argument("--shard-size", default="64KB", help="the writer's shard size (default 64KB)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the readers' sample choices")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a new temp dir, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the dataset")
    ap.add_argument("--quick", action="store_true", help=f"a smoke test: {QUICK_OPENS:,} opens")
    ap.add_argument("--json", type=Path, help="also write the results (and the markdown report) here")
    ap.add_argument("--child-writer", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-reader", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--label", default="reader", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_writer:
        return writer_main(args.child_writer, args.commits, args.shard_size)
    if args.child_reader:
        return reader_main(args.child_reader, args.opens, args.seed, args.label, args.out)
    if args.quick:
        args.opens = QUICK_OPENS
    if args.opens < 1 or args.readers < 1 or args.commits < 1:
        ap.error("--opens, --readers and --commits must be at least 1")
    if args.dir is None:
        work = Path(tempfile.mkdtemp(prefix="kvdata-opens-"))
    else:
        work = args.dir
        work.mkdir(parents=True, exist_ok=True)
        if any(work.iterdir()):
            ap.error(f"--dir {work} is not empty; give an empty or new directory")
    r = run(args, work)
    report = markdown(args, r)
    print(report)
    if not r["ok"] or args.keep or args.dir is not None:
        print(f"dataset kept under {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        config = {k: str(v) for k, v in vars(args).items() if not k.startswith("child") and k not in ("label", "out")}
        write_json(args.json, {"config": config,
                               "machine": machine_info(), **{k: v for k, v in r.items()}, "markdown": report})
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
