"""Helpers shared by the bench scripts and bench/run_all.py.

- timing and statistics: `timed`, `median`, `quantile_sorted`, `rotated`, `repeat_rotated`
- the machine: `machine_info` (cpu count/model, memory, kernel, python/numpy/lmdb/torch/...
  versions) and `machine_line` (the same in one line, for report headers)
- seeded data: `make_images` (227x227x3 uint8 images: "noise"/"random", "photo", "smooth"),
  `image_chunks`, `write_image_dataset` (a sealed kvdata dataset of image records),
  `built`/`mark_built` (reuse a work directory built with the same parameters), `work_dir`,
  `dir_bytes`
- output: `md_table` (a markdown table from rows), `write_json`, `log`
- results pages' blocks (bench/results/*.md): `block_markers`, `replace_block`, `read_blocks`, `demote_headings`,
  `md_tables` (parse markdown tables back), `num` (a number out of a table cell)

Only the standard library and numpy at import time: run_all.py and the unit tests import this
module without kvdata's optional dependencies.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

SHAPE = (227, 227, 3)        # the classic Caffe crop
IMG = int(np.prod(SHAPE))    # 154,587 bytes
BATCH = 256
MB = 1e6


# ====================================================================== page cache

def drop_caches() -> bool:
    """Drop the page cache (root only); False where that is not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def can_drop_caches() -> bool:
    """Whether drop_caches() would be permitted, without dropping anything."""
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


# ====================================================================== timing and statistics

def timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[float, T]:
    """(seconds, result) of one call, timed with perf_counter."""
    t0 = time.perf_counter()
    res = fn(*args, **kwargs)
    return time.perf_counter() - t0, res


def median(xs: Iterable[float]) -> float:
    """Median of the numbers that are not NaN; NaN when there are none."""
    vals = [x for x in xs if x == x]
    return statistics.median(vals) if vals else float("nan")


def quantile_sorted(sorted_xs: Sequence[float], q: float) -> float:
    """The q-quantile of an ascending list as the benches report it: the element at
    int(len * q), clamped to the last one (p50 of [a, b] is b). NaN for an empty list."""
    if not sorted_xs:
        return float("nan")
    return sorted_xs[min(len(sorted_xs) - 1, int(len(sorted_xs) * q))]


def rotated(items: Sequence[T], r: int) -> list[T]:
    """items rotated left by r: repeat r runs the methods in a different order."""
    items = list(items)
    if not items:
        return items
    k = r % len(items)
    return items[k:] + items[:k]


def repeat_rotated(names: Sequence[str], repeats: int, run: Callable[[str, int], float]) -> dict[str, list[float]]:
    """Call run(name, repeat) for every name in every repeat, in an order rotated per repeat;
    the values per name, in repeat order."""
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in rotated(names, r):
            out[name].append(run(name, r))
    return out


# ====================================================================== the machine

def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(module: str) -> str | None:
    """A module's version if it imports (None if it does not); never raises."""
    if module in sys.modules:
        mod = sys.modules[module]
    else:
        try:
            mod = __import__(module)
        except Exception:  # noqa: BLE001 -- missing or broken: reported as None
            return None
    return str(getattr(mod, "__version__", "?"))


def machine_info(modules: Sequence[str] = ("numpy", "lmdb", "zstandard", "torch", "kvdata")) -> dict[str, Any]:
    """Where a bench ran: host, CPUs (count, usable, model), memory, kernel, Python and the
    versions of `modules` (None where a module is not installed)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "mem_total_bytes": _mem_total(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in modules},
    }


def machine_line(info: dict[str, Any] | None = None) -> str:
    """One line for report headers, e.g. 'vm, 2 CPUs (Intel Xeon ...), 7.8 GB RAM, kernel 6.1,
    Python 3.11.7, numpy 2.4.6, lmdb 1.4.1, torch 2.13.0'."""
    info = info or machine_info()
    parts = [str(info.get("host") or "?"), f"{info.get('cpus')} CPUs"
             + (f" ({info['cpu_model']})" if info.get("cpu_model") else "")]
    if info.get("mem_total_bytes"):
        parts.append(f"{info['mem_total_bytes'] / 2**30:.1f} GiB RAM")
    parts += [f"kernel {info.get('kernel')}", f"Python {info.get('python')}"]
    parts += [f"{m} {v}" for m, v in (info.get("versions") or {}).items() if v is not None]
    return ", ".join(parts)


# ====================================================================== seeded data

def _interp(n_out: int, n_in: int) -> np.ndarray:
    """Bilinear interpolation matrix (n_out x n_in)."""
    x = np.linspace(0, n_in - 1, n_out)
    i0 = np.floor(x).astype(int).clip(0, n_in - 2)
    f = (x - i0).astype(np.float32)
    a = np.zeros((n_out, n_in), np.float32)
    a[np.arange(n_out), i0] = 1 - f
    a[np.arange(n_out), i0 + 1] = f
    return a


def make_images(rng: np.random.Generator, n: int, content: str = "noise",
                shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """n seeded uint8 samples of `shape` (default 227x227x3). Content:

    - "noise" / "random": uniform random bytes (incompressible; JPEG ~50 KB per image);
    - "photo": a per-image base colour plus 48 noise levels (zstd level 3 gets ~1.15x and
      decompresses well under 1 GB/s, like raw photo pixels);
    - "smooth": a random 32x32 grid upscaled bilinearly plus +-10 noise (JPEG q90 ~20 KB).

    The same rng state gives the same bytes as the scripts' former private copies."""
    if content in ("noise", "random"):
        return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
    if content == "photo":
        base = rng.integers(0, 208, size=(n, 1, 1, shape[-1]), dtype=np.uint8)
        return base + rng.integers(0, 48, size=(n, *shape), dtype=np.uint8)
    if content == "smooth":
        g, (h, w, c) = 32, shape
        ah, aw = _interp(h, g), _interp(w, g)
        low = rng.integers(0, 256, size=(n, g, g, c)).astype(np.float32)
        tmp = np.matmul(ah, low.reshape(n, g, g * c)).reshape(n, h, g, c)
        img = np.matmul(tmp.transpose(0, 1, 3, 2), aw.T).transpose(0, 1, 3, 2)
        img += rng.integers(-10, 11, size=img.shape).astype(np.float32)
        return np.clip(img, 0, 255).astype(np.uint8)
    raise ValueError(f"unknown image content {content!r} (noise, random, photo, smooth)")


def image_chunks(rng: np.random.Generator, n: int, chunk: int, content: str = "noise",
                 shape: tuple[int, ...] = SHAPE) -> Iterator[tuple[int, np.ndarray]]:
    """(start, images[start:start + chunk]) for n images generated `chunk` at a time (the
    content depends on the chunk size: keep it fixed for a given dataset)."""
    for start in range(0, n, chunk):
        yield start, make_images(rng, min(chunk, n - start), content, shape)


def write_image_dataset(path: Path, chunks: Iterable[tuple[int, np.ndarray]], *, shard_size: str,
                        compress: bool, record: Callable[[int, np.ndarray], Any] = lambda i, img: {"image": img},
                        label: Callable[[int], int] | None = lambda i: i % 1000, seal: bool = True) -> None:
    """A kvdata dataset of image records, keys "%08d", written chunk by chunk and sealed (a
    finished dataset: every record read by memory-map offset)."""
    import kvdata

    with kvdata.open(path, "w", shard_size=shard_size, compress=compress) as st:
        for start, arr in chunks:
            idx = range(start, start + len(arr))
            if label is None:
                st.put_many((f"{i:08d}", record(i, img)) for i, img in zip(idx, arr))
            else:
                st.put_many((f"{i:08d}", record(i, img), label(i)) for i, img in zip(idx, arr))
        if seal:
            st.seal()


def built(done: Path, params: dict[str, Any], *outputs: Path) -> dict[str, Any] | None:
    """The info mark_built() saved in `done` if it was built with the same params and every
    path in `outputs` still exists; None otherwise (build again)."""
    try:
        info = json.loads(done.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("params") != params or not all(p.exists() for p in outputs):
        return None
    return info


def mark_built(done: Path, params: dict[str, Any], **info: Any) -> dict[str, Any]:
    """Record that what `done` stands for was built with `params` (plus `info`); returns the record."""
    rec = {"params": params, **info}
    done.write_text(json.dumps(rec))
    return rec


def work_dir(given: Path | None, prefix: str) -> tuple[Path, bool]:
    """(directory, made): `given` (created if needed), or a new temp dir under /tmp."""
    if given is None:
        return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp")), True
    given.mkdir(parents=True, exist_ok=True)
    return given, False


def dir_bytes(p: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# ====================================================================== output

def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], left: int = 1) -> str:
    """A markdown table: the first `left` columns left-aligned, the others right-aligned
    (numbers); cells with str(); ends with a newline."""
    align = ["---"] * min(left, len(header)) + ["---:"] * max(0, len(header) - left)
    out = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def write_json(path: Path, obj: Any) -> None:
    """Write obj as indented JSON (parents created; non-JSON values as str; NaN as NaN)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ====================================================================== results pages' blocks

def block_markers(name: str) -> tuple[str, str]:
    """The comments around a generated block on a bench's results page (bench/results/<script>.md)."""
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def _block_re(begin: str, end: str) -> re.Pattern[str]:
    return re.compile(re.escape(begin) + r"(.*?)" + re.escape(end), re.S)


def replace_block(doc: str, begin: str, end: str, body: str) -> str:
    """doc with the text between the `begin` and `end` markers replaced by body (markers
    kept, body on its own lines). KeyError if the markers are missing, ValueError if there
    is more than one such block."""
    pat = _block_re(begin, end)
    found = pat.findall(doc)
    if not found:
        raise KeyError(f"no {begin} ... {end} block")
    if len(found) > 1:
        raise ValueError(f"{len(found)} {begin} ... {end} blocks; expected one")
    text = begin + "\n" + body.strip("\n") + "\n" + end
    return pat.sub(lambda _m: text, doc, count=1)


def read_blocks(doc: str) -> dict[str, str]:
    """Every <!-- bench:NAME:begin --> ... <!-- bench:NAME:end --> block: NAME -> its text."""
    out = {}
    for m in re.finditer(r"<!-- bench:([\w.-]+):begin -->(.*?)<!-- bench:\1:end -->", doc, re.S):
        out[m.group(1)] = m.group(2).strip("\n")
    return out


def demote_headings(md: str, level: int = 4, drop_first_h2: bool = True) -> str:
    """A script's report as a results page's block: its "## title" line dropped (the block has its own
    provenance line) and every other heading set to `level` (outside ``` fences)."""
    out, fence, dropped = [], False, not drop_first_h2
    for line in md.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            if not dropped and line.startswith("## "):
                dropped = True
                continue
            line = "#" * level + " " + line.lstrip("#").lstrip()
        out.append(line)
    return "\n".join(out).strip("\n")


class Table:
    """A markdown table parsed back: the last heading above it, its header and its rows."""

    def __init__(self, heading: str, header: list[str], rows: list[list[str]]) -> None:
        self.heading, self.header, self.rows = heading, header, rows

    def col(self, name: str) -> int:
        """Index of the first column whose header contains `name` (case-insensitive)."""
        for i, h in enumerate(self.header):
            if name.lower() in h.lower():
                return i
        raise KeyError(f"no column {name!r} in {self.header}")

    def __repr__(self) -> str:
        return f"Table({self.heading!r}, {self.header!r}, {len(self.rows)} rows)"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def md_tables(md: str) -> list[Table]:
    """Every markdown table in md (outside ``` fences), in order."""
    lines = md.splitlines()
    out, heading, fence, i = [], "", False, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip()
        elif (not fence and line.lstrip().startswith("|") and i + 1 < len(lines)
              and re.fullmatch(r"\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*", lines[i + 1])):
            header = _cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append(Table(heading, header, rows))
            continue
        i += 1
    return out


_NUM = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def num(cell: str) -> float:
    """The first number in a table cell ("1,234" -> 1234, "1.08x" -> 1.08, "99.9%" -> 99.9,
    "+0.105" -> 0.105, "138 / 138" -> 138, "**2.0x**" -> 2.0); NaN if there is none."""
    m = _NUM.search(cell.replace("\u2212", "-"))
    if not m:
        return float("nan")
    try:
        return float(m.group(0).replace(",", ""))
    except ValueError:
        return float("nan")


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
