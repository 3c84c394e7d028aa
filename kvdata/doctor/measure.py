"""The measurements of `kvdata doctor` (kvdata.doctor): each link of the chain that feeds a
training job, measured on this box -- memcpy of a large buffer, a tier directory's read bandwidth
(O_DIRECT where the filesystem allows it, so the page cache does not flatter a disk), the home's
latency and bandwidth (ranged reads of one shard), and the samples/s of `kvdata.open` +
`get_batch` of random batches on one thread.

Its own module because these only measure; diagnose.py turns the numbers into a verdict and words.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import Config
from ..format.manifest import ShardEntry
from ..homes import open_home
from ..reader.open import open_dataset

__all__ = ["Sizes", "QUICK", "FULL", "memcpy_bandwidth", "directory_read", "home_probe", "reader_rate"]

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
