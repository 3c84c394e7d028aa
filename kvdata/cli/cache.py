"""`kvdata stage|evict|cache ls|push|seal`: commands about where copies of a dataset live."""

from __future__ import annotations

import json
from concurrent.futures import as_completed
from typing import Any

import click

from .._util.sizes import format_size


def _daemon() -> Any:
    """A client of kvdatad if it answers, else None (commands then work in-process)."""
    from ..config import load_config
    from ..protocol import connect

    return connect(load_config().daemon.socket)


def _location(dataset: str) -> str:
    """How the daemon names a dataset: a URL, or an absolute path."""
    from pathlib import Path

    from ..tiers.homes import is_url

    return dataset if is_url(dataset) else str(Path(dataset).resolve())


def _engine() -> Any:
    from ..config import load_config
    from ..tiers.engine import Engine

    return Engine(load_config())


def register(main: click.Group) -> None:
    from . import _json

    @main.command()
    @click.argument("dataset")
    @click.option("--tier", help="Tier to stage into (default: the fastest).")
    @click.option("--wait/--no-wait", default=True, show_default=True,
                  help="Wait until every shard is staged. Without a daemon the work runs in this "
                       "process, so it always waits.")
    @click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
    def stage(dataset: str, tier: str | None, wait: bool, as_json: bool) -> None:
        """Copy a dataset's shards into a tier ahead of a job (verified, resumable)."""
        from ..reader.open import open_dataset
        from .._util.progress import progress

        daemon = _daemon()
        if daemon is not None:  # the daemon stages for everyone and keeps it staged
            with daemon:
                r = daemon.request("stage", dataset=_location(dataset), tier=tier, wait=wait)
            summary = {"dataset": dataset, "shards": r["shards"], "tier": tier, "queued": r["queued"], "daemon": True}
            if as_json:
                _json(summary)
            else:
                click.echo(f"kvdatad is staging {r['shards']} shards of {dataset}"
                           + (f" ({r['queued']} still queued)" if r["queued"] else " (all staged)"))
            return
        eng = _engine()
        store = open_dataset(dataset, engine=eng, use_daemon=False)
        try:
            entries = store.manifest["shards"]
            if tier is not None:
                eng.config.tier(tier)
            with progress(len(entries), "stage") as bar:
                futures = [eng.stage(store.home, e, tier) for e in entries]
                for f in as_completed(futures):
                    f.result()
                    bar.update(1)
            status = eng.status()
        finally:
            store.close()
            eng.close()
        summary = {"dataset": dataset, "shards": len(entries), "tier": tier or eng.tiers[0].name,
                   "shards_staged": status["shards_staged"], "bytes_staged": status["bytes_staged"],
                   "bytes_from_home": status["bytes_from_home"]}
        if as_json:
            _json(summary)
        else:
            click.echo(f"{summary['shards']} shards of {dataset} are in tier {summary['tier']!r} "
                       f"({summary['shards_staged']} staged now, {format_size(summary['bytes_staged'])})")

    @main.command()
    @click.argument("dataset")
    @click.option("--tier", help="Only this tier (default: all).")
    @click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
    def evict(dataset: str, tier: str | None, as_json: bool) -> None:
        """Drop staged copies of a dataset's shards (never the home; shards being read stay)."""
        from ..reader.open import open_dataset

        daemon = _daemon()
        if daemon is not None:
            with daemon:
                n = daemon.request("evict", dataset=_location(dataset), tier=tier)["evicted"]
        else:
            eng = _engine()
            store = open_dataset(dataset, engine=eng, use_daemon=False)
            try:
                if tier is not None:
                    eng.config.tier(tier)
                n = eng.evict(store.manifest["shards"], tier)
            finally:
                store.close()
                eng.close()
        if as_json:
            _json({"dataset": dataset, "evicted": n})
        else:
            click.echo(f"evicted {n} staged shard copies of {dataset}")

    @main.command()
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
            _json(st)
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

    @main.group()
    def cache() -> None:
        """Inspect the cache tiers."""

    @cache.command("ls")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    def cache_ls(as_json: bool) -> None:
        """What is staged where, and bytes per tier."""
        eng = _engine()
        try:
            report = cache_report(eng)
        finally:
            eng.close()
        if as_json:
            _json(report)
            return
        for t in report["tiers"]:
            click.echo(f"{t['name']:<8} {t['path']}  {format_size(t['used'])} / {format_size(t['budget'])}  "
                       f"{len(t['shards'])} shards")
            for s in t["shards"]:
                owners = ", ".join(s["datasets"]) or "?"
                click.echo(f"    {s['sha256'][:16]}  {format_size(s['bytes']):>10}  {owners}")

    @main.command()
    @click.argument("dataset", type=click.Path(exists=True, file_okay=False))
    @click.argument("url")
    @click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
    def push(dataset: str, url: str, as_json: bool) -> None:
        """Upload a sealed local dataset to a home (a path or s3://); the manifest goes last."""
        from ..tiers.push import push as run_push

        summary = run_push(dataset, url)
        if as_json:
            _json(summary)
        else:
            click.echo(f"pushed {dataset} to {url} (generation {summary['generation']}, "
                       f"{summary['shards_uploaded']} shards uploaded, {summary['shards_skipped']} already there)")

    @main.command()
    @click.argument("dataset", type=click.Path(exists=True, file_okay=False))
    def seal(dataset: str) -> None:
        """Seal the open tail shard so every record is in an immutable, stageable shard."""
        from ..reader.open import open_dataset as open_store

        with open_store(dataset, "a") as store:
            store.seal()
            gen = store.commit()
        click.echo(f"sealed {dataset} (generation {gen})")


def cache_report(eng: Any) -> dict[str, Any]:
    """Tiers with their staged shards, named by the datasets that own them where known."""
    from ..tiers.mirror import cache_root

    owners: dict[str, list[str]] = {}
    root = cache_root(eng.config)
    if root.exists():
        for d in root.iterdir():
            try:
                m = json.loads((d / "manifest.json").read_text())
                url = json.loads((d / "source.json").read_text())["url"]
            except (OSError, ValueError, KeyError):
                continue
            for e in m.get("shards", []):
                owners.setdefault(e["sha256"], []).append(f"{url}#{e['name']}")
    tiers = []
    for t in eng.tiers:
        res = t.resident()
        tiers.append({"name": t.name, "path": str(t.root), "budget": t.budget, "used": sum(res.values()),
                      "shards": [{"sha256": sha, "bytes": size, "datasets": owners.get(sha, [])}
                                 for sha, size in sorted(res.items())]})
    return {"tiers": tiers}

