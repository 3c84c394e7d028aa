"""The `kvdata` command line: parsing and printing only; the work is in the library.

Every error kvdata raises on purpose becomes one line on stderr and a non-zero
exit code, never a traceback. `--json` output is stable (documented in docs/CLI.md).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import click

from ..errors import KVDataError
from .._util.sizes import format_size, parse_size

EXIT_ERROR = 1


class KVDataGroup(click.Group):
    """A click group that turns kvdata, OS and usage errors into one-line messages."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.UsageError as e:  # bad option value, missing argument: one line, exit 2
            hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            click.echo(f"kvdata: error: {e.format_message()}{hint}", err=True)
            sys.exit(2)
        except click.ClickException as e:
            click.echo(f"kvdata: error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("kvdata: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KVDataError as e:
            _die(str(e))
        except KeyError as e:
            _die(str(e.args[0]) if e.args else "key not found")
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            _die(f"{where}{e.strerror or e}")
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


def _die(msg: str) -> None:
    click.echo(f"kvdata: error: {msg.splitlines()[0] if msg else 'failed'}", err=True)
    sys.exit(EXIT_ERROR)


def _json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=1, sort_keys=True, default=str))


def _size_option(value: str | None) -> int | None:
    return None if value is None else parse_size(value, "--shard-size")


@click.group(cls=KVDataGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvdata")
def main() -> None:
    """kvdata: datasets as uncompressed LMDB shards with an O(1) memmap index."""


# ---------------------------------------------------------------- put / get / rm


def _walk_inputs(paths: tuple[str, ...], key: str | None) -> list[tuple[str, Path | None]]:
    """(key, file) pairs for files, directories (recursive) and '-' (stdin, file None)."""
    out: list[tuple[str, Path | None]] = []
    if key is not None and (len(paths) != 1 or (paths[0] != "-" and Path(paths[0]).is_dir())):
        raise click.UsageError("--key names one record: give exactly one file or '-'")
    for p in paths:
        if p == "-":
            if key is None:
                raise click.UsageError("reading stdin ('-') needs --key")
            out.append((key, None))
            continue
        path = Path(p)
        if path.is_dir():
            for f in sorted(path.rglob("*")):
                if f.is_file():
                    out.append((f.relative_to(path).as_posix(), f))
        elif path.is_file():
            out.append((key or path.name, path))
        else:
            raise click.BadParameter(f"{p}: no such file or directory", param_hint="PATH")
    return out


@main.command()
@click.argument("dataset", type=click.Path())
@click.argument("paths", nargs=-1, required=True)
@click.option("--key", "-k", help="Key for a single file or for stdin ('-').")
@click.option("--label", "-l", type=int, help="Integer label stored with each record.")
@click.option("--shard-size", help="Seal shards at this size when creating the dataset (e.g. 256MB).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def put(dataset: str, paths: tuple[str, ...], key: str | None, label: int | None, shard_size: str | None,
        as_json: bool) -> None:
    """Store files (key = file name), directories (key = relative path) or stdin ('-' with --key).

    Creates DATASET if it does not exist. All records commit together.
    """
    from ..reader.open import open_dataset as open_store
    from ..format import check_key
    from .._util.progress import progress

    items = _walk_inputs(paths, key)
    for k, _f in items:
        check_key(k)
    size = _size_option(shard_size)
    n = 0
    with open_store(dataset, "a", shard_size=size) as store:
        with progress(len(items), "put") as bar:
            for k, f in items:
                data = sys.stdin.buffer.read() if f is None else f.read_bytes()
                store.put(k, data, label=label)
                n += 1
                bar.update(1)
        gen = store.commit()
    if as_json:
        _json({"dataset": dataset, "put": n, "generation": gen})
    elif sys.stderr.isatty():
        click.echo(f"put {n} record(s) into {dataset} (generation {gen})", err=True)


def _value_bytes(value: Any, key: str, field: str | None) -> memoryview:
    import numpy as np

    if not isinstance(value, dict):
        if field is not None:
            raise KVDataError(f"record {key!r} holds plain bytes, it has no field {field!r}; drop --field")
        return memoryview(value)
    if field is None:
        big = [n for n, v in value.items() if isinstance(v, (np.ndarray, memoryview, bytes, str))]
        if len(big) != 1:
            raise KVDataError(f"record {key!r} has fields {', '.join(value)}; choose one with --field")
        field = big[0]
    if field not in value:
        raise KVDataError(f"record {key!r} has no field {field!r}; it has {', '.join(value)}")
    v = value[field]
    if isinstance(v, np.ndarray):
        return memoryview(np.ascontiguousarray(v)).cast("B")
    if isinstance(v, str):
        return memoryview(v.encode("utf-8"))
    if isinstance(v, (bytes, memoryview)):
        return memoryview(v)
    return memoryview(str(v).encode("utf-8"))


@main.command()
@click.argument("dataset")
@click.argument("key")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), help="Write to FILE instead of stdout.")
@click.option("--field", "-f", help="For a record of fields: which field's raw bytes to write.")
@click.option("--json", "as_json", is_flag=True, help="Print the record's metadata instead of its bytes.")
def get(dataset: str, key: str, output: str | None, field: str | None, as_json: bool) -> None:
    """Write a record's raw bytes to stdout or FILE (or its metadata with --json)."""
    from ..reader.open import open_dataset

    with open_dataset(dataset) as store:
        pos = store.find(key)
        if pos is None:
            raise KVDataError(f"key {key!r} is not in {dataset}; list keys with `kvdata ls {dataset}`")
        if as_json:
            _json(store.record_info(pos))
            return
        data = _value_bytes(store.get_many([pos])[0], key, field)
        if output:
            tmp = Path(output + ".kvdata-tmp")
            tmp.write_bytes(data)
            os.replace(tmp, output)
        else:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()


@main.command()
@click.argument("dataset", type=click.Path())
@click.argument("keys", nargs=-1, required=True)
def rm(dataset: str, keys: tuple[str, ...]) -> None:
    """Delete records by key (all or none: a missing key changes nothing)."""
    from ..reader.open import open_dataset as open_store

    keys = tuple(dict.fromkeys(keys))  # a key named twice is deleted once
    with open_store(dataset) as reader:
        missing = [k for k in keys if k not in reader]
    if missing:
        raise KVDataError(f"key {missing[0]!r} is not in {dataset}; nothing was deleted")
    with open_store(dataset, "a") as store:
        for k in keys:
            store.delete(k)


# ---------------------------------------------------------------- ls / info


@main.command()
@click.argument("dataset", type=click.Path())
@click.option("--long", "-l", "long_", is_flag=True, help="Show index, shard, slot, label and size.")
@click.option("--limit", "-n", type=click.IntRange(min=0), help="Show at most N records.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per record, as a list.")
def ls(dataset: str, long_: bool, limit: int | None, as_json: bool) -> None:
    """List keys in sample order."""
    from ..reader.open import open_dataset

    with open_dataset(dataset) as store:
        stop = len(store) if limit is None else min(limit, len(store))
        rows = _iter_described(store, stop)
        if as_json:
            _json(list(rows))
            return
        for r in rows:
            if long_:
                label = "-" if r["label"] is None else r["label"]
                click.echo(f"{r['index']:>9} {r['shard']:>6}:{r['slot']:<7} {label!s:>6} {r['bytes']:>10}  {r['key']}")
            else:
                click.echo(r["key"])


def _iter_described(store: Any, stop: int) -> Iterator[dict[str, Any]]:
    for start in range(0, stop, 4096):
        yield from store.describe(start, min(stop, start + 4096))


def dataset_info(store: Any) -> dict[str, Any]:
    """What `kvdata info --json` prints."""
    m = store.manifest
    disk = sum(f.stat().st_size for f in store.root.rglob("*") if f.is_file()) if store.home is None \
        or store.home.local_path("") is not None else None
    return {
        "dataset": str(store.root),
        "format_version": m["version"],
        "generation": m["generation"],
        "samples": len(store),
        "sealed_shards": len(m["shards"]),
        "tail_records": m["tail"]["records"],
        "shard_size": m["shard_size"],
        "bytes_on_disk": disk,
        "bytes_sealed": sum(s["bytes"] for s in m["shards"]),
        "bytes_compressed": sum(s["zst"]["bytes"] for s in m["shards"] if s.get("zst")),
        "fields": m.get("fields") or {},
        "classes": len(m.get("classes") or []),
        "labelled": bool(len(store)) and bool((store.labels != -(2**63)).any()),
    }


@main.command()
@click.argument("dataset", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def info(dataset: str, as_json: bool) -> None:
    """Samples, shards, bytes on disk, fields and generation."""
    from ..reader.open import open_dataset

    with open_dataset(dataset) as store:
        d = dataset_info(store)
    if as_json:
        _json(d)
        return
    click.echo(f"dataset      {d['dataset']}")
    click.echo(f"samples      {d['samples']}")
    click.echo(f"shards       {d['sealed_shards']} sealed + tail ({d['tail_records']} records), "
               f"sealed at {format_size(d['shard_size'])}")
    local = "remote home" if d["bytes_on_disk"] is None else format_size(d["bytes_on_disk"])
    click.echo(f"on disk      {local} ({format_size(d['bytes_compressed'])} zstd copies)")
    click.echo(f"generation   {d['generation']} (format {d['format_version']})")
    click.echo(f"classes      {d['classes']}")
    for name, spec in d["fields"].items():
        shape = spec.get("shape")
        shape_s = "x".join("?" if s is None else str(s) for s in shape) if shape else ""
        click.echo(f"field        {name}: {spec.get('dtype', spec.get('type'))} {shape_s}".rstrip())


# ---------------------------------------------------------------- maintenance


@main.command()
@click.argument("dataset", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def verify(dataset: str, as_json: bool) -> None:
    """Check shard checksums, every record's crc32 and the index; exit 1 naming what is bad."""
    from ..reader.open import verify as run_verify

    report = run_verify(dataset)
    if as_json:
        _json(report)
    else:
        for b in report["bad_shards"]:
            click.echo(f"BAD shard {b['shard']}: {b['problem']}", err=True)
        for b in report["bad_records"]:
            click.echo(f"BAD key {b['key']!r} (shard {b['shard']} slot {b['slot']}): {b['problem']}", err=True)
        for p in report["index_problems"]:
            click.echo(f"BAD index: {p}", err=True)
        if report["ok"]:
            click.echo(f"ok: {report['records_checked']} records in {report['shards']} shards, "
                       f"{report['samples']} samples, generation {report['generation']}")
    if not report["ok"]:
        if not as_json:
            click.echo(f"kvdata: error: {dataset} failed verification; restore the named shards "
                       "from a copy or run `kvdata reindex` for index problems", err=True)
        sys.exit(EXIT_ERROR)


@main.command()
@click.argument("dataset", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def reindex(dataset: str, as_json: bool) -> None:
    """Rebuild the side-index (and a lost manifest) from the shards alone."""
    from ..store.rebuild import reindex as run_reindex

    summary = run_reindex(dataset)
    if as_json:
        _json(summary)
    else:
        click.echo(f"reindexed {summary['samples']} samples from {summary['shards']} sealed shards + tail "
                   f"(generation {summary['generation']})")


from . import cache, imports  # noqa: E402  (register the remaining commands)

imports.register(main)
cache.register(main)
