"""`kvdata put|get|rm|ls|info|verify|reindex|seal`: commands about a dataset's records.

The library is imported inside each command, so `kvdata --help` stays fast.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .._util.fsutil import unlink_quiet
from .._util.sizes import parse_size
from ..errors import KVDataError
from .output import EXIT_ERROR, error, format_size, print_json, progress

if TYPE_CHECKING:
    from ..store import Store

DESCRIBE_CHUNK = 4096  # records described per call while listing


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


@click.command()
@click.argument("dataset", type=click.Path())
@click.argument("paths", nargs=-1, required=True)
@click.option("--key", "-k", help="Key for a single file or for stdin ('-').")
@click.option("--label", "-l", type=int, help="Integer label stored with each record.")
@click.option("--shard-size", help="Seal shards at this size when creating the dataset (e.g. 256MB).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing on success.")
def put(dataset: str, paths: tuple[str, ...], key: str | None, label: int | None, shard_size: str | None,
        as_json: bool, quiet: bool) -> None:
    """Store files (key = file name), directories (key = relative path) or stdin ('-' with --key).

    Creates DATASET if it does not exist. All records commit together; says what it wrote
    ("put 2 records into DATASET (generation N)") unless --quiet.
    """
    from ..format import check_key
    from ..reader.open import open_dataset

    items = _walk_inputs(paths, key)
    for k, _f in items:
        check_key(k)
    size = None if shard_size is None else parse_size(shard_size, "--shard-size")
    n = 0
    with open_dataset(dataset, "a", shard_size=size) as store:
        with progress(len(items), "put") as bar:
            for k, f in items:
                data = sys.stdin.buffer.read() if f is None else f.read_bytes()
                store.put(k, data, label=label)
                n += 1
                bar.update(1)
        gen = store.commit()
    if as_json:
        print_json({"dataset": dataset, "put": n, "generation": gen})
    elif not quiet:
        click.echo(f"put {n} record{'' if n == 1 else 's'} into {dataset} (generation {gen})")


def _value_bytes(value: Any, key: str, field: str | None) -> memoryview:
    """The raw bytes `kvdata get` writes: the record itself, or one field of a record of fields."""
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
        return np.ascontiguousarray(v).data.cast("B")
    if isinstance(v, str):
        return memoryview(v.encode("utf-8"))
    if isinstance(v, (bytes, memoryview)):
        return memoryview(v)
    return memoryview(str(v).encode("utf-8"))


def _write_output(out: Path, data: memoryview) -> None:
    """Write `data` to OUT through a new temp file beside it, renamed onto OUT.

    The temp name is random and created O_CREAT|O_EXCL|O_NOFOLLOW (mode 0666 less the
    umask, as for any new file): a symlink or file planted at any temp name makes that
    attempt fail and is left untouched; nothing is written through it. OUT itself is
    replaced by rename: if OUT is a symlink, the link is replaced by a regular file and
    its target is never written (like `mv`, unlike shell redirection)."""
    from .._util.fsutil import create_exclusive
    from ..format import names

    try:
        fd, tmp = create_exclusive((out.with_name(names.temp_name(out.name, secrets.token_hex(8))) for _ in range(16)),
                                   str(out))
    except OSError as e:
        raise KVDataError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        with open(fd, "wb", closefd=True) as f:
            f.write(data)
        os.replace(tmp, out)
    except OSError as e:
        unlink_quiet(tmp)
        raise KVDataError(f"cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        unlink_quiet(tmp)
        raise


@click.command()
@click.argument("dataset")
@click.argument("key")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), help="Write to FILE instead of stdout.")
@click.option("--field", "-f", help="For a record of fields: which field's raw bytes to write.")
@click.option("--json", "as_json", is_flag=True, help="Print the record's metadata instead of its bytes.")
def get(dataset: str, key: str, output: str | None, field: str | None, as_json: bool) -> None:
    """Write a record's raw bytes to stdout or FILE (or its metadata with --json)."""
    with open_to_read(dataset) as store:
        pos = store.find(key)
        if pos is None:
            raise KVDataError(f"key {key!r} is not in {dataset}; list keys with `kvdata ls {dataset}`")
        if as_json:
            print_json(store.record_info(pos))
            return
        data = _value_bytes(store.get_many([pos])[0], key, field)
        if output:
            _write_output(Path(output), data)
        else:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()


@click.command()
@click.argument("dataset", type=click.Path())
@click.argument("keys", nargs=-1, required=True)
def rm(dataset: str, keys: tuple[str, ...]) -> None:
    """Delete records by key (all or none: a missing key changes nothing)."""
    from ..reader.open import open_dataset

    keys = tuple(dict.fromkeys(keys))  # a key named twice is deleted once
    with open_to_read(dataset) as reader:
        missing = [k for k in keys if k not in reader]
    if missing:
        raise KVDataError(f"key {missing[0]!r} is not in {dataset}; nothing was deleted")
    with open_dataset(dataset, "a") as store:
        for k in keys:
            store.delete(k)


# ---------------------------------------------------------------- ls / info


def open_to_read(dataset: str) -> Store:
    """`open_dataset(dataset)` for a read command; where there is no dataset yet but an import is
    building it (its parts directory DATASET.parts-PID beside it), the error says so."""
    from ..reader.open import open_dataset

    with said_if_being_built(dataset):
        return open_dataset(dataset)


@contextlib.contextmanager
def said_if_being_built(dataset: str) -> Iterator[None]:
    """A NotADatasetError about `dataset` says so when an import is building it (being_built)."""
    from ..errors import NotADatasetError

    try:
        yield
    except NotADatasetError as e:
        building = being_built(dataset)
        if building is None:
            raise
        raise NotADatasetError(building) from e


def being_built(dataset: str) -> str | None:
    """One line about the imports building `dataset` in parallel (importers.parts), or None."""
    from ..importers.parts import find_parts_dirs

    found = find_parts_dirs(dataset)  # (none beside a URL)
    if not found:
        return None
    path, pid, running = next(((p, i, r) for p, i, r in found if r), found[0])
    if running:
        return (f"{dataset} is being built by an import (process {pid}, its parts in {path}); "
                "try again when the import has finished")
    return (f"{dataset} is not a dataset: {path} was left by an import that was killed (process {pid} is gone); "
            "delete it and run the import again")


def _iter_described(store: Store, stop: int) -> Iterator[dict[str, Any]]:
    for start in range(0, stop, DESCRIBE_CHUNK):
        yield from store.describe(start, min(stop, start + DESCRIBE_CHUNK))


@click.command()
@click.argument("dataset", type=click.Path())
@click.option("--long", "-l", "long_", is_flag=True, help="Show index, shard, slot, label and size.")
@click.option("--limit", "-n", type=click.IntRange(min=0), help="Show at most N records.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per record, as a list.")
def ls(dataset: str, long_: bool, limit: int | None, as_json: bool) -> None:
    """List keys in sample order."""
    with open_to_read(dataset) as store:
        stop = len(store) if limit is None else min(limit, len(store))
        rows = _iter_described(store, stop)
        if as_json:
            print_json(list(rows))
            return
        for r in rows:
            if long_:
                label = "-" if r["label"] is None else r["label"]
                click.echo(f"{r['index']:>9} {r['shard']:>6}:{r['slot']:<7} {label!s:>6} {r['bytes']:>10}  {r['key']}")
            else:
                click.echo(r["key"])


def dataset_info(store: Store, dataset: str | None = None) -> dict[str, Any]:
    """What `kvdata info --json` prints. `dataset`: what the user named it; a URL is shown as
    given (the local directory it is read through -- a tier's index mirror, kvdatad's or this
    process's -- only as `served_from`), a path as the dataset's directory."""
    from ..homes import is_url

    m = store.manifest
    home = store.home
    local = home is None or home.local_path("") is not None
    disk = sum(f.stat().st_size for f in store.root.rglob("*") if f.is_file()) if local else None
    url = dataset is not None and is_url(dataset)
    return {
        "dataset": dataset if url else str(store.root),
        "served_from": str(store.root) if url else None,
        "format_version": m.version,
        "generation": m.generation,
        "samples": len(store),
        "sealed_shards": len(m.shards),
        "tail_records": m.tail.records,
        "shard_size": m.shard_size,
        "bytes_on_disk": disk,
        "bytes_sealed": sum(s.bytes for s in m.shards),
        "bytes_compressed": sum(s.zst.bytes for s in m.shards if s.zst is not None),
        "fields": dict(m.fields),
        "classes": len(m.classes),
        "labelled": bool(len(store)) and bool((store.labels != -(2**63)).any()),
    }


@click.command()
@click.argument("dataset", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def info(dataset: str, as_json: bool) -> None:
    """Samples, shards, bytes on disk, fields and generation."""
    with open_to_read(dataset) as store:
        d = dataset_info(store, dataset)
    if as_json:
        print_json(d)
        return
    click.echo(f"dataset      {d['dataset']}")
    if d["served_from"] is not None:
        click.echo(f"served from  {d['served_from']}")
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


@click.command()
@click.argument("dataset", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def verify(dataset: str, as_json: bool) -> None:
    """Check shard checksums, every record's crc32 and the index; exit 1 naming what is bad."""
    from ..reader.open import verify as run_verify

    with said_if_being_built(dataset):
        report = run_verify(dataset)
    if as_json:
        print_json(report)
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
            error(f"{dataset} failed verification; restore the named shards "
                  "from a copy or run `kvdata reindex` for index problems")
        sys.exit(EXIT_ERROR)


@click.command()
@click.argument("dataset", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def reindex(dataset: str, as_json: bool) -> None:
    """Rebuild the side-index (and a lost manifest) from the shards alone."""
    from ..store.rebuild import reindex as run_reindex

    summary = run_reindex(dataset)
    if as_json:
        print_json(summary)
    else:
        click.echo(f"reindexed {summary['samples']} samples from {summary['shards']} sealed shards + tail "
                   f"(generation {summary['generation']})")


@click.command()
@click.argument("dataset", type=click.Path(exists=True, file_okay=False))
def seal(dataset: str) -> None:
    """Seal the open tail shard so every record is in an immutable, stageable shard."""
    from ..reader.open import open_dataset

    with open_dataset(dataset, "a") as store:
        store.seal()
        gen = store.commit()
    click.echo(f"sealed {dataset} (generation {gen})")


COMMANDS: tuple[click.Command, ...] = (put, get, rm, ls, info, verify, reindex, seal)
