#!/usr/bin/env python
"""Run every kvdata benchmark, one at a time, and regenerate the tables and plots of its results pages.

    python bench/run_all.py --quick                   # every bench at smoke-test sizes (< 5 min on 2 cores);
                                                      # results in bench/out/, plots in bench/out/plots/,
                                                      # bench/results/ untouched
    python bench/run_all.py --quick --update-results  # ... and write them into bench/results/*.md and
                                                      # bench/results/plots/, labelled as quick-mode figures
    python bench/run_all.py --full                    # full sizes (an hour or more; idle machine): results
                                                      # in bench/out/, the pages' tables and plots updated
    python bench/run_all.py --full --only store_read,daemon    # a subset (--skip NAMES: all but these)
    python bench/run_all.py --report-only             # no runs: pages + plots from bench/out/*.json
    python bench/run_all.py --plots-only              # no runs: bench/results/plots/ from the pages' tables
    python bench/run_all.py --list                    # the benches, their commands, what each needs

Each bench runs as its own subprocess (`python bench/<script> <its --quick or full flags> --json
bench/out/<name>.json`), output in bench/out/<name>.log. A bench whose requirements are missing
(torch, kvdatad, root and ../shared/netlab for the network home, ...) is skipped with the reason.
Every bench's JSON carries its markdown report ("markdown"); the bench script's results page,
bench/results/<script>.md (one page per script: staging.py's holds staging_local, staging_policy and
staging_network), holds each between <!-- bench:NAME:begin --> and <!-- bench:NAME:end -->
(headings demoted, with a provenance line and the plot's image link); the prose around the markers
is hand-written and never touched, and bench/README.md (the targets table) is never written. Plots
(matplotlib, Agg) are drawn from the tables of those blocks, so a plot always shows what the
table next to it says. bench/out/run_all.json records what ran, how long, and why a bench was
skipped. Exit status 1 if a bench failed (skips are not failures).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402
    Table,
    block_markers,
    can_drop_caches,
    demote_headings,
    finite,
    machine_info,
    machine_line,
    md_table,
    md_tables,
    num,
    read_blocks,
    replace_block,
    write_json,
)

OUT = HERE / "out"
RESULTS = HERE / "results"   # one page per bench script: <script>.md, its generated blocks between markers
PLOTS = RESULTS / "plots"
NETLAB_SH = REPO.parent / "shared" / "netlab" / "netlab.sh"
QUICK_TIMEOUT = 300.0      # seconds per bench in --quick
FULL_TIMEOUT = 4 * 3600.0  # seconds per bench in --full


# ====================================================================== the benches

def _missing(*modules: str) -> list[str]:
    out = []
    for m in modules:
        try:
            if importlib.util.find_spec(m) is None:
                out.append(m)
        except (ImportError, ValueError):
            out.append(m)
    return out


def needs_modules(*modules: str, hint: str = "") -> Callable[[], str | None]:
    def check() -> str | None:
        miss = _missing(*modules)
        if miss:
            return f"{', '.join(miss)} not installed" + (f" ({hint})" if hint else "")
        return None
    return check


def netlab_missing() -> str | None:
    """Why ../shared/netlab cannot run here (None if it can)."""
    if not NETLAB_SH.exists():
        return f"netlab not available ({NETLAB_SH} not found)"
    if os.geteuid() != 0:
        return "netlab needs root (network namespaces and tc)"
    tools = [t for t in ("ip", "tc", "nginx", "iperf3") if shutil.which(t) is None]
    if tools:
        return f"netlab needs {', '.join(tools)} on PATH"
    miss = _missing("boto3")
    if miss:
        return "boto3 not installed (pip install -e '.[s3]')"
    py = os.environ.get("NETLAB_PY") or sys.executable
    try:
        r = subprocess.run([py, "-c", "import moto.server, uvloop"], capture_output=True, timeout=60, check=False)
        if r.returncode != 0:
            return f"NETLAB_PY={py} cannot import moto.server and uvloop (pip install 'moto[server]' uvloop)"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"NETLAB_PY={py} does not run ({e})"
    return None


def random_order_missing() -> str | None:
    """Why bench/random_order.py cannot run here: as netlab_missing, but iperf3 and uvloop are
    optional for it (it measures no iperf3 rates; the delay proxy falls back to asyncio)."""
    if not NETLAB_SH.exists():
        return f"netlab not available ({NETLAB_SH} not found)"
    if os.geteuid() != 0:
        return "netlab needs root (network namespaces and tc)"
    tools = [t for t in ("ip", "tc", "nginx") if shutil.which(t) is None]
    if tools:
        return f"netlab needs {', '.join(tools)} on PATH"
    if _missing("boto3"):
        return "boto3 not installed (pip install -e '.[s3]')"
    py = os.environ.get("NETLAB_PY") or sys.executable
    try:
        r = subprocess.run([py, "-c", "import moto.server"], capture_output=True, timeout=60, check=False)
        if r.returncode != 0:
            return f"NETLAB_PY={py} cannot import moto.server (pip install 'moto[server]')"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"NETLAB_PY={py} does not run ({e})"
    return None


def multinode_missing() -> str | None:
    """Why bench/multinode.py cannot run here (it probes namespaces itself, and says why it cannot)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc)"
    tools = [t for t in ("ip", "tc", "nginx") if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]
    if tools:
        return f"needs {', '.join(tools)} (Debian packages iproute2, nginx)"
    miss = _missing("boto3", "moto", "kvdata_daemon")
    if miss:
        return f"{', '.join(miss)} not installed (pip install -e '.[test]')"
    return None


def store_read_notes() -> list[str]:
    notes = []
    if not can_drop_caches():
        notes.append("(c) cold-cache reads are skipped inside the script: dropping the page cache needs root "
                     "and a writable /proc/sys/vm/drop_caches")
    if _missing("mmap_ninja"):
        notes.append("mmap_ninja rows skipped (pip install mmap-ninja)")
    return notes


def imports_notes() -> list[str]:
    miss = _missing("google.protobuf", "webdataset", "google_crc32c", "pyarrow", "datasets")
    return [f"importers whose input libraries are missing lose their rows: {', '.join(miss)} "
            "(pip install -e '.[test]')"] if miss else []


def loader_notes() -> list[str]:
    miss = _missing("PIL", "mmap_ninja", "litdata")
    return [f"rows of missing peers skipped: {', '.join(miss)} (pip install -e '.[bench]' pillow)"] if miss else []


@dataclass
class Bench:
    name: str
    script: str
    quick: list[str]
    full: list[str]
    requires: Callable[[], str | None] = lambda: None
    notes: Callable[[], list[str]] = list
    plot: str | None = None            # plotter name (PLOTTERS), None: no plot
    full_only: bool = False            # not run by --quick (skipped with the reason)

    def argv(self, quick: bool, json_path: Path) -> list[str]:
        """The subprocess's argv (run from the repo root, so paths inside it are repo-relative)."""
        rel = lambda p: str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)  # noqa: E731
        flags = self.quick if quick else self.full
        return [sys.executable, rel(HERE / self.script), *flags, "--json", rel(json_path)]

    @property
    def page(self) -> str:
        """The file name of its results page in bench/results/ (one per script)."""
        return Path(self.script).stem + ".md"

    def command(self, quick: bool) -> str:
        """The command as a user would type it (from the repo root)."""
        return " ".join(["python", f"bench/{self.script}", *map(shlex.quote, self.quick if quick else self.full),
                         "--json", f"bench/out/{self.name}.json"])


_torch = needs_modules("torch", hint="pip install -e '.[torch]'")


def _daemon_missing() -> str | None:
    return _torch() or needs_modules("kvdata_daemon", hint="pip install -e . installs kvdatad")()


BENCHES: list[Bench] = [
    Bench("store_read", "store_read.py", ["--quick"], [], notes=store_read_notes, plot="store_read"),
    Bench("write", "write.py", ["--quick"], []),
    Bench("loader", "loader.py", ["--quick"], [], requires=_torch, notes=loader_notes, plot="loader"),
    Bench("crash_kill", "crash_kill.py", ["--quick"], []),
    Bench("compact", "compact.py", ["--quick"], []),
    Bench("reader_opens", "reader_opens.py", ["--quick"], []),
    Bench("staging_local", "staging.py", ["local", "--quick"], ["local"], plot="staging_local"),
    Bench("staging_policy", "staging.py", ["policy", "--quick"], ["policy"], plot="staging_policy"),
    Bench("staging_network", "staging.py", ["network", "--netlab-up", "--rtt-ms", "10", "--quick"],
          ["network", "--netlab-up", "--rtt-ms", "10,25", "--rate", "1gbit", "--samples", "4000"],
          requires=lambda: _torch() or netlab_missing(), plot="staging_network"),
    Bench("random_order", "random_order.py", ["--quick"], [], full_only=True,
          requires=lambda: _torch() or random_order_missing()),
    Bench("daemon", "daemon.py", ["--quick"], [], requires=_daemon_missing, plot="daemon"),
    Bench("multinode", "multinode.py", ["--quick"], [], requires=lambda: _daemon_missing() or multinode_missing()),
    Bench("shuffle_quality", "shuffle_quality.py", ["--quick"], [], plot="shuffle_quality"),
    Bench("locality_churn", "locality_churn.py", ["--quick"], []),
    Bench("cluster_sim", "cluster_sim.py", ["--quick", "--quiet"], ["--quiet"]),
    Bench("imports", "imports.py", ["--quick"], [], notes=imports_notes,
          requires=needs_modules("PIL", hint="the images are JPEGs; pip install -e '.[test]'")),
    Bench("fuzz", "fuzz.py", ["--quick"], [],
          requires=needs_modules("google.protobuf", "PIL", hint="the Caffe targets; pip install -e '.[test]'")),
]
BY_NAME = {b.name: b for b in BENCHES}


# ====================================================================== running

def run_bench(b: Bench, quick: bool, out: Path, timeout: float) -> dict[str, Any]:
    """Run one bench as a subprocess (its own session, so a timeout reaches everything it started)."""
    js, logf = out / f"{b.name}.json", out / f"{b.name}.log"
    rec: dict[str, Any] = {"name": b.name, "command": b.command(quick), "json": str(js), "log": str(logf)}
    reason = "full only (run by --full, not --quick)" if quick and b.full_only else b.requires()
    if reason:
        rec.update(status="skipped", reason=reason, seconds=0.0, json=None)
        return rec
    rec["notes"] = b.notes()
    js.unlink(missing_ok=True)  # a failed run must not leave an older result behind
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    t0 = time.perf_counter()
    with open(logf, "wb") as f:
        f.write(f"$ {rec['command']}\n".encode())
        f.flush()
        p = subprocess.Popen(b.argv(quick, js), cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(p)
            rc = p.returncode
        except BaseException:  # Ctrl-C: take the bench's whole session down with us
            _kill_group(p)
            raise
    rec["seconds"] = time.perf_counter() - t0
    rec["rc"] = rc
    if timed_out:
        rec.update(status="failed", reason=f"timed out after {timeout:.0f} s")
    elif rc != 0:
        rec.update(status="failed", reason=f"exit status {rc}")
    else:
        rec["status"] = "ok"
    if not js.exists():
        rec["json"] = None
        if rec["status"] == "ok":
            rec.update(status="failed", reason=f"no {js.name} written")
    return rec


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(path: str, n: int = 25) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + x for x in lines[-n:])


# ====================================================================== results pages' blocks

def is_quick(data: dict[str, Any]) -> bool:
    return str((data.get("config") or {}).get("quick")) == "True"


def render_block(b: Bench, data: dict[str, Any], date: str) -> str:
    """The text between a bench's markers on its results page: mode comment, provenance, report,
    plot link (relative to the page: bench/results/plots/)."""
    quick = is_quick(data)
    mach = data.get("machine")
    where = machine_line(mach) if isinstance(mach, dict) else str(mach or "unknown machine")
    lines = [f"<!-- run_all mode={'quick' if quick else 'full'} date={date}: generated, edit outside the markers -->"]
    if quick:
        lines += ["**Quick mode: smoke-test sizes, not measurements.** These figures come from "
                  "`python bench/run_all.py --quick --update-results`; they show that the bench runs, not how "
                  "fast kvdata is. `python bench/run_all.py --full` replaces them.", ""]
    lines += [f"_Generated by `python bench/run_all.py {'--quick' if quick else '--full'}` on {date} ({where}). "
              f"Command: `{b.command(quick)}`; raw numbers in `bench/out/{b.name}.json` (not committed)._", "",
              demote_headings(str(data.get("markdown", "")).strip())]
    if b.plot:
        lines += ["", f"![{b.name}{' (quick mode)' if quick else ''}](plots/{b.name}.png)"]
    return "\n".join(lines)


def update_readme(page: Path, results: dict[str, dict[str, Any]], date: str) -> list[str]:
    """Replace the blocks of the benches in `results` (name -> JSON data) in one markdown file (a
    results page); the names updated."""
    doc = page.read_text()
    done = []
    for name, data in results.items():
        begin, end = block_markers(name)
        try:
            doc = replace_block(doc, begin, end, render_block(BY_NAME[name], data, date))
            done.append(name)
        except (KeyError, ValueError) as e:
            print(f"{page.name}: {name}: {e}; not updated", file=sys.stderr)
    tmp = page.with_name(page.name + ".tmp")
    tmp.write_text(doc)
    tmp.replace(page)
    return done


def update_pages(results: dict[str, dict[str, Any]], date: str, root: Path = RESULTS) -> list[str]:
    """Replace each bench's block in `results` on its own results page (root/<script>.md); the names
    updated."""
    done = []
    for page in dict.fromkeys(BY_NAME[n].page for n in results if n in BY_NAME):
        mine = {n: d for n, d in results.items() if n in BY_NAME and BY_NAME[n].page == page}
        path = root / page
        if not path.exists():
            print(f"{path}: no such results page; {', '.join(mine)} not updated", file=sys.stderr)
            continue
        done += update_readme(path, mine, date)
    for n in results:
        if n not in BY_NAME:
            print(f"{n}: not a bench; not updated", file=sys.stderr)
    return done


def read_pages(root: Path = RESULTS) -> dict[str, str]:
    """Every bench block of every results page (root/*.md): NAME -> its text."""
    blocks: dict[str, str] = {}
    for path in sorted(root.glob("*.md")):
        blocks.update(read_blocks(path.read_text()))
    return blocks


def block_is_quick(text: str) -> bool:
    return "<!-- run_all mode=quick" in text


# ====================================================================== plots

def _rows_num(t: Table, col: str) -> list[tuple[str, float]]:
    i = t.col(col)
    return [(r[0].strip("*"), num(r[i])) for r in t.rows if len(r) > i]


def _short(s: str, n: int = 48) -> str:
    return s if len(s) <= n else s[:n - 1] + "\u2026"


def _barh(ax: Any, labels: list[str], values: list[float], ref: float | None = None, fmt: str = "{:.2f}") -> None:
    y = list(range(len(labels)))
    vals = [v if finite(v) else 0.0 for v in values]
    ax.barh(y, vals, color="#4C72B0")
    ax.set_yticks(y, [_short(x) for x in labels], fontsize=7)
    ax.invert_yaxis()
    for yi, v in zip(y, values):
        if finite(v):
            ax.text(v, yi, " " + fmt.format(v), va="center", fontsize=6)
    if ref is not None:
        ax.axvline(ref, color="grey", lw=0.8, ls="--")
    ax.margins(x=0.15)
    ax.tick_params(axis="x", labelsize=7)


def plot_store_read(tables: list[Table], plt: Any) -> Any:
    ts = [t for t in tables if t.heading[:3] in ("(a)", "(b)", "(c)") and any(h.startswith("vs ") for h in t.header)]
    if not ts:
        return None
    fig, axes = plt.subplots(len(ts), 1, figsize=(8, 1.2 + 1.9 * len(ts)), squeeze=False)
    for ax, t in zip(axes[:, 0], ts):
        base = next(h for h in t.header if h.startswith("vs "))
        rows = _rows_num(t, base)
        _barh(ax, [r[0] for r in rows], [r[1] for r in rows], ref=1.0, fmt="{:.2f}x")
        ax.set_title(_short(t.heading, 90), fontsize=8)
        ax.set_xlabel(f"samples/s, median, relative to {base[3:]}", fontsize=7)
    fig.suptitle("store_read: read throughput vs the baseline", fontsize=10)
    return fig


def plot_loader(tables: list[Table], plt: Any) -> Any:
    ts = [t for t in tables if t.heading[:3] in ("(a)", "(b)") and any("img/s" in h for h in t.header)]
    if not ts:
        return None
    fig, axes = plt.subplots(1, len(ts), figsize=(5 * len(ts), 3.6), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], ts):
        cols = [i for i, h in enumerate(t.header) if "img/s" in h]
        names = [r[0] for r in t.rows]
        h = 0.8 / max(1, len(cols))
        for k, ci in enumerate(cols):
            vals = [num(r[ci]) for r in t.rows]
            ax.barh([y + k * h for y in range(len(names))], [v if finite(v) else 0 for v in vals], height=h,
                    label=t.header[ci].replace(" img/s", ""))
        ax.set_yticks([y + h * (len(cols) - 1) / 2 for y in range(len(names))], [_short(n, 34) for n in names],
                      fontsize=7)
        if not ax.yaxis_inverted():  # shared y axis: invert it once
            ax.invert_yaxis()
        ax.set_xlabel("images/s (median)", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(_short(t.heading.split(":")[0], 40), fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle("loader: torch DataLoader, batch 256", fontsize=10)
    return fig


def plot_staging_local(tables: list[Table], plt: Any) -> Any:
    t = next((t for t in tables if any("source MB/s" in h for h in t.header)), None)
    if t is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2))
    rows = _rows_num(t, "source MB/s")
    _barh(ax, [r[0] for r in rows], [r[1] for r in rows], fmt="{:,.0f}")
    ax.set_xlabel("MB/s read from the home (median)", fontsize=7)
    fig.suptitle("staging (local home): Engine.stage vs raw copies and zstd", fontsize=10)
    return fig


def plot_staging_policy(tables: list[Table], plt: Any) -> Any:
    ts = [t for t in tables if any(h.startswith("budget") for h in t.header)]
    if not ts:
        return None
    fig, axes = plt.subplots(1, len(ts), figsize=(5.2 * len(ts), 3.8), squeeze=False)
    for ax, t in zip(axes[0], ts):
        shard_aware = "shard-aware" in t.heading
        ycol = t.col("traffic/epoch") if shard_aware else t.col("hit rate")
        pcol, bcol = t.col("policy"), t.col("budget")
        series: dict[str, list[tuple[float, float]]] = {}
        for r in t.rows:
            series.setdefault(r[pcol], []).append((num(r[bcol]), num(r[ycol])))
        for name, pts in series.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=_short(name, 44))
        if shard_aware:
            xs = sorted({num(r[bcol]) for r in t.rows})
            ax.plot(xs, [1 - x / 100 for x in xs], "k--", lw=0.8, label="1 - budget (ideal)")
            ax.set_ylabel("home traffic per warm epoch (datasets)", fontsize=7)
        else:
            ax.set_ylabel("hit rate (%)", fontsize=7)
        ax.set_xlabel("tier budget (% of the shards)", fontsize=7)
        ax.set_title(_short(t.heading.split(":")[0], 60), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    fig.suptitle("staging policy replay", fontsize=10)
    return fig


def plot_staging_network(tables: list[Table], plt: Any) -> Any:
    ts = [t for t in tables if any(h == "vs (a)" for h in t.header)]
    if not ts:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.8))
    names = [r[0] for r in ts[0].rows]
    h = 0.8 / len(ts)
    for k, t in enumerate(ts):
        vals = {r[0]: num(r[t.col("samples/s")]) for r in t.rows}
        ax.barh([y + k * h for y in range(len(names))], [vals.get(n, 0) for n in names], height=h,
                label=_short(t.heading, 40))
    ax.set_yticks([y + h * (len(ts) - 1) / 2 for y in range(len(names))], [_short(n, 44) for n in names], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("samples/s (log scale)", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    fig.suptitle("staging: network home vs one GET per sample", fontsize=10)
    return fig


def plot_daemon(tables: list[Table], plt: Any) -> Any:
    main = next((t for t in tables if t.header and t.header[0] == "mode"), None)
    lat = next((t for t in tables if any("p99" in h for h in t.header)), None)
    if main is None:
        return None
    fig, axes = plt.subplots(1, 2 if lat else 1, figsize=(11 if lat else 6, 3.6), squeeze=False)
    ratio = next((r for r in main.rows if "/" in r[0]), None)
    if ratio is not None:
        _barh(axes[0, 0], main.header[1:], [num(c) for c in ratio[1:]], ref=1.0, fmt="{:.2f}x")
        axes[0, 0].set_title("one kvdatad / each reader its own engine", fontsize=8)
        axes[0, 0].set_xlabel("ratio (home bytes, tier: lower is better; samples/s: higher)", fontsize=7)
    if lat is not None:
        ax = axes[0, 1]
        names = [r[0] for r in lat.rows]
        for k, col in enumerate(("p50 ms", "p99 ms")):
            ax.barh([y + k * 0.4 for y in range(len(names))], [num(r[lat.col(col)]) for r in lat.rows], height=0.4,
                    label=col)
        ax.set_yticks([y + 0.2 for y in range(len(names))], [_short(n, 40) for n in names], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms per request (log scale)", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title("protocol latency", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle("daemon: four readers through one kvdatad", fontsize=10)
    return fig


def plot_shuffle_quality(tables: list[Table], plt: Any) -> Any:
    t = next((t for t in tables if t.header and t.header[0].startswith("window")), None)
    if t is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    pts = [r for r in t.rows if finite(num(r[0])) and r[0].strip().isdigit()]
    ref = next((r for r in t.rows if not r[0].strip().isdigit()), None)
    xs = [num(r[0]) for r in pts]
    for ci, style in ((1, "o-"), (2, "s-")):
        ax.plot(xs, [num(r[ci]) for r in pts], style, ms=4, label=t.header[ci].split(":")[0])
        if ref is not None:
            ax.axhline(num(ref[ci]), color="grey", lw=0.8, ls="--")
    if ref is not None:
        ax.text(xs[0] if xs else 1, num(ref[1]), f" {ref[0]}", fontsize=7, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("shuffle window (shards mixed)", fontsize=7)
    ax.set_ylabel("distinct classes per batch (mean)", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    fig.suptitle("shuffle quality of the shard-blocked order", fontsize=10)
    return fig


PLOTTERS: dict[str, Callable[[list[Table], Any], Any]] = {
    "store_read": plot_store_read, "loader": plot_loader, "staging_local": plot_staging_local,
    "staging_policy": plot_staging_policy, "staging_network": plot_staging_network, "daemon": plot_daemon,
    "shuffle_quality": plot_shuffle_quality,
}


def draw_plots(blocks: dict[str, str], outdir: Path, quick_names: set[str]) -> list[Path]:
    """A PNG per bench block that has a plotter, drawn from the block's markdown tables."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return []
    plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80})
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in blocks.items():
        b = BY_NAME.get(name)
        if b is None or b.plot is None:
            continue
        try:
            fig = PLOTTERS[b.plot](md_tables(text), plt)
        except Exception as e:  # noqa: BLE001 -- a table the plotter does not understand: no plot, say why
            print(f"plot {name}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if fig is None:
            print(f"plot {name}: no table to plot", file=sys.stderr)
            continue
        if name in quick_names:
            fig.text(0.5, 0.5, "QUICK MODE\nsmoke-test sizes", ha="center", va="center", fontsize=28,
                     color="red", alpha=0.18, rotation=20)
            title = fig.get_suptitle() if hasattr(fig, "get_suptitle") else name
            fig.suptitle(f"{title}  [QUICK MODE: not measurements]", fontsize=10)
        fig.tight_layout()
        path = outdir / f"{name}.png"
        fig.savefig(path, metadata={"Software": None})
        plt.close(fig)
        written.append(path)
    return written


# ====================================================================== main

def load_results(out: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    res = {}
    for n in names:
        p = out / f"{n}.json"
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("markdown"):
            res[n] = data
    return res


def select(a: argparse.Namespace) -> list[Bench]:
    def names(s: str | None) -> set[str]:
        got = {x.strip() for x in (s or "").split(",") if x.strip()}
        bad = got - set(BY_NAME)
        if bad:
            raise SystemExit(f"unknown bench(es) {sorted(bad)}; known: {', '.join(BY_NAME)}")
        return got
    only, skip = names(a.only), names(a.skip)
    return [b for b in BENCHES if (not only or b.name in only) and b.name not in skip]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smoke-test sizes (< 5 minutes in all on 2 cores)")
    mode.add_argument("--full", action="store_true", help="the full sizes the results pages' figures come from")
    mode.add_argument("--report-only", action="store_true",
                      help="run nothing: the results pages' blocks and plots from the JSON already in bench/out/")
    mode.add_argument("--plots-only", action="store_true",
                      help="run nothing: bench/results/plots/ from the results pages' tables")
    mode.add_argument("--list", action="store_true", help="list the benches, their commands and what is missing")
    p.add_argument("--only", help="comma-separated bench names to run (default: all)")
    p.add_argument("--skip", help="comma-separated bench names not to run")
    p.add_argument("--update-results", "--update-readme", dest="update_results", action="store_true",
                   help="also write quick-mode results into bench/results/*.md and bench/results/plots/ (labelled quick)")
    p.add_argument("--no-results", "--no-readme", dest="no_results", action="store_true",
                   help="--full: leave bench/results/ (pages and plots) alone")
    p.add_argument("--timeout", type=float, help=f"seconds per bench (default {QUICK_TIMEOUT:.0f} in --quick, "
                                                 f"{FULL_TIMEOUT:.0f} in --full)")
    p.add_argument("--out", type=Path, default=OUT, help="results directory (default bench/out)")
    p.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    p.add_argument("--plots", type=Path, default=PLOTS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.out, a.results, a.plots = a.out.resolve(), a.results.resolve(), a.plots.resolve()
    benches = select(a)
    date = _dt.date.today().isoformat()

    if a.list:
        rows = []
        for b in benches:
            reason = b.requires()
            rows.append([b.name, f"`{b.command(True)}`", f"`{b.command(False)}`",
                         f"skipped: {reason}" if reason else "; ".join(b.notes()) or "ready"])
        print(md_table(["bench", "--quick", "--full", "here"], rows, left=4))
        return 0

    if a.plots_only:
        blocks = read_pages(a.results)
        blocks = {k: v for k, v in blocks.items() if any(b.name == k for b in benches)}
        written = draw_plots(blocks, a.plots, {k for k, v in blocks.items() if block_is_quick(v)})
        print("\n".join(f"wrote {w.relative_to(REPO) if w.is_relative_to(REPO) else w}" for w in written))
        return 0

    if a.report_only:
        results = load_results(a.out, [b.name for b in benches])
        if not results:
            raise SystemExit(f"no bench results in {a.out} (run --quick or --full first)")
        skipped = [n for n, d in results.items() if is_quick(d) and not a.update_results]
        for n in skipped:
            print(f"{n}: a quick-mode result; its results page left alone (add --update-results to write it)")
        results = {n: d for n, d in results.items() if n not in skipped}
        if not results:
            return 0
        done = update_pages(results, date, a.results)
        blocks = {k: v for k, v in read_pages(a.results).items() if k in done}
        written = draw_plots(blocks, a.plots, {k for k, v in blocks.items() if block_is_quick(v)})
        print(f"results blocks updated: {', '.join(done) or 'none'}; plots: {', '.join(w.name for w in written)}")
        return 0

    if not (a.quick or a.full):
        p.error("give --quick or --full (or --report-only, --plots-only, --list)")
    quick = a.quick
    timeout = a.timeout or (QUICK_TIMEOUT if quick else FULL_TIMEOUT)
    a.out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    records = []
    print(f"run_all --{'quick' if quick else 'full'}: {len(benches)} bench(es), one at a time; results in {a.out}",
          flush=True)
    for b in benches:
        print(f"{b.name}: {b.command(quick)}", flush=True)
        rec = run_bench(b, quick, a.out, timeout)
        records.append(rec)
        if rec["status"] == "skipped":
            print(f"{b.name}: SKIPPED: {rec['reason']}", flush=True)
            continue
        for note in rec.get("notes", []):
            print(f"{b.name}: note: {note}", flush=True)
        line = f"{b.name}: {rec['status'].upper()} in {rec['seconds']:.1f}s"
        if rec["status"] != "ok":
            line += f" ({rec['reason']}); last lines of {rec['log']}:\n{log_tail(rec['log'])}"
        print(line, flush=True)
    total = time.perf_counter() - t_all

    results = load_results(a.out, [r["name"] for r in records if r.get("json")])
    update = (not a.no_results) if a.full else a.update_results
    results_done: list[str] = []
    if update and results:
        results_done = update_pages(results, date, a.results)
        blocks = {k: v for k, v in read_pages(a.results).items() if k in results_done}
        plots = draw_plots(blocks, a.plots, {k for k, v in blocks.items() if block_is_quick(v)})
    else:
        plots = draw_plots({n: d["markdown"] for n, d in results.items()}, a.out / "plots",
                           set(results) if quick else set())

    summary = {"mode": "quick" if quick else "full", "date": date, "seconds": total, "machine": machine_info(),
               "benches": records, "results_updated": results_done, "plots": [str(x) for x in plots]}
    write_json(a.out / "run_all.json", summary)
    rows = [[r["name"], r["status"], r.get("reason", "") or "; ".join(r.get("notes", [])), f"{r['seconds']:.1f}"]
            for r in records]
    print()
    print(md_table(["bench", "status", "reason / notes", "seconds"], rows, left=3))
    print(f"total {total:.1f}s ({total / 60:.1f} min); summary in {a.out / 'run_all.json'}")
    if results_done:
        print(f"results blocks updated ({'quick mode, labelled' if quick else 'full'}): {', '.join(results_done)}; "
              f"plots in {a.plots}")
    else:
        where = a.out / "plots"
        print(f"bench/results/ not touched{' (add --update-results to write quick-mode figures)' if quick else ''}; "
              f"plots in {where if plots else '(none)'}")
    return 1 if any(r["status"] == "failed" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
