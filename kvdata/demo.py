"""`kvdata demo`: build datasets from real images that ship with scikit-learn, read them back fast.

The comparison is the zero-overhead recipe users copy from tutorials: the same
bytes in one flat np.memmap with an offsets table, batches stacked the same way.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .errors import KVDataError
from .reader.open import open_dataset, verify

CROP = 227
N_CROPS = 1024
BATCH = 256


def _real_images() -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    try:
        from sklearn.datasets import load_digits, load_sample_images
    except ImportError:
        raise KVDataError("kvdata demo uses the images bundled with scikit-learn: pip install 'kvdata[demo]'") from None
    digits = load_digits()
    images = (digits.images * (255 / 16)).round().astype(np.uint8)[..., None]  # (1797, 8, 8, 1) HWC
    return images, digits.target.astype(np.int64), [np.asarray(im) for im in load_sample_images().images]


def _crops(photos: list[np.ndarray], n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random 227x227 crops (randomly mirrored) of the bundled photos, label = which photo."""
    out = np.empty((n, CROP, CROP, 3), np.uint8)
    labels = rng.integers(0, len(photos), n)
    for i, which in enumerate(labels):
        p = photos[which]
        y = rng.integers(0, p.shape[0] - CROP)
        x = rng.integers(0, p.shape[1] - CROP)
        c = p[y:y + CROP, x:x + CROP]
        out[i] = c[:, ::-1] if rng.random() < 0.5 else c
    return out, labels


def _rate(fn: Callable[[np.ndarray], Any], batches: list[np.ndarray], repeats: int = 3) -> float:
    """Median samples/s over `repeats` passes of `fn` over all batches."""
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for b in batches:
            fn(b)
        rates.append(sum(len(b) for b in batches) / (time.perf_counter() - t))
    return float(np.median(rates))


def _measure(name: str, path: Path, images: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
    flat = path.with_suffix(".memmap")
    images.reshape(len(images), -1).tofile(flat)
    per = images[0].nbytes
    offsets = np.arange(len(images), dtype=np.int64) * per
    mm = np.memmap(flat, dtype=np.uint8, mode="r")
    shape = images.shape[1:]
    store = open_dataset(path)
    batches = [rng.integers(0, len(images), min(BATCH, len(images))) for _ in range(max(4, 8192 // BATCH))]

    def read_kvdata(idx: np.ndarray) -> np.ndarray:
        return store.get_batch(idx)["image"]

    def read_memmap(idx: np.ndarray) -> np.ndarray:
        out = np.empty((len(idx),) + shape, np.uint8)
        for i, j in enumerate(idx.tolist()):
            out[i] = mm[offsets[j]:offsets[j] + per].reshape(shape)
        return out

    b0 = batches[0]
    if not np.array_equal(read_kvdata(b0), images[b0]):
        raise KVDataError(f"{path}: demo read back different pixels than it wrote")
    read_kvdata(b0), read_memmap(b0)  # warm both
    kv, base = [], []
    for _ in range(3):  # alternate so neither side gets a warmer machine
        kv.append(_rate(read_kvdata, batches, 1))
        base.append(_rate(read_memmap, batches, 1))
    store.close()
    k, b = float(np.median(kv)), float(np.median(base))
    return {"dataset": name, "samples": len(images), "sample_bytes": per, "kvdata_per_s": k, "memmap_per_s": b,
            "ratio": k / b, "kvdata_MBps": k * per / 1e6}


def run_demo(workdir: str | None, keep: bool = False, as_json: bool = False) -> dict[str, Any]:
    tmp = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kvdata-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    made = [tmp / f"{name}{ext}" for name in ("digits", "photos") for ext in (".kv", ".memmap")]
    try:
        digits, digit_labels, photos = _real_images()
        crops, crop_labels = _crops(photos, N_CROPS, rng)
        results = []
        t0 = time.perf_counter()
        for name, images, labels, shard in (("digits", digits, digit_labels, "256MB"),
                                            ("photos", crops, crop_labels, "32MB")):
            path = tmp / f"{name}.kv"
            with open_dataset(path, "w", shard_size=shard) as store:
                store.put_many((f"{name}/{i:06d}", {"image": im, "label": int(lb)}) for i, (im, lb)
                               in enumerate(zip(images, labels)))
                store.seal()
            report = verify(path)
            if not report["ok"]:
                raise KVDataError(f"{path}: verify failed after the demo wrote it: {report}")
            results.append(_measure(name, path, images, rng))
        summary = {"dir": str(tmp), "seconds": time.perf_counter() - t0, "results": results}
        if as_json:
            print(json.dumps(summary, indent=1))
        else:
            _print_table(summary, keep)
        return summary
    finally:
        if not keep:
            for p in made:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            if not workdir:
                shutil.rmtree(tmp, ignore_errors=True)


def _print_table(summary: dict[str, Any], keep: bool) -> None:
    print("kvdata demo: real images bundled with scikit-learn (8x8 digits; 227x227x3 crops of its two photos),")
    print(f"written, verified and read back in random batches of {BATCH} (warm page cache).\n")
    print("| dataset | samples | bytes/sample | kvdata samples/s | np.memmap samples/s | kvdata / memmap |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in summary["results"]:
        print(f"| {r['dataset']} | {r['samples']} | {r['sample_bytes']} | {r['kvdata_per_s']:,.0f} "
              f"| {r['memmap_per_s']:,.0f} | {r['ratio']:.2f}x |")
    where = summary["dir"] if keep else "(deleted; --keep to keep them)"
    print(f"\ndatasets: {where}; total {summary['seconds']:.1f} s")
