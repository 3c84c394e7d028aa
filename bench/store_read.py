#!/usr/bin/env python
"""Read throughput of kvdata against a bare np.memmap, raw LMDB and mmap_ninja, in one process.

(a) warm cache, random batches of 256 images 227x227x3 uint8 (151 KB): every method fills one
    contiguous (256, 227, 227, 3) uint8 batch.                       Ratio vs np.memmap.
(b) warm cache, random batches of 256 records of 1 KiB: every method returns a list of 256
    Python bytes (column "result" says where it returns views).      Ratio vs LMDB txn.get.
(c) cold cache, one image at a time: page cache dropped before each method's run (needs root).
                                                                     Ratio vs np.memmap.

In (a) and (b), "kvdata as written" is a second copy of the kvdata dataset written the way
training code writes one -- `kvdata.open(p, "w")`, put_many, close(), no seal() -- and read
right away (issue 12: its last shard used to stay an LMDB tail read through transactions).
"kvdata as appended" is a third copy written with mode "a" (the README's `kvdata.open(p, "a")`),
put_many, close(): its last shard stays an open LMDB tail (all of it below one shard), read by
a tail snapshot (store.tail_snapshot: the tail's map and record rows, pinned by a read txn).

All methods read the same seeded random indices; repeats alternate between methods and the
table reports the median samples/s. Run:  python bench/store_read.py [--quick] [--json F]
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

import kvdata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    BATCH,
    IMG,
    SHAPE,
    built,
    drop_caches,
    image_chunks,
    machine_info,
    machine_line,
    mark_built,
    md_table,
    median,
    repeat_rotated,
    work_dir,
    write_json,
)

try:
    from mmap_ninja import numpy as ninja_np
    from mmap_ninja.ragged import RaggedMmap
except ImportError:  # pip install mmap-ninja (the `bench` extra)
    ninja_np = RaggedMmap = None

SMALL = 1024
AS_WRITTEN = "kvdata as written (w, close, no seal): "
# mode "a" (the README's `kvdata.open(p, "a")`): close keeps the last shard an open LMDB tail,
# read by a tail snapshot (store.tail_snapshot) once enough of it is asked for
AS_APPENDED = "kvdata as appended (a, close: open tail): "


def build(root: Path, n: int, nbytes: int, image: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Write the same n random samples to every format under root (reused if already built)."""
    params = {"n": n, "nbytes": nbytes, "seed": args.seed, "shard_size": args.shard_size,
              "keep_tail": args.keep_tail, "ninja": RaggedMmap is not None, "as_written": True,
              "as_appended": True}
    done = root / "DONE.json"
    info = built(done, params)
    if info is not None:
        return info
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(args.seed)
    shape = SHAPE if image else (SMALL,)
    chunk = max(1, (64 << 20) // nbytes)
    env = lmdb.open(str(root / "raw.lmdb"), subdir=False, map_size=int(n * (nbytes + 4096) * 1.25) + (64 << 20))
    # --keep-tail: mode "a" on a new directory (a "w" writer seals its tail at close)
    with open(root / "flat.u8", "wb") as flat, \
            kvdata.open(root / "kvdata", "a" if args.keep_tail else "w", shard_size=args.shard_size,
                        compress=False) as st, \
            kvdata.open(root / "kvdata-as-written", "w", shard_size=args.shard_size, compress=False) as aw, \
            kvdata.open(root / "kvdata-as-appended", "a", shard_size=args.shard_size, compress=False) as ap:
        for start, arr in image_chunks(rng, n, chunk, "noise", shape):
            keys = range(start, start + len(arr))
            flat.write(arr.tobytes())
            with env.begin(write=True) as txn:
                for i, a in zip(keys, arr):
                    txn.put(b"%08d" % i, a.tobytes(), append=True)
            st.put_many((f"{i:08d}", {"image": a} if image else a.tobytes()) for i, a in zip(keys, arr))
            aw.put_many((f"{i:08d}", {"image": a} if image else a.tobytes()) for i, a in zip(keys, arr))
            ap.put_many((f"{i:08d}", {"image": a} if image else a.tobytes()) for i, a in zip(keys, arr))
            if ninja_np is None:
                pass
            elif image:  # fixed-shape samples: one (N, 227, 227, 3) memmap
                (ninja_np.from_ndarray if start == 0 else ninja_np.extend_dir)(root / "ninja", arr)
            elif start == 0:  # variable-size records: RaggedMmap
                rm = RaggedMmap.from_lists(root / "ninja", list(arr))
            else:
                rm.extend(list(arr))
        # A finished dataset is sealed (as `kvdata import` does) so every record is read by
        # memory-map offset; --keep-tail measures the open LMDB tail instead.
        if not args.keep_tail:
            st.seal()
    env.close()
    np.save(root / "offsets.npy", np.arange(n + 1, dtype=np.int64) * nbytes)
    with kvdata.open(root / "kvdata") as st:
        sealed = sum(int(e["records"]) for e in st.manifest["shards"])
        shards = len(st.manifest["shards"])
    with kvdata.open(root / "kvdata-as-written") as st:
        aw_sealed = sum(int(e["records"]) for e in st.manifest["shards"])
        aw_shards = len(st.manifest["shards"])
    with kvdata.open(root / "kvdata-as-appended") as st:
        ap_sealed = sum(int(e["records"]) for e in st.manifest["shards"])
        ap_shards = len(st.manifest["shards"])
    return mark_built(done, params, kvdata_shards=shards, kvdata_sealed_fraction=sealed / n,
                      as_written_shards=aw_shards, as_written_sealed_fraction=aw_sealed / n,
                      as_appended_shards=ap_shards, as_appended_sealed_fraction=ap_sealed / n)


def copy_threads(st: Any) -> int | str:
    """The threads get_batch copies with (its Copier's; the reader behind the Store holds it)."""
    for holder in (st, getattr(st, "_reader", None)):
        copier = getattr(holder, "_copier", None)
        if copier is not None:
            return copier.threads
    return "default"


def image_methods(root: Path, n: int) -> tuple[dict[str, tuple[Callable, str]], Callable]:
    flat = np.memmap(root / "flat.u8", np.uint8, "r")
    offs = np.load(root / "offsets.npy")
    env = lmdb.open(str(root / "raw.lmdb"), subdir=False, readonly=True, lock=False)
    keys = [b"%08d" % i for i in range(n)]
    st = kvdata.open(root / "kvdata")
    aw = kvdata.open(root / "kvdata-as-written")
    ap = kvdata.open(root / "kvdata-as-appended")
    out = np.empty((BATCH, *SHAPE), np.uint8)  # every "into out" method fills this one batch

    def memmap(idx):
        for j, a in enumerate(offs[idx].tolist()):
            out[j] = flat[a:a + IMG].reshape(SHAPE)
        return out

    def lmdb_get(idx, buffers=False):
        with env.begin(buffers=buffers) as txn:
            for j, i in enumerate(idx.tolist()):
                out[j] = np.frombuffer(txn.get(keys[i]), np.uint8).reshape(SHAPE)
        return out

    def kv_copy(idx):
        for j, r in enumerate(st.get_many(idx)):
            out[j] = r["image"]
        return out

    m = {"np.memmap + offsets": (memmap, "into out"),
         "lmdb txn.get (copy)": (lmdb_get, "into out"),
         "lmdb buffers=True": (lambda idx: lmdb_get(idx, True), "into out"),
         "kvdata get_many + copy into out": (kv_copy, "into out"),
         # the API for stacked batches: one copy per sample into `out`, split across copy threads
         f"kvdata get_batch into out ({copy_threads(st)} copy threads)":
             (lambda idx: st.get_batch(idx, fields=["image"], alloc=lambda shape, dtype: out)["image"], "into out"),
         "kvdata get_many + np.stack": (lambda idx: np.stack([r["image"] for r in st.get_many(idx)]), "new array"),
         AS_WRITTEN + f"get_batch into out ({copy_threads(aw)} copy threads)":
             (lambda idx: aw.get_batch(idx, fields=["image"], alloc=lambda shape, dtype: out)["image"], "into out"),
         AS_APPENDED + f"get_batch into out ({copy_threads(ap)} copy threads)":
             (lambda idx: ap.get_batch(idx, fields=["image"], alloc=lambda shape, dtype: out)["image"], "into out")}
    if ninja_np is not None:
        nin = ninja_np.open_existing(root / "ninja")
        m["mmap_ninja numpy: take(out=)"] = (
            lambda idx: np.take(nin, idx, axis=0, out=out[:len(idx)], mode="clip"), "into out")
        m["mmap_ninja numpy: mm[idx]"] = (lambda idx: nin[idx], "new array")
    return m, lambda: (env.close(), st.close(), aw.close(), ap.close())


def small_methods(root: Path, n: int) -> tuple[dict[str, tuple[Callable, str]], Callable]:
    flat = np.memmap(root / "flat.u8", np.uint8, "r")
    offs = np.load(root / "offsets.npy")
    env = lmdb.open(str(root / "raw.lmdb"), subdir=False, readonly=True, lock=False)
    keys = [b"%08d" % i for i in range(n)]
    st = kvdata.open(root / "kvdata")
    aw = kvdata.open(root / "kvdata-as-written")
    ap = kvdata.open(root / "kvdata-as-appended")

    def lmdb_get(idx):
        with env.begin() as txn:
            return [txn.get(keys[i]) for i in idx.tolist()]

    def lmdb_buf(idx):
        with env.begin(buffers=True) as txn:
            return [bytes(txn.get(keys[i])) for i in idx.tolist()]

    def memmap(idx):
        return [flat[a:b].tobytes() for a, b in zip(offs[idx].tolist(), offs[idx + 1].tolist())]

    m = {"lmdb txn.get (copy)": (lmdb_get, "bytes"),
         "lmdb buffers=True + bytes()": (lmdb_buf, "bytes"),
         "np.memmap + offsets .tobytes()": (memmap, "bytes"),
         "kvdata get_many(copy=True)": (lambda idx: st.get_many(idx, copy=True), "bytes"),
         "kvdata get_many (views)": (lambda idx: st.get_many(idx), "memoryview"),
         AS_WRITTEN + "get_many(copy=True)": (lambda idx: aw.get_many(idx, copy=True), "bytes"),
         AS_APPENDED + "get_many(copy=True)": (lambda idx: ap.get_many(idx, copy=True), "bytes")}
    if RaggedMmap is not None:
        rm = RaggedMmap(root / "ninja")
        m["mmap_ninja RaggedMmap .tobytes()"] = (lambda idx: [a.tobytes() for a in rm[idx]], "bytes")
    return m, lambda: (env.close(), st.close(), aw.close(), ap.close())


def cold_openers(root: Path) -> dict[str, Callable]:
    """Per method: open after the cache drop, return (read one sample into buf, close)."""
    buf = np.empty(SHAPE, np.uint8)

    def memmap():
        flat, offs = np.memmap(root / "flat.u8", np.uint8, "r"), np.load(root / "offsets.npy").tolist()

        def read(i):
            buf[...] = flat[offs[i]:offs[i] + IMG].reshape(SHAPE)
        return read, lambda: None

    def raw_lmdb(readahead):
        def opener():
            env = lmdb.open(str(root / "raw.lmdb"), subdir=False, readonly=True, lock=False, readahead=readahead)

            def read(i):
                with env.begin(buffers=True) as txn:
                    buf[...] = np.frombuffer(txn.get(b"%08d" % i), np.uint8).reshape(SHAPE)
            return read, env.close
        return opener

    def kv():
        st = kvdata.open(root / "kvdata")

        def read(i):
            buf[...] = st[i]["image"]
        return read, st.close

    return {"np.memmap + offsets": memmap, "lmdb readahead=False": raw_lmdb(False),
            "lmdb readahead=True": raw_lmdb(True), "kvdata s[i]": kv}


def measure(methods: dict[str, tuple[Callable, str]], batches: list[np.ndarray],
            repeats: int) -> dict[str, list[float]]:
    total = sum(len(b) for b in batches)

    def run(name: str, _r: int) -> float:
        fn = methods[name][0]
        t0 = time.perf_counter()
        for b in batches:
            fn(b)
        return total / (time.perf_counter() - t0)

    return repeat_rotated(list(methods), repeats, run)


def measure_cold(root: Path, idx: np.ndarray, repeats: int) -> dict[str, list[float]]:
    openers = cold_openers(root)

    def run(name: str, _r: int) -> float:
        gc.collect()  # mapped pages survive drop_caches: earlier maps must be gone
        drop_caches()
        read, close = openers[name]()
        t0 = time.perf_counter()
        for i in idx.tolist():
            read(i)
        rate = len(idx) / (time.perf_counter() - t0)
        close()
        del read, close
        return rate

    return repeat_rotated(list(openers), repeats, run)


def table(title: str, rates: dict[str, list[float]], kinds: dict[str, str], base: str, nbytes: int) -> tuple[str, list]:
    b = median(rates[base])
    lines, rows = [], []
    for name, rs in rates.items():
        med = median(rs)
        lines.append([name, kinds.get(name, "into buf"), f"{med:,.0f}", f"{med * nbytes / 1e6:,.0f}",
                      f"{med / b:.2f}x"])
        rows.append({"method": name, "result": kinds.get(name, "into buf"), "median_samples_per_s": med,
                     "samples_per_s": rs, "ratio": med / b})
    header = ["method", "result", "samples/s (median)", "MB/s", f"vs {base}"]
    text = f"### {title}\n\n" + md_table(header, lines, left=2)
    return text, rows


def run_warm(key: str, root: Path, n: int, nbytes: int, count: int, rng: np.random.Generator,
             repeats: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    methods, close = (image_methods if key == "a" else small_methods)(root, n)
    bs = [rng.choice(n, size=BATCH, replace=n < BATCH) for _ in range(count)]
    flat = np.memmap(root / "flat.u8", np.uint8, "r").reshape(n, -1)
    want = flat[bs[0]].reshape(-1, *SHAPE) if key == "a" else [flat[i].tobytes() for i in bs[0].tolist()]
    del flat
    for name, (fn, _kind) in methods.items():  # same data from every method (not a timing assertion)
        got = fn(bs[0])
        if not (np.array_equal(got, want) if key == "a" else [bytes(g) for g in got] == want):
            raise SystemExit(f"{name}: returned different data than the flat file")
    for fn, _kind in methods.values():  # untimed pass over every sample: page cache and mappings warm
        for s in range(0, n, BATCH):
            fn(np.arange(s, min(n, s + BATCH)))
    rates = measure(methods, bs, repeats)
    kinds = {k: v[1] for k, v in methods.items()}
    close()
    return rates, kinds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, help="where to build the datasets (default: a temp dir under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the datasets; a later run with the same --dir reuses them")
    p.add_argument("--n-images", type=int, default=4000, help="227x227x3 images (default 4000, ~620 MB per format)")
    p.add_argument("--n-small", type=int, default=200_000, help="1 KiB records (default 200000)")
    p.add_argument("--batches", type=int, default=20, help="image batches of 256 per repeat")
    p.add_argument("--small-batches", type=int, default=200, help="1 KiB batches of 256 per repeat")
    p.add_argument("--cold-samples", type=int, default=500, help="single-image reads per method in (c)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shard-size", default="256MB", help="kvdata shard size")
    p.add_argument("--keep-tail", action="store_true", help="leave kvdata's last shard as an open LMDB tail")
    p.add_argument("--skip-cold", action="store_true", help="skip (c)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    if a.quick:
        a.n_images, a.n_small, a.batches, a.small_batches = 300, 5000, 3, 20
        a.cold_samples, a.repeats, a.shard_size = 50, 3, "16MB"
    d, made = work_dir(a.dir, "kvdata-bench-")
    rng = np.random.default_rng(a.seed + 1)
    machine = machine_info()
    out: dict[str, Any] = {"config": {k: str(v) for k, v in vars(a).items()}, "machine": machine, "sections": {}}
    md = [f"## kvdata store_read ({machine_line(machine)})", ""]
    if RaggedMmap is None:
        md.append("_mmap_ninja not installed: its rows are skipped (pip install mmap-ninja)._\n")
    try:
        t0 = time.perf_counter()
        info_a = build(d / "img", a.n_images, IMG, True, a)
        info_b = build(d / "small", a.n_small, SMALL, False, a)
        print(f"built/reused datasets in {d} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        out["datasets"] = {"images": info_a, "small": info_b}
        for name, info in (("images", info_a), ("1 KiB records", info_b)):
            frac = info["kvdata_sealed_fraction"]
            md.append(f"- kvdata {name}: {info['kvdata_shards']} sealed shard(s) hold {100 * frac:.0f}% of the samples "
                      "(memmap path)" + ("; the rest is read from the open LMDB tail" if frac < 1 else ""))
            aw_frac = info["as_written_sealed_fraction"]
            md.append(f"- kvdata {name} as written (no seal): {info['as_written_shards']} sealed shard(s) hold "
                      f"{100 * aw_frac:.0f}% of the samples" + ("; the rest is in the open LMDB tail" if aw_frac < 1 else ""))
            ap_frac = info["as_appended_sealed_fraction"]
            md.append(f"- kvdata {name} as appended (mode a, no seal): {info['as_appended_shards']} sealed shard(s) hold "
                      f"{100 * ap_frac:.0f}% of the samples" + ("; the rest is in the open LMDB tail (read by a tail "
                                                                "snapshot)" if ap_frac < 1 else ""))
        md.append("")

        for key, root, n, nbytes, count, base, title in (
                ("a", d / "img", a.n_images, IMG, a.batches, "np.memmap + offsets",
                 f"(a) warm, random batches of {BATCH} images {SHAPE} uint8 -> one contiguous batch"),
                ("b", d / "small", a.n_small, SMALL, a.small_batches, "lmdb txn.get (copy)",
                 f"(b) warm, random batches of {BATCH} records of {SMALL} B -> list of {BATCH}")):
            rates, kinds = run_warm(key, root, n, nbytes, count, rng, a.repeats)
            text, out["sections"][key] = table(title, rates, kinds, base, nbytes)
            if key == "a":
                s, c = (median(rates[k]) for k in ("kvdata get_many + np.stack", "kvdata get_many + copy into out"))
                text += (f"\nkvdata stacking: {'copy into a preallocated out' if c >= s else 'np.stack'} is faster "
                         f"({max(c, s) / min(c, s):.2f}x).\n")
            md.append(text)

        gc.collect()
        if a.skip_cold:
            md.append("(c) skipped (--skip-cold).\n")
        elif not drop_caches():
            md.append("(c) skipped: cannot drop the page cache (needs root and a writable /proc/sys/vm/drop_caches).\n")
        else:
            idx = rng.choice(a.n_images, size=min(a.cold_samples, a.n_images), replace=False)
            rates = measure_cold(d / "img", idx, a.repeats)
            text, out["sections"]["c"] = table(f"(c) cold cache, {len(idx)} random single-image reads (batch of 1) "
                                               "into one buffer", rates, {}, "np.memmap + offsets", IMG)
            md.append(text)
    finally:
        if not a.keep:
            shutil.rmtree(d / "img", ignore_errors=True)  # kvdata-as-written included
            shutil.rmtree(d / "small", ignore_errors=True)
            if made or not any(d.iterdir()):
                shutil.rmtree(d, ignore_errors=True)
    out["markdown"] = "\n".join(md)
    print(out["markdown"])
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
