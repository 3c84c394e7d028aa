#!/usr/bin/env python
"""One sample per call (issue 13, item 3): `store[i]`, `store.get(key)` and `Dataset[i]` against a
plain np.memmap slice, the np.memmap recipe (offsets + slice) and mmap_ninja, warm page cache.

Code that calls `ds[i]` per sample (a Dataset wrapping kvdata's, default `__getitem__` paths,
notebooks) pays the per-call overhead on every sample. Each method reads the same seeded
random indices one at a time; the table gives the median microseconds per call over the
repeats (methods alternate), and the ratio of calls/s against the recipe's offsets slice and
against a bare `mm[i]` of a fixed-shape memmap. "view" rows return zero-copy views; "copy" rows
an owned array (what a DataLoader worker must produce).

(c) the first index of an epoch from kvdata.ShardShuffleSampler (with and without a staging engine
listening for its order) against torch's RandomSampler, over --n-sampler samples (1M) in 1,000
shards: what a training loop waits for before its first batch.

  python bench/single_sample.py [--quick] [--json F]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, machine_line, md_table, median, repeat_rotated, write_json  # noqa: E402

import kvdata  # noqa: E402

try:
    from mmap_ninja.ragged import RaggedMmap
except ImportError:  # a peer of the bench extra
    RaggedMmap = None

SHAPE = (227, 227, 3)
SMALL = 1024


def build(root: Path, n: int, image: bool, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    shape = SHAPE if image else (SMALL,)
    nbytes = int(np.prod(shape))
    flat = np.memmap(root / "flat.u8", np.uint8, "w+", shape=(n * nbytes,))
    with kvdata.open(root / "kv", "w", shard_size="256MB") as st:
        for lo in range(0, n, 256):
            hi = min(n, lo + 256)
            arr = rng.integers(0, 256, size=(hi - lo, *shape), dtype=np.uint8)
            flat[lo * nbytes:hi * nbytes] = arr.reshape(-1)
            if image:
                st.put_many((f"k{i:08d}", {"image": arr[i - lo], "label": i % 1000}) for i in range(lo, hi))
            else:
                st.put_many((f"k{i:08d}", arr[i - lo].tobytes()) for i in range(lo, hi))
        st.seal()
    flat.flush()
    del flat
    np.save(root / "offsets.npy", np.arange(n + 1, dtype=np.int64) * nbytes)
    if RaggedMmap is not None and image:
        mm = np.memmap(root / "flat.u8", np.uint8, "r").reshape(n, *shape)
        RaggedMmap.from_generator(str(root / "ninja"), (mm[i] for i in range(n)), batch_size=1024, verbose=False)
    return {"n": n, "bytes_per_sample": nbytes}


def methods(root: Path, n: int, image: bool) -> dict[str, Callable[[int], Any]]:
    shape = SHAPE if image else (SMALL,)
    st = kvdata.open(root / "kv")
    flat = np.memmap(root / "flat.u8", np.uint8, "r")
    fixed = flat.reshape(n, *shape)
    offsets = np.load(root / "offsets.npy")
    keys = [f"k{i:08d}" for i in range(n)]

    def recipe(i: int) -> Any:
        a, b = offsets[i], offsets[i + 1]
        return flat[a:b].reshape(shape)

    out: dict[str, Callable[[int], Any]] = {
        "kvdata store[i] (view)": lambda i: st[i],
        "kvdata store.get(key) (view)": lambda i: st.get(keys[i]),
        "np.memmap recipe, offsets + slice (view)": recipe,
        "np.memmap mm[i], fixed shape (view)": lambda i: fixed[i],
    }
    if image:
        ds = kvdata.Dataset(root / "kv")
        out["kvdata Dataset[i] (copy)"] = lambda i: ds[i]
        out["kvdata store[i]['image'] copied"] = lambda i: np.array(st[i]["image"])
        out["np.memmap recipe (copy)"] = lambda i: np.array(recipe(i))
        if RaggedMmap is not None:
            rm = RaggedMmap(str(root / "ninja"))
            out["mmap_ninja rm[i] (view)"] = lambda i: rm[i]
    else:
        out["kvdata store[i] as bytes (copy)"] = lambda i: bytes(st[i])
        out["np.memmap recipe as bytes (copy)"] = lambda i: recipe(i).tobytes()
    return out


def run(root: Path, n: int, image: bool, calls: int, repeats: int, seed: int) -> dict[str, Any]:
    ms = methods(root, n, image)
    idx = np.random.default_rng(seed).integers(0, n, calls).tolist()
    for fn in ms.values():  # warm: every method touches every sample once before timing
        for i in range(n):
            fn(i)

    def one(name: str, _r: int) -> float:
        fn = ms[name]
        t0 = time.perf_counter()
        for i in idx:
            fn(i)
        return (time.perf_counter() - t0) / len(idx) * 1e6

    return repeat_rotated(list(ms), repeats, one)


class _SampledDataset:
    """What ShardShuffleSampler reads of a Dataset: the shard of every sample, and (listening)
    the announce/progress calls a staging engine receives (taken and dropped here)."""

    def __init__(self, n: int, shards: int, listening: bool) -> None:
        self.sample_shards = np.repeat(np.arange(shards, dtype=np.uint32), -(-n // shards))[:n]
        self.wants_orders = listening
        self.announced = 0

    def __len__(self) -> int:
        return len(self.sample_shards)

    def announce(self, reader: str, seq: list, position: int = 0) -> None:
        self.announced += 1

    def progress(self, reader: str, position: int) -> None:
        pass


def first_index(n: int, repeats: int) -> dict[str, list[float]]:
    """Milliseconds from iter(sampler) to its first index, a fresh epoch each time."""
    import torch

    quiet, loud = _SampledDataset(n, 1000, False), _SampledDataset(n, 1000, True)
    epochs = iter(range(1 << 30))

    def kv(ds: _SampledDataset) -> Any:
        s = kvdata.ShardShuffleSampler(ds, seed=0, rank=0, world_size=1)
        s.set_epoch(next(epochs))
        return s

    makers: dict[str, Callable[[], Any]] = {
        "torch RandomSampler": lambda: torch.utils.data.RandomSampler(range(n)),
        "ShardShuffleSampler, read in place (nothing listens)": lambda: kv(quiet),
        "ShardShuffleSampler, a staging engine listening": lambda: kv(loud),
    }

    def one(name: str, _r: int) -> float:
        sampler = makers[name]()
        t0 = time.perf_counter()
        next(iter(sampler))
        return (time.perf_counter() - t0) * 1e3

    return repeat_rotated(list(makers), repeats, one)


def sampler_table(title: str, ms: dict[str, list[float]]) -> str:
    base = median(ms["torch RandomSampler"])
    rows = [[name, f"{median(xs):.1f}", f"{min(xs):.1f}", f"{median(xs) / base:.2f}x"] for name, xs in ms.items()]
    return f"### {title}\n\n" + md_table(["sampler", "ms to first index (median)", "min", "vs RandomSampler"], rows)


def table(title: str, us: dict[str, list[float]]) -> str:
    base = median(us["np.memmap recipe, offsets + slice (view)"])
    bare = median(us["np.memmap mm[i], fixed shape (view)"])
    rows = []
    for name, xs in us.items():
        m = median(xs)
        rows.append([name, f"{m:.2f}", f"{1e6 / m:,.0f}", f"{base / m:.2f}x", f"{bare / m:.2f}x"])
    return f"### {title}\n\n" + md_table(["method", "us per call (median)", "calls/s", "vs recipe slice",
                                          "vs mm[i]"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-images", type=int, default=4000)
    p.add_argument("--n-small", type=int, default=100_000)
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--n-sampler", type=int, default=1_000_000, help="samples for (c), the sampler's first index")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.quick:
        a.n_images, a.n_small, a.calls, a.repeats, a.n_sampler = 300, 5000, 2000, 3, 20_000
    machine = machine_info()
    out: dict[str, Any] = {"config": {k: str(v) for k, v in vars(a).items()}, "machine": machine, "sections": {}}
    md = [f"## kvdata single_sample ({machine_line(machine)})", ""]
    with tempfile.TemporaryDirectory(prefix="kvdata-single-", dir="/tmp") as d:
        for key, n, image, title in (("images", a.n_images, True, f"(a) {a.n_images} images 227x227x3 uint8"),
                                     ("small", a.n_small, False, f"(b) {a.n_small} records of 1 KiB")):
            root = Path(d) / key
            root.mkdir()
            build(root, n, image, a.seed)
            us = run(root, n, image, a.calls, a.repeats, a.seed + 1)
            out["sections"][key] = us
            md += [table(f"{title}, {a.calls} random single reads, warm page cache", us), ""]
    ms = first_index(a.n_sampler, max(a.repeats, 5))
    out["sections"]["sampler_first_index"] = ms
    md += [sampler_table(f"(c) first index of an epoch, {a.n_sampler:,} samples in 1,000 shards", ms), ""]
    if RaggedMmap is None:
        md.append("mmap_ninja is not installed: its row is skipped (pip install mmap-ninja).")
    text = "\n".join(md) + "\n"
    out["markdown"] = text
    print(text)
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
