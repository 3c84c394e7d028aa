#!/usr/bin/env python
"""torch's default collate against kvdata.collate over kvdata.Dataset, measured as users run it.

A user's training script is a fresh process that writes

    ds = kvdata.Dataset(path)
    sampler = kvdata.ShardShuffleSampler(ds, seed=0)          # or shuffle=True
    dl = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=nw)   # default collate_fn
    for epoch in range(E):
        sampler.set_epoch(epoch)
        for batch in dl: ...

so its first epoch pays for everything once per process: opening the store, kvdata's zero-copy
collate self-check (main process and every worker), the copy threads, each worker's ring of
shared batch buffers, the first touch of every mapped page. Every run here is such a run, in its
own fresh process (forked from this script's main process, which has imported torch and kvdata and
done nothing else with them), with the plain DataLoader (no persistent_workers: with workers,
every epoch starts them again, as a user's loop does):

  variants:  default collate (no collate_fn) | collate_fn=kvdata.collate | the np.memmap recipe
             (flat uint8 file + offsets, default collate; the baseline of bench/loader.py)
  rows:      num_workers {0, 2} x sampler {shuffle=True, ShardShuffleSampler} x
             {first epoch with a cold page cache (root only), first epoch warm, steady state}

The np.memmap recipe has no shards: with ShardShuffleSampler it is given the sampler built on the
kvdata Dataset (the same images in the same order), so it reads the same index order.

(a) "first epoch" is timed from `kvdata.Dataset(path)` (the recipe's Dataset) to the epoch's last
batch; "steady" is the median of epochs 2..E of the same process. Warm: every file was read once
before the runs (the page cache as right after writing a dataset); cold: the page cache is dropped
(`sync; echo 3 > /proc/sys/vm/drop_caches`, root only) before each cold process, which then runs
one epoch. Every repeat runs every cell once, the variants of a cell back to back in an order
rotated by the repeat's number, so that neither collate always runs first; the np.memmap recipe,
the slowest run, only in the first --memmap-repeats.
Tables give medians and the ratio of medians default / kvdata.collate, of images/s and of CPU
seconds per image (the process and its workers, user + system: the same work, less exposed to
other jobs on the machine than the clock).

(b) The side-by-side way of issue 26's figures: one process runs an epoch with one collate, then
an epoch with the other (ShardShuffleSampler, a new Dataset and DataLoader each), after the page
cache was dropped (root only); both orders, per worker count.

Before timing, the first batch of every variant is checked (0 and 2 workers, both samplers, in a
fresh process too): each image equals an original with its label, no repeats.

Run:  python bench/collate.py [--quick] [--json F] [--dir D --keep] [--cold-repeats 0 --in-turn-repeats 0]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

import kvdata  # imported once here: every run forks from this process

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    BATCH,
    IMG,
    SHAPE,
    built,
    can_drop_caches,
    dir_bytes,
    drop_caches,
    image_chunks,
    machine_info,
    machine_line,
    mark_built,
    md_table,
    median,
    rotated,
    work_dir,
    write_json,
)
from _memmap_recipe import MemmapDataset  # noqa: E402

GEN_CHUNK = 128        # images generated per step (the content depends on it; the same as loader.py)
TOUCH_STRIDE = 4096    # consume one byte per page of every image batch (as loader.py's Sink)
VARIANTS = ("default", "kvdata", "memmap")
HEAD = {"default": "default collate", "kvdata": "kvdata.collate", "memmap": "np.memmap recipe"}
SAMPLERS = ("shuffle", "shard")
SAMPLER_TEXT = {"shuffle": "shuffle=True", "shard": "ShardShuffleSampler"}


# ----------------------------------------------------------------------------- one user run (the child)

def user_run(root: Path, variant: str, sampler_kind: str, nw: int, epochs: int) -> dict[str, Any]:
    """One user run (call it in a fresh process): build the Dataset, sampler and DataLoader as a
    user writes them and iterate `epochs` epochs. Per epoch: images, seconds, and CPU seconds of
    this process and of its reaped children (the DataLoader's workers, which exit at each epoch's
    end: no persistent_workers)."""
    def cpu() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    sink = 0
    out: list[tuple[int, float, float]] = []
    c0, t0 = cpu(), time.perf_counter()
    if variant == "memmap":
        ds: Any = MemmapDataset(root)
        order_ds = kvdata.Dataset(root / "kvdata") if sampler_kind == "shard" else None
    else:
        ds = order_ds = kvdata.Dataset(root / "kvdata")
    sampler = kvdata.ShardShuffleSampler(order_ds, seed=0) if sampler_kind == "shard" else None
    kw: dict[str, Any] = {"collate_fn": kvdata.collate} if variant == "kvdata" else {}
    if sampler is not None:
        dl = tud.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=nw, **kw)
    else:
        dl = tud.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=nw, **kw)
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        n = 0
        for b in dl:
            img, lab = b["image"], b["label"]
            n += img.shape[0]
            sink += int(img.reshape(img.shape[0], -1)[:, ::TOUCH_STRIDE].sum()) + int(lab.sum())
        c1, t1 = cpu(), time.perf_counter()
        out.append((n, t1 - t0, c1 - c0))
        c0, t0 = c1, t1
    return {"epochs": out, "sink": sink}


def one_process_in_turn(root: Path, order: list[str], nw: int) -> dict[str, float]:
    """The side-by-side way (issue 26's figures): one process, ShardShuffleSampler, one epoch with
    each collate in turn (a new Dataset and DataLoader each); images/s per variant."""
    out = {}
    for variant in order:
        r = user_run(root, variant, "shard", nw, 1)
        (n, s, _), = r["epochs"]
        out[variant] = n / s
    return out


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a child forked from this process (which has imported torch and kvdata and
    done nothing else with them: no Dataset, no self-check, no threads of kvdata's): its result,
    or SystemExit with the child's traceback."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        code = 0
        try:
            msg = json.dumps({"ok": fn(*args)})
        except BaseException:
            msg, code = json.dumps({"error": traceback.format_exc()}), 1
        try:
            with os.fdopen(w, "w") as f:
                f.write(msg)
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    res = json.loads(data) if data else {"error": "the child died without a result"}
    if "error" in res:
        raise SystemExit(f"{getattr(fn, '__name__', fn)}{args[1:]} failed:\n{res['error']}")
    return res["ok"]


# ----------------------------------------------------------------------------- the parent

def build(root: Path, n: int, seed: int, content: str, shard_size: str) -> dict[str, Any]:
    """The same n seeded images as a kvdata dataset (sealed) and as the recipe's flat file
    (reused when built with the same parameters)."""
    params = {"n": n, "seed": seed, "content": content, "shard_size": shard_size}
    done = root / "DONE.json"
    info = built(done, params, root / "kvdata", root / "flat.u8")
    if info is not None:
        return info
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    labels = np.arange(n, dtype=np.int64) % 1000
    with open(root / "flat.u8", "wb") as flat, \
            kvdata.open(root / "kvdata", "w", shard_size=shard_size, compress=False) as st:
        for start, arr in image_chunks(rng, n, GEN_CHUNK, content):
            flat.write(arr.tobytes())
            st.put_many((f"{i:08d}", {"image": img, "label": int(labels[i])}, int(labels[i]))
                        for i, img in zip(range(start, start + len(arr)), arr))
        st.seal()
    np.save(root / "offsets.npy", np.arange(n + 1, dtype=np.int64) * IMG)
    np.save(root / "labels.npy", labels)
    with kvdata.open(root / "kvdata") as st:
        shards = len(st.manifest["shards"])
    sizes = {f: dir_bytes(root / f) for f in ("flat.u8", "kvdata")}
    return mark_built(done, params, kvdata_shards=shards, bytes=sizes)


def warm_page_cache(root: Path) -> None:
    buf = bytearray(8 << 20)
    for f in sorted(root.rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def check_first_batches(root: Path, workers: list[int]) -> None:
    """Untimed (run it in a fresh process): the first batch of every variant, sampler and worker
    count holds originals with their labels, none repeated."""
    flat = np.memmap(root / "flat.u8", np.uint8, "r").reshape(-1, *SHAPE)
    lookup = {flat[i, 0].tobytes(): i for i in range(len(flat))}
    kv_ds = kvdata.Dataset(root / "kvdata")
    for variant in VARIANTS:
        ds: Any = MemmapDataset(root) if variant == "memmap" else kvdata.Dataset(root / "kvdata")
        kw: dict[str, Any] = {"collate_fn": kvdata.collate} if variant == "kvdata" else {}
        for sk in SAMPLERS:
            for nw in workers:
                if sk == "shard":
                    sampler = kvdata.ShardShuffleSampler(kv_ds, seed=0)
                    dl = tud.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=nw, **kw)
                else:
                    dl = tud.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=nw, **kw)
                b = next(iter(dl))
                img, lab = b["image"], b["label"]
                what = f"{HEAD[variant]}, {SAMPLER_TEXT[sk]}, num_workers={nw}"
                if not (isinstance(img, torch.Tensor) and img.dtype == torch.uint8
                        and tuple(img.shape) == (BATCH, *SHAPE) and tuple(lab.shape) == (BATCH,)):
                    raise SystemExit(f"{what}: batch is {tuple(img.shape)} {img.dtype}, labels {tuple(lab.shape)}")
                x, labels, seen = img.numpy(), lab.numpy(), set()
                for j in range(BATCH):
                    i = lookup.get(x[j, 0].tobytes())
                    if i is None or not np.array_equal(x[j], flat[i]) or labels[j] != i % 1000:
                        raise SystemExit(f"{what}: sample {j} of the first batch is not an original with its label")
                    seen.add(i)
                if len(seen) != BATCH:
                    raise SystemExit(f"{what}: the first batch repeats samples")
                del b, img, lab, x, dl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, help="where to build the dataset (default: a temp dir under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the dataset; a later run with the same --dir reuses it")
    p.add_argument("--n-images", type=int, default=3000, help="227x227x3 images (default 3000, ~460 MB per format)")
    p.add_argument("--workers", default="0,2", help="num_workers values (default 0,2)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per warm process: the first + E-1 steady (default 3)")
    p.add_argument("--repeats", type=int, default=8,
                   help="warm repeats (default 8: with 3 recipe repeats, each collate runs first in 4)")
    p.add_argument("--memmap-repeats", type=int, default=3,
                   help="of those, the first R also run the np.memmap recipe (default 3: it is the slowest run)")
    p.add_argument("--cold-repeats", type=int, default=2,
                   help="cold first-epoch repeats (default 2; root only, else skipped with a note; 0: none)")
    p.add_argument("--in-turn-repeats", type=int, default=2,
                   help="repeats of (b), both collates in turn in one process after dropping the page cache "
                        "(default 2; root only; 0: none)")
    p.add_argument("--content", choices=("smooth", "noise"), default="smooth")
    p.add_argument("--shard-size", default="256MB", help="kvdata shard size (default 256MB, as loader.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test (numbers mean nothing)")
    p.add_argument("--json", type=Path, help="also write the raw numbers here")
    if "--quick" in sys.argv[1:]:  # smaller defaults; options given explicitly still win
        p.set_defaults(n_images=600, epochs=2, repeats=1, memmap_repeats=1, cold_repeats=1, in_turn_repeats=1,
                       shard_size="16MB")
    a = p.parse_args()
    if a.n_images < BATCH or a.epochs < 2 or a.repeats < 1:
        raise SystemExit(f"--n-images >= {BATCH}, --epochs >= 2 and --repeats >= 1")
    workers = [int(x) for x in a.workers.split(",")]
    droppable = can_drop_caches()
    cold, in_turn = a.cold_repeats > 0 and droppable, a.in_turn_repeats > 0 and droppable
    notes = []
    if (a.cold_repeats > 0 or a.in_turn_repeats > 0) and not droppable:
        notes.append("cold first epochs and (b) skipped: dropping the page cache needs root and a writable "
                     "/proc/sys/vm/drop_caches")
    d, made = work_dir(a.dir, "kvdata-collate-")
    root = d / "collate"
    machine = machine_info(("numpy", "torch", "kvdata"))
    out: dict[str, Any] = {"config": {k: str(v) for k, v in vars(a).items()}, "machine": machine}
    cells = [(nw, sk) for nw in workers for sk in SAMPLERS]
    states = (["cold"] if cold else []) + ["first", "steady"]
    # raw[state][nw][sampler][variant] -> [(images/s, CPU seconds per 1000 images), ...] one per repeat
    raw: dict[str, dict[str, dict[str, dict[str, list[tuple[float, float]]]]]] = {
        st: {str(nw): {sk: {v: [] for v in VARIANTS} for sk in SAMPLERS} for nw in workers} for st in states}
    sink = 0
    try:
        t0 = time.perf_counter()
        info = in_fresh_process(build, root, a.n_images, a.seed, a.content, a.shard_size)
        warm_page_cache(root)
        print(f"built/reused the dataset in {root} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        out["dataset"] = info
        in_fresh_process(check_first_batches, root, workers)
        t_start = time.perf_counter()
        for r in range(a.repeats):
            variants = list(VARIANTS) if r < a.memmap_repeats else ["default", "kvdata"]
            for nw, sk in rotated(cells, r):
                for v in rotated(variants, r):  # by the repeat alone: each variant runs first equally often
                    res = in_fresh_process(user_run, root, v, sk, nw, a.epochs)
                    sink += res["sink"]
                    (n0, s0, c0), *rest = res["epochs"]
                    raw["first"][str(nw)][sk][v].append((n0 / s0, 1000 * c0 / n0))
                    raw["steady"][str(nw)][sk][v].append((median(n / s for n, s, _ in rest),
                                                          median(1000 * c / n for n, _, c in rest)))
            print(f"warm repeat {r + 1}/{a.repeats} ({time.perf_counter() - t_start:.0f}s)", file=sys.stderr)
        if cold:
            for r in range(a.cold_repeats):
                for nw, sk in rotated(cells, r):
                    for v in rotated(list(VARIANTS), r):
                        drop_caches()
                        res = in_fresh_process(user_run, root, v, sk, nw, 1)
                        sink += res["sink"]
                        (n0, s0, c0), = res["epochs"]
                        raw["cold"][str(nw)][sk][v].append((n0 / s0, 1000 * c0 / n0))
                print(f"cold repeat {r + 1}/{a.cold_repeats} ({time.perf_counter() - t_start:.0f}s)", file=sys.stderr)
        turns: dict[str, dict[str, list[float]]] = {}  # "nw=W first->second" -> ratios default / kvdata.collate
        if in_turn:
            for r in range(a.in_turn_repeats):
                for nw in workers:
                    for order in rotated([["default", "kvdata"], ["kvdata", "default"]], r):
                        drop_caches()
                        res = in_fresh_process(one_process_in_turn, root, order, nw)
                        turns.setdefault(f"{nw} {order[0]}", {}).setdefault("ratio", []).append(
                            res["default"] / res["kvdata"])
                        for v in order:
                            turns[f"{nw} {order[0]}"].setdefault(v, []).append(res[v])
                print(f"in-turn repeat {r + 1}/{a.in_turn_repeats} ({time.perf_counter() - t_start:.0f}s)",
                      file=sys.stderr)
        if cold or in_turn:
            warm_page_cache(root)
        out["in_turn_images_per_s"] = turns
        out["images_per_s_and_cpu_s_per_1000"] = raw
        out["seconds"] = time.perf_counter() - t_start
        out["checksum"] = sink
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
            if made or not any(d.iterdir()):
                shutil.rmtree(d, ignore_errors=True)

    state_text = {"cold": "first, cold cache", "first": "first, warm", "steady": f"steady (2..{a.epochs})"}
    head = ["workers", "sampler", "epoch", "default collate img/s", "kvdata.collate img/s", "default / kvdata.collate",
            "CPU per image, default / kvdata.collate", "np.memmap recipe img/s"]
    rows, ratios = [], {}
    for nw in workers:
        for sk in SAMPLERS:
            for st in states:
                cell = raw[st][str(nw)][sk]
                rate = {v: median(x for x, _ in cell[v]) for v in VARIANTS}
                cpu = {v: median(y for _, y in cell[v]) for v in VARIANTS}
                ratios[f"{st} nw={nw} {sk}"] = q = rate["default"] / rate["kvdata"]
                rows.append([str(nw), SAMPLER_TEXT[sk], state_text[st], f"{rate['default']:,.0f}",
                             f"{rate['kvdata']:,.0f}", f"{q:.2f}x", f"{cpu['default'] / cpu['kvdata']:.2f}x",
                             f"{rate['memmap']:,.0f}"])
    out["default_over_kvdata_collate"] = ratios
    worst = min(ratios, key=lambda k: ratios[k])
    # every pair of runs (the two collates back to back in one repeat of one cell), pooled
    pairs = [(dflt[0] / kv[0], dflt[1] / kv[1]) for st in states for nw in workers for sk in SAMPLERS
             for dflt, kv in zip(raw[st][str(nw)][sk]["default"], raw[st][str(nw)][sk]["kvdata"])]
    below = sum(1 for q, _ in pairs if q < 0.9)
    sizes = info["bytes"]
    md = [f"## kvdata collate: torch's default collate against kvdata.collate, as users run it "
          f"({machine_line(machine)})", "",
          f"- {a.n_images} images {SHAPE[0]}x{SHAPE[1]}x{SHAPE[2]} uint8 ({a.content}), labels i % 1000, batch "
          f"{BATCH}; on disk: flat.u8 {sizes['flat.u8'] / 1e6:,.0f} MB, kvdata {sizes['kvdata'] / 1e6:,.0f} MB "
          f"({info['kvdata_shards']} sealed shard(s) <= {a.shard_size})",
          "- every run: a fresh process, `DataLoader(ds, batch_size=256, shuffle=True | sampler=ShardShuffleSampler(ds, "
          "seed=0), num_workers=W[, collate_fn=kvdata.collate])`, no persistent_workers (with workers, every epoch "
          f"starts them); first epoch timed from `Dataset(...)`, steady = median of epochs 2..{a.epochs} of the "
          "same process",
          f"- warm: every file read once before the runs (as right after writing the dataset), {a.repeats} repeat(s) "
          f"(the np.memmap recipe in the first {min(a.memmap_repeats, a.repeats)})"
          + (f"; cold: page cache dropped before each run (one epoch), {a.cold_repeats} repeat(s)" if cold else "")
          + "; medians; a cell's runs back to back, in an order rotated per repeat (each collate first equally often)",
          "- CPU per image: this process and its workers (user + system); np.memmap recipe: default collate, with "
          "ShardShuffleSampler reading the kvdata sampler's index order",
          f"- measured in {out['seconds']:.0f} s"]
    md += [f"- {x}" for x in notes]
    if a.quick:
        md.append("- --quick: tiny sizes on whatever the machine is doing; the numbers mean nothing")
    md += ["", "### (a) every run in its own process (images/s, medians)", "", md_table(head, rows, left=3), "",
           f"Lowest default / kvdata.collate: {ratios[worst]:.2f}x ({worst}; target >= 0.9x in every cell: "
           + ("met" if ratios[worst] >= 0.9 else "NOT met") + "). All "
           f"{len(pairs)} pairs of runs (one repeat of one cell, back to back) pooled: default / kvdata.collate "
           f"{median(q for q, _ in pairs):.2f}x images/s and {median(c for _, c in pairs):.2f}x CPU per image "
           f"(medians; {below} pair(s) below 0.9x, {sum(1 for q, _ in pairs if q > 1 / 0.9)} above 1.11x).", ""]
    if turns:
        trows = []
        for nw in workers:
            for first in ("default", "kvdata"):
                t = turns[f"{nw} {first}"]
                second = "kvdata" if first == "default" else "default"
                trows.append([str(nw), f"{HEAD[first]}, then {HEAD[second]}", f"{median(t['default']):,.0f}",
                              f"{median(t['kvdata']):,.0f}", ", ".join(f"{x:.2f}x" for x in t["ratio"])])
        md += ["### (b) both collates in turn in one process, ShardShuffleSampler, one epoch each, page cache dropped "
               "before the process (images/s, medians)", "",
               md_table(["workers", "order", "default collate img/s", "kvdata.collate img/s",
                         "default / kvdata.collate, each repeat"], trows, left=2), "",
               "The first epoch of a process reads the files from disk (and faults in every mapped page) for "
               "whichever collate runs first; the second finds them in the page cache.", ""]
    out["markdown"] = "\n".join(md)
    print(out["markdown"])
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
