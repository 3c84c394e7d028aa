"""Crash-test child: write to a dataset in committed batches until SIGKILLed.

    python tests/crash_writer.py DATASET SEED JOURNAL

The journal (see crash_check.py) says what is committed; this process reads it at start,
resolves an intent a previous child left outstanding (the dataset's generation says whether
that commit landed), and goes on from that state: new keys, overwrites and deletes of existing
keys, sometimes seal(), then commit(). Before each commit() it journals the batch (intent) and
prints "I <gen>"; after commit() returns it journals "done" and prints "D <gen>". It prints "R"
once its imports are done, before it opens the dataset (so a kill can land in recovery).
It never exits on its own unless something is wrong (exit status 3).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import kvdata

from crash_check import SHARD_SIZE, Journal, digest, read_journal, repair_journal, replay, value_for

LIVE_TARGET = 300
BATCHES = (("tiny", 0.35, 1, 4), ("medium", 0.45, 10, 41), ("large", 0.2, 100, 251))  # name, p, lo, hi


def say(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def fail(msg: str) -> None:
    sys.stderr.write(f"crash_writer: {msg}\n")
    sys.stderr.flush()
    sys.exit(3)


def main(ds: Path, seed: int, journal_path: Path) -> None:
    say("R")
    repair_journal(journal_path)
    r = replay(read_journal(journal_path))
    if r.generation < 0:
        fail(f"{journal_path} has no init line; the parent creates the dataset first")
    journal = Journal(journal_path)
    s = kvdata.open(ds, "a", shard_size=SHARD_SIZE)
    live = dict(r.state)
    if r.pending is not None:
        gen = int(r.pending["gen"])
        if s.generation == gen:
            journal.append({"t": "done", "gen": gen})
            live = {**{k: v for k, v in live.items() if k not in r.pending["del"]},
                    **{k: tuple(v) for k, v in r.pending["put"].items()}}
        elif s.generation == gen - 1:
            journal.append({"t": "abort", "gen": gen})
        else:
            fail(f"generation {s.generation} after an intent for {gen}")
    elif s.generation != r.generation:
        fail(f"generation {s.generation}, the journal says {r.generation}")
    restart = r.restarts
    journal.append({"t": "start", "n": restart})
    rng = np.random.default_rng([seed, restart])
    next_key = r.next_key
    batch = 0
    while True:
        batch += 1
        names, probs = [b[0] for b in BATCHES], [b[1] for b in BATCHES]
        _name, _p, lo, hi = BATCHES[names.index(str(rng.choice(names, p=probs)))]
        n_ops = int(rng.integers(lo, hi))
        cur = dict(live)
        puts: dict[str, tuple[str, str]] = {}
        dels: set[str] = set()
        seal_at = int(rng.integers(0, n_ops + 1)) if rng.random() < 0.25 else -1
        op = 0
        while op < n_ops:
            if op == seal_at:
                s.seal()
            crowded = len(cur) > LIVE_TARGET
            p_new, p_over = (0.15, 0.25) if crowded else (0.55, 0.3)
            u = rng.random()
            if u < 0.08:
                # put_many: a few new and existing keys in one call
                group = []
                existing = list(cur)
                for _ in range(int(rng.integers(2, 9))):
                    if existing and rng.random() < (0.8 if crowded else 0.4):
                        k = existing[int(rng.integers(len(existing)))]
                    else:
                        k, next_key = f"k{next_key:07d}", next_key + 1
                    if k in (g[0] for g in group):
                        continue
                    ver = f"{restart}.{batch}.{op}"
                    v = value_for(k, ver)
                    group.append((k, v))
                    cur[k] = puts[k] = (ver, digest(v))
                    dels.discard(k)
                s.put_many(group)
            elif not cur or u < p_new:
                k, next_key = f"k{next_key:07d}", next_key + 1
                ver = f"{restart}.{batch}.{op}"
                v = value_for(k, ver)
                s.put(k, v)
                cur[k] = puts[k] = (ver, digest(v))
            elif u < p_new + p_over:
                k = list(cur)[int(rng.integers(len(cur)))]
                ver = f"{restart}.{batch}.{op}"
                v = value_for(k, ver)
                s.put(k, v)
                cur[k] = puts[k] = (ver, digest(v))
                dels.discard(k)
            else:
                k = list(cur)[int(rng.integers(len(cur)))]
                s.delete(k)
                del cur[k]
                puts.pop(k, None)
                if k in live:
                    dels.add(k)
            op += 1
        if seal_at == n_ops:
            s.seal()
        gen = s.generation + 1
        journal.append({"t": "intent", "gen": gen, "put": {k: list(v) for k, v in puts.items()}, "del": sorted(dels)})
        say(f"I {gen}")
        got = s.commit()
        if got != gen:
            fail(f"commit() returned {got}, expected {gen}")
        journal.append({"t": "done", "gen": gen})
        say(f"D {gen}")
        live = cur


if __name__ == "__main__":
    if len(sys.argv) != 4:
        fail("usage: crash_writer.py DATASET SEED JOURNAL")
    main(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
