"""Shuffle quality of the shard-blocked epoch order: distinct classes per batch.

An ImageNet-like dataset (1000 classes x 1300 samples, shards of 1300 samples) is laid
out two ways:

- class-sorted: written in class order, so every shard holds one class (what a naive
  writer produces);
- random-order: shuffled before writing (what `kvdata import` does by default), so every
  shard holds a random sample of the classes.

For each shuffle window (shards whose samples are mixed together) the script runs the
exact order ShardShuffleSampler yields (kvdata.order.epoch_order, one rank), cuts it into
batches of 256 and reports the mean (and the minimum) number of distinct classes per
batch, against a true random permutation of all samples, and how often two samples of
the same shard share a batch (the price of a small window, whatever the layout). Only numpy and kvdata.order are
used: no dataset is written.

    python bench/shuffle_quality.py                          # print the table
    python bench/shuffle_quality.py --write docs/SHUFFLE.md  # and update the table there
    python bench/shuffle_quality.py --quick --json out.json  # one epoch per row; numbers as JSON
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from kvdata import order as om

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, machine_line, md_table, replace_block, write_json  # noqa: E402

BEGIN, END = "<!-- shuffle_quality:begin -->", "<!-- shuffle_quality:end -->"


def distinct_per_batch(labels_in_order: np.ndarray, batch: int) -> np.ndarray:
    """Distinct labels in each full batch of `batch` consecutive samples."""
    nb = len(labels_in_order) // batch
    b = np.sort(labels_in_order[:nb * batch].reshape(nb, batch), axis=1)
    return 1 + np.count_nonzero(b[:, 1:] != b[:, :-1], axis=1)


def same_shard_pairs_together(sample_shards: np.ndarray, order: np.ndarray, batch: int) -> float:
    """Fraction of same-shard sample pairs that land in the same batch (layout-independent:
    it says how tied a sample's batch-mates are to its shard)."""
    nb = -(-len(order) // batch)
    bid = np.empty(len(order), dtype=np.int64)
    bid[order] = np.arange(len(order)) // batch
    shards = sample_shards.astype(np.int64)
    together = np.bincount(shards * nb + bid)
    per_shard = np.bincount(shards)
    return float((together * (together - 1)).sum() / (per_shard * (per_shard - 1)).sum())


def expected_random(classes: int, per_class: int, batch: int) -> float:
    """E[distinct classes] in a batch drawn without replacement from a balanced dataset."""
    n = classes * per_class
    # P(a given class is absent) = C(n - per_class, batch) / C(n, batch), as a product
    k = np.arange(batch, dtype=np.float64)
    p_absent = float(np.prod((n - per_class - k) / (n - k)))
    return classes * (1.0 - p_absent)


Row = tuple[str, list[tuple[float, int]], float]


def measure(args: argparse.Namespace) -> tuple[list[Row], dict]:
    n = args.classes * args.per_class
    sorted_labels = np.repeat(np.arange(args.classes, dtype=np.int16), args.per_class)
    random_labels = np.random.default_rng(args.seed + 1).permutation(sorted_labels)  # shuffled before writing
    sample_shards = (np.arange(n, dtype=np.int64) // args.shard).astype(np.uint32)
    groups = om.group_by_shard(sample_shards)
    layouts = [sorted_labels, random_labels]

    rows = []
    plan_s = 0.0
    for w in args.windows:
        cells = [[] for _ in layouts]
        pairs = []
        for e in range(args.epochs):
            t0 = time.perf_counter()
            order = om.epoch_order(groups, args.seed, e, window=w)
            plan_s = max(plan_s, time.perf_counter() - t0)
            for c, lab in zip(cells, layouts):
                c.append(distinct_per_batch(lab[order], args.batch))
            pairs.append(same_shard_pairs_together(sample_shards, order, args.batch))
        rows.append((str(w), [(float(np.mean(c)), int(np.min(c))) for c in map(np.concatenate, cells)],
                     float(np.mean(pairs))))

    rng = np.random.default_rng(args.seed)
    perms = [rng.permutation(n) for _ in range(args.epochs)]
    rows.append(("random permutation", [
        (float(np.mean(d)), int(np.min(d)))
        for d in (np.concatenate([distinct_per_batch(lab[p], args.batch) for p in perms]) for lab in layouts)],
        float(np.mean([same_shard_pairs_together(sample_shards, p, args.batch) for p in perms]))))
    info = {"n": n, "shards": len(groups.shard_ids), "batches": args.epochs * (n // args.batch),
            "expected": expected_random(args.classes, args.per_class, args.batch), "plan_s": plan_s}
    return rows, info


def table(rows: list[Row]) -> str:
    return md_table(["window (shards mixed)", "class-sorted shards: mean (min)", "random-order shards: mean (min)",
                     "same-shard pairs in one batch"],
                    [[name, *(f"{m:.1f} ({lo})" for m, lo in cells), f"{100 * pairs:.3g}%"]
                     for name, cells, pairs in rows]).rstrip("\n")


def body(rows: list[Row], info: dict, args: argparse.Namespace, command: str) -> str:
    """The report (what goes between the BEGIN and END markers)."""
    return "\n".join([
        f"Distinct classes per batch of {args.batch}, {args.classes} classes x {args.per_class} samples "
        f"({info['n']:,} samples) in {info['shards']} shards of {args.shard}; "
        f"{info['batches']:,} batches ({args.epochs} epochs, seed {args.seed}). "
        f"Expected for a uniformly random batch: {info['expected']:.1f}.",
        "",
        table(rows),
        "",
        f"Produced by `{command}`.",
    ])


def write(path: Path, text: str) -> None:
    """Replace the BEGIN ... END block of a markdown file with text (a new file if there is none)."""
    if path.exists():
        try:
            doc = replace_block(path.read_text(), BEGIN, END, text)
        except (KeyError, ValueError) as e:
            raise SystemExit(f"{path}: {e}") from None
    else:
        doc = "# Shuffle quality\n\n" + BEGIN + "\n" + text + "\n" + END + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(doc)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=1300)
    p.add_argument("--shard", type=int, default=1300, help="samples per shard")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    p.add_argument("--epochs", type=int, default=3, help="epochs averaged per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", type=Path, metavar="MD", help="replace the table block in this markdown file")
    p.add_argument("--quick", action="store_true", help="one epoch per row (instead of --epochs)")
    p.add_argument("--json", type=Path, help="also write the rows (and the markdown report) here")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs = 1
    t0 = time.perf_counter()
    rows, info = measure(args)
    command = "python bench/shuffle_quality.py" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    text = body(rows, info, args, command)
    print(BEGIN + "\n" + text + "\n" + END)
    seconds = time.perf_counter() - t0
    print(f"\n({seconds:.1f}s; slowest epoch plan {info['plan_s']:.2f}s)", file=sys.stderr)
    if args.write is not None:
        write(args.write, text)
    if args.json is not None:
        machine = machine_info(("numpy", "kvdata"))
        write_json(args.json, {
            "config": {k: str(v) for k, v in vars(args).items()}, "machine": machine, "seconds": seconds, "info": info,
            "rows": [{"window": name, "class_sorted_mean": cells[0][0], "class_sorted_min": cells[0][1],
                      "random_order_mean": cells[1][0], "random_order_min": cells[1][1], "same_shard_pairs": pairs}
                     for name, cells, pairs in rows],
            "markdown": f"## kvdata shuffle_quality ({machine_line(machine)})\n\n{text}\n"})


if __name__ == "__main__":
    main()
