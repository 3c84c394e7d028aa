#!/usr/bin/env python
"""torch DataLoader throughput of kvdata against the usual ways to feed images, in one process.

One dataset of N images 227x227x3 uint8 (labels i % 1000) is written once per format, then a
torch DataLoader (batch 256, shuffled, num_workers 0 and 2) reads it through:

  kvdata.Loader + ShardShuffleSampler                     (threads fill a reused ring; no workers:
                                                           the workers column is its thread count)
  kvdata.Dataset + ShardShuffleSampler + kvdata.collate   (the DataLoader setup)
  kvdata.Dataset + shuffle=True + default collate
  in-RAM numpy array (a TensorDataset-like Dataset)
  np.memmap recipe (flat uint8 file + offsets)             (the baseline of every ratio)
  mmap_ninja RaggedMmap
  JPEG folder decoded with PIL (the ImageFolder way)
  litdata StreamingDataset (+ StreamingDataLoader)

(a) short:  a fresh, non-persistent DataLoader; K batches timed from iter() to the iterator's
            shutdown, so it includes worker start-up (what a user sees per epoch);
(b) steady: persistent workers, W warm-up batches, then M >= 100 batches timed (epochs
            chained as a training loop does);
(c) kvdata.BatchReader (a prefetch thread, no worker processes) against memcpy bandwidth
    (np.copyto of 256 MB) measured in the same run.

Repeats alternate between methods; tables report median images/s and ratios of medians.
Run:  python bench/loader.py [--quick] [--json F] [--dir D --keep]
"""
from __future__ import annotations

import argparse
import functools
import gc
import multiprocessing
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# default_collate turns read-only arrays (memmap slices, PIL's np.asarray) into tensors with a
# warning; the copy it makes is the measured cost, the warning is noise (also in workers).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

import torch  # noqa: E402
import torch.utils.data as tud  # noqa: E402

import kvdata  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    BATCH,
    IMG,
    SHAPE,
    built,
    dir_bytes,
    image_chunks,
    machine_info,
    machine_line,
    mark_built,
    md_table,
    median,
    rotated,
    timed,
    work_dir,
    write_json,
)
from _memmap_recipe import MemmapDataset  # noqa: E402

try:
    import PIL
    from PIL import Image
except ImportError:  # pip install pillow
    Image = PIL = None
try:
    import mmap_ninja
    from mmap_ninja.ragged import RaggedMmap
except ImportError:  # pip install mmap-ninja
    mmap_ninja = RaggedMmap = None
try:
    import litdata
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata import optimize as lit_optimize
    LITDATA_ERROR = ""
except Exception as e:  # pip install litdata; any import failure skips its rows, with the reason
    litdata = StreamingDataLoader = StreamingDataset = lit_optimize = None
    LITDATA_ERROR = f"{type(e).__name__}: {e}"

GEN_CHUNK = 128            # images generated per step (fixed: the content depends on it)
MEMCPY_BYTES = 256 << 20
TOUCH_STRIDE = 4096        # consume one byte per page of every batch

BASE = "np.memmap recipe"
JPEG = "JPEG folder (PIL)"
KV = "kvdata Dataset"


# ----------------------------------------------------------------------------- dataset building

_FLAT_CACHE: dict[str, np.memmap] = {}


def _lit_item(flat_path: str, i: int) -> dict[str, Any]:
    """litdata.optimize's fn (top level, so its worker processes can import it)."""
    mm = _FLAT_CACHE.get(flat_path)
    if mm is None:
        mm = _FLAT_CACHE[flat_path] = np.memmap(flat_path, np.uint8, "r")
    return {"image": np.array(mm[i * IMG:(i + 1) * IMG]).reshape(SHAPE), "label": i % 1000}


def _lit_build(flat_path: str, n: int, out_dir: str, chunk_bytes: str) -> None:
    lit_optimize(fn=functools.partial(_lit_item, flat_path), inputs=list(range(n)), output_dir=out_dir,
                 chunk_bytes=chunk_bytes, num_workers=1, verbose=False, mode="overwrite")


def jpeg_path(root: Path, i: int) -> Path:
    return root / "jpeg" / f"{i % 1000:04d}" / f"{i:06d}.jpg"


def build(root: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Write the same n images to every format under root (reused if already built)."""
    n = a.n_images
    params = {"n": n, "seed": a.seed, "content": a.content, "shard_size": a.shard_size,
              "jpeg_quality": a.jpeg_quality, "lit_chunk_bytes": a.lit_chunk_bytes,
              "ninja": RaggedMmap is not None, "jpeg": Image is not None, "litdata": litdata is not None}
    done = root / "DONE.json"
    info = built(done, params)
    if info is not None:
        return info
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(a.seed)
    labels = np.arange(n, dtype=np.int64) % 1000
    if Image is not None:
        for c in sorted(set(labels.tolist())):
            (root / "jpeg" / f"{c:04d}").mkdir(parents=True)
    rm = None
    with open(root / "flat.u8", "wb") as flat, \
            kvdata.open(root / "kvdata", "w", shard_size=a.shard_size, compress=False) as st:
        # images are "smooth" (JPEG q90 ~20 KB) or "noise" (JPEG ~50 KB, ~2x slower to decode)
        for start, arr in image_chunks(rng, n, GEN_CHUNK, a.content):
            idx = range(start, start + len(arr))
            flat.write(arr.tobytes())
            # the label is a record field (what Dataset returns) and the side-index label (BatchReader's)
            st.put_many((f"{i:08d}", {"image": img, "label": int(labels[i])}, int(labels[i]))
                        for i, img in zip(idx, arr))
            if RaggedMmap is not None:
                if rm is None:
                    rm = RaggedMmap.from_lists(root / "ninja", list(arr))
                else:
                    rm.extend(list(arr))
            if Image is not None:
                for i, img in zip(idx, arr):
                    Image.fromarray(img).save(jpeg_path(root, i), "JPEG", quality=a.jpeg_quality)
        st.seal()  # a finished dataset is sealed: every record is read by memory-map offset
    del rm
    np.save(root / "offsets.npy", np.arange(n + 1, dtype=np.int64) * IMG)
    np.save(root / "labels.npy", labels)
    if litdata is not None:
        # In a child process: optimize() sets the global multiprocessing start method to "spawn",
        # which would make every later DataLoader spawn (and pickle the dataset to) its workers.
        proc = multiprocessing.get_context("spawn").Process(
            target=_lit_build, args=(str(root / "flat.u8"), n, str(root / "litdata"), a.lit_chunk_bytes))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"litdata optimize failed (exit code {proc.exitcode})")
    with kvdata.open(root / "kvdata") as st:
        shards = len(st.manifest["shards"])
    sizes = {f: dir_bytes(root / f) for f in ("flat.u8", "kvdata", "ninja", "jpeg", "litdata") if (root / f).exists()}
    return mark_built(done, params, kvdata_shards=shards, bytes=sizes)


def warm_page_cache(root: Path) -> None:
    """Read every file once, so each method starts with the same (warm) page cache."""
    buf = bytearray(8 << 20)
    for f in sorted(root.rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


# ----------------------------------------------------------------------------- the datasets (as a user writes them)

class RamDataset(tud.Dataset):
    """All images in one numpy array in RAM (what TensorDataset does)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": torch.from_numpy(self.images[i]), "label": int(self.labels[i])}


class NinjaDataset(tud.Dataset):
    """mmap_ninja RaggedMmap: rm[i] is the (227, 227, 3) array (a view of its memmap)."""

    def __init__(self, root: Path) -> None:
        self.path = root / "ninja"
        self.labels = np.load(root / "labels.npy")
        self.rm: Any = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.rm is None:
            self.rm = RaggedMmap(self.path)
        return {"image": self.rm[i], "label": int(self.labels[i])}


class JpegFolder(tud.Dataset):
    """torchvision.datasets.ImageFolder's layout and loader (root/class/file.jpg, PIL .convert("RGB"))."""

    def __init__(self, root: Path) -> None:
        top = root / "jpeg"
        classes = sorted(d.name for d in os.scandir(top) if d.is_dir())
        self.samples = [(os.path.join(top, c, f), ci) for ci, c in enumerate(classes)
                        for f in sorted(os.listdir(top / c)) if f.endswith(".jpg")]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path, label = self.samples[i]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        return {"image": np.asarray(img), "label": label}


# ----------------------------------------------------------------------------- methods

Loader = tuple[tud.DataLoader, Callable[[int], None]]


class Method:
    """make(nw, persistent) -> (DataLoader, set_epoch); `lossless`: batches equal the originals."""

    def __init__(self, name: str, how: str, make_ds: Callable[[], Any],
                 make_dl: Callable[[Any, int, bool], Loader], lossless: bool = True) -> None:
        self.name, self.how, self.make_ds, self.make_dl, self.lossless = name, how, make_ds, make_dl, lossless


def _dl_kwargs(nw: int, persistent: bool) -> dict[str, Any]:
    return {"batch_size": BATCH, "num_workers": nw, "persistent_workers": persistent and nw > 0}


def _plain(ds: Any, nw: int, persistent: bool) -> Loader:
    return tud.DataLoader(ds, shuffle=True, **_dl_kwargs(nw, persistent)), lambda e: None


def _kv_shard(ds: Any, nw: int, persistent: bool) -> Loader:
    sampler = kvdata.ShardShuffleSampler(ds, seed=0)
    dl = tud.DataLoader(ds, sampler=sampler, collate_fn=kvdata.collate, **_dl_kwargs(nw, persistent))
    return dl, sampler.set_epoch


def _kv_loader(ds: Any, nw: int, persistent: bool) -> Any:
    """kvdata.Loader: no worker processes; the workers column is its thread count (0 -> 1)."""
    sampler = kvdata.ShardShuffleSampler(ds, seed=0)
    return kvdata.Loader(ds, BATCH, sampler=sampler, threads=max(1, nw)), sampler.set_epoch


def _lit(ds: Any, nw: int, persistent: bool) -> Loader:
    return StreamingDataLoader(ds, **_dl_kwargs(nw, persistent)), lambda e: None  # it counts epochs itself


def methods(root: Path, want: set[str] | None) -> tuple[list[Method], list[str]]:
    ms = [Method("kvdata.Loader", "ShardShuffleSampler, threads = max(1, workers), reused ring",
                 lambda: kvdata.Dataset(root / "kvdata"), _kv_loader),
          Method(KV, "ShardShuffleSampler + kvdata.collate", lambda: kvdata.Dataset(root / "kvdata"), _kv_shard),
          Method("kvdata Dataset (default collate)", "shuffle=True + default_collate",
                 lambda: kvdata.Dataset(root / "kvdata"), _plain),
          Method("in-RAM numpy array", "shuffle=True + default_collate",
                 lambda: RamDataset(np.fromfile(root / "flat.u8", np.uint8).reshape(-1, *SHAPE),
                                    np.load(root / "labels.npy")), _plain),
          Method(BASE, "shuffle=True + default_collate", lambda: MemmapDataset(root), _plain)]
    notes = []
    if RaggedMmap is not None:
        ms.append(Method("mmap_ninja RaggedMmap", "shuffle=True + default_collate", lambda: NinjaDataset(root), _plain))
    else:
        notes.append("mmap_ninja is not installed: its row is skipped (pip install mmap-ninja).")
    if Image is not None:
        ms.append(Method(JPEG, "shuffle=True + default_collate", lambda: JpegFolder(root), _plain, lossless=False))
    else:
        notes.append("Pillow is not installed: the JPEG row is skipped (pip install pillow).")
    if litdata is not None:
        ms.append(Method("litdata StreamingDataset", "shuffle=True (its own) + StreamingDataLoader",
                         lambda: StreamingDataset(str(root / "litdata"), shuffle=True, seed=0), _lit))
    else:
        notes.append(f"litdata is not available, its row is skipped ({LITDATA_ERROR}).")
    if want:
        ms = [m for m in ms if m.name in want or any(w.lower() in m.name.lower() for w in want)]
    return ms, notes


# ----------------------------------------------------------------------------- measuring

class Sink:
    """Consumes batches: reads one byte per page of every image batch (so shared-memory
    batches are faulted in and nothing lazy goes unread) plus the labels."""

    def __init__(self) -> None:
        self.total = 0

    def __call__(self, b: Any) -> int:
        img, lab = b["image"], b["label"]
        n = img.shape[0]
        self.total += int(img.reshape(n, -1)[:, ::TOUCH_STRIDE].sum()) + int(lab.sum())
        return n


def run_short(m: Method, ds: Any, nw: int, k: int, epoch: int, sink: Sink) -> float:
    dl, set_epoch = m.make_dl(ds, nw, False)
    set_epoch(epoch)
    n = 0
    t0 = time.perf_counter()
    it = iter(dl)
    for _ in range(k):
        n += sink(next(it))
    del it  # the epoch ends: non-persistent workers are shut down (and joined) here
    dt = time.perf_counter() - t0
    del dl
    return n / dt


def run_steady(m: Method, ds: Any, nw: int, w: int, count: int, sink: Sink) -> float:
    """Epoch after epoch as a training loop iterates them; after w warm-up batches, the next
    `count` batches are timed (across epoch boundaries)."""
    dl, set_epoch = m.make_dl(ds, nw, True)
    done = n = 0
    t0 = dt = 0.0
    epoch = 0
    while not dt:
        set_epoch(epoch)
        empty = True
        for b in dl:
            empty = False
            if done == w:
                t0 = time.perf_counter()
            got = sink(b)
            done += 1
            if done > w:
                n += got
                if done == w + count:
                    dt = time.perf_counter() - t0
                    break
        if empty:
            raise RuntimeError(f"{m.name}: the DataLoader produced an empty epoch")
        epoch += 1
    del dl, b  # the persistent workers go with the DataLoader (untimed)
    gc.collect()
    return n / dt


def check_batch(m: Method, ds: Any, b: Any, flat: np.ndarray, lookup: dict[bytes, int]) -> None:
    """The first batch of a method: shape, dtype, labels, and (lossless formats) the exact pixels."""
    img, lab = b["image"], b["label"]
    if not (isinstance(img, torch.Tensor) and img.dtype == torch.uint8 and tuple(img.shape) == (BATCH, *SHAPE)):
        raise SystemExit(f"{m.name}: image batch is {type(img).__name__} {getattr(img, 'dtype', '?')} "
                         f"{tuple(getattr(img, 'shape', ()))}, expected uint8 {(BATCH, *SHAPE)}")
    if not (isinstance(lab, torch.Tensor) and tuple(lab.shape) == (BATCH,) and not lab.is_floating_point()):
        raise SystemExit(f"{m.name}: label batch is {type(lab).__name__} {tuple(getattr(lab, 'shape', ()))}")
    x, labels = img.numpy(), lab.numpy()
    if m.lossless:
        seen = set()
        for j in range(BATCH):
            i = lookup.get(x[j, 0].tobytes())
            if i is None or not np.array_equal(x[j], flat[i]) or labels[j] != i % 1000:
                raise SystemExit(f"{m.name}: sample {j} of the first batch is not an original image with its label")
            seen.add(i)
        if len(seen) != BATCH:
            raise SystemExit(f"{m.name}: the first batch repeats samples")
    else:  # JPEG is lossy: the decoded image must be close to the original its file name says
        if not ((labels >= 0) & (labels < 1000)).all():
            raise SystemExit(f"{m.name}: labels out of range")
        for j in (0, len(ds) // 2, len(ds) - 1):
            path, label = ds.samples[j]
            i = int(Path(path).stem)
            err = np.abs(np.asarray(ds[j]["image"], np.int16) - flat[i]).mean()
            if label != i % 1000 or err > 8:
                raise SystemExit(f"{m.name}: {path} decodes {err:.1f} levels away from image {i} (label {label})")


def measure_memcpy(times: int = 5) -> float:
    src = np.full(MEMCPY_BYTES, 7, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault in dst
    ts = [timed(np.copyto, dst, src)[0] for _ in range(times)]
    del src, dst
    return MEMCPY_BYTES / median(ts)


def run_batch_reader(path: Path, count: int, flat: np.ndarray | None, sink_total: list[int]) -> float:
    br = kvdata.BatchReader(str(path), batch_size=BATCH, prefetch=4)
    try:
        first, labels = next(br)
        if flat is not None:  # sequential cursor: the first batch is records 0..255, NCHW
            if first.shape != (BATCH, SHAPE[2], SHAPE[0], SHAPE[1]) or first.dtype != np.uint8:
                raise SystemExit(f"BatchReader: batch is {first.dtype} {first.shape}")
            if not (np.array_equal(first, flat[:BATCH].transpose(0, 3, 1, 2))
                    and np.array_equal(labels, np.arange(BATCH) % 1000)):
                raise SystemExit("BatchReader: the first batch differs from records 0..255")
        next(br)
        n = 0
        t0 = time.perf_counter()
        for _ in range(count):
            imgs, labels = next(br)
            sink_total[0] += int(imgs.reshape(len(imgs), -1)[:, ::TOUCH_STRIDE].sum()) + int(labels.sum())
            n += len(imgs)
        return n / (time.perf_counter() - t0)
    finally:
        br.close()


# ----------------------------------------------------------------------------- reporting

def loader_table(title: str, mode: str, rates: dict, ms: list[Method], workers: list[int]) -> str:
    head = ["method", "sampler + collate"]
    for w in workers:
        head += [f"nw={w} img/s", "vs np.memmap", "vs JPEG"]
    rows = []
    for m in ms:
        row = [m.name, m.how]
        for w in workers:
            v = median(rates[m.name][mode][str(w)])
            b = median(rates.get(BASE, {}).get(mode, {}).get(str(w), []))
            j = median(rates.get(JPEG, {}).get(mode, {}).get(str(w), []))
            row += [f"{v:,.0f}", f"{v / b:.2f}x", f"{v / j:.1f}x"]
        rows.append(row)
    return f"### {title}\n\n" + md_table(head, rows, left=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, help="where to build the datasets (default: a temp dir under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the datasets; a later run with the same --dir reuses them")
    p.add_argument("--n-images", type=int, default=3000, help="227x227x3 images (default 3000, ~460 MB raw per format)")
    p.add_argument("--workers", default="0,2", help="num_workers values (default 0,2)")
    p.add_argument("--short-batches", type=int, default=0,
                   help="K, batches per short run (default min(n // 256, 12))")
    p.add_argument("--warmup-batches", type=int, default=0, help="W, steady-state warm-up batches (default K)")
    p.add_argument("--steady-batches", type=int, default=100, help="M, timed steady-state batches (default 100)")
    p.add_argument("--br-batches", type=int, default=100, help="timed BatchReader batches (default 100)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", help="comma-separated subset (substrings of the method names)")
    p.add_argument("--content", choices=("smooth", "noise"), default="smooth",
                   help="image content: smooth random (JPEG ~20 KB, default) or uniform noise (JPEG ~50 KB)")
    p.add_argument("--jpeg-quality", type=int, default=90)
    p.add_argument("--shard-size", default="256MB", help="kvdata shard size")
    p.add_argument("--lit-chunk-bytes", default="64MB", help="litdata optimize chunk_bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test (numbers mean nothing)")
    p.add_argument("--json", type=Path, help="also write the raw numbers here")
    if p.parse_args().quick:  # smaller defaults; options given explicitly still win
        p.set_defaults(n_images=600, short_batches=2, warmup_batches=1, steady_batches=4, br_batches=6,
                       repeats=2, shard_size="16MB", lit_chunk_bytes="16MB")
    a = p.parse_args()
    per_epoch = a.n_images // BATCH
    if per_epoch < 1:
        raise SystemExit(f"--n-images must be at least {BATCH}")
    k = a.short_batches or min(per_epoch, 12)
    if k > per_epoch:
        raise SystemExit(f"--short-batches {k} is more than the {per_epoch} full batches of one epoch")
    w = a.warmup_batches or k
    if min(a.steady_batches, a.br_batches, a.repeats) < 1:
        raise SystemExit("--steady-batches, --br-batches and --repeats must be >= 1")
    workers = [int(x) for x in a.workers.split(",")]
    d, made = work_dir(a.dir, "kvdata-loader-")
    root = d / "loader"
    machine = machine_info(("numpy", "lmdb", "torch", "kvdata", "PIL", "mmap_ninja", "litdata"))
    versions = {"python": machine["python"], "torch": torch.__version__, "numpy": np.__version__,
                "kvdata": kvdata.__version__, "pillow": getattr(PIL, "__version__", None),
                "mmap_ninja": getattr(mmap_ninja, "__version__", None) if mmap_ninja else None,
                "litdata": getattr(litdata, "__version__", None) if litdata else None}
    out: dict[str, Any] = {"config": {k_: str(v) for k_, v in vars(a).items()}, "machine": machine,
                           "versions": versions, "K": k, "W": w, "M": a.steady_batches}
    try:
        t0 = time.perf_counter()
        info = build(root, a)
        print(f"built/reused datasets in {root} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        out["dataset"] = info
        ms, notes = methods(root, set(a.methods.split(",")) if a.methods else None)
        if not ms:
            raise SystemExit("no method selected")
        flat = np.memmap(root / "flat.u8", np.uint8, "r").reshape(-1, *SHAPE)
        lookup = {flat[i, 0].tobytes(): i for i in range(len(flat))}
        warm_page_cache(root)

        # untimed: every method's first batch is checked, with every worker setting
        for m in ms:
            ds = m.make_ds()
            for nw in workers:
                dl, set_epoch = m.make_dl(ds, nw, False)
                set_epoch(0)
                it = iter(dl)
                check_batch(m, ds, next(it), flat, lookup)
                del it, dl
            del ds
            gc.collect()

        sink = Sink()
        rates: dict[str, dict[str, dict[str, list[float]]]] = {
            m.name: {mode: {str(nw): [] for nw in workers} for mode in ("short", "steady")} for m in ms}
        memcpy: list[float] = []
        br: list[float] = []
        br_total = [0]
        for r in range(a.repeats):
            for m in rotated(ms, r):
                tm = time.perf_counter()
                ds = m.make_ds()
                for nw in (workers if r % 2 == 0 else workers[::-1]):
                    rates[m.name]["short"][str(nw)].append(run_short(m, ds, nw, k, r + 1, sink))
                    rates[m.name]["steady"][str(nw)].append(run_steady(m, ds, nw, w, a.steady_batches, sink))
                del ds
                gc.collect()
                print(f"repeat {r + 1}/{a.repeats}: {m.name} ({time.perf_counter() - tm:.1f}s)", file=sys.stderr)
            # BatchReader and memcpy after the loaders: no reader thread is alive while workers fork
            check = flat if r == 0 else None  # the first BatchReader run checks its first batch
            pair = [lambda: memcpy.append(measure_memcpy()),
                    lambda check=check: br.append(run_batch_reader(root / "kvdata", a.br_batches, check, br_total))]
            for f in rotated(pair, r):
                f()
            gc.collect()
        out["rates_images_per_s"] = rates
        out["memcpy_bytes_per_s"] = memcpy
        out["batch_reader_images_per_s"] = br

        sizes = info["bytes"]
        md = [f"## kvdata loader ({machine_line(machine)})", ""]
        md += [f"- DataLoader workers start with {multiprocessing.get_start_method()!r}"]
        md += [f"- {a.n_images} images {SHAPE[0]}x{SHAPE[1]}x{SHAPE[2]} uint8 ({a.content} content), labels i % 1000, "
               f"batch {BATCH}, shuffled; K={k} short batches, W={w} warm-up + M={a.steady_batches} steady batches, "
               f"{a.repeats} repeats (medians)",
               "- on disk: " + ", ".join(f"{f} {v / 1e6:,.0f} MB" for f, v in sizes.items())
               + (f"; JPEG {sizes['jpeg'] / a.n_images / 1e3:.1f} KB/image (q{a.jpeg_quality})"
                  if "jpeg" in sizes else "")
               + f"; kvdata {info['kvdata_shards']} sealed shard(s)"]
        md += [f"- {x}" for x in notes] + [""]
        md.append(loader_table(f"(a) short: fresh DataLoader, {k} batches incl. worker start-up and shutdown "
                               "(images/s)", "short", rates, ms, workers))
        md.append(loader_table(f"(b) steady: persistent workers, after {w} warm-up batch(es), {a.steady_batches} "
                               "batches (images/s)", "steady", rates, ms, workers))
        mc, b = median(memcpy), median(br)
        threads = min(4, len(os.sched_getaffinity(0)))
        md += ["### (c) kvdata.BatchReader (batch 256, prefetch=4, no worker processes) vs memcpy", "",
               "| | images/s | GB/s | memcpy GB/s (np.copyto 256 MB) | of memcpy |", "|---|---:|---:|---:|---:|",
               f"| BatchReader, {a.br_batches} batches after 2 warm-up | {b:,.0f} | {b * IMG / 1e9:.2f} | "
               f"{mc / 1e9:.2f} | {100 * b * IMG / mc:.0f}% |", "",
               f"BatchReader copies with up to {threads} thread(s) (copy_threads default); memcpy is one thread.", ""]

        tgt = ["### Targets", ""]
        if KV in rates and BASE in rates:
            for mode in ("steady", "short"):
                for nw in workers:
                    kv_v = median(rates[KV][mode][str(nw)])
                    base_v = median(rates[BASE][mode][str(nw)])
                    line = f"- {mode}, nw={nw}: kvdata {kv_v / base_v:.2f}x np.memmap recipe"
                    if nw == 2:
                        line += " (target >= 2x: " + ("met" if kv_v >= 2 * base_v else "NOT met") + ")"
                    if JPEG in rates:
                        jv = median(rates[JPEG][mode][str(nw)])
                        line += f", {kv_v / jv:.1f}x JPEG folder"
                        if nw == 2:
                            line += " (target >= 10x: " + ("met" if kv_v >= 10 * jv else "NOT met") + ")"
                    tgt.append(line)
        tgt.append(f"- BatchReader: {100 * b * IMG / mc:.0f}% of memcpy bandwidth (target >= 25%: "
                   + ("met" if b * IMG >= 0.25 * mc else "NOT met") + ")")
        if a.quick:
            tgt.append("- --quick: tiny sizes on whatever the machine is doing; the numbers mean nothing")
        md += tgt + [""]
        out["checksum"] = sink.total + br_total[0]
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
            if made or not any(d.iterdir()):
                shutil.rmtree(d, ignore_errors=True)
    out["markdown"] = "\n".join(md)
    print(out["markdown"])
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
