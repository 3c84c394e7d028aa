#!/usr/bin/env python
"""Import throughput of every importer, with `--workers 1` and `--workers 2` on the same input.

One seeded set of N RGB images (default 2,000 of 256x256 and 2,000 of 128x96: smooth content,
JPEG quality 90) is written once into every input format, each by the library users write it
with where that library installs (the `test` extra):

- folder:    an ImageFolder tree of JPEG files, src/cNN/NNNNNN.jpg (PIL);
- listfile:  a Caffe convert_imageset list file ("cNN/NNNNNN.jpg LABEL") over the same files;
- caffe:     two Caffe LMDBs of `Datum` protos as convert_imageset writes them (keys
             "%08d_<file>", a commit per 1,000 puts): encoded (the JPEG bytes, encoded=true)
             and raw (CHW uint8 pixels); the Datum wire bytes are written by hand in field
             order by tests/helpers/wire.py (as the Caffe tests do), not by kvdata's descriptor;
- wds:       WebDataset tars of 500 samples (jpg + cls), written by webdataset's TarWriter;
- tfrecord:  TFRecord files of 500 tf.train.Example (image bytes + label), framed with the
             format's masked CRC-32C from google-crc32c (Examples encoded by hand in
             tests/helpers/wire.py, no TensorFlow);
- parquet:   Parquet files of 500 rows (image bytes column + int label) written by pyarrow;
- hf:        a Hugging Face Dataset with an Image feature and a ClassLabel, save_to_disk'ed by
             `datasets`;
- from_arrays / from_iterable: the decoded pixels as one NumPy array (+ labels), and a list of
  dicts ({"image": pixels, "label"}; and {"jpeg": bytes, "label"}) in a fresh Python process.

Every importer is then run as a user runs it: `kvdata import KIND SRC DST --decode rgb
--workers N --json` (and `--decode none`, which keeps the JPEG bytes; caffe has no --workers
and --keep-encoded instead of --decode none), for N = 1 and 2 alternating (the order flips every
repeat), each into a fresh destination, timed as the command's wall time (interpreter start-up
included: it is reported too). After every run, outside the clock, the dataset is checked: N
records, the expected keys, and 16 sampled records equal to the source (pixels equal to
Pillow's decoding of the source JPEG, or the JPEG bytes themselves) with their labels. The table
gives the median images/s, MB/s of input (the source's bytes on disk; for the Python entry
points the bytes handed over), the ratio workers 2 / workers 1, and the `"writers"` field of
--json. from_arrays and from_iterable have no workers option: one figure, the time of the call
(arrays already in memory) in a fresh process.

    python bench/imports.py --quick                 # 200 images of 64x48, 1 repeat: a smoke test
    python bench/imports.py --json results.json     # full size; run on an idle machine, under flock
    python bench/imports.py --only folder,wds --sizes 128x96 --n 1000

Inputs are read from the page cache (written just before, read again every repeat).
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    MB,
    built,
    dir_bytes,
    log,
    machine_info,
    machine_line,
    make_images,
    mark_built,
    md_table,
    median,
    rotated,
    work_dir,
    write_json,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from helpers.wire import datum_bytes, example_bytes, tfrecord_frame, write_caffe_lmdb  # noqa: E402

PER_FILE = 500            # samples per tar / TFRecord file / Parquet file
CLASSES = 10
QUALITY = 90
CHECKED = 16              # records compared to the source after every run
IMPORTERS = ("folder", "listfile", "caffe", "wds", "tfrecord", "parquet", "hf", "from_arrays", "from_iterable")
# What writing an importer's input and running it need beyond kvdata and Pillow (the `test` extra
# has them all); an importer whose modules are missing loses its rows, and the report says so.
NEEDS = {"caffe": ("google.protobuf",), "wds": ("webdataset",), "tfrecord": ("google_crc32c", "google.protobuf"),
         "parquet": ("pyarrow",), "hf": ("datasets", "pyarrow")}


# ====================================================================== the images

@dataclass
class Images:
    """The seeded set every format is written from: JPEG bytes, the pixels Pillow decodes them
    to (what every decoding importer must store), labels and the ImageFolder names."""

    jpegs: list[bytes]
    pixels: np.ndarray        # (n, h, w, 3) uint8
    labels: np.ndarray        # (n,) int64
    names: list[str]          # "c03/000123.jpg"


def parse_size(text: str) -> tuple[int, int]:
    """'256x96' -> (width 256, height 96)."""
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--sizes {text!r}: write WIDTHxHEIGHT, e.g. 256x256") from None
    if w <= 0 or h <= 0:
        raise SystemExit(f"--sizes {text!r}: width and height must be positive")
    return w, h


def make_set(n: int, width: int, height: int, seed: int) -> Images:
    from PIL import Image

    rng = np.random.default_rng(seed)
    raw = make_images(rng, n, "smooth", (height, width, 3))
    jpegs, pixels = [], np.empty((n, height, width, 3), np.uint8)
    for i, a in enumerate(raw):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "JPEG", quality=QUALITY)
        jpegs.append(buf.getvalue())
        with Image.open(io.BytesIO(jpegs[-1])) as im:
            pixels[i] = np.asarray(im.convert("RGB"))
    labels = (np.arange(n) % CLASSES).astype(np.int64)
    names = [f"c{int(labels[i]):02d}/{i:06d}.jpg" for i in range(n)]
    return Images(jpegs, pixels, labels, names)


# ====================================================================== the inputs

@dataclass
class Source:
    """One input: the CLI arguments before DST and after it, and each image's expected key."""

    path: Path
    before: list[str]
    after: list[str]
    keys: list[str]
    bytes: int = 0


def chunks(n: int, per: int) -> list[range]:
    return [range(lo, min(n, lo + per)) for lo in range(0, n, per)]


def write_folder(root: Path, im: Images) -> Source:
    for name, data in zip(im.names, im.jpegs):
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return Source(root, [str(root)], [], list(im.names))


def write_listfile(root: Path, tree: Path, im: Images) -> Source:
    root.mkdir(parents=True, exist_ok=True)
    lst = root / "train.txt"
    lst.write_text("".join(f"{name} {int(lab)}\n" for name, lab in zip(im.names, im.labels)))
    return Source(lst, [str(lst)], ["--root", str(tree)], list(im.names))


def write_caffe(root: Path, im: Images, encoded: bool) -> Source:
    """convert_imageset's LMDB: with --encoded (ReadFileToDatum: the file's bytes, encoded=true)
    or without (CVMatToDatum: CHW uint8 pixels)."""
    def value(i: int) -> bytes:
        label = int(im.labels[i])
        if encoded:
            return datum_bytes(data=im.jpegs[i], label=label, encoded=True)
        h, w, c = im.pixels[i].shape
        chw = np.ascontiguousarray(im.pixels[i].transpose(2, 0, 1))
        return datum_bytes(channels=c, height=h, width=w, data=chw.tobytes(), label=label, encoded=False)

    keys = write_caffe_lmdb(root, [(name, value(i)) for i, name in enumerate(im.names)])
    return Source(root, [str(root)], [], keys)


def write_wds(root: Path, im: Images) -> Source:
    import webdataset

    root.mkdir(parents=True, exist_ok=True)
    keys = [f"{i:06d}" for i in range(len(im.jpegs))]
    for s, rows in enumerate(chunks(len(keys), PER_FILE)):
        with webdataset.TarWriter(str(root / f"shard-{s:05d}.tar")) as sink:
            for i in rows:
                sink.write({"__key__": keys[i], "jpg": im.jpegs[i], "cls": int(im.labels[i])})
    return Source(root, [str(root)], [], keys)


def write_tfrecord(root: Path, im: Images) -> Source:
    import google_crc32c

    root.mkdir(parents=True, exist_ok=True)
    keys = []
    for f, rows in enumerate(chunks(len(im.jpegs), PER_FILE)):
        name = f"train-{f:05d}.tfrecord"
        with open(root / name, "wb") as out:
            for r, i in enumerate(rows):
                ex = example_bytes({"image": ("bytes", [im.jpegs[i]]), "label": ("int", [int(im.labels[i])])})
                out.write(tfrecord_frame(ex, google_crc32c.value))
                keys.append(f"{name}/{r:08d}")
    return Source(root, [str(root)], [], keys)


def write_parquet(root: Path, im: Images) -> Source:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    keys = []
    for f, rows in enumerate(chunks(len(im.jpegs), PER_FILE)):
        stem = f"train-{f:05d}"
        table = pa.table({"image": pa.array([im.jpegs[i] for i in rows], pa.binary()),
                          "label": pa.array([int(im.labels[i]) for i in rows], pa.int64())})
        pq.write_table(table, root / f"{stem}.parquet")
        keys += [f"{stem}/{r:09d}" for r in range(len(rows))]
    return Source(root, [str(root)], ["--label", "label"], keys)


def write_hf(root: Path, im: Images) -> Source:
    import datasets

    datasets.disable_progress_bars()
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=[f"c{c:02d}" for c in range(CLASSES)])})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in im.jpegs],
                                     "label": [int(x) for x in im.labels]}, features=features)
    ds.save_to_disk(str(root))
    # a saved Dataset (not a DatasetDict) has no split name: keys are "data/<row>" (arrow.py)
    return Source(root, [str(root)], [], [f"data/{i:09d}" for i in range(len(im.jpegs))])


def write_numpy(root: Path, im: Images) -> Source:
    """The arrays from_arrays/from_iterable are given (loaded in the child before its clock)."""
    root.mkdir(parents=True, exist_ok=True)
    np.save(root / "pixels.npy", im.pixels)
    np.save(root / "labels.npy", im.labels)
    (root / "jpegs.bin").write_bytes(b"".join(im.jpegs))
    np.save(root / "jpeg_ends.npy", np.cumsum([len(b) for b in im.jpegs]))
    return Source(root, [], [], [f"{i:010d}" for i in range(len(im.jpegs))])


def write_sources(d: Path, im: Images, needed: set[str]) -> dict[str, Source]:
    """The input formats named in `needed` (write_sources' step names) under `d`, one directory each."""
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    steps: list[tuple[str, Callable[[], Source]]] = [
        ("folder", lambda: write_folder(d / "folder", im)),
        ("listfile", lambda: write_listfile(d / "listfile", d / "folder", im)),
        ("caffe", lambda: write_caffe(d / "caffe-encoded", im, encoded=True)),
        ("caffe_raw", lambda: write_caffe(d / "caffe-raw", im, encoded=False)),
        ("wds", lambda: write_wds(d / "wds", im)),
        ("tfrecord", lambda: write_tfrecord(d / "tfrecord", im)),
        ("parquet", lambda: write_parquet(d / "parquet", im)),
        ("hf", lambda: write_hf(d / "hf", im)),
        ("numpy", lambda: write_numpy(d / "numpy", im)),
    ]
    for name, step in steps:
        if name not in needed and not (name == "folder" and "listfile" in needed):
            continue
        t0 = time.perf_counter()
        src = step()
        src.bytes = dir_bytes(src.path)
        if name == "listfile":  # the list and the image files it names
            src.bytes += dir_bytes(d / "folder")
        out[name] = src
        log(f"  input {name}: {src.bytes / MB:,.1f} MB in {time.perf_counter() - t0:.1f} s")
    return out


# ====================================================================== the cases

@dataclass(frozen=True)
class Case:
    """One importer and variant: how it is run and what its records must hold."""

    importer: str
    variant: str
    source: str                     # key of write_sources()
    args: tuple[str, ...]           # CLI options (or the --py-run mode)
    field: str                      # the field holding the image ("image" for every importer: docs/CLI.md)
    pixels: bool                    # decoded pixels (else the JPEG bytes)
    workers: tuple[int, ...] = (1, 2)   # () : no --workers option, one figure
    py: bool = False                # a Python entry point, run by this script in a fresh process

    @property
    def name(self) -> str:
        return f"{self.importer} ({self.variant})"


def cases() -> list[Case]:
    rgb, keep = ("--decode", "rgb"), ("--decode", "none")
    return [
        Case("folder", "decode rgb", "folder", rgb, "image", True),
        Case("folder", "bytes", "folder", keep, "image", False),
        Case("listfile", "decode rgb", "listfile", rgb, "image", True),
        Case("listfile", "bytes", "listfile", keep, "image", False),
        Case("caffe", "encoded Datum, decoded", "caffe", (), "image", True, ()),
        Case("caffe", "encoded Datum, --keep-encoded", "caffe", ("--keep-encoded",), "image", False, ()),
        Case("caffe", "raw Datum (CHW pixels)", "caffe_raw", (), "image", True, ()),
        Case("wds", "decode rgb", "wds", rgb, "image", True),
        Case("wds", "bytes", "wds", keep, "image", False),
        Case("tfrecord", "decode rgb", "tfrecord", rgb, "image", True),
        Case("tfrecord", "bytes", "tfrecord", keep, "image", False),
        Case("parquet", "decode rgb", "parquet", rgb, "image", True),
        Case("parquet", "bytes", "parquet", keep, "image", False),
        Case("hf", "decode rgb", "hf", rgb, "image", True),
        Case("hf", "bytes", "hf", keep, "image", False),
        Case("from_arrays", "pixels", "numpy", ("from_arrays",), "image", True, (), py=True),
        Case("from_iterable", "dicts of pixels", "numpy", ("from_iterable",), "image", True, (), py=True),
        Case("from_iterable", "dicts of JPEG bytes", "numpy", ("from_iterable_bytes",), "jpeg", False, (), py=True),
    ]


def missing_modules(importer: str) -> list[str]:
    """The modules `importer` needs (NEEDS) that do not import here."""
    out = []
    for m in NEEDS.get(importer, ()):
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(m)
    return out


def kvdata_cli() -> list[str]:
    """The `kvdata` console script of this interpreter's environment (as a user runs it)."""
    here = Path(sys.executable).parent / "kvdata"
    if here.exists():
        return [str(here)]
    found = shutil.which("kvdata")
    if found is None:
        raise SystemExit("no `kvdata` command next to this Python or on PATH; pip install -e . first")
    return [found]


def argv(case: Case, src: Source, dst: Path, workers: int | None) -> list[str]:
    if case.py:
        return [sys.executable, os.path.abspath(__file__), "--py-run", case.args[0], str(src.path), str(dst)]
    cmd = [*kvdata_cli(), "import", case.importer, *src.before, str(dst), *src.after, *case.args]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    return cmd + ["--json"]


def py_run(mode: str, src: str, dst: str) -> None:
    """The child of a Python-entry-point case: load the arrays, then time the call alone."""
    import kvdata

    root = Path(src)
    pixels = np.load(root / "pixels.npy")
    labels = np.load(root / "labels.npy")
    if mode == "from_arrays":
        t0 = time.perf_counter()
        out = kvdata.from_arrays(dst, image=pixels, label=labels, progress=False)
    else:
        if mode == "from_iterable_bytes":
            blob = (root / "jpegs.bin").read_bytes()
            ends = np.load(root / "jpeg_ends.npy").tolist()
            starts = [0, *ends[:-1]]
            items = [{"jpeg": blob[a:b], "label": int(y)} for a, b, y in zip(starts, ends, labels.tolist())]
        elif mode == "from_iterable":
            items = [{"image": p, "label": int(y)} for p, y in zip(pixels, labels.tolist())]
        else:
            raise SystemExit(f"--py-run {mode!r}: from_arrays, from_iterable or from_iterable_bytes")
        t0 = time.perf_counter()
        out = kvdata.from_iterable(dst, items, progress=False)
    out["call_seconds"] = time.perf_counter() - t0
    print(json.dumps(out))


# ====================================================================== running and checking

def check(case: Case, dst: Path, src: Source, im: Images, rng: np.random.Generator) -> None:
    """The dataset holds every image under its expected key, and sampled records (value and
    label) equal the source. Raises SystemExit naming what differs."""
    import kvdata

    n = len(src.keys)
    index = {k: i for i, k in enumerate(src.keys)}
    with kvdata.open(dst) as st:
        if len(st) != n:
            raise SystemExit(f"{case.name}: {len(st)} records in {dst}, expected {n}")
        keys = [st.key_at(i) for i in range(n)]
        if set(keys) != set(index):
            extra = sorted(set(keys) - set(index))[:3]
            raise SystemExit(f"{case.name}: keys differ from the source's (e.g. {extra} not expected)")
        labels = st.labels
        for j in rng.choice(n, size=min(CHECKED, n), replace=False).tolist():
            i = index[keys[j]]
            v = st.get_one(j, copy=True)[case.field]
            if case.pixels:
                ok = np.array_equal(np.asarray(v), im.pixels[i])
            else:
                ok = bytes(v) == im.jpegs[i]
            if not ok:
                raise SystemExit(f"{case.name}: record {keys[j]!r} differs from source image {i}")
            if int(labels[j]) != int(im.labels[i]):
                raise SystemExit(f"{case.name}: record {keys[j]!r} has label {labels[j]}, expected {im.labels[i]}")


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat; NaN where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    except (OSError, ValueError):
        return float("nan")
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(case: Case, src: Source, dst: Path, workers: int | None) -> tuple[float, dict[str, Any], float]:
    """(wall seconds, the --json summary, cores other processes kept busy meanwhile) of one import
    into the fresh `dst`. The last is the machine's busy CPU time less the import's own (its
    processes and the workers they reaped) over the wall time: on shared cores it says how much
    of the machine the run did not have."""
    shutil.rmtree(dst, ignore_errors=True)
    cmd = argv(case, src, dst, workers)
    busy0, ours0 = busy_cpu_seconds(), children_cpu_seconds()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    other = max(0.0, (busy_cpu_seconds() - busy0) - (children_cpu_seconds() - ours0)) / wall
    if p.returncode != 0:
        raise SystemExit(f"{case.name}: `{' '.join(cmd)}` exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    try:
        out = json.loads(p.stdout)
    except ValueError:
        raise SystemExit(f"{case.name}: no JSON summary on stdout: {p.stdout[-500:]!r}") from None
    return wall, out, other


def startup_seconds(repeats: int) -> float:
    """Median wall time of `kvdata import --help`: the interpreter and CLI start-up every CLI figure includes."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([*kvdata_cli(), "import", "folder", "--help"], capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
    return median(times)


@dataclass
class Result:
    case: Case
    input_bytes: int
    walls: dict[int | None, list[float]] = field(default_factory=dict)     # workers -> wall seconds
    inside: dict[int | None, list[float]] = field(default_factory=dict)    # workers -> the summary's own seconds
    writers: dict[int | None, set[Any]] = field(default_factory=dict)      # workers -> "writers" values seen
    other: list[float] = field(default_factory=list)                       # cores busy elsewhere, per run


def run_case(case: Case, src: Source, im: Images, d: Path, repeats: int, seed: int) -> Result:
    res = Result(case, src.bytes if not case.py else (im.pixels.nbytes if case.pixels else sum(map(len, im.jpegs))))
    rng = np.random.default_rng(seed)
    order: list[int | None] = list(case.workers) or [None]
    for r in range(repeats):
        for w in rotated(order, r):
            dst = d / f"dst-w{w}"
            wall, out, other = run_once(case, src, dst, w)
            res.other.append(other)
            if out.get("imported") != len(src.keys):
                raise SystemExit(f"{case.name}: --json says imported={out.get('imported')}, expected {len(src.keys)}")
            check(case, dst, src, im, rng)
            shutil.rmtree(dst, ignore_errors=True)
            if case.py:
                wall = float(out["call_seconds"])
            res.walls.setdefault(w, []).append(wall)
            res.inside.setdefault(w, []).append(float(out.get("seconds", float("nan"))))
            res.writers.setdefault(w, set()).add(out.get("writers"))
            log(f"    {case.name} workers={w}: {wall:.2f} s ({len(src.keys) / wall:,.0f} images/s), "
                f"writers={out.get('writers')}, other processes {other:.2f} cores")
    return res


# ====================================================================== report

def writers_cell(res: Result) -> str:
    def one(w: int | None) -> str:
        seen = sorted(res.writers.get(w, set()), key=str)
        return "/".join("absent" if s is None else str(s) for s in seen) or "-"
    ws = list(res.case.workers) or [None]
    return " / ".join(one(w) for w in ws)


def ratio(res: Result, inside: bool = False) -> float:
    """Median rate with 2 workers over the median rate with 1 (NaN without workers)."""
    src = res.inside if inside else res.walls
    if 1 not in src or 2 not in src:
        return float("nan")
    return median(src[1]) / median(src[2])


def table_rows(results: Sequence[Result], n: int) -> tuple[list[list[str]], list[dict[str, Any]]]:
    rows, js = [], []
    for res in results:
        c = res.case
        rate = {w: n / median(ts) for w, ts in res.walls.items()}
        mbs = {w: res.input_bytes / median(ts) / MB for w, ts in res.walls.items()}
        if c.workers:
            cells = [f"{rate[1]:,.0f}", f"{rate[2]:,.0f}", f"{ratio(res):.2f}x", f"{ratio(res, True):.2f}x",
                     f"{mbs[1]:,.0f} / {mbs[2]:,.0f}"]
        else:
            cells = [f"{rate[None]:,.0f}", "-", "-", "-", f"{mbs[None]:,.0f}"]
        rows.append([c.importer, c.variant, f"{res.input_bytes / MB:,.1f}", *cells, writers_cell(res),
                     f"{median(res.other):.2f}"])
        js.append({"importer": c.importer, "variant": c.variant, "input_bytes": res.input_bytes,
                   "wall_seconds": {str(w): v for w, v in res.walls.items()},
                   "summary_seconds": {str(w): v for w, v in res.inside.items()},
                   "images_per_s": {str(w): v for w, v in rate.items()},
                   "input_MBps": {str(w): v for w, v in mbs.items()},
                   "ratio_2_over_1": ratio(res), "ratio_2_over_1_summary_seconds": ratio(res, True),
                   "writers": {str(w): sorted(map(str, v)) for w, v in res.writers.items()},
                   "other_cores": res.other})
    return rows, js


HEADER = ["importer", "input -> stored", "input MB", "workers 1: images/s", "workers 2: images/s", "2 / 1",
          "2 / 1 (summary s)", "MB/s of input (1 / 2)", "\"writers\" (1 / 2)", "other CPU (cores)"]


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--py-run":
        py_run(*sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000, help="images per set (default 2000)")
    p.add_argument("--sizes", default="256x256,128x96", help="WIDTHxHEIGHT of each set, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="runs per importer and worker count (medians)")
    p.add_argument("--only", help=f"comma-separated importers (default all: {', '.join(IMPORTERS)})")
    p.add_argument("--dir", type=Path, help="work directory (default: a temp dir under /tmp, removed); "
                                             "inputs built with the same parameters are reused")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="200 images of 64x48, 1 repeat: a smoke test")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    if a.quick:
        a.n, a.sizes, a.repeats = 200, "64x48", 1
    only = set(IMPORTERS) if not a.only else {x.strip() for x in a.only.split(",") if x.strip()}
    if only - set(IMPORTERS):
        raise SystemExit(f"--only: unknown importer(s) {sorted(only - set(IMPORTERS))}; known: {', '.join(IMPORTERS)}")
    sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    skipped = {imp: miss for imp in sorted(only, key=IMPORTERS.index) if (miss := missing_modules(imp))}
    chosen = [c for c in cases() if c.importer in only and c.importer not in skipped]
    if not chosen:
        raise SystemExit(f"nothing to run: {'; '.join(f'{k} needs {v}' for k, v in skipped.items())}")
    for imp, miss in skipped.items():
        log(f"{imp}: skipped, {', '.join(miss)} not installed (pip install -e '.[test]')")
    d, made = work_dir(a.dir, "kvdata-bench-imports-")
    machine = machine_info(("numpy", "lmdb", "PIL", "pyarrow", "datasets", "webdataset", "kvdata"))
    out: dict[str, Any] = {"config": {k: str(v) for k, v in vars(a).items()}, "machine": machine, "sections": {}}
    load_before = os.getloadavg()
    start = startup_seconds(5)
    md = [f"## kvdata import throughput, workers 1 and 2 ({machine_line(machine)})", ""]
    try:
        for (w, h) in sizes:
            sd = d / f"{w}x{h}"
            needed = {c.source for c in chosen}
            params = {"n": a.n, "w": w, "h": h, "seed": a.seed, "quality": QUALITY, "per_file": PER_FILE,
                      "sources": sorted(needed), "v": 1}
            log(f"{a.n} images {w}x{h}: writing the inputs")
            im = make_set(a.n, w, h, a.seed)
            info = built(sd / "inputs.done", params, sd / "in")
            if info is None:
                shutil.rmtree(sd / "in", ignore_errors=True)
                srcs = write_sources(sd / "in", im, needed)
                mark_built(sd / "inputs.done", params,
                           sources={k: {"path": str(s.path), "before": s.before, "after": s.after, "keys": s.keys,
                                        "bytes": s.bytes} for k, s in srcs.items()})
            else:
                srcs = {k: Source(Path(s["path"]), s["before"], s["after"], s["keys"], s["bytes"])
                        for k, s in info["sources"].items()}
            results = []
            for case in chosen:
                log(f"  {case.name}")
                results.append(run_case(case, srcs[case.source], im, sd, a.repeats, a.seed))
            rows, js = table_rows(results, a.n)
            jpeg_kb = sum(map(len, im.jpegs)) / len(im.jpegs) / 1e3
            title = (f"### {a.n:,} RGB images {w}x{h} (JPEG q{QUALITY}, {jpeg_kb:.1f} KB each; "
                     f"pixels {w * h * 3 / 1e3:.1f} KB), median of {a.repeats}")
            md += [title, "", md_table(HEADER, rows, left=2)]
            out["sections"][f"{w}x{h}"] = {"jpeg_bytes_mean": jpeg_kb * 1e3, "rows": js}
            del im
    finally:
        if made:
            shutil.rmtree(d, ignore_errors=True)
    load_after = os.getloadavg()
    out["startup_seconds"] = start
    out["skipped"] = skipped
    if skipped:
        md += ["Not run here (their input libraries are missing; `pip install -e '.[test]'`): "
               + "; ".join(f"{k} ({', '.join(v)})" for k, v in skipped.items()) + ".", ""]
    out["loadavg"] = {"before": load_before, "after": load_after}
    md += [f"CLI figures are the wall time of `kvdata import ...` as a user runs it, interpreter start-up "
           f"included (`kvdata import folder --help`: {start:.2f} s median); \"2 / 1 (summary s)\" is the ratio "
           "of the importers' own `seconds` from --json, without it. from_arrays / from_iterable: the call alone, "
           "arrays in memory, in a fresh process. Every run is checked: N records under the expected keys, "
           f"{CHECKED} sampled records equal to the source with their labels. \"other CPU\": the median over "
           "the runs of the cores other processes kept busy (the machine's busy time from /proc/stat less the "
           f"import's own); {os.cpu_count()} CPUs here. Load average {load_before[0]:.2f} before, "
           f"{load_after[0]:.2f} after.", ""]
    out["markdown"] = "\n".join(md)
    print(out["markdown"])
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
