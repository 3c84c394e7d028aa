"""Importing Arrow data: Parquet files and Hugging Face `datasets` saved with `save_to_disk`.

One record per row and one field per column, with its type kept: integers, floats and
bools as numbers, strings as str, binary as bytes, lists (fixed-size or not, nested) of
numbers as numpy arrays, dates/times/decimals as ISO text, nulls as None. Image columns
(binary image bytes, or the struct {bytes, path} of HF's Image feature) are stored as
their bytes, or decoded to HWC uint8 pixels with decode="rgb"/"gray".

Everything that can be checked without reading rows (the files, their schemas, the key,
label and column names) is checked before the dataset is opened. Rows are read BATCH_ROWS
at a time (pyarrow's Parquet batches, IPC record batches through a memory map), so memory
holds two batches whatever the input's size: worker processes decode batch k + 1's images
while the parent -- the one writer -- puts batch k. The import is one commit at the end:
a bad record fails it with nothing committed, or with skip_bad is left out and listed.

pyarrow is imported only here, when an import runs; `datasets` is never needed to read.

Workers pay off when decoding dominates: the parent still reads, converts and writes every
row. On 2 shared cores, 2,000 images, --decode rgb: 64x64 PNGs 3.5-3.6k -> 3.8-4.2k images/s
with --workers 2 instead of 1; 256x256 JPEGs 630-700 -> 920-940 images/s.
"""

from __future__ import annotations

import io
import json
import mmap
import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .. import format as fmt
from .._util.progress import progress as make_progress
from .._util.sizes import parse_size
from ..errors import ConfigError, InvalidKeyError, InvalidValueError, KVDataError
from ..reader.open import open_dataset
from .common import summary

BATCH_ROWS = 256          # rows read, converted and decoded at a time
REGION_BYTES = 64 << 20   # decoded pixels of one batch that workers hand over in shared memory
MAX_BAD_LISTED = 1000     # bad records a summary lists (all are counted)
EXTRA_KEY = "import"      # the manifest key (Manifest.extra) that records the source's split and schema
DECODE_MODES = ("none", "rgb", "gray")
INSTALL = {"parquet": "pip install 'kvdata[parquet]'", "hf": "pip install 'kvdata[hf]'"}
# The formats Pillow may open: hostile bytes never reach its rarer decoders.
PIL_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP")
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")

# Column kinds: how a column's values become field values.
INT, FLOAT, BOOL, STR, BYTES, IMAGE, ARRAY, TEXT, NULL = ("int", "float", "bool", "str", "bytes", "image",
                                                          "array", "text", "null")


class Source(NamedTuple):
    """One input file: its path, its name in keys and messages, and how to read it."""

    path: str
    name: str
    kind: str  # "parquet" | "arrow"


class Column(NamedTuple):
    """One column to read: its name, kind and (arrays) leaf dtype and nesting depth."""

    name: str
    kind: str
    dtype: str | None = None
    depth: int = 0


class Row(NamedTuple):
    """A converted row: key (None: bad), fields without decoded images, label, where, why bad."""

    key: str | None
    fields: dict[str, Any]
    label: int | None
    where: str
    bad: str | None


class Plan(NamedTuple):
    """What every source is read with (checked against each source's schema first)."""

    columns: list[Column]   # every column read, in schema order
    stored: list[str]       # the column names that become fields
    key: str | None
    label: str | None
    classes: list[str] | None
    features: dict[str, Any] | None
    schema: dict[str, str]  # column -> its Arrow type, as recorded in the manifest


# ---------------------------------------------------------------- public entry points

def import_parquet(sources: Sequence[str | os.PathLike[str]], dataset: str | os.PathLike[str], *,
                   key: str | None = None, label: str | None = None, columns: Sequence[str] | None = None,
                   images: Sequence[str] = (), decode: str = "none", workers: int = 0, skip_bad: bool = False,
                   shard_size: int | str | None = None, compress: bool = False,
                   progress: bool | None = None) -> dict[str, Any]:
    """Import Parquet files (files, or directories searched for *.parquet) into `dataset`.

    Keys come from the `key` column, else "<file name without .parquet>/<row:09d>". `label`
    names an integer column for the index label (default: the one ClassLabel column of
    HF-written files, if any). `columns` keeps a subset. Image columns are those named in
    `images`, HF Image features, {bytes, path} structs and binary columns whose first value
    is an image file; they are decoded with decode="rgb"/"gray".
    """
    started = time.perf_counter()
    _check_options(decode, workers, shard_size, "parquet")
    files = find_files(sources, (".parquet",), unique=key is None)
    if not files:
        raise ConfigError(f"{', '.join(map(str, sources))}: no .parquet files found; pass Parquet files or "
                          "a directory that holds them")
    srcs = [Source(p, n, "parquet") for p, n in files]
    return _import(srcs, dataset, kind="parquet", split=None, key=key, label=label, columns=columns,
                   images=images, decode=decode, workers=workers, skip_bad=skip_bad, shard_size=shard_size,
                   compress=compress, progress=progress, started=started, features=None)


def import_hf(src: str | os.PathLike[str], dataset: str | os.PathLike[str], *, split: str | None = None,
              key: str | None = None, label: str | None = None, columns: Sequence[str] | None = None,
              images: Sequence[str] = (), decode: str = "none", workers: int = 0, skip_bad: bool = False,
              shard_size: int | str | None = None, compress: bool = False,
              progress: bool | None = None) -> dict[str, Any]:
    """Import a Hugging Face dataset saved with `save_to_disk` (a Dataset, or one `split` of a
    DatasetDict), or a folder of Parquet/Arrow files (`split` keeps the files named for it).

    Read with pyarrow alone. Keys are "<split>/<row:09d>" (the row's index in the split)
    unless `key` names a column; the ClassLabel column, if there is one, is the label and
    its names the dataset's classes; Image features are decoded with `decode`. The split
    and the features (as JSON) are recorded in the manifest under "import".
    """
    started = time.perf_counter()
    _check_options(decode, workers, shard_size, "hf")
    srcs, split, features = find_hf(Path(src), split)
    return _import(srcs, dataset, kind="hf", split=split, key=key, label=label, columns=columns, images=images,
                   decode=decode, workers=workers, skip_bad=skip_bad, shard_size=shard_size, compress=compress,
                   progress=progress, started=started, features=features)


# ---------------------------------------------------------------- finding the files

def _pa() -> Any:
    """pyarrow, or one line naming the extra that installs it."""
    try:
        import pyarrow
    except ImportError:
        raise ConfigError("reading Parquet/Arrow needs pyarrow; install it with "
                          f"`{INSTALL['parquet']}`") from None
    return pyarrow


def find_files(sources: Sequence[str | os.PathLike[str]], suffixes: tuple[str, ...],
               unique: bool = True) -> list[tuple[str, str]]:
    """(path, name) of every file named, or found under a directory named (sorted, symlinks
    not followed); the name is the path relative to that directory, without its suffix, and
    with `unique` (names make keys) no two may be equal."""
    out: list[tuple[str, str]] = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            found = []
            for dirpath, dirnames, filenames in os.walk(p):  # os.walk does not enter symlinked dirs
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for f in filenames:
                    full = Path(dirpath) / f
                    if f.endswith(suffixes) and not f.startswith(".") and not full.is_symlink():
                        found.append(full)
            for full in sorted(found):
                rel = full.relative_to(p).as_posix()
                out.append((str(full), _strip(rel, suffixes)))
        elif p.is_file():
            out.append((str(p), _strip(p.name, suffixes)))
        else:
            raise ConfigError(f"{p}: no such file or directory; check the path")
    names = [n for _p, n in out]
    if unique and len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"two inputs are both named {dup!r} (their rows would get the same keys); "
                          "pass them from one directory, or use --key")
    return out


def _strip(name: str, suffixes: tuple[str, ...]) -> str:
    for s in suffixes:
        if name.endswith(s):
            return name[: -len(s)]
    return name


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name


def _read_json(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read(16 << 20)
        return json.loads(data)
    except (OSError, ValueError) as e:
        raise InvalidValueError(f"{path}: cannot read this JSON file ({type(e).__name__}); "
                                "save the dataset again with save_to_disk") from None


def find_hf(src: Path, split: str | None) -> tuple[list[Source], str | None, dict[str, Any] | None]:
    """(files, split, features) of a saved Dataset / DatasetDict or a folder of Parquet/Arrow files."""
    if not src.is_dir():
        raise ConfigError(f"{src}: no such directory; pass the folder save_to_disk wrote (or one of Parquet/Arrow files)")
    if (src / "dataset_dict.json").is_file():
        splits = _read_json(src / "dataset_dict.json")
        splits = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(splits, list) or not all(_plain_name(s) for s in splits):
            raise InvalidValueError(f"{src / 'dataset_dict.json'}: 'splits' is not a list of split names; "
                                    "save the DatasetDict again")
        if split is None:
            if len(splits) != 1:
                raise ConfigError(f"{src} holds the splits {', '.join(splits)}; choose one with --split")
            split = splits[0]
        if split not in splits:
            raise ConfigError(f"--split {split!r}: {src} holds the splits {', '.join(splits)}")
        sub = src / split
        if sub.is_symlink() or not sub.is_dir():
            raise InvalidValueError(f"{sub}: the split's folder is missing (or a symlink); save the DatasetDict again")
        srcs, _own, features = _saved_dataset(sub)
        return srcs, split, features
    if (src / "state.json").is_file():
        srcs, own, features = _saved_dataset(src)
        if split is not None and own is not None and split != own:
            raise ConfigError(f"--split {split!r}: {src} is the saved split {own!r}; leave --split out")
        return srcs, split or own, features
    files = find_files([src], (".parquet", ".arrow"))
    if split is not None:
        files = [(p, n) for p, n in files if _names_split(n, split)]
        if not files:
            raise ConfigError(f"--split {split!r}: no Parquet/Arrow file under {src} is named for it "
                              f"(expected e.g. {split}-00000-of-00001.parquet or {split}/...)")
    if not files:
        raise ConfigError(f"{src}: not a saved Hugging Face dataset (no state.json or dataset_dict.json) and "
                          "no .parquet/.arrow files; pass the folder save_to_disk wrote")
    return [Source(p, n, "parquet" if p.endswith(".parquet") else "arrow") for p, n in files], split, None


def _names_split(name: str, split: str) -> bool:
    """Whether a file (name relative to the folder, no suffix) holds `split`, by the Hub's layouts."""
    parts = name.split("/")
    return split in parts[:-1] or any(parts[-1].startswith(split + c) for c in "-_.") or parts[-1] == split


def _saved_dataset(d: Path) -> tuple[list[Source], str | None, dict[str, Any] | None]:
    """The Arrow files of one saved Dataset (state.json's _data_files, confined to `d`)."""
    state = _read_json(d / "state.json")
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InvalidValueError(f"{d / 'state.json'}: no _data_files list; save the dataset again with save_to_disk")
    srcs = []
    for e in entries:
        name = e.get("filename") if isinstance(e, dict) else None
        if not isinstance(name, str) or not _plain_name(name):
            raise InvalidValueError(f"{d / 'state.json'}: data file {str(name)[:80]!r} is not a file name in "
                                    f"{d}; save the dataset again")
        p = d / name
        if p.is_symlink() or not p.is_file():
            raise InvalidValueError(f"{p}: the data file state.json names is missing (or a symlink); "
                                    "save the dataset again")
        srcs.append(Source(str(p), _strip(name, (".arrow",)), "arrow"))
    own = state.get("_split")
    features = None
    if (d / "dataset_info.json").is_file():
        info = _read_json(d / "dataset_info.json")
        if isinstance(info, dict) and isinstance(info.get("features"), dict):
            features = info["features"]
    return srcs, own if isinstance(own, str) else None, features


# ---------------------------------------------------------------- reading (pyarrow)

def _open_error(src: Source, e: BaseException) -> InvalidValueError:
    what = "Parquet" if src.kind == "parquet" else "Arrow IPC"
    reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
    return InvalidValueError(f"{src.path}: not a readable {what} file ({reason}); pass {what} files only")


def _schema(src: Source) -> tuple[Any, int]:
    """(schema, rows) of one source, read from its metadata / batch headers only."""
    pa = _pa()
    try:
        if src.kind == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(src.path)
            return pf.schema_arrow, int(pf.metadata.num_rows)
        rows = 0
        with pa.memory_map(src.path) as mm:
            reader = _ipc_reader(pa, mm)
            for batch in reader:
                rows += batch.num_rows
            return reader.schema, rows
    except KVDataError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for files that are not its format
        raise _open_error(src, e) from None


def _ipc_reader(pa: Any, mm: Any) -> Any:
    """The record batches of an Arrow IPC file (file or stream format, as save_to_disk writes)."""
    import pyarrow.ipc as ipc

    try:
        f = ipc.open_file(mm)
    except pa.ArrowInvalid:
        mm.seek(0)
        return ipc.open_stream(mm)

    class _File:
        schema = f.schema

        def __iter__(self) -> Iterator[Any]:
            return (f.get_batch(i) for i in range(f.num_record_batches))
    return _File()


def _batches(src: Source, names: list[str]) -> Iterator[Any]:
    """Record batches of at most BATCH_ROWS rows holding `names`; damage names the file."""
    pa = _pa()
    try:
        if src.kind == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(src.path)
            for b in pf.iter_batches(batch_size=BATCH_ROWS, columns=names, use_threads=False):
                yield b
            return
        with pa.memory_map(src.path) as mm:
            for b in _ipc_reader(pa, mm):
                b.validate(full=True)  # IPC buffers are used in place: offsets must be checked first
                b = b.select(names)
                for start in range(0, b.num_rows, BATCH_ROWS):
                    yield b.slice(start, BATCH_ROWS)
    except KVDataError:
        raise
    except Exception as e:
        raise _open_error(src, e) from None


# ---------------------------------------------------------------- the plan (schemas only)

def _storage(t: Any) -> Any:
    pa = _pa()
    while isinstance(t, pa.ExtensionType):
        t = t.storage_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    return t


def _column(name: str, t: Any, image: bool, where: str) -> Column:
    """How a column of Arrow type `t` is stored, or one line saying it cannot be."""
    pa = _pa()
    types = pa.types
    t = _storage(t)
    if types.is_struct(t) and {t.field(i).name for i in range(t.num_fields)} == {"bytes", "path"} \
            and _is_binary(t.field("bytes").type):
        return Column(name, IMAGE)
    if _is_binary(t):
        return Column(name, IMAGE if image else BYTES)
    if image:
        raise ConfigError(f"{where}: column {name!r} is {t}, not image bytes; name binary columns with --image")
    if types.is_boolean(t):
        return Column(name, BOOL)
    if types.is_integer(t):
        return Column(name, INT)
    if types.is_floating(t):
        return Column(name, FLOAT)
    if types.is_string(t) or types.is_large_string(t) or getattr(types, "is_string_view", lambda _t: False)(t):
        return Column(name, STR)
    if types.is_temporal(t) or types.is_decimal(t):
        return Column(name, TEXT)
    if types.is_null(t):
        return Column(name, NULL)
    depth, leaf = 0, t
    while _is_list(leaf):
        depth, leaf = depth + 1, _storage(leaf.value_type)
    if depth and (types.is_integer(leaf) or types.is_floating(leaf) or types.is_boolean(leaf)):
        return Column(name, ARRAY, np.dtype(leaf.to_pandas_dtype()).str, depth)
    raise ConfigError(f"{where}: column {name!r} has type {t}, which kvdata cannot store as a field "
                      "(numbers, strings, bytes, images and lists of numbers can be); leave it out with --columns")


def _is_binary(t: Any) -> bool:
    types = _pa().types
    return bool(types.is_binary(t) or types.is_large_binary(t) or types.is_fixed_size_binary(t)
                or getattr(types, "is_binary_view", lambda _t: False)(t))


def _is_list(t: Any) -> bool:
    types = _pa().types
    return bool(types.is_list(t) or types.is_large_list(t) or types.is_fixed_size_list(t)
                or getattr(types, "is_list_view", lambda _t: False)(t)
                or getattr(types, "is_large_list_view", lambda _t: False)(t))


def _hf_features(schema: Any) -> dict[str, Any] | None:
    """The features HF writes into the schema metadata of its Arrow and Parquet files."""
    meta = schema.metadata or {}
    raw = meta.get(b"huggingface")
    if not raw or len(raw) > (16 << 20):
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    feats = info.get("info", {}).get("features") if isinstance(info, dict) else None
    return feats if isinstance(feats, dict) else None


def _plan(srcs: list[Source], *, key: str | None, label: str | None, columns: Sequence[str] | None,
          images: Sequence[str], features: dict[str, Any] | None) -> tuple[Plan, int]:
    """Check every source's schema against the options; (plan, total rows). Nothing is written."""
    plan: Plan | None = None
    total = 0
    for src in srcs:
        schema, rows = _schema(src)
        total += rows
        names = list(schema.names)
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise InvalidValueError(f"{src.path}: column names must be unique and non-empty; rename the columns")
        if plan is None:
            features = features if features is not None else _hf_features(schema)
            plan = _first_plan(src, schema, key=key, label=label, columns=columns, images=images, features=features)
        for col in plan.columns:
            if col.name not in names:
                role = "the --key column" if col.name == plan.key else "the --label column" \
                    if col.name == plan.label else f"which {srcs[0].path} has"
                raise ConfigError(f"{src.path}: has no column {col.name!r} ({role}); its columns are "
                                  f"{_listed(names)}; import files with one schema together")
            got = _column(col.name, schema.field(col.name).type, col.kind == IMAGE, src.path)
            if (got.kind != col.kind and {got.kind, col.kind} != {BYTES, IMAGE}) or got.dtype != col.dtype \
                    or got.depth != col.depth:
                raise ConfigError(f"{src.path}: column {col.name!r} is {schema.field(col.name).type}, unlike in "
                                  f"{srcs[0].path}; import files with one schema together")
    assert plan is not None
    return plan, total


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:20])
    return shown + (f" and {len(names) - 20} more" if len(names) > 20 else "")


def _first_plan(src: Source, schema: Any, *, key: str | None, label: str | None, columns: Sequence[str] | None,
                images: Sequence[str], features: dict[str, Any] | None) -> Plan:
    names = list(schema.names)
    feats = features or {}
    class_cols = [n for n, f in feats.items() if isinstance(f, dict) and f.get("_type") == "ClassLabel"]
    image_cols = {n for n, f in feats.items() if isinstance(f, dict) and f.get("_type") == "Image"} | set(images)
    for opt, name in (("--key", key), ("--label", label)):
        if name is not None and name not in names:
            raise ConfigError(f"{opt} {name!r}: {src.path} has no such column; its columns are {_listed(names)}")
    for name in images:
        if name not in names:
            raise ConfigError(f"--image {name!r}: {src.path} has no such column; its columns are {_listed(names)}")
    stored = list(names) if columns is None else list(dict.fromkeys(columns))
    missing = [c for c in stored if c not in names]
    if missing:
        raise ConfigError(f"--columns: {src.path} has no column {missing[0]!r}; its columns are {_listed(names)}")
    if not stored:
        raise ConfigError("--columns: name at least one column to keep")
    if label is None and len(class_cols) == 1 and class_cols[0] in names:
        label = class_cols[0]
    wanted = set(stored) | {c for c in (key, label) if c is not None}
    cols = [_column(n, schema.field(n).type, n in image_cols, src.path) for n in names if n in wanted]
    kinds = {c.name: c.kind for c in cols}
    if key is not None and kinds[key] not in (INT, STR):
        raise ConfigError(f"--key {key!r}: the column is {schema.field(key).type}; keys come from a string or "
                          "integer column")
    if label is not None and kinds[label] != INT:
        raise ConfigError(f"--label {label!r}: the column is {schema.field(label).type}; labels come from an "
                          "integer (or ClassLabel) column")
    classes = None
    if label is not None and isinstance(feats.get(label), dict) and feats[label].get("_type") == "ClassLabel":
        got = feats[label].get("names")
        if isinstance(got, list) and all(isinstance(c, str) for c in got):
            classes = list(got)
    return Plan(cols, stored, key, label, classes, features,
                {n: str(schema.field(n).type) for n in names if n in wanted})


# ---------------------------------------------------------------- converting a batch (parent)

def _values(col: Column, arr: Any) -> list[Any]:
    """Field values of one column of a batch (None for nulls)."""
    pa = _pa()
    if isinstance(arr, pa.ChunkedArray):
        arr = pa.concat_arrays(arr.chunks) if arr.num_chunks != 1 else arr.chunk(0)
    while isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if col.kind == ARRAY:
        return _arrays(arr, np.dtype(col.dtype), col.depth)
    if col.kind == IMAGE and pa.types.is_struct(arr.type):
        children = dict(zip((arr.type.field(i).name for i in range(arr.type.num_fields)), arr.flatten()))
        out: list[Any] = []
        for d, p, ok in zip(children["bytes"].to_pylist(), children["path"].to_pylist(), arr.is_valid().to_pylist()):
            if not ok or (d is None and p is None):
                out.append(None)
            else:
                out.append(_NoBytes(p) if d is None else d)
        return out
    values = arr.to_pylist()
    if col.kind == FLOAT:
        return [None if v is None else float(v) for v in values]  # float16 comes as numpy scalars
    if col.kind == TEXT:
        return [None if v is None else v.isoformat() if hasattr(v, "isoformat") else str(v) for v in values]
    return values


class _NoBytes(str):
    """An image entry that has only a path (its file is not read: paths in data are not trusted)."""


def _arrays(arr: Any, dtype: np.dtype, depth: int) -> list[Any]:
    """Numpy arrays of a list column; an entry holding nulls or ragged inner lists becomes a
    _Bad string naming the problem."""
    pa = _pa()
    n = len(arr)
    valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool) if arr.null_count else None
    if depth == 1 and (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        offsets = arr.offsets.to_numpy()
        child = arr.values
        flat = child.to_numpy(zero_copy_only=False)
        bad_child = None if not child.null_count else child.is_null().to_numpy(zero_copy_only=False)
        if bad_child is not None:
            flat = np.where(bad_child, 0, flat)  # the rows holding them are bad; no NaN cast to int
        flat = flat.astype(dtype, copy=False)
        out: list[Any] = []
        for i in range(n):
            if valid is not None and not valid[i]:
                out.append(None)
                continue
            a, b = int(offsets[i]), int(offsets[i + 1])
            if bad_child is not None and bad_child[a:b].any():
                out.append(_Bad("a null inside the list"))
            else:
                out.append(flat[a:b])
        return out
    if valid is None and _all_fixed(arr.type) and _no_nulls_below(arr):
        shape: list[int] = []
        flat = arr
        while pa.types.is_fixed_size_list(flat.type):
            shape.append(flat.type.list_size)
            flat = flat.flatten()
        values = flat.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(n, *shape)
        return list(values)
    leaf = arr
    while _is_list(leaf.type):
        leaf = leaf.flatten()
    nulls_inside = leaf.null_count > 0  # np.asarray would make a float null NaN: look for them
    out = []
    for v in arr.to_pylist():
        if v is None:
            out.append(None)
            continue
        if nulls_inside and _has_none(v):
            out.append(_Bad("a null inside the list"))
            continue
        try:
            got = np.asarray(v, dtype=dtype)
        except (ValueError, TypeError):  # ragged inner lists, or a null inside
            out.append(_Bad("ragged inner lists or a null inside the list"))
            continue
        out.append(got if got.ndim == depth else _Bad("ragged inner lists"))
    return out


def _has_none(v: list[Any]) -> bool:
    level = v
    while level:
        if any(x is None for x in level):
            return True
        level = [y for x in level if isinstance(x, list) for y in x]
    return False


def _all_fixed(t: Any) -> bool:
    types = _pa().types
    while types.is_fixed_size_list(t):
        t = _storage(t.value_type)
    return not _is_list(t)


def _no_nulls_below(arr: Any) -> bool:
    types = _pa().types
    while types.is_fixed_size_list(arr.type):
        arr = arr.flatten()
        if arr.null_count:
            return False
    return True


class _Bad(str):
    """A value that makes its row bad (the text says why)."""


def _convert(batch: Any, plan: Plan, src: Source, first_row: int, key_first: int, key_base: str,
             decode: str) -> tuple[list[Row], list[tuple[tuple[str, Any], ...]]]:
    """The rows of one batch (rows first_row.. of `src`, numbered key_first.. in generated
    keys), and for each the image bytes workers decode (empty: none)."""
    cols = {c.name: _values(c, batch.column(c.name)) for c in plan.columns}
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
            if isinstance(v, _Bad):
                problem = problem or f"column {name!r}: {v}"
            elif isinstance(v, _NoBytes):
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

def looks_like_image(data: bytes) -> bool:
    """Whether `data` starts like a JPEG/PNG/GIF/BMP/TIFF/WebP file."""
    return data.startswith(_IMAGE_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


def decode_image(data: bytes, decode: str) -> np.ndarray:
    """HWC uint8 pixels of encoded image bytes; InvalidValueError with Pillow's reason."""
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


class _InRing(NamedTuple):
    """Decoded pixels a worker wrote into the shared ring: where, and the array's shape."""

    offset: int
    shape: tuple[int, ...]


# The shared ring of a pool worker process, set by the pool's initializer in that process only.
_worker_ring: mmap.mmap | None = None


def _init_worker(ring: mmap.mmap | None) -> None:
    global _worker_ring
    _worker_ring = ring


def _decode_chunk(task: tuple[str, int, int, list[tuple[tuple[str, Any], ...]]]) -> list[dict[str, Any] | str]:
    """Decode the images of some rows: per row its decoded fields, or why one cannot be decoded
    (bad input never raises: the parent decides whether it fails the import). Pixels go into
    the ring's [start, start + size) while they fit, the rest travel back pickled."""
    decode, pos, size, rows = task
    end = pos + size
    ring = _worker_ring
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
            if ring is not None and pos + px.nbytes <= end:
                np.frombuffer(ring, np.uint8, px.nbytes, pos)[:] = px.reshape(-1)
                fields[name] = _InRing(pos, px.shape)
                pos += -(-px.nbytes // 64) * 64
            else:
                fields[name] = px
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
                    fields = {name: np.frombuffer(ring, np.uint8, int(np.prod(v.shape)), v.offset).reshape(v.shape)
                              if isinstance(v, _InRing) else v for name, v in fields.items()}
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
            self.ring = mmap.mmap(-1, 2 * REGION_BYTES)
            ctx = multiprocessing.get_context("fork")
        # else spawn cannot hand the mapping over: results are pickled
        self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=(self.ring,))

    def submit(self, tasks: list[tuple[tuple[str, Any], ...]]) -> _Done | _Pending:
        """Start decoding one batch (one tuple of (column, bytes) per row; empty: no image)."""
        if self.pool is None or not any(tasks):
            return _Done([_decode_chunk((self.decode, 0, 0, [t]))[0] if t else {} for t in tasks])
        n = self.workers * 2
        per = -(-len(tasks) // n)
        size = (REGION_BYTES // n) // 64 * 64
        base = (self.turn % 2) * REGION_BYTES
        self.turn += 1
        work = [(self.decode, base + j * size, size, tasks[j * per:(j + 1) * per]) for j in range(n)]
        return _Pending(self.pool.map_async(_decode_chunk, [w for w in work if w[3]], chunksize=1), self.ring)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
        if self.ring is not None:
            try:
                self.ring.close()
            except BufferError:  # a caller still holds a view; the mapping goes with it
                pass


# ---------------------------------------------------------------- writing

def _check_options(decode: str, workers: Any, shard_size: int | str | None, kind: str) -> None:
    """Reject bad settings (and a missing pyarrow or Pillow) before any file is read."""
    if decode not in DECODE_MODES:
        raise ConfigError(f"decode: must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 0:
        raise ConfigError(f"workers: expected a count >= 0, got {workers!r}")
    if shard_size is not None:
        parse_size(shard_size, "shard_size")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ConfigError(f"`kvdata import {kind}` needs pyarrow; install it with `{INSTALL[kind]}`") from None
    if decode != "none":
        try:
            import PIL.Image  # noqa: F401
        except ImportError:
            raise ConfigError(f"decode={decode!r} needs Pillow; install it with `pip install 'kvdata[images]'`") from None


def _import(srcs: list[Source], dataset: str | os.PathLike[str], *, kind: str, split: str | None, key: str | None,
            label: str | None, columns: Sequence[str] | None, images: Sequence[str], decode: str, workers: int,
            skip_bad: bool, shard_size: int | str | None, compress: bool, progress: bool | None, started: float,
            features: dict[str, Any] | None) -> dict[str, Any]:
    """Read every source batch by batch, put each good row, commit once; the summary."""
    plan, total = _plan(srcs, key=key, label=label, columns=columns, images=images, features=features)
    names = [c.name for c in plan.columns]
    bad: list[tuple[str, str, str]] = []  # (key or "", where, why)
    seen: set[str] = set()
    labels: set[int] = set()
    sniff = {c.name for c in plan.columns if c.kind == BYTES and c.name not in images}
    kinds: dict[str, str] = {c.name: c.kind for c in plan.columns}
    n = 0
    decoder = Decoder(int(workers), decode)
    bar: Any = None

    def put(store: Any, rows: list[Row], decoded: list[dict[str, Any] | str]) -> None:
        nonlocal n
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
            value = {c: dec[c] if c in dec else row.fields[c] for c in plan.stored} if dec else row.fields
            store.put(row.key, value, label=row.label)  # fields in column order, images decoded
            if row.label is not None:
                labels.add(row.label)
            n += 1

    try:
        bar = make_progress(total=total, label="import", enabled=progress)
        with open_dataset(dataset, "a", shard_size=shard_size, compress=compress) as store:
            if plan.classes is not None:
                old = store.classes
                if old and old != plan.classes:
                    raise ConfigError(f"{store.root} already has classes {old[:5]}{'...' if len(old) > 5 else ''} "
                                      f"that differ from the column {plan.label!r}'s names; import into a new dataset")
                store.set_classes(plan.classes)
            waiting: tuple[list[Row], Any] | None = None
            row_base = 0  # hf: keys number the split's rows across its files
            for src in srcs:
                first = 0
                key_base = (split or "data") if kind == "hf" else src.name
                for batch in _batches(src, names):
                    if sniff:
                        _sniff(batch, sniff, kinds, plan)
                    rows, tasks = _convert(batch, plan, src, first, (row_base if kind == "hf" else 0) + first,
                                           key_base, decode)
                    first += batch.num_rows
                    handle = decoder.submit(tasks)
                    if waiting is not None:
                        put(store, waiting[0], waiting[1].get())
                    waiting = (rows, handle)
                row_base += first
            if waiting is not None:
                put(store, waiting[0], waiting[1].get())
            if n == 0:
                raise InvalidValueError(f"no record could be imported ({len(bad)} bad); nothing was written")
            store.set_extra(EXTRA_KEY, {
                "kind": kind, "split": split, "rows": n, "schema": plan.schema,
                "features": None if plan.features is None else json.dumps(plan.features, sort_keys=True),
            })
            store.seal()  # a finished import is read by memory-map offset and can be staged
            store.commit()
    finally:
        if bar is not None:
            bar.close()
        decoder.close()
    out = summary(dataset, n, len(bad), len(plan.classes) if plan.classes is not None else len(labels), started)
    out["bad"] = [{"key": k, "where": w, "error": e} for k, w, e in bad[:MAX_BAD_LISTED]]
    out["records_per_s"] = round(n / max(time.perf_counter() - started, 1e-9), 1)
    out["columns"] = {c.name: kinds[c.name] for c in plan.columns if c.name in plan.stored}
    out["key"], out["label"], out["split"] = plan.key, plan.label, split
    return out


def _sniff(batch: Any, sniff: set[str], kinds: dict[str, str], plan: Plan) -> None:
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
