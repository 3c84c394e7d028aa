"""What the record importers (wds, tfrecord) share: decoding image bytes, the worker pool,
and the one writing loop with `--skip-bad`.

A source is first scanned in the parent (framing, names, sizes: everything that can be
checked without reading payloads), which yields a list of small picklable tasks. Workers
turn a task into a record (`Loaded`) or a report of why it is bad (`Bad`) -- they never
raise for bad input, so the parent decides: fail the whole import (nothing committed) or,
with skip_bad, leave the record out and list it in the summary. The parent is the one
writer and commits once at the end, so an import is all-or-nothing.

What workers buy: decoding (Pillow) runs in them, but every record's bytes still pass
through the parent (unpickle, encode, LMDB put, the seal's sha256). Measured on 2,000
128x128 JPEGs, --decode rgb: workers spend ~420-530 us of CPU per record, the parent
~260-275 us with a pool (~400-560 us when it decodes itself), so more workers pay only
while the parent has a core of its own. Decoded pixels come back through a shared mapping
(shared_ring.py), not pickled through the pool's pipe: tasks go out in batches, each task
of a batch with its own slice of one of two regions, and a region is reused only once the
writer has put the batch that used it. Without decoding no pool is started at all
(decode_workers).
"""

from __future__ import annotations

import contextlib
import io
import mmap
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from .. import format as fmt
from .._util.progress import progress as make_progress
from .._util.sizes import parse_size
from ..errors import ConfigError, InvalidKeyError, InvalidValueError
from . import shared_ring
from .common import LABEL_FIELD, rename, summary
from .target import open_target, start_pool

DECODE_MODES = ("none", "rgb", "gray")
# The formats Pillow may open: hostile bytes never reach its rarer decoders.
PIL_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP")
# Decoded arrays of one batch that workers hand over in shared memory (two such regions).
REGION_BYTES = 64 << 20
# What an encoded image starts with: only bytes that look like an image are given to Pillow.
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")
# How many bad records a summary lists (all are counted).
MAX_BAD_LISTED = 1000


def max_workers() -> int:
    """The most worker processes an import starts: more than a few per core only costs memory,
    and an unchecked count (`--workers 1000000000`) would fork until the machine runs out."""
    return max(64, 4 * (os.cpu_count() or 1))


class Loaded(NamedTuple):
    """A record ready to put."""

    key: str
    value: dict[str, Any]
    label: int | None
    where: str


class Bad(NamedTuple):
    """A record that cannot be imported: its key (or member name), where it is, and why."""

    key: str
    where: str
    reason: str


def looks_like_image(data: bytes) -> bool:
    """Whether `data` starts like a JPEG/PNG/GIF/BMP/TIFF/WebP file."""
    return data.startswith(_IMAGE_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


def decode_image(data: bytes, decode: str) -> np.ndarray:
    """HWC uint8 pixels (3 channels for "rgb", 1 for "gray") of encoded image bytes.
    Raises InvalidValueError with Pillow's reason; the caller names the record."""
    from PIL import Image

    if not looks_like_image(data):
        raise InvalidValueError("the bytes are not a JPEG/PNG/GIF/BMP/TIFF/WebP image")
    try:
        with Image.open(io.BytesIO(data), formats=PIL_FORMATS) as opened:
            pixels = np.asarray(opened.convert("RGB" if decode == "rgb" else "L"), dtype=np.uint8)
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, DecompressionBombError ...
        reason = (str(e).splitlines() or [""])[0][:200]
        raise InvalidValueError(f"Pillow cannot decode the image ({type(e).__name__}: {reason})") from None
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return np.ascontiguousarray(pixels)


def check_common(decode: str, workers: Any, shard_size: int | str | None, install_hint: str) -> None:
    """Reject bad settings before any file is read."""
    if decode not in DECODE_MODES:
        raise ConfigError(f"decode: must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 0:
        raise ConfigError(f"workers: expected a count >= 0, got {workers!r}")
    if workers > max_workers():
        raise ConfigError(f"workers: {workers} is more than this machine can use; give at most {max_workers()}")
    if shard_size is not None:
        parse_size(shard_size, "shard_size")
    if decode != "none":
        try:
            import PIL.Image  # noqa: F401
        except ImportError:
            raise ConfigError(f"decode={decode!r} needs Pillow; install it with `{install_hint}`") from None


def decode_workers(workers: int, decode: str) -> int:
    """The worker processes worth starting for `workers` requested: none when nothing is decoded.

    Without decoding, a worker only reads a record's bytes (and parses its framing), and handing
    them to the one writer costs the parent more than reading them itself: every result is
    unpickled by the pool's result thread, which must win the GIL back from the busy writer
    once per pipe read (up to the 5 ms switch interval each time). Measured with
    bench/imports.py, 2,000 256x256 JPEGs kept as bytes, `--workers 2` ran at 0.60x (wds) and
    0.67x (tfrecord) the in-process rate, so those records are read in-process."""
    return int(workers) if decode != "none" else 0


class Workers(NamedTuple):
    """An import's worker processes and the shared mapping they hand decoded arrays over in
    (None where this platform cannot fork: arrays then travel pickled)."""

    pool: Any
    ring: mmap.mmap | None


def make_pool(workers: int) -> Workers | None:
    """A fork pool for workers >= 2 (None: load in-process), its processes given the shared
    mapping; they ignore Ctrl-C (target.start_pool). Made before the store opens, so children
    inherit no LMDB handle or writer lock."""
    if workers <= 1:
        return None
    if "fork" in multiprocessing.get_all_start_methods():
        ring: mmap.mmap | None = shared_ring.make_ring(2, REGION_BYTES)
        ctx: Any = multiprocessing.get_context("fork")
    else:
        ring, ctx = None, multiprocessing.get_context()
    try:
        pool = start_pool(ctx, workers, shared_ring.init_worker, (ring,))
    except BaseException:
        shared_ring.close_pool(None, ring)
        raise
    return Workers(pool, ring)


@contextlib.contextmanager
def worker_pool(workers: int, decode: str) -> Iterator[Workers | None]:
    """make_pool's workers for the whole import (scan and load), terminated at the end; None
    (everything in-process) for workers <= 1 or decode="none" (decode_workers)."""
    pool = make_pool(decode_workers(workers, decode))
    try:
        yield pool
    finally:
        if pool is not None:
            shared_ring.close_pool(pool.pool, pool.ring)


def map_ordered(pool: Workers | None, fn: Callable[[Any], Any], items: list[Any]) -> Iterator[Any]:
    """fn over items, in order: in the pool's processes (one item each) or in-process."""
    return map(fn, items) if pool is None else pool.pool.imap(fn, items, chunksize=1)


def _load_chunk(task: tuple[Callable[[Any], Iterable[Loaded | Bad]], int, int, list[Any]]) -> list[Loaded | Bad]:
    """In a worker: load some tasks, the arrays of their records placed into this chunk's
    slice [pos, pos + size) of the shared mapping while they fit."""
    load, pos, size, items = task
    place = shared_ring.Slice(pos, size).place
    out: list[Loaded | Bad] = []
    for item in items:
        for r in load(item):
            if isinstance(r, Loaded):
                r = r._replace(value={k: place(v) for k, v in r.value.items()})
            out.append(r)
    return out


# Tasks in an import's first batch; later batches take as many tasks as the arrays of the last
# batch say fill about 3/4 of a region (at least one per worker chunk, at most MAX_BATCH).
FIRST_BATCH = 4
MAX_BATCH = 4096


def _loaded(tasks: list[Any], load: Callable[[Any], Iterable[Loaded | Bad]], pool: Workers | None,
            workers: int) -> Iterator[Loaded | Bad]:
    """Results in task order (the dataset does not depend on the worker count). With a pool:
    batches of tasks, two in flight, each into its own region of the shared mapping, split
    among the batch's chunks (2 per worker); a region is handed out again once every record of
    the batch that used it was yielded (the writer has put it: the views it got are not read
    again)."""
    if pool is None:
        for task in tasks:
            yield from load(task)
        return
    chunks = max(1, workers) * 2
    pending: deque[tuple[Any, int]] = deque()
    state = {"next": 0, "turn": 0, "batch": FIRST_BATCH}

    def submit() -> None:
        start = state["next"]
        items = tasks[start:start + state["batch"]]
        if not items:
            return
        state["next"] = start + len(items)
        base = (state["turn"] % 2) * REGION_BYTES
        state["turn"] += 1
        work = [(load, pos, size, part) for pos, size, part in shared_ring.split(items, chunks, base, REGION_BYTES)]
        pending.append((pool.pool.map_async(_load_chunk, work, chunksize=1), len(items)))

    submit()
    submit()
    ring = pool.ring
    while pending:
        handle, count = pending.popleft()
        nbytes = 0  # every array's bytes, in the mapping or pickled: what the next batches size by
        for chunk in handle.get():
            for r in chunk:
                if isinstance(r, Loaded):
                    value = {}
                    for k, v in r.value.items():
                        v = shared_ring.view(ring, v)
                        if isinstance(v, np.ndarray):
                            nbytes += v.nbytes
                        value[k] = v
                    r = r._replace(value=value)
                yield r
        if nbytes:
            state["batch"] = int(min(MAX_BATCH, max(chunks, 0.75 * REGION_BYTES * count / nbytes)))
        submit()


def write_records(tasks: list[Any], load: Callable[[Any], list[Loaded | Bad]], dataset: str | os.PathLike[str], *,
                  total: int, pool: Workers | None, workers: int, skip_bad: bool, scan_bad: list[Bad],
                  shard_size: int | str | None, compress: bool, progress: bool | None, started: float,
                  ignored: int = 0, existing: str = "refuse",
                  key_of: Callable[[Any], str] | None = None,
                  fields: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Put every record the tasks load (in `pool`, from worker_pool, made before the dataset
    opens), in order, and commit once; return the summary.

    A Bad result (or a key seen twice) fails the import with its reason unless skip_bad,
    in which case it is counted in "skipped" and listed in "bad" (up to MAX_BAD_LISTED).
    `scan_bad` are the records the scan already refused (only passed with skip_bad);
    `ignored` counts members that are not records at all (no extension, directories).
    `existing`: see target.py; `key_of`: a task's key where the scan knows it, so an append
    leaves out the keys the dataset has before they are read. `fields`: {source name: field
    name} applied to every record (common.rename); a record's label is its int field "label"
    after that. The dataset's classes are numbered from the labels (Target.number_classes)."""
    bad = list(scan_bad)
    seen: dict[str, str] = {}
    labels: set[int] = set()
    n = 0
    bar = None
    try:
        bar = make_progress(total=total, label="import", enabled=progress)
        with open_target(dataset, existing, shard_size=shard_size, compress=compress) as target:
            if key_of is not None:
                wanted = [t for t in tasks if target.wants(key_of(t))]
                bar.update(len(tasks) - len(wanted))
                tasks = wanted
            for result in _loaded(tasks, load, pool, int(workers)):
                bar.update(1)
                if isinstance(result, Loaded):
                    result = _renamed(result, fields or {})
                if isinstance(result, Loaded) and result.key in seen:
                    result = Bad(result.key, seen[result.key],
                                 f"key {result.key!r} appears twice (first in {seen[result.key]}); "
                                 "keys must be unique")
                if isinstance(result, Bad):
                    if not skip_bad:
                        raise InvalidValueError(f"{result.where}: {result.reason}; nothing was imported "
                                                "(pass --skip-bad to leave such records out)")
                    bad.append(result)
                    continue
                seen[result.key] = result.where
                if key_of is None and not target.wants(result.key):
                    continue
                target.put(result.key, result.value, label=result.label)
                if result.label is not None:
                    labels.add(result.label)
                n += 1
            if n == 0 and not target.kept:
                raise InvalidValueError(f"no record could be imported ({len(bad)} bad); nothing was written")
            classes = target.number_classes(labels)
            target.commit()
    finally:
        if bar is not None:
            bar.close()
    out = summary(dataset, n, len(bad) + ignored, classes, started, counts=target.counts())
    out["bad"] = [{"key": b.key, "where": b.where, "error": b.reason} for b in bad[:MAX_BAD_LISTED]]
    out["records_per_s"] = round(n / max(time.perf_counter() - started, 1e-9), 1)
    return out


def _renamed(r: Loaded, names: Mapping[str, str]) -> Loaded | Bad:
    """The record with its fields renamed, its label the int field "label"; or why it cannot be."""
    try:
        value = rename(r.value, names)
    except ValueError as e:
        return Bad(r.key, r.where, str(e))
    label = value.get(LABEL_FIELD)
    ok = isinstance(label, (int, np.integer)) and not isinstance(label, (bool, np.bool_))
    return r._replace(value=value, label=int(label) if ok else None)  # type: ignore[arg-type]


def open_same(path: str, ident: tuple[int, int]) -> int:
    """A read-only fd of `path` if it is still the file the scan read ((st_dev, st_ino)
    `ident`), so offsets found by the scan are never applied to a file put there since."""
    fd = os.open(path, os.O_RDONLY)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != ident:
        os.close(fd)
        raise InvalidValueError("the file was replaced while importing; import it again")
    return fd


def key_problem(key: str) -> str | None:
    """None if `key` is a valid kvdata key, else why not."""
    try:
        fmt.check_key(key)
    except InvalidKeyError as e:
        return str(e)
    return None
