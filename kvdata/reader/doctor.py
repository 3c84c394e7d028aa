"""`kvdata doctor`: what this box can feed a training job, measured, and whether a stated rate
would starve.

A job is fed by a chain: the home (a local disk, S3, HTTP) -> the tiers (RAM, SSD) -> the
reader's copy of each sample into its batch (memcpy). Each link is measured on this box:
memcpy of a large buffer, each configured tier directory's read bandwidth (O_DIRECT where the
filesystem allows it, so the page cache does not flatter a disk), the home's latency and
bandwidth (ranged reads of one shard), and the end-to-end samples/s of `kvdata.open` +
`get_batch` of random batches on one thread. `diagnose` turns those into samples/s capacities
for one dataset -- a link carries only the share of the bytes that pass through it (the home
only what the tiers or the page cache cannot keep) -- and names the smallest one, with the
setting that would lift it.

Numbers, not advice from a table: every capacity comes from a measurement made in this run.
This module lives in the reader layer because it reads through `kvdata.open`; it does not
import torch.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import Config, load_config
from ..errors import ConfigError, InvalidValueError
from ..format.manifest import ShardEntry
from ..tiers.homes import is_url, open_home
from .daemon_client import DaemonStager
from .open import open_dataset

__all__ = ["Sizes", "QUICK", "FULL", "parse_rate", "memcpy_bandwidth", "directory_read", "home_probe",
           "reader_rate", "diagnose", "run_doctor"]

MB = 1 << 20
_ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffers aligned to the logical block size


@dataclass(frozen=True)
class Sizes:
    """How much each measurement moves: FULL for the command (about 10 s), QUICK for tests."""

    memcpy_bytes: int
    memcpy_repeats: int
    tier_bytes: int
    home_bytes: int
    home_pings: int
    reader_seconds: float
    batch: int


FULL = Sizes(memcpy_bytes=256 * MB, memcpy_repeats=5, tier_bytes=64 * MB, home_bytes=64 * MB, home_pings=5,
             reader_seconds=3.0, batch=256)
QUICK = Sizes(memcpy_bytes=8 * MB, memcpy_repeats=3, tier_bytes=2 * MB, home_bytes=2 * MB, home_pings=3,
              reader_seconds=0.3, batch=16)


_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgG]?)\s*(?:/\s*s|/\s*sec|/\s*second)?\s*$")
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text: str) -> float:
    """Samples per second from '20000', '20000/s', '20k/s', '1.5M/s', '1e6/s'."""
    m = _RATE.match(text)
    if m is None:
        raise InvalidValueError(f"{text!r} is not a rate of samples per second (write e.g. 20000, 20000/s or 20k/s)")
    rate = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if not math.isfinite(rate) or rate <= 0:
        raise InvalidValueError(f"{text!r} is not a positive number of samples per second")
    return rate


# ---------------------------------------------------------------- the links, measured


def memcpy_bandwidth(nbytes: int, repeats: int) -> dict[str, Any]:
    """Bytes/s of np.copyto between two buffers of nbytes (median of `repeats` after a warm-up
    copy that faults the pages in): the ceiling of any reader that copies samples into batches."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"bytes_per_s": nbytes / t, "bytes": nbytes, "repeats": repeats}


def _aligned(n: int) -> int:
    return max(_ALIGN, n // _ALIGN * _ALIGN)


def _read_direct(path: Path, nbytes: int, chunk: int = 4 * MB) -> float | None:
    """Seconds to read nbytes of path with O_DIRECT, or None where the filesystem refuses it
    (tmpfs, some network filesystems)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
    try:
        t0 = time.perf_counter()
        off = 0
        while off < nbytes:
            try:
                got = os.preadv(fd, [memoryview(buf)[:_aligned(min(chunk, nbytes - off))]], off)
            except OSError:
                return None
            if got <= 0:
                break
            off += got
        return time.perf_counter() - t0
    finally:
        buf.close()
        os.close(fd)


def _read_buffered(path: Path, nbytes: int, chunk: int = 4 * MB) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        off = 0
        while off < nbytes:
            data = os.pread(fd, min(chunk, nbytes - off), off)
            if not data:
                break
            off += len(data)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def directory_read(directory: Path, nbytes: int) -> dict[str, Any]:
    """Read bandwidth of the device under `directory`: a temp file of nbytes is written,
    fsync'ed, read back (O_DIRECT where possible, else through the page cache, said so) and
    removed. A directory that is missing or not writable by this user is reported, not made."""
    nbytes = _aligned(nbytes)
    out: dict[str, Any] = {"path": str(directory), "bytes": nbytes}
    if not directory.is_dir():  # staging will create it: measure where it will be (same filesystem, usually)
        parent = next((p for p in directory.parents if p.is_dir()), None)
        if parent is None or directory.exists():
            return {**out, "ok": False, "problem": "not a directory"}
        out["measured_at"] = str(parent)
        directory = parent
    if not os.access(directory, os.W_OK | os.X_OK):
        return {**out, "ok": False, "problem": "not writable by this user (kvdatad's tier?)"}
    try:
        free = os.statvfs(directory)
        room = free.f_bavail * free.f_frsize
    except OSError:
        room = nbytes
    if room < 2 * nbytes:
        return {**out, "ok": False, "problem": f"only {room} bytes free"}
    path = directory / f".kvdata-doctor-{os.getpid()}.tmp"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            block = np.random.default_rng(0).integers(0, 256, size=4 * MB, dtype=np.uint8).tobytes()
            t0 = time.perf_counter()
            left = nbytes
            while left > 0:
                left -= os.write(fd, block[:min(left, len(block))])
            os.fsync(fd)
            write_s = time.perf_counter() - t0
        finally:
            os.close(fd)
        t = _read_direct(path, nbytes)
        direct = t is not None
        if t is None:
            t = _read_buffered(path, nbytes)
        return {**out, "ok": True, "read_bytes_per_s": nbytes / t, "write_bytes_per_s": nbytes / write_s,
                "direct": direct, "page_cache": not direct}
    except OSError as e:
        return {**out, "ok": False, "problem": e.strerror or str(e)}
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def home_probe(location: str, entry: ShardEntry, sizes: Sizes) -> dict[str, Any]:
    """The home's latency (median of small ranged reads of one shard) and bandwidth (one read of
    up to sizes.home_bytes of it). A remote home holds the shard's zstd cold copy: its wire
    bandwidth times the copy's expansion is what it delivers in sample bytes. A local shard
    file is read with O_DIRECT where possible."""
    home = open_home(location)
    try:
        name, size, expand = f"shards/{entry.name}", entry.bytes, 1.0
        local = home.local_path(name)
        if (local is None or not local.exists()) and entry.zst is not None:
            name, size = f"shards/{entry.zst.name}", entry.zst.bytes
            expand = entry.bytes / max(1, entry.zst.bytes)
            local = home.local_path(name)
        n = min(size, sizes.home_bytes)
        out: dict[str, Any] = {"location": location, "remote": local is None, "object": name, "bytes": n,
                               "expansion": expand}
        if local is not None:
            t = _read_direct(local, _aligned(n)) if n >= _ALIGN else None
            out["direct"] = t is not None
            if t is None:
                t = _read_buffered(local, n)
            pings = []
            for _ in range(sizes.home_pings):
                t0 = time.perf_counter()
                os.stat(local)
                pings.append(time.perf_counter() - t0)
        else:
            pings = []
            for i in range(sizes.home_pings):
                t0 = time.perf_counter()
                home.read_range(name, (i * 7919) % max(1, size - 4096), min(4096, size))
                pings.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            n = len(home.read_range(name, 0, n))
            t = time.perf_counter() - t0
            out.update(bytes=n, direct=False)
        bw = n / t if t > 0 else math.inf
        out.update(latency_s=statistics.median(pings), bytes_per_s=bw, sample_bytes_per_s=bw * expand)
        return out
    finally:
        home.close()


def reader_rate(location: str, seconds: float, batch: int, config: Config | None = None) -> dict[str, Any]:
    """Samples/s of `kvdata.open` + `get_batch` of random batches on one thread, for `seconds`
    after one warm-up batch (no decoding beyond stacking the stored arrays)."""
    store = open_dataset(location, config=config)
    try:
        n = len(store)
        if n == 0:
            return {"samples_per_s": 0.0, "samples": 0, "seconds": 0.0, "batch": batch, "threads": 1}
        rng = np.random.default_rng(0)
        b = min(batch, n)
        store.get_batch(rng.integers(0, n, size=b).tolist())
        done = 0
        t0 = time.perf_counter()
        while True:
            store.get_batch(rng.integers(0, n, size=b).tolist())
            done += b
            t = time.perf_counter() - t0
            if t >= seconds:
                break
        return {"samples_per_s": done / t, "samples": done, "seconds": t, "batch": b, "threads": 1}
    finally:
        store.close()


# ---------------------------------------------------------------- the verdict


@dataclass
class Part:
    """One link of the chain with its capacity in samples/s for this dataset."""

    name: str
    samples_per_s: float
    why: str
    fix: str


@dataclass
class Verdict:
    need: float
    ok: bool
    limit: str
    parts: list[Part] = field(default_factory=list)
    text: str = ""


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _seconds(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t >= 1e-4 else f"{t * 1e6:.0f} us"


def _rate(n: float) -> str:
    return f"{n:,.0f}" if n >= 10 else f"{n:.2g}"


def diagnose(report: dict[str, Any], need: float, cpus: int | None = None) -> Verdict:
    """Which link of the measured chain caps the dataset's samples/s, and whether `need` fits.

    Bytes per sample = the dataset's shard bytes / its samples. memcpy carries every byte;
    the tiers carry what they hold (their budgets against the dataset's bytes); the home carries
    the rest every epoch (for a local dataset read in place: what the page cache cannot keep);
    the measured one-thread reader is the end-to-end figure. A link below the need starves it
    whatever the thread count (the smallest is named); else a reader below it needs threads.
    A dataset kvdata could not open with this config starves at 0, the error its fix."""
    ds = report["dataset"]
    if ds.get("error"):
        return Verdict(need, False, "configuration", [], f"STARVES: kvdata cannot read {ds['location']} with this "
                       f"config: {ds['error']}")
    per = max(1.0, ds["bytes"] / max(1, ds["samples"]))
    parts: list[Part] = []
    mem = report["memcpy"]["bytes_per_s"]
    parts.append(Part("memcpy", mem / per, f"{_size(mem)}/s of memory bandwidth at {_size(per)} per sample",
                      "store fewer bytes per sample (a smaller resize, uint8 not float) or use more boxes"))
    tiers = [t for t in report["tiers"] if t.get("ok")]
    budget = sum(t["budget"] for t in report["tiers"])
    home = report.get("home") or {}
    if ds["in_place"]:  # read from its own directory: the page cache is the only cache
        cache = _mem_available() or 0
        held = min(1.0, cache / ds["bytes"]) if ds["bytes"] else 1.0
        keep_fix = (f"more free RAM for the page cache ({_size(ds['bytes'])} would hold it), or tiers in "
                    "$KVDATA_CONFIG on a faster device")
    else:
        held = min(1.0, budget / ds["bytes"]) if ds["bytes"] else 1.0
        keep_fix = (f"a tier budget of {_size(ds['bytes'])} in all (now {_size(budget)}) holds the whole dataset, "
                    "or read it shard-aware with kvdata.ShardShuffleSampler (whole shards, and only "
                    "1 - budget of the dataset fetched per epoch)")
        if tiers:
            first = tiers[0]
            bw = first["read_bytes_per_s"]
            how = "O_DIRECT" if first.get("direct") else "page-cache speed"
            parts.append(Part(f"tier {first['name']}", bw / per, f"{_size(bw)}/s read ({how})",
                              "a faster device for the first tier (RAM: /dev/shm), or fewer bytes per sample"))
    if home.get("sample_bytes_per_s"):
        miss = 1.0 - held
        bw = home["sample_bytes_per_s"]
        where = "the home link" if home.get("remote") else "the home disk"
        if miss > 0:
            parts.append(Part(where, bw / (per * miss),
                              f"{_size(bw)}/s of sample bytes for the {miss:.0%} of them nothing on this box keeps",
                              f"{keep_fix}; or more bandwidth to the home"))
    head = f"{_rate(need)} samples/s ({_size(need * per)}/s at {_size(per)} per sample)"
    link = min(parts, key=lambda p: p.samples_per_s)  # the box's links: no thread count lifts these
    r = report.get("reader") or {}
    limit = link
    if r.get("samples_per_s"):
        one = r["samples_per_s"]
        threads = math.ceil(need / one)
        cores = cpus if cpus is not None else (os.cpu_count() or 1)
        fix = (f"read with kvdata.Loader(threads={threads}) or {threads} DataLoader workers" if threads <= cores else
               f"about {threads} threads' worth of reading, and this box has {cores} cores: fewer bytes or less "
               "work per sample, or more boxes")
        reader = Part("the reader (one thread)", one, f"measured with get_batch of {r['batch']} random samples", fix)
        parts.append(reader)
        if link.samples_per_s >= need and one < need:
            limit = reader  # the links would carry it; one thread does not
    ok = limit.samples_per_s >= need
    if ok:
        tight = min(parts, key=lambda p: p.samples_per_s)
        text = (f"OK: {head} fits. The tightest part is {tight.name} at {_rate(tight.samples_per_s)} samples/s "
                f"({tight.samples_per_s / need:.1f}x the need): {tight.why}.")
    else:
        text = (f"STARVES: {head} is more than {limit.name} gives: {_rate(limit.samples_per_s)} samples/s "
                f"({limit.why}). Fix: {limit.fix}.")
    return Verdict(need, ok, limit.name, parts, text)


# ---------------------------------------------------------------- the whole run


def run_doctor(dataset: str | None, need: float | None, sizes: Sizes = FULL, config: Config | None = None,
               say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every measurement (and with `need` and a dataset, the verdict) as one JSON-able dict.
    `say` is told what is being measured, for a progress line on a terminal."""
    cfg = config if config is not None else load_config()
    tell = say or (lambda _s: None)
    tell("memcpy")
    report: dict[str, Any] = {"memcpy": memcpy_bandwidth(sizes.memcpy_bytes, sizes.memcpy_repeats), "tiers": []}
    for t in cfg.tiers:
        tell(f"tier {t.name}")
        report["tiers"].append({"name": t.name, "budget": t.budget, **directory_read(t.path, sizes.tier_bytes)})
    if dataset is not None:
        tell(f"dataset {dataset}")
        try:
            with _opened(dataset, cfg) as store:
                shards = list(store.manifest.shards)
                samples = len(store)
                via = ("kvdatad" if isinstance(store.source, DaemonStager) else
                       "in place" if store.source is None else "tiers")
        except ConfigError as e:  # e.g. a tier smaller than a shard: that is the diagnosis
            report["dataset"] = {"location": dataset, "error": str(e)}
            if need is not None:
                report["verdict"] = asdict(diagnose(report, need))
            return report
        total = sum(e.bytes for e in shards)
        report["dataset"] = {"location": dataset, "samples": samples, "shards": len(shards), "bytes": total,
                             "bytes_per_sample": total / samples if samples else 0.0,
                             "remote": is_url(dataset), "in_place": via == "in place", "via": via}
        if shards:
            big = max(shards, key=lambda e: e.bytes)
            tell("home")
            report["home"] = home_probe(dataset, big, sizes)
        tell("reader")
        report["reader"] = reader_rate(dataset, sizes.reader_seconds, sizes.batch, cfg)
    if need is not None:
        if dataset is None:
            raise InvalidValueError("--need needs a DATASET: its bytes per sample turn the rate into bandwidth")
        report["verdict"] = asdict(diagnose(report, need))
    return report


@contextlib.contextmanager
def _opened(dataset: str, cfg: Config) -> Iterator[Any]:
    store = open_dataset(dataset, config=cfg)
    try:
        yield store
    finally:
        store.close()


def text_report(report: dict[str, Any]) -> list[str]:
    """The report in plain words, one line per measurement, then the verdict."""
    lines = []
    m = report["memcpy"]
    lines.append(f"memcpy        {_size(m['bytes_per_s'])}/s ({_size(m['bytes'])} buffer, median of {m['repeats']})")
    for t in report["tiers"]:
        if t.get("ok"):
            how = "O_DIRECT" if t["direct"] else "page-cache speed: O_DIRECT not supported here"
            at = f" (not there yet: measured at {t['measured_at']})" if t.get("measured_at") else ""
            lines.append(f"tier {t['name']:<8} {_size(t['read_bytes_per_s'])}/s read ({how}), budget {_size(t['budget'])}"
                         f", {t['path']}{at}")
        else:
            lines.append(f"tier {t['name']:<8} not measured: {t['path']} is {t['problem']}")
    ds = report.get("dataset")
    if ds is not None and ds.get("error"):
        lines.append(f"dataset       {ds['location']}: cannot be read with this config: {ds['error']}")
    elif ds is not None:
        where = ("remote" if ds["remote"] else "local") + {"in place": ", read in place", "tiers": ", staged into tiers",
                                                          "kvdatad": ", through kvdatad"}[ds["via"]]
        lines.append(f"dataset       {ds['location']}: {ds['samples']:,} samples, {ds['shards']} shards, "
                     f"{_size(ds['bytes'])}, {_size(ds['bytes_per_sample'])} per sample ({where})")
        h = report.get("home")
        if h:
            how = "" if h["remote"] else (" (O_DIRECT)" if h.get("direct") else " (page cache)")
            zst = f", {_size(h['sample_bytes_per_s'])}/s of samples from zstd" if h["expansion"] != 1.0 else ""
            lines.append(f"home          {_size(h['bytes_per_s'])}/s{how}{zst}, latency {_seconds(h['latency_s'])}")
        r = report["reader"]
        lines.append(f"reader        {_rate(r['samples_per_s'])} samples/s (kvdata.open + get_batch of {r['batch']} "
                     f"random samples, 1 thread, {r['seconds']:.1f} s)")
    v = report.get("verdict")
    if v is not None:
        lines.append(v["text"])
    return lines
