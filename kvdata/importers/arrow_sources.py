"""The inputs of `kvdata import parquet|hf`: finding them, opening them, checking their schemas.

Apart from the driver (arrow.py) because this is everything that happens before a row is
converted: Parquet files and directories, the layouts `save_to_disk` writes (a Dataset's
state.json, a DatasetDict's splits) and the Hub's folders of Parquet/Arrow files (the
split picked by file name), all confined to the folder given with no symlink followed;
record batches of at most BATCH_ROWS rows read from Parquet or through a memory map from
Arrow IPC (damage names the file); and the ImportPlan: every source's schema checked against
the key, label, column and image options, with HF features (ClassLabel names, Image
columns) taken from dataset_info.json or the schema metadata. Nothing here writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ConfigError, InvalidValueError, KVDataError
from .arrow_types import BYTES, IMAGE, INT, STR, Column, column_of, require_pyarrow

BATCH_ROWS = 256          # rows read, converted and decoded at a time


class Source(NamedTuple):
    """One input file: its path, its name in keys and messages, and how to read it."""

    path: str
    name: str
    kind: str  # "parquet" | "arrow"


class ImportPlan(NamedTuple):
    """What every source is read with (checked against each source's schema first)."""

    columns: list[Column]   # every column read, in schema order
    stored: list[str]       # the column names that become fields
    key: str | None
    label: str | None
    classes: list[str] | None
    features: dict[str, Any] | None
    schema: dict[str, str]  # column -> its Arrow type, as recorded in the manifest


# ---------------------------------------------------------------- finding the files

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
    pa = require_pyarrow()
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


def batches(src: Source, names: list[str]) -> Iterator[Any]:
    """Record batches of at most BATCH_ROWS rows holding `names`; damage names the file."""
    pa = require_pyarrow()
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


def plan_sources(srcs: list[Source], *, key: str | None, label: str | None, columns: Sequence[str] | None,
          images: Sequence[str], features: dict[str, Any] | None) -> tuple[ImportPlan, int]:
    """Check every source's schema against the options; (plan, total rows). Nothing is written."""
    plan: ImportPlan | None = None
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
        present = set(names)  # a set: a file may have very many columns
        for col in plan.columns:
            if col.name not in present:
                role = "the --key column" if col.name == plan.key else "the --label column" \
                    if col.name == plan.label else f"which {srcs[0].path} has"
                raise ConfigError(f"{src.path}: has no column {col.name!r} ({role}); its columns are "
                                  f"{_listed(names)}; import files with one schema together")
            got = column_of(col.name, schema.field(col.name).type, col.kind == IMAGE, src.path)
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
                images: Sequence[str], features: dict[str, Any] | None) -> ImportPlan:
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
    # the key column is the key, not also a field (unless --columns names it)
    stored = [n for n in names if n != key] if columns is None else list(dict.fromkeys(columns))
    present = set(names)
    missing = [c for c in stored if c not in present]
    if missing:
        raise ConfigError(f"--columns: {src.path} has no column {missing[0]!r}; its columns are {_listed(names)}")
    if not stored:
        raise ConfigError("--columns: name at least one column to keep")
    if label is None and len(class_cols) == 1 and class_cols[0] in names:
        label = class_cols[0]
    if label is None and not class_cols and "label" in names and key != "label" \
            and column_of("label", schema.field("label").type, False, src.path).kind == INT:
        label = "label"  # a plain integer column named label is the label, as in every importer
    if label is not None and label not in stored:
        stored.append(label)  # the label is always the field "label" too
    wanted = set(stored) | {c for c in (key, label) if c is not None}
    cols = [column_of(n, schema.field(n).type, n in image_cols, src.path) for n in names if n in wanted]
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
    return ImportPlan(cols, stored, key, label, classes, features,
                      {n: str(schema.field(n).type) for n in names if n in wanted})
