"""Shuffle quality of the shard-blocked epoch order: distinct classes per batch.

An ImageNet-like dataset (1000 classes x 1300 samples, shards of 1300 samples) is laid
out two ways:

- class-sorted: written in class order, so every shard holds one class (what a naive
  writer produces);
- random-order: shuffled before writing (what `kvdata import` does by default), so every
  shard holds a random sample of the classes.

For each shuffle window (shards whose samples are mixed together) the script runs the
exact order ShardShuffleSampler yields (kvdata.order.blocked.epoch_order, one rank), cuts it into
batches of 256 and reports the mean (and the minimum) number of distinct classes per
batch, against a true random permutation of all samples, and how often two samples of
the same shard share a batch (the price of a small window, whatever the layout). Only numpy and kvdata.order are
used: no dataset is written.

The locality sampler (ShardShuffleSampler(locality=True), kvdata.order.locality.locality_shares) gets
the same measures with 4 nodes x 1 rank at exchange 0, 0.1 and 0.3, next to the global order
on 4 ranks, plus how much of a node's shards it already read the epoch before (what its
tier can serve again).

Then a real training comparison (needs torch and scikit-learn; skipped with a note
otherwise): scikit-learn's bundled digits (no download), the training split written as a
real kvdata dataset in class-sorted shards of 16 samples; a small MLP (torch, CPU) trained
data-parallel on 4 simulated nodes x 2 ranks (every step's batch is the concatenation of
every rank's next batch, i.e. averaged gradients), each rank's indices from the real
ShardShuffleSampler: global order vs locality at exchange 0 / 0.1 / 0.3, and a uniformly
random permutation for reference; final test accuracy over 3 seeds.

    python bench/shuffle_quality.py                          # print the tables (~1 minute)
    python bench/shuffle_quality.py --write docs/SHUFFLE.md  # and update the tables there
    python bench/shuffle_quality.py --quick --json out.json  # one epoch per row; numbers as JSON
    python bench/shuffle_quality.py --no-train               # numpy only: no training
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvdata.order import blocked, locality

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, machine_line, md_table, replace_block, write_json  # noqa: E402

BEGIN, END = "<!-- shuffle_quality:begin -->", "<!-- shuffle_quality:end -->"
TRAIN_BEGIN, TRAIN_END = "<!-- shuffle_training:begin -->", "<!-- shuffle_training:end -->"


def distinct_per_batch(labels_in_order: np.ndarray, batch: int) -> np.ndarray:
    """Distinct labels in each full batch of `batch` consecutive samples."""
    nb = len(labels_in_order) // batch
    b = np.sort(labels_in_order[:nb * batch].reshape(nb, batch), axis=1)
    return 1 + np.count_nonzero(b[:, 1:] != b[:, :-1], axis=1)


def same_shard_pairs_together(sample_shards: np.ndarray, order: np.ndarray, batch: int) -> float:
    """Fraction of same-shard sample pairs that land in the same batch (layout-independent:
    it says how tied a sample's batch-mates are to its shard)."""
    return same_shard_pairs_in([order], sample_shards, batch)


def same_shard_pairs_in(shares: list[np.ndarray], sample_shards: np.ndarray, batch: int) -> float:
    """same_shard_pairs_together over several ranks' shares (a permutation together), each
    cut into its own batches."""
    n = sum(len(x) for x in shares)
    bid = np.empty(n, dtype=np.int64)
    first = 0
    for x in shares:
        bid[x] = first + np.arange(len(x)) // batch
        first += -(-len(x) // batch)
    nb = first
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
    groups = blocked.group_by_shard(sample_shards)
    layouts = [sorted_labels, random_labels]

    rows = []
    plan_s = 0.0
    for w in args.windows:
        cells = [[] for _ in layouts]
        pairs = []
        for e in range(args.epochs):
            t0 = time.perf_counter()
            order = blocked.epoch_order(groups, args.seed, e, window=w)
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
    info["locality"] = measure_locality(args, groups, sample_shards, layouts)
    return rows, info


LocRow = tuple[str, list[tuple[float, int]], float, float]


def measure_locality(args: argparse.Namespace, groups: blocked.ShardGroups, sample_shards: np.ndarray,
                     layouts: list[np.ndarray]) -> list[LocRow]:
    """The global order on nodes x 1 rank vs the locality order at each exchange: the same
    per-rank batch measures, and the fraction of a node's shards it also read the epoch before."""
    rows = []
    nodes, w = args.nodes, args.locality_window
    epochs = max(2, args.epochs)  # "read the epoch before" needs two
    for exchange in [None, *args.exchanges]:
        cells: list[list[np.ndarray]] = [[] for _ in layouts]
        pairs, kept = [], []
        before: list[set[int]] | None = None
        for e in range(epochs):
            if exchange is None:
                order = blocked.epoch_order(groups, args.seed, e, window=w)
                shares = [blocked.rank_share(order, r, nodes, False) for r in range(nodes)]
            else:
                shares = list(locality.locality_shares(groups, args.seed, e, nodes, nodes, exchange, window=w))
            for c, lab in zip(cells, layouts):
                c.extend(distinct_per_batch(lab[x], args.batch) for x in shares)
            pairs.append(same_shard_pairs_in(shares, sample_shards, args.batch))
            now = [set(np.unique(sample_shards[x]).tolist()) for x in shares]
            if before is not None:
                kept.extend(len(a & b) / len(a) for a, b in zip(now, before))
            before = now
        name = f"global order, {nodes} ranks" if exchange is None else f"locality, exchange {exchange:g}"
        rows.append((name, [(float(np.mean(d)), int(np.min(d))) for d in map(np.concatenate, cells)],
                     float(np.mean(pairs)), float(np.mean(kept))))
    return rows


def locality_table(rows: list[LocRow]) -> str:
    return md_table(["sampler", "class-sorted shards: mean (min)", "random-order shards: mean (min)",
                     "same-shard pairs in one batch", "a node's shards also read the epoch before"],
                    [[name, *(f"{m:.1f} ({lo})" for m, lo in cells), f"{100 * pairs:.3g}%", f"{100 * kept:.0f}%"]
                     for name, cells, pairs, kept in rows]).rstrip("\n")


# ---------------------------------------------------------------- a real training comparison

def write_digits(path: Path, x: np.ndarray, y: np.ndarray, shard: int) -> Any:
    """The training split as a kvdata dataset in class-sorted shards of `shard` samples."""
    import kvdata

    order = np.argsort(y, kind="stable")
    with kvdata.open(path, "w") as s:
        for a in range(0, len(order), shard):
            s.put_many((f"d{i:05d}", {"x": x[i], "y": int(y[i])}) for i in order[a:a + shard].tolist())
            s.seal()
            s.commit()
    return kvdata.open(path)


def train_once(xs: np.ndarray, ys: np.ndarray, xt: np.ndarray, yt: np.ndarray,
               epoch_shares: Callable[[int], list[np.ndarray]], args: argparse.Namespace, seed: int) -> list[float]:
    """Data-parallel SGD: each step's batch is every rank's next `batch` samples; returns the
    test accuracy after each of args.train_epochs epochs (one run, evaluated on the way)."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    x_all, y_all = torch.from_numpy(xs), torch.from_numpy(ys)
    b = args.train_batch
    accs = []
    for e in range(max(args.train_epochs)):
        shares = epoch_shares(e)
        steps = min(len(x) for x in shares) // b
        for k in range(steps):
            idx = torch.from_numpy(np.concatenate([x[k * b:(k + 1) * b] for x in shares]).astype(np.int64))
            loss = torch.nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if e + 1 in args.train_epochs:
            with torch.no_grad():
                pred = model(torch.from_numpy(xt)).argmax(1).numpy()
            accs.append(float((pred == yt).mean()))
    return accs


def measure_training(args: argparse.Namespace) -> tuple[list[tuple[str, list[list[float]]]], dict] | str:
    """Final test accuracy per sampler and seed, or why it could not run."""
    try:
        import torch  # noqa: F401
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        from kvdata.reader.sampler import ShardShuffleSampler
    except ImportError as e:
        return f"training comparison skipped: {e} (pip install -e '.[test]')"
    import tempfile

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    xs, xt, ys, yt = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    nodes, per_node = args.nodes, args.train_ranks_per_node
    world = nodes * per_node
    results: list[tuple[str, list[list[float]]]] = []
    with tempfile.TemporaryDirectory(prefix="kvdata-shuffle-") as tmp:
        ds = write_digits(Path(tmp) / "digits.kv", xs, ys, args.train_shard)
        try:
            n = len(ds.sample_shards)
            info = {"train": n, "test": len(yt), "shards": int(len(np.unique(ds.sample_shards))),
                    "world": world, "nodes": nodes}
            # the dataset's record order is class-sorted: sample i of the dataset is stored record i
            keys = [ds.key_at(i) for i in range(n)]
            rows = np.array([int(k[1:]) for k in keys])
            xs_ds, ys_ds = xs[rows], ys[rows]
            # the control row shows the comparison can tell a poor order: the class-sorted data
            # read as stored by one rank (the same samples per step), the classic mistake
            configs: list[tuple[str, Any]] = [("uniformly random permutation", None),
                                              ("control: stored order, 1 rank, no shuffle", "control"),
                                              (f"global order ({world} ranks)", {})]
            configs += [(f"locality, exchange {ex:g}", {"locality": True, "exchange": ex, "nodes": nodes})
                        for ex in args.exchanges_train]
            for name, kw in configs:
                accs = []
                for seed in range(args.train_seeds):
                    if kw is None:
                        def shares_of(e: int, seed: int = seed) -> list[np.ndarray]:
                            p = np.random.default_rng([seed, e]).permutation(n)
                            return [p[r::world] for r in range(world)]
                    elif kw == "control":
                        def shares_of(e: int) -> list[np.ndarray]:
                            p = np.arange(n - n % world)   # every step: the next world x batch stored samples
                            return [p[r::world] for r in range(world)]
                    else:
                        samplers = [ShardShuffleSampler(ds, seed=seed, window=args.train_window, rank=r,
                                                        world_size=world, **kw) for r in range(world)]

                        def shares_of(e: int, samplers: list = samplers) -> list[np.ndarray]:
                            return [s.indices(e) for s in samplers]
                    accs.append(train_once(xs_ds, ys_ds, xt, yt, shares_of, args, seed))
                results.append((name, accs))
        finally:
            ds.close()
    return results, info


def training_body(res: tuple[list[tuple[str, list[list[float]]]], dict] | str, args: argparse.Namespace) -> str:
    if isinstance(res, str):
        return res
    results, info = res

    def cell(a: np.ndarray) -> str:
        return f"{100 * a.mean():.1f}% ({100 * a.min():.1f}-{100 * a.max():.1f})"
    table_ = md_table(["sampler", *(f"test accuracy after {e} epochs: mean (min-max)" for e in args.train_epochs)],
                      [[name, *(cell(np.asarray(a)[:, j]) for j in range(len(args.train_epochs)))]
                       for name, a in results]).rstrip("\n")
    return "\n".join([
        f"scikit-learn digits: {info['train']:,} training samples written as a kvdata dataset in "
        f"{info['shards']} class-sorted shards of {args.train_shard}, {info['test']} test samples. "
        f"MLP 64-64-10, SGD (lr {args.lr}, momentum 0.9), "
        f"{info['nodes']} nodes x {args.train_ranks_per_node} ranks, {args.train_batch} samples per rank per step "
        f"({info['world'] * args.train_batch} per step), window {args.train_window}; seeds 0-{args.train_seeds - 1} "
        "(the sampler's seed and the model's), each run evaluated after the epochs named.",
        "",
        table_,
    ])


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
        f"The locality sampler: {args.nodes} nodes x 1 rank, window {args.locality_window}, per-rank "
        f"batches of {args.batch} ({max(2, args.epochs)} epochs).",
        "",
        locality_table(info["locality"]),
        "",
        f"Produced by `{command}`.",
    ])


def write(path: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the begin ... end block of a markdown file with text (a new file if there is none)."""
    if path.exists():
        try:
            doc = replace_block(path.read_text(), begin, end, text)
        except (KeyError, ValueError) as e:
            raise SystemExit(f"{path}: {e}") from None
    else:
        doc = "# Shuffle quality\n\n" + begin + "\n" + text + "\n" + end + "\n"
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
    p.add_argument("--nodes", type=int, default=4, help="nodes of the locality rows and the training")
    p.add_argument("--exchanges", type=float, nargs="+", default=[0.0, 0.1, 0.3], help="locality rows")
    p.add_argument("--locality-window", type=int, default=8)
    p.add_argument("--no-train", action="store_true", help="skip the training comparison")
    p.add_argument("--exchanges-train", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    p.add_argument("--train-seeds", type=int, default=3)
    p.add_argument("--train-epochs", type=int, nargs="+", default=[5, 20], help="report accuracy after these")
    p.add_argument("--train-ranks-per-node", type=int, default=2)
    p.add_argument("--train-batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--train-shard", type=int, default=16, help="samples per class-sorted shard")
    p.add_argument("--train-window", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args(argv)
    if args.quick:
        args.epochs = 1
    t0 = time.perf_counter()
    rows, info = measure(args)
    command = "python bench/shuffle_quality.py" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    text = body(rows, info, args, command)
    print(BEGIN + "\n" + text + "\n" + END)
    train_text = None
    if not args.no_train:
        t1 = time.perf_counter()
        res = measure_training(args)
        train_text = training_body(res, args) + f"\n\nProduced by `{command}` ({time.perf_counter() - t1:.0f}s)."
        print("\n" + TRAIN_BEGIN + "\n" + train_text + "\n" + TRAIN_END)
    seconds = time.perf_counter() - t0
    print(f"\n({seconds:.1f}s; slowest epoch plan {info['plan_s']:.2f}s)", file=sys.stderr)
    if args.write is not None:
        write(args.write, text)
        if train_text is not None:
            write(args.write, train_text, TRAIN_BEGIN, TRAIN_END)
    if args.json is not None:
        machine = machine_info(("numpy", "kvdata"))
        write_json(args.json, {
            "config": {k: str(v) for k, v in vars(args).items()}, "machine": machine, "seconds": seconds, "info": info,
            "rows": [{"window": name, "class_sorted_mean": cells[0][0], "class_sorted_min": cells[0][1],
                      "random_order_mean": cells[1][0], "random_order_min": cells[1][1], "same_shard_pairs": pairs}
                     for name, cells, pairs in rows],
            "locality_rows": [{"sampler": name, "class_sorted_mean": cells[0][0], "random_order_mean": cells[1][0],
                               "same_shard_pairs": pairs, "node_shards_kept": kept}
                              for name, cells, pairs, kept in info["locality"]],
            "markdown": f"## kvdata shuffle_quality ({machine_line(machine)})\n\n{text}\n"
                        + (f"\n{train_text}\n" if train_text else "")})


if __name__ == "__main__":
    main()
