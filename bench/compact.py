#!/usr/bin/env python
"""Compaction throughput (`kvdata compact`) against a plain copy of the same files.

Two datasets, each written whole and then with half of its keys overwritten (a random half,
in a second commit), so every old shard holds dead records and compaction rewrites them all:

(a) 1 KiB raw records (default 50,000);
(b) 227x227x3 uint8 images (151 KB) as field records {"image": a} with a label (default 2,000).

Each repeat compacts a fresh copy of the dataset made of hard links (the old files stay in the
page cache, as they are after the writes that made them dead) and is timed in-process from the
call to its return: recovery, the plan, every live record copied (crc32 checked) into new
shards, their fsync, sha256 and offsets, the index, the manifest, and the removal of the old
files. The peer copies exactly the files compaction rewrites (the old shards) to a new
directory with `shutil.copyfile` and fsyncs them: what moving those bytes costs at all. The
table gives the median seconds and MB/s over the old shards' bytes for both, and the ratio.

Run:  flock /tmp/bench.lock python bench/compact.py [--quick] [--json F]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import kvdata
from kvdata.format import names
from kvdata.store import read_manifest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import image_chunks, machine_info, machine_line, md_table, median, work_dir, write_json  # noqa: E402

SMALL = 1024


def build_small(path: Path, n: int, shard_size: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with kvdata.open(path, "w", shard_size=shard_size) as s:
        for start in range(0, n, 10_000):
            s.put_many((f"{i:08d}", rng.bytes(SMALL)) for i in range(start, min(n, start + 10_000)))
        s.commit()
        for chunk in np.array_split(np.sort(rng.choice(n, n // 2, replace=False)), max(1, n // 10_000)):
            s.put_many((f"{i:08d}", rng.bytes(SMALL)) for i in chunk.tolist())
        s.seal()


def build_images(path: Path, n: int, shard_size: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with kvdata.open(path, "w", shard_size=shard_size) as s:
        for start, arr in image_chunks(rng, n, 100):
            s.put_many((f"{i:08d}", {"image": img}, i % 1000) for i, img in zip(range(start, start + len(arr)), arr))
        s.commit()
        again = np.sort(rng.choice(n, n // 2, replace=False))
        for part in np.array_split(again, max(1, len(again) // 100)):
            imgs = rng.integers(0, 256, size=(len(part), 227, 227, 3), dtype=np.uint8)
            s.put_many((f"{i:08d}", {"image": img}, i % 1000) for i, img in zip(part.tolist(), imgs))
        s.seal()


def linked_copy(src: Path, dst: Path) -> None:
    """The dataset under another name, every file a hard link (no bytes copied, caches warm)."""
    shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns(names.LOCK))


def plain_copy(files: list[Path], dst: Path) -> float:
    """Seconds to copy these files into `dst` and fsync them (and the directory)."""
    dst.mkdir()
    t = time.perf_counter()
    for f in files:
        out = dst / f.name
        shutil.copyfile(f, out)
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t


def run_case(root: Path, name: str, base: Path, repeats: int) -> dict[str, Any]:
    m = read_manifest(base)
    files = [base / names.SHARDS_DIR / e.name for e in m.shards]
    old_bytes = sum(e.bytes for e in m.shards)
    comp: list[float] = []
    copy: list[float] = []
    summary: dict[str, Any] = {}
    for r in range(repeats):
        ds = root / f"{name}-c{r}"
        linked_copy(base, ds)
        t = time.perf_counter()
        s = kvdata.compact(ds, progress=False)
        comp.append(time.perf_counter() - t)
        summary = s.to_json()
        assert s.compacted and s.files_kept_for_readers == []
        shutil.rmtree(ds)
        out = root / f"{name}-cp{r}"
        copy.append(plain_copy(files, out))
        shutil.rmtree(out)
    return {"case": name, "samples": int(m.count), "old_shards": len(m.shards), "old_bytes": old_bytes,
            "compact_s": median(comp), "copy_s": median(copy), "compact_runs": comp, "copy_runs": copy,
            "summary": summary}


def report(results: list[dict[str, Any]]) -> str:
    rows = []
    for c in results:
        mb = c["old_bytes"] / 1e6
        s = c["summary"]
        rows.append([c["case"], f"{c['samples']:,}", f"{c['old_shards']} -> {s['shards_after']}",
                     f"{mb:.0f}", f"{s['bytes_copied'] / 1e6:.0f}", f"{(s['bytes_before'] - s['bytes_after']) / 1e6:.0f}",
                     f"{c['compact_s']:.2f}", f"{mb / c['compact_s']:.0f}", f"{c['copy_s']:.2f}",
                     f"{mb / c['copy_s']:.0f}", f"{c['copy_s'] / c['compact_s']:.2f}"])
    return md_table(["case", "samples", "shards", "old MB", "live MB copied", "MB freed", "compact s",
                     "compact MB/s", "cp+fsync s", "cp MB/s", "compact / cp speed"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--n-small", type=int, default=50_000, help="1 KiB records (default 50000)")
    p.add_argument("--n-images", type=int, default=2000, help="227x227x3 images (default 2000, ~310 MB)")
    p.add_argument("--shard-size", default="64MB", help="kvdata shard size (default 64MB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    if a.quick:
        a.n_small, a.n_images, a.shard_size, a.repeats = 5000, 100, "4MB", 1
    d, made = work_dir(a.dir, "kvdata-bench-compact-")
    try:
        small, images = d / "small.kv", d / "images.kv"
        build_small(small, a.n_small, a.shard_size, a.seed)
        build_images(images, a.n_images, a.shard_size, a.seed)
        results = [run_case(d, f"{a.n_small:,} x 1 KiB, half overwritten", small, a.repeats),
                   run_case(d, f"{a.n_images:,} images 227x227x3, half overwritten", images, a.repeats)]
    finally:
        if made:
            shutil.rmtree(d, ignore_errors=True)
    info = machine_info()
    md = (f"## Compaction throughput (bench/compact.py)\n\n{machine_line(info)}; shard size {a.shard_size}, "
          f"median of {a.repeats}; MB/s over the old shards' bytes (what compaction reads and replaces).\n\n"
          + report(results))
    print(md)
    if a.json:
        write_json(a.json, {"machine": info, "results": results, "markdown": md})


if __name__ == "__main__":
    main()
