"""Importing Arrow data: Parquet files and Hugging Face `datasets` saved with `save_to_disk`.

One record per row and one field per column, with its type kept (arrow_types.py says how
each Arrow type becomes a field). Image columns (binary image bytes, or the struct
{bytes, path} of HF's Image feature) are stored as their bytes, or decoded to HWC uint8
pixels with decode="rgb"/"gray".

This module is the driver: the public entry points, a batch's rows converted into records,
the image-decoding workers and their shared-memory hand-off, the one writer and the summary.
Finding and opening the inputs and checking their schemas into a plan is arrow_sources.py.

Everything that can be checked without reading rows (the files, their schemas, the key,
label and column names) is checked before the dataset is opened. Rows are read BATCH_ROWS
at a time (pyarrow's Parquet batches, IPC record batches through a memory map), so memory
holds two batches whatever the input's size: worker processes decode batch k + 1's images
while the parent -- the one writer -- puts batch k. The import is one commit at the end:
a bad record fails it with nothing committed, or with skip_bad is left out and listed.

pyarrow is imported only when an import runs; `datasets` is never needed to read.

Workers pay off when decoding dominates: the parent still reads, converts and writes every
row. On 2 shared cores, 2,000 images, --decode rgb: 64x64 PNGs 3.5-3.6k -> 3.8-4.2k images/s
with --workers 2 instead of 1; 256x256 JPEGs 630-700 -> 920-940 images/s.
"""

from __future__ import annotations

import json
import mmap
import multiprocessing
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .. import format as fmt
from .._util.progress import progress as make_progress
from ..errors import ConfigError, InvalidKeyError, InvalidValueError
from . import shared_ring
from .arrow_sources import ImportPlan, Source, batches, find_files, find_hf, plan_sources
from .arrow_types import BYTES, IMAGE, INSTALL, BadValue, NoBytes, column_values
from .common import DROP, IMAGE_FIELD, LABEL_FIELD, parse_fields, rename, summary
from .records import check_common, decode_image, decode_workers, looks_like_image
from .target import Target, import_entry, open_target, refuse_existing, start_pool

REGION_BYTES = 64 << 20   # decoded pixels of one batch that workers hand over in shared memory
MAX_BAD_LISTED = 1000     # bad records a summary lists (all are counted)
EXTRA_KEY = "import"      # the manifest key (Manifest.extra) that records the source's split and schema


class Row(NamedTuple):
    """A converted row: key (None: bad), fields without decoded images, label, where, why bad."""

    key: str | None
    fields: dict[str, Any]
    label: int | None
    where: str
    bad: str | None


# ---------------------------------------------------------------- public entry points

@import_entry
def import_parquet(sources: Sequence[str | os.PathLike[str]], dataset: str | os.PathLike[str], *,
                   key: str | None = None, label: str | None = None, columns: Sequence[str] | None = None,
                   images: Sequence[str] = (), decode: str = "none", workers: int = 0, skip_bad: bool = False,
                   shard_size: int | str | None = None, compress: bool = False,
                   progress: bool | None = None, existing: str = "refuse",
                   fields: Sequence[str] | Mapping[str, str] | None = None) -> dict[str, Any]:
    """Import Parquet files (files, or directories searched for *.parquet) into `dataset`.

    Keys come from the `key` column, else "<file name without .parquet>/<row:09d>". `label`
    names an integer column for the index label (default: the one ClassLabel column of
    HF-written files, if any). `columns` keeps a subset. Image columns are those named in
    `images`, HF Image features, {bytes, path} structs and binary columns whose first value
    is an image file; they are decoded with decode="rgb"/"gray". existing: what to do with a
    dataset already there ("refuse", "append", "overwrite": target.py).
    """
    started = time.perf_counter()
    _check_options(decode, workers, shard_size, "parquet")
    refuse_existing(dataset, existing)
    files = find_files(sources, (".parquet",), unique=key is None)
    if not files:
        raise ConfigError(f"{', '.join(map(str, sources))}: no .parquet files found; pass Parquet files or "
                          "a directory that holds them")
    srcs = [Source(p, n, "parquet") for p, n in files]
    return _import(srcs, dataset, kind="parquet", split=None, key=key, label=label, columns=columns,
                   images=images, decode=decode, workers=workers, skip_bad=skip_bad, shard_size=shard_size,
                   compress=compress, progress=progress, started=started, features=None, existing=existing,
                   fields=fields)


@import_entry
def import_hf(src: str | os.PathLike[str], dataset: str | os.PathLike[str], *, split: str | None = None,
              key: str | None = None, label: str | None = None, columns: Sequence[str] | None = None,
              images: Sequence[str] = (), decode: str = "none", workers: int = 0, skip_bad: bool = False,
              shard_size: int | str | None = None, compress: bool = False,
              progress: bool | None = None, existing: str = "refuse",
              fields: Sequence[str] | Mapping[str, str] | None = None) -> dict[str, Any]:
    """Import a Hugging Face dataset saved with `save_to_disk` (a Dataset, or one `split` of a
    DatasetDict), or a folder of Parquet/Arrow files (`split` keeps the files named for it).

    Read with pyarrow alone. Keys are "<split>/<row:09d>" (the row's index in the split)
    unless `key` names a column; the ClassLabel column, if there is one, is the label and
    its names the dataset's classes; Image features are decoded with `decode`. The split
    and the features (as JSON) are recorded in the manifest under "import". existing: as for
    import_parquet.
    """
    started = time.perf_counter()
    _check_options(decode, workers, shard_size, "hf")
    refuse_existing(dataset, existing)
    srcs, split, features = find_hf(Path(src), split)
    return _import(srcs, dataset, kind="hf", split=split, key=key, label=label, columns=columns, images=images,
                   decode=decode, workers=workers, skip_bad=skip_bad, shard_size=shard_size, compress=compress,
                   progress=progress, started=started, features=features, existing=existing, fields=fields)


# ---------------------------------------------------------------- converting a batch (parent)

def _convert(batch: Any, plan: ImportPlan, src: Source, first_row: int, key_first: int, key_base: str,
             decode: str) -> tuple[list[Row], list[tuple[tuple[str, Any], ...]]]:
    """The rows of one batch (rows first_row.. of `src`, numbered key_first.. in generated
    keys), and for each the image bytes workers decode (empty: none)."""
    cols = {c.name: column_values(c, batch.column(c.name)) for c in plan.columns}
    kinds = {c.name: c.kind for c in plan.columns}
    rows: list[Row] = []
    tasks: list[tuple[tuple[str, Any], ...]] = []
    for i in range(batch.num_rows):
        r = first_row + i
        where = f"{src.path}: row {r}"
        problem = None
        if plan.key is None:
            key: str | None = f"{key_base}/{key_first + i:09d}"
        else:
            k = cols[plan.key][i]
            key = None if k is None else str(k)
            if key is None:
                problem = f"the --key column {plan.key!r} is null"
        if key is not None:
            try:
                fmt.check_key(key)
            except InvalidKeyError as e:
                problem, key = str(e), None
        label = None if plan.label is None else cols[plan.label][i]
        if label is not None and not -(1 << 63) < label < (1 << 63):
            problem = f"label {label} does not fit in int64"
        fields: dict[str, Any] = {}
        imgs: list[tuple[str, Any]] = []
        for name in plan.stored:
            v = cols[name][i]
            if isinstance(v, BadValue):
                problem = problem or f"column {name!r}: {v}"
            elif isinstance(v, NoBytes):
                problem = problem or (f"column {name!r}: the image has no bytes, only the path {str(v)[:120]!r}; "
                                      "embed the images in the dataset before saving it")
            elif kinds[name] == IMAGE and decode != "none" and v is not None:
                imgs.append((name, v))
            else:
                fields[name] = v
        rows.append(Row(key, fields, label, where, problem))
        tasks.append(tuple(imgs) if problem is None else ())
    return rows, tasks


# ---------------------------------------------------------------- decoding images (workers)

def _decode_chunk(task: tuple[str, int, int, list[tuple[tuple[str, Any], ...]]]) -> list[dict[str, Any] | str]:
    """Decode the images of some rows: per row its decoded fields, or why one cannot be decoded
    (bad input never raises: the parent decides whether it fails the import). Pixels go into
    the ring's [start, start + size) while they fit, the rest travel back pickled."""
    decode, pos, size, rows = task
    place = shared_ring.Slice(pos, size).place
    out: list[dict[str, Any] | str] = []
    for imgs in rows:
        fields: dict[str, Any] | str = {}
        for name, data in imgs:
            try:
                px = decode_image(data, decode)
            except InvalidValueError as e:
                fields = f"column {name!r}: {e}"
                break
            assert isinstance(fields, dict)
            fields[name] = place(px)
        out.append(fields)
    return out


class _Done(NamedTuple):
    """Decoded results computed in-process (the interface of the pool's pending results)."""

    value: list[dict[str, Any] | str]

    def get(self) -> list[dict[str, Any] | str]:
        return self.value


class _Pending:
    """A batch the pool is decoding; get() waits and returns its rows' fields, pixels that
    came through the ring as views of it (valid until the region is decoded into again)."""

    def __init__(self, handle: Any, ring: mmap.mmap | None) -> None:
        self.handle, self.ring = handle, ring

    def get(self) -> list[dict[str, Any] | str]:
        ring = self.ring
        out: list[dict[str, Any] | str] = []
        for chunk in self.handle.get():
            for fields in chunk:
                if isinstance(fields, dict) and ring is not None:
                    fields = {name: shared_ring.view(ring, v) for name, v in fields.items()}
                out.append(fields)
        return out  # the only references to the views: the caller puts them and lets go


class Decoder:
    """Decodes each batch's images: in-process (workers <= 1), or by a fork pool that writes
    pixels into an anonymous shared mapping made before the fork, so they cross processes as
    (offset, shape) instead of pickles. The mapping has two REGION_BYTES regions: workers
    decode batch k + 1 into one while the parent puts batch k from the other; it has no name
    (no /dev/shm entry) and goes with the last process that maps it. Made before the store
    opens, so children inherit no LMDB handle or writer lock."""

    def __init__(self, workers: int, decode: str) -> None:
        self.workers, self.decode, self.turn = workers, decode, 0
        self.pool: Any = None
        self.ring: mmap.mmap | None = None
        if workers <= 1:
            return
        ctx: Any = multiprocessing.get_context()
        if "fork" in multiprocessing.get_all_start_methods():
            self.ring = shared_ring.make_ring(2, REGION_BYTES)
            ctx = multiprocessing.get_context("fork")
        # else spawn cannot hand the mapping over: results are pickled
        try:
            self.pool = start_pool(ctx, workers, shared_ring.init_worker, (self.ring,))  # they ignore Ctrl-C
        except BaseException:
            self.close()
            raise

    def submit(self, tasks: list[tuple[tuple[str, Any], ...]]) -> _Done | _Pending:
        """Start decoding one batch (one tuple of (column, bytes) per row; empty: no image)."""
        if self.pool is None or not any(tasks):
            return _Done([_decode_chunk((self.decode, 0, 0, [t]))[0] if t else {} for t in tasks])
        base = (self.turn % 2) * REGION_BYTES
        self.turn += 1
        work = [(self.decode, pos, size, part)
                for pos, size, part in shared_ring.split(tasks, self.workers * 2, base, REGION_BYTES)]
        return _Pending(self.pool.map_async(_decode_chunk, work, chunksize=1), self.ring)

    def close(self) -> None:
        shared_ring.close_pool(self.pool, self.ring)


# ---------------------------------------------------------------- writing

def _check_options(decode: str, workers: Any, shard_size: int | str | None, kind: str) -> None:
    """Reject bad settings (and a missing pyarrow or Pillow) before any file is read."""
    check_common(decode, workers, shard_size, "pip install 'kvdata[images]'")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ConfigError(f"`kvdata import {kind}` needs pyarrow; install it with `{INSTALL[kind]}`") from None


def _import(srcs: list[Source], dataset: str | os.PathLike[str], *, kind: str, split: str | None, key: str | None,
            label: str | None, columns: Sequence[str] | None, images: Sequence[str], decode: str, workers: int,
            skip_bad: bool, shard_size: int | str | None, compress: bool, progress: bool | None, started: float,
            features: dict[str, Any] | None, existing: str,
            fields: Sequence[str] | Mapping[str, str] | None = None) -> dict[str, Any]:
    """Read every source batch by batch, put each good row, commit once; the summary."""
    user_names = parse_fields(fields)
    plan, total = plan_sources(srcs, key=key, label=label, columns=columns, images=images, features=features)
    for src_name in user_names:
        if src_name not in plan.stored:
            raise ConfigError(f"--field {src_name}=...: no column {src_name!r} is stored; the columns are "
                              f"{', '.join(map(repr, plan.stored))}")
    names = [c.name for c in plan.columns]
    bad: list[tuple[str, str, str]] = []  # (key or "", where, why)
    seen: set[str] = set()
    labels: set[int] = set()
    sniff = {c.name for c in plan.columns if c.kind == BYTES and c.name not in images}
    kinds: dict[str, str] = {c.name: c.kind for c in plan.columns}
    n = 0
    decoder: Decoder | None = None
    bar: Any = None

    def field_names() -> dict[str, str]:
        """{column: field}: the label column is "label", the one image column "image" (common.py);
        --field over that. Asked per batch: a binary column is found to hold images at its first
        value (_sniff)."""
        out = {} if plan.label is None else {plan.label: LABEL_FIELD}
        imgs = [c.name for c in plan.columns if kinds[c.name] == IMAGE and c.name in plan.stored]
        if len(imgs) == 1:
            out[imgs[0]] = IMAGE_FIELD
        out.update(user_names)
        try:
            rename(dict.fromkeys(plan.stored), out)
        except ValueError as e:
            raise ConfigError(str(e).replace("fields", "columns", 1)) from None
        return out

    def put(target: Target, rows: list[Row], decoded: list[dict[str, Any] | str]) -> None:
        nonlocal n
        names = field_names()
        for row, dec in zip(rows, decoded):
            bar.update(1)
            problem = row.bad or (dec if isinstance(dec, str) else None)
            if problem is None and row.key in seen:
                problem = f"key {row.key!r} appears twice; keys must be unique (pick another --key column)"
            if problem is not None:
                shown = row.key or ""
                if not skip_bad:
                    raise InvalidValueError(f"{row.where}{f' (key {shown!r})' if shown else ''}: {problem}; "
                                            "nothing was imported (pass --skip-bad to leave such records out)")
                bad.append((shown, row.where, problem))
                continue
            assert row.key is not None and not isinstance(dec, str)
            seen.add(row.key)
            if not target.wants(row.key):
                continue
            value = {c: dec[c] if c in dec else row.fields[c] for c in plan.stored} if dec else row.fields
            value = rename(value, names)
            target.put(row.key, value, label=row.label)  # fields in column order, images decoded
            if row.label is not None:
                labels.add(row.label)
            n += 1

    try:
        decoder = Decoder(decode_workers(workers, decode), decode)  # decode="none": no pool
        bar = make_progress(total=total, label="import", enabled=progress)
        with open_target(dataset, existing, shard_size=shard_size, compress=compress) as target:
            if plan.classes is not None:
                target.set_classes(plan.classes, f"the column {plan.label!r}'s names")
            waiting: tuple[list[Row], Any] | None = None
            row_base = 0  # hf: keys number the split's rows across its files
            for src in srcs:
                first = 0
                key_base = (split or "data") if kind == "hf" else src.name
                for batch in batches(src, names):
                    if sniff:
                        _sniff(batch, sniff, kinds, plan)
                    rows, tasks = _convert(batch, plan, src, first, (row_base if kind == "hf" else 0) + first,
                                           key_base, decode)
                    first += batch.num_rows
                    handle = decoder.submit(tasks)
                    if waiting is not None:
                        put(target, waiting[0], waiting[1].get())
                    waiting = (rows, handle)
                row_base += first
            if waiting is not None:
                put(target, waiting[0], waiting[1].get())
            if n == 0 and not target.kept:
                raise InvalidValueError(f"no record could be imported ({len(bad)} bad); nothing was written")
            classes = len(plan.classes) if plan.classes is not None else target.number_classes(labels)
            target.store.set_extra(EXTRA_KEY, {
                "kind": kind, "split": split, "rows": n, "schema": plan.schema,
                "features": None if plan.features is None else json.dumps(plan.features, sort_keys=True),
            })
            target.commit()
    finally:
        if bar is not None:
            bar.close()
        if decoder is not None:
            decoder.close()
    out = summary(dataset, n, len(bad), classes, started, counts=target.counts())
    out["bad"] = [{"key": k, "where": w, "error": e} for k, w, e in bad[:MAX_BAD_LISTED]]
    out["records_per_s"] = round(n / max(time.perf_counter() - started, 1e-9), 1)
    stored = set(plan.stored)
    final = field_names()
    out["columns"] = {final.get(c.name, c.name): kinds[c.name] for c in plan.columns
                      if c.name in stored and final.get(c.name) != DROP}
    out["key"], out["label"], out["split"] = plan.key, plan.label, split
    return out


def _sniff(batch: Any, sniff: set[str], kinds: dict[str, str], plan: ImportPlan) -> None:
    """Binary columns become image columns if their first value is an image file (decided at
    the first batch with a non-null value; earlier rows had only nulls, so no row differs)."""
    for name in list(sniff):
        values = batch.column(name).drop_null()
        if len(values):
            first = values[0].as_py()
            if looks_like_image(first):
                kinds[name] = IMAGE
                i = next(i for i, c in enumerate(plan.columns) if c.name == name)
                plan.columns[i] = plan.columns[i]._replace(kind=IMAGE)
            sniff.discard(name)
