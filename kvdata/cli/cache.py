"""`kvdata stage|evict|status|cache ls|push`: commands about where copies of a dataset live.

When kvdatad answers on its socket, stage/evict/status ask it; otherwise the work
runs in this process on the tiers of the local config.
"""

from __future__ import annotations

import json
from concurrent.futures import as_completed
from typing import TYPE_CHECKING, Any

import click

from .output import format_size, print_json, progress

if TYPE_CHECKING:
    from ..protocol import Client
    from ..tiers.staging import Engine


def _daemon() -> Client | None:
    """A client of kvdatad if it answers, else None (commands then work in-process)."""
    from ..config import load_config
    from ..protocol import connect

    return connect(load_config().daemon.socket)


def _location(dataset: str) -> str:
    """How the daemon names a dataset: a URL, or an absolute path."""
    from pathlib import Path

    from ..homes import is_url

    return dataset if is_url(dataset) else str(Path(dataset).resolve())


def _engine() -> Engine:
    """Local tiers, for when no daemon answers."""
    from ..config import load_config
    from ..tiers.staging import Engine

    return Engine(load_config())


# ---------------------------------------------------------------- stage / evict


@click.command()
@click.argument("dataset")
@click.option("--tier", help="Tier to stage into (default: the fastest).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until every shard is staged. Without a daemon the work runs in this "
                   "process, so it always waits.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def stage(dataset: str, tier: str | None, wait: bool, as_json: bool) -> None:
    """Copy a dataset's shards into a tier ahead of a job (verified, resumable)."""
    from ..reader.daemon_requests import stage_entries, stage_request
    from ..reader.open import open_dataset

    daemon = _daemon()
    if daemon is not None:  # the daemon stages for everyone and keeps it staged
        location = _location(dataset)
        with daemon:  # a uid the daemon does not open paths for passes its own shard files
            entries = () if daemon.may_name_paths else stage_entries(location)
            r = stage_request(daemon, location, entries, tier=tier, wait=wait)
        queued = {"dataset": dataset, "shards": r["shards"], "tier": tier, "queued": r["queued"], "daemon": True}
        if as_json:
            print_json(queued)
        else:
            click.echo(f"kvdatad is staging {r['shards']} shards of {dataset}"
                       + (f" ({r['queued']} still queued)" if r["queued"] else " (all staged)"))
        return
    eng = _engine()
    store = open_dataset(dataset, engine=eng, use_daemon=False)
    try:
        entries = store.manifest.shards
        if tier is not None:
            eng.config.tier(tier)  # an unknown tier name fails here, naming the tiers there are
        with progress(len(entries), "stage") as bar:
            futures = [eng.stage(store.home, e, tier) for e in entries]
            for f in as_completed(futures):
                f.result()
                bar.update(1)
        st = eng.status()
    finally:
        store.close()
        eng.close()
    summary = {"dataset": dataset, "shards": len(entries), "tier": tier or eng.tiers[0].name,
               "shards_staged": st["shards_staged"], "bytes_staged": st["bytes_staged"],
               "bytes_from_home": st["bytes_from_home"]}
    if as_json:
        print_json(summary)
    else:
        click.echo(f"{summary['shards']} shards of {dataset} are in tier {summary['tier']!r} "
                   f"({summary['shards_staged']} staged now, {format_size(summary['bytes_staged'])})")


@click.command()
@click.argument("dataset")
@click.option("--tier", help="Only this tier (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def evict(dataset: str, tier: str | None, as_json: bool) -> None:
    """Drop staged copies of a dataset's shards (never the home; shards being read stay)."""
    from ..reader.daemon_requests import evict_request
    from ..reader.open import open_dataset

    daemon = _daemon()
    if daemon is not None:
        with daemon:
            n = evict_request(daemon, _location(dataset), tier)["evicted"]
    else:
        eng = _engine()
        store = open_dataset(dataset, engine=eng, use_daemon=False)
        try:
            if tier is not None:
                eng.config.tier(tier)
            n = eng.evict(list(store.manifest.shards), tier)
        finally:
            store.close()
            eng.close()
    if as_json:
        print_json({"dataset": dataset, "evicted": n})
    else:
        click.echo(f"evicted {n} staged shard copies of {dataset}")


# ---------------------------------------------------------------- status / cache ls


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(as_json: bool) -> None:
    """The cache daemon's state: tiers, hit rate, bytes staged, queue, clients (or the local tiers)."""
    daemon = _daemon()
    if daemon is not None:
        with daemon:
            st = daemon.request("status")
        st.pop("id", None)
        st.pop("ok", None)
        st["daemon"] = True
    else:
        eng = _engine()
        try:
            st = eng.status()
        finally:
            eng.close()
        st["daemon"] = False
    if as_json:
        print_json(st)
        return
    click.echo("kvdatad: " + (f"running (pid {st['pid']}, {st['connected_clients']} clients, "
                              f"up {st['uptime_seconds']:.0f} s)" if st["daemon"] else "not running (local tiers)"))
    for t in st["tiers"]:
        flag = f"  !! {t['problem']}" if t.get("problem") else ""
        click.echo(f"tier {t['name']:<6} {format_size(t['used']):>10} / {format_size(t['budget']):<10} "
                   f"{t['shards']:>5} shards  {t['path']}{flag}")
    rate = "-" if st["hit_rate"] is None else f"{100 * st['hit_rate']:.1f}%"
    click.echo(f"hit rate {rate} ({st['hits']} hits, {st['misses']} misses), staged {st['shards_staged']} shards / "
               f"{format_size(st['bytes_staged'])}, from home {format_size(st['bytes_from_home'])}")
    click.echo(f"queue {st['in_flight']}, stall {st['stall_seconds']:.1f} s"
               + (f", reader stall {st['reader_stall_seconds']:.1f} s" if st["daemon"] else ""))
    for d in st.get("datasets", []):
        click.echo(f"dataset {d['dataset']}: {_mode_line(d)}")


def _mode_line(d: dict[str, Any]) -> str:
    """How a dataset is read (the engine's policy for unannounced orders)."""
    mode = d.get("mode")
    if mode is None:
        return "open, not being read"
    if mode == "shard-aware":
        return "shard-aware (an announced order: prefetch ahead, keep what is needed next)"
    held = d.get("resident_shards")
    if held is None:  # claimed by another process: only its budget is known here
        return f"random order: resident set of {format_size(d.get('resident_budget') or 0)} kept whole"
    return (f"random order: resident set of {held} shards / {format_size(d.get('resident_bytes') or 0)} kept whole "
            f"({d.get('resident_staged', 0)} staged), the rest read without keeping it")


def cache_report(eng: Engine) -> dict[str, Any]:
    """Tiers with their staged shards, named by the datasets that own them where known."""
    from ..format import names
    from ..sync.dataset_names import MAX_RECORD, read_names, read_trusted, valid_shards
    from ..sync.mirror import cache_root

    root = cache_root(eng.config)
    owners: dict[str, list[str]] = read_names(root)  # datasets kvdatad opened (kept across restarts)
    if root.exists():
        for d in sorted(root.iterdir()):
            # a mirror's files as JSON, not parsed; only ours, valid and printable: a half-written,
            # foreign or planted one is skipped
            m_raw, src_raw = read_trusted(d / names.MANIFEST, MAX_RECORD), read_trusted(d / names.SOURCE, 1 << 16)
            if m_raw is None or src_raw is None:
                continue
            try:
                m, src = json.loads(m_raw), json.loads(src_raw)
            except ValueError:
                continue
            for sha, label in valid_shards(m, src.get("url") if isinstance(src, dict) else None):
                if label not in owners.setdefault(sha, []):
                    owners[sha].append(label)
    tiers = []
    for t in eng.tiers:
        res = t.resident()
        tiers.append({"name": t.name, "path": str(t.root), "budget": t.budget, "used": sum(res.values()),
                      "shards": [{"sha256": sha, "bytes": size, "datasets": owners.get(sha, [])}
                                 for sha, size in sorted(res.items())]})
    return {"tiers": tiers}


@click.group("cache")
def cache_group() -> None:
    """Inspect the cache tiers."""


@cache_group.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def cache_ls(as_json: bool) -> None:
    """What is staged where, and bytes per tier."""
    eng = _engine()
    try:
        report = cache_report(eng)
    finally:
        eng.close()
    if as_json:
        print_json(report)
        return
    for t in report["tiers"]:
        click.echo(f"{t['name']:<8} {t['path']}  {format_size(t['used'])} / {format_size(t['budget'])}  "
                   f"{len(t['shards'])} shards")
        for s in t["shards"]:
            owners = ", ".join(s["datasets"]) or "?"
            click.echo(f"    {s['sha256'][:16]}  {format_size(s['bytes']):>10}  {owners}")


# ---------------------------------------------------------------- push


@click.command()
@click.argument("dataset", type=click.Path(exists=True, file_okay=False))
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def push(dataset: str, url: str, as_json: bool) -> None:
    """Upload a sealed local dataset to a home (a path or s3://); the manifest goes last."""
    from ..sync.push import push as run_push

    summary = run_push(dataset, url)
    if as_json:
        print_json(summary)
    else:
        click.echo(f"pushed {dataset} to {url} (generation {summary['generation']}, "
                   f"{summary['shards_uploaded']} shards uploaded, {summary['shards_skipped']} already there)")


COMMANDS: tuple[click.Command, ...] = (stage, evict, status, cache_group, push)
