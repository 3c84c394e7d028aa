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

Numbers, not advice from a table: every capacity comes from a measurement made in this run
(measure.py makes them; this module runs them and gives the verdict). The doctor is a
package above the reader (it reads through `kvdata.open` and the daemon client) and beside the
CLI, whose `kvdata doctor` only parses and prints; it does not import torch.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import Config, load_config
from ..errors import ConfigError, InvalidValueError
from ..homes import is_url
from ..reader.daemon_client import DaemonStager
from ..reader.open import open_dataset
from .measure import FULL, Sizes, directory_read, home_probe, memcpy_bandwidth, reader_rate

__all__ = ["parse_rate", "diagnose", "run_doctor"]

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
