#!/usr/bin/env python
"""Write throughput of kvdata `put` against a raw LMDB append loop of the same records.

(a) 227x227x3 uint8 images (151 KB), stored by kvdata as records of fields {"image": a};
(b) 1 KiB records, stored by kvdata as raw bytes.

Every method writes the same seeded samples into a fresh directory, durably (the data is
fsync'ed before the clock stops), and the table reports the median samples/s of the repeats
(methods alternate between repeats) with the ratio to the raw LMDB loop:

- raw LMDB: one env (subdir=False, like a shard), `txn.put(key, value, append=True)` in write
  transactions of at most 64 MB, `env.sync(True)` at the end -- the floor kvdata writes on;
- np.memmap: the flat file (values back to back) written in order and flushed;
- kvdata put_many / put loop: `kvdata.open(p, "w")`, the puts, close() -- which commits and
  seals the tail (a hard link of the tail file, its sha256 and record offsets; no copy);
- kvdata compress=True: the same with a zstd cold copy written at every seal (what
  every seal did before issue 12), to show what the lazy cold copy saves.

Disk bytes per method are reported too (a .zst beside every shard doubles them for
incompressible data).

(c) the cost of one seal (+ its commit) of a tail holding the images of (a): sealing in place
(a hard link, the offsets from the tail env's map, the sha256) against the compacted copy it
replaced (`mdb_env_copy2`, still the path where a filesystem refuses hard links), each with and
without a zstd copy. Run:  python bench/write.py [--quick] [--json F]
"""
from __future__ import annotations

import argparse
import errno
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
from kvdata.store import sealing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    IMG,
    SHAPE,
    dir_bytes,
    image_chunks,
    machine_info,
    machine_line,
    md_table,
    median,
    repeat_rotated,
    work_dir,
    write_json,
)

SMALL = 1024
TXN_BYTES = 64 << 20  # the raw loop commits as often as kvdata's writer does (LMDB_TXN_BYTES)
PUT_MANY = "kvdata put_many (w, close)"
BASE = "raw LMDB append loop"


def samples(n: int, nbytes: int, seed: int) -> list[np.ndarray]:
    """The n samples every method writes (generated once, outside the timing)."""
    rng = np.random.default_rng(seed)
    shape = SHAPE if nbytes == IMG else (SMALL,)
    chunk = max(1, (64 << 20) // nbytes)
    return [a for _start, arr in image_chunks(rng, n, chunk, "noise", shape) for a in arr]


def methods(data: list[np.ndarray], image: bool, shard_size: str) -> dict[str, Callable[[Path], None]]:
    n = len(data)
    nbytes = data[0].nbytes
    keys = [f"{i:08d}" for i in range(n)]
    bkeys = [k.encode() for k in keys]
    blobs = [a.tobytes() for a in data]  # the raw loop writes bytes, as it would from a file or a decoder

    def record(i: int) -> Any:
        return {"image": data[i]} if image else blobs[i]

    def raw_lmdb(d: Path) -> None:
        env = lmdb.open(str(d / "raw.mdb"), subdir=False, map_size=int(n * (nbytes + 4096) * 1.25) + (64 << 20),
                        sync=True, metasync=True, meminit=False)
        i = 0
        while i < n:
            size = 0
            with env.begin(write=True) as txn:
                while i < n and size < TXN_BYTES:
                    txn.put(bkeys[i], blobs[i], append=True)
                    size += len(blobs[i])
                    i += 1
        env.sync(True)
        env.close()

    def memmap(d: Path) -> None:
        mm = np.memmap(d / "flat.u8", np.uint8, "w+", shape=(n * nbytes,))
        for i, a in enumerate(data):
            mm[i * nbytes:(i + 1) * nbytes] = a.reshape(-1)
        mm.flush()
        del mm

    def kv_put_many(compress: bool) -> Callable[[Path], None]:
        def run(d: Path) -> None:
            with kvdata.open(d / "kv", "w", shard_size=shard_size, compress=compress) as st:
                st.put_many((keys[i], record(i)) for i in range(n))
        return run

    def kv_put(d: Path) -> None:
        with kvdata.open(d / "kv", "w", shard_size=shard_size, compress=False) as st:
            for i in range(n):
                st.put(keys[i], record(i))

    return {BASE: raw_lmdb, "np.memmap (flat file)": memmap,
            PUT_MANY: kv_put_many(False), "kvdata put loop (w, close)": kv_put,
            "kvdata put_many, compress=True (a .zst at every seal)": kv_put_many(True)}


def check_as_written(d: Path, data: list[np.ndarray], image: bool) -> dict[str, Any]:
    """The dataset put_many wrote: every record sealed (read by memory map), values exact."""
    with kvdata.open(d / "kv") as st:
        m = st.manifest
        if m.tail.records:
            raise SystemExit(f"{d / 'kv'}: {m.tail.records} records left in the tail after close")
        rng = np.random.default_rng(0)
        for i in rng.choice(len(data), size=min(64, len(data)), replace=False).tolist():
            v = st[i]
            got = np.asarray(v["image"]) if image else np.frombuffer(v, np.uint8)
            if not np.array_equal(got.reshape(-1), data[i].reshape(-1)):
                raise SystemExit(f"kvdata sample {i} differs from what was written")
        return {"shards": len(m.shards), "zst_copies": sum(1 for s in m.shards if s.zst is not None)}


def run_case(root: Path, data: list[np.ndarray], image: bool, repeats: int,
             shard_size: str) -> tuple[dict[str, list[float]], dict[str, int], dict[str, Any]]:
    ms = methods(data, image, shard_size)
    disk: dict[str, int] = {}
    shape: dict[str, Any] = {}

    def run(name: str, r: int) -> float:
        d = root / f"m{list(ms).index(name)}-r{r}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        t0 = time.perf_counter()
        ms[name](d)
        dt = time.perf_counter() - t0
        disk[name] = dir_bytes(d)
        if name == PUT_MANY and not shape:
            shape.update(check_as_written(d, data, image))
        shutil.rmtree(d, ignore_errors=True)
        return len(data) / dt

    (root / "warm").mkdir(parents=True, exist_ok=True)
    ms[BASE](root / "warm")  # an untimed first pass: imports, allocator and page cache warmed for all
    shutil.rmtree(root / "warm", ignore_errors=True)
    rates = repeat_rotated(list(ms), repeats, run)
    return rates, disk, shape


def table(title: str, rates: dict[str, list[float]], disk: dict[str, int], nbytes: int) -> tuple[str, list]:
    b = median(rates[BASE])
    lines, rows = [], []
    for name, rs in rates.items():
        med = median(rs)
        lines.append([name, f"{med:,.0f}", f"{med * nbytes / 1e6:,.0f}", f"{disk[name] / 1e6:,.1f}", f"{med / b:.2f}x"])
        rows.append({"method": name, "median_samples_per_s": med, "samples_per_s": rs, "disk_bytes": disk[name],
                     "ratio": med / b})
    header = ["method", "samples/s (median)", "MB/s", "disk MB", f"vs {BASE}"]
    return f"### {title}\n\n" + md_table(header, lines), rows


def seal_cost(root: Path, data: list[np.ndarray], repeats: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Milliseconds of seal() + commit() of one tail holding `data` (the puts and their commit untimed)."""
    real_link = sealing.os.link

    def no_link(*_a: Any, **_k: Any) -> None:
        raise OSError(errno.EXDEV, "hard links refused (bench: the copy path)")

    cases = {"in place (hard link)": (True, False), "compacted copy (before issue 12)": (False, False),
             "in place + zstd copy": (True, True), "compacted copy + zstd copy (before issue 12's default)": (False, True)}
    disk: dict[str, int] = {}

    def run(name: str, r: int) -> float:
        link, compress = cases[name]
        p = root / f"seal-{r}"
        shutil.rmtree(p, ignore_errors=True)
        tail_size = 2 * sum(a.nbytes for a in data) + (64 << 20)  # one tail holds them all
        st = kvdata.open(p, "a", shard_size=tail_size, compress=compress)
        try:
            st.put_many((f"{i:08d}", {"image": a}) for i, a in enumerate(data))
            st.commit()
            st.seal()
            sealing.os.link = real_link if link else no_link
            t0 = time.perf_counter()
            st.commit()
            ms = (time.perf_counter() - t0) * 1e3
            if st.manifest.tail.records or len(st.manifest.shards) != 1:
                raise SystemExit(f"{p}: expected one shard sealed by seal(), got {len(st.manifest.shards)}")
        finally:
            sealing.os.link = real_link
            st.close()
        disk[name] = dir_bytes(p / "shards")
        shutil.rmtree(p, ignore_errors=True)
        return ms

    return repeat_rotated(list(cases), repeats, run), disk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--n-images", type=int, default=2000, help="227x227x3 images (default 2000, ~310 MB)")
    p.add_argument("--n-small", type=int, default=200_000, help="1 KiB records (default 200000, ~205 MB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shard-size", default="256MB", help="kvdata shard size")
    p.add_argument("--skip-seal", action="store_true", help="skip (c)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    if a.quick:
        a.n_images, a.n_small, a.repeats, a.shard_size = 200, 20_000, 3, "16MB"
    d, made = work_dir(a.dir, "kvdata-bench-write-")
    machine = machine_info()
    out: dict[str, Any] = {"config": {k: str(v) for k, v in vars(a).items()}, "machine": machine, "sections": {}}
    md = [f"## kvdata write ({machine_line(machine)})", ""]
    seal_md: list[str] = []
    try:
        for key, n, nbytes, title in (
                ("a", a.n_images, IMG, f"(a) {a.n_images} images {SHAPE} uint8, written and fsync'ed"),
                ("b", a.n_small, SMALL, f"(b) {a.n_small} records of {SMALL} B, written and fsync'ed")):
            data = samples(n, nbytes, a.seed)
            rates, disk, shape = run_case(d / key, data, key == "a", a.repeats, a.shard_size)
            text, out["sections"][key] = table(title, rates, disk, nbytes)
            text += (f"\nAfter close: {shape['shards']} sealed shard(s), no record left in the tail, "
                     f"{shape['zst_copies']} zstd copies (made at `kvdata push`).\n")
            md.append(text)
            if key == "a" and not a.skip_seal:
                ms, sdisk = seal_cost(d / "c", data, a.repeats)
                base = median(ms["compacted copy (before issue 12)"])
                rows = [[name, f"{median(v):,.0f}", f"{sdisk[name] / 1e6:,.1f}", f"{median(v) / base:.2f}x"]
                        for name, v in ms.items()]
                out["sections"]["c"] = [{"method": name, "median_ms": median(v), "ms": v, "disk_bytes": sdisk[name]}
                                        for name, v in ms.items()]
                seal_md.append(f"### (c) one seal + commit of a tail of {n} images ({n * nbytes / 1e6:,.0f} MB)\n\n"
                          + md_table(["seal", "ms (median)", "shard files MB", "vs compacted copy"], rows))
            del data
        md += seal_md
    finally:
        for key in ("a", "b", "c"):
            shutil.rmtree(d / key, ignore_errors=True)
        if made or not any(d.iterdir()):
            shutil.rmtree(d, ignore_errors=True)
    out["markdown"] = "\n".join(md)
    print(out["markdown"])
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
