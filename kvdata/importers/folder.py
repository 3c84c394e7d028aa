"""Importing image collections: an ImageFolder tree or a Caffe convert_imageset list file.

An import is all-or-nothing. Everything that can be checked without decoding
(options, the list file, that every file exists, every key) is checked before the
dataset is opened, and the whole import is one commit at the end, so a failure
midway (an image Pillow cannot read) leaves the dataset at its previous
generation. Worker processes only read and decode files; the parent is the one
writer, and ordered `imap` keeps the sample order a function of the seed alone.

With workers > 1 and a new destination (missing or an empty directory), the one writer is
the bottleneck, so each of the N workers decodes and writes a contiguous slice of the
ordered items as its own part dataset and the parts are merged without copying
(kvdata.importers.parts): same records, keys, labels and order as one writer, still all or
nothing. Writing into a dataset that already exists (`existing`="append" or "overwrite",
target.py) keeps the single writer.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .. import format as fmt
from .._util.progress import progress as make_progress
from .._util.sizes import parse_size
from ..errors import ConfigError, InvalidValueError
from ..reader.open import open_dataset
from .common import numbered_classes, summary
from .parts import is_new_local, write_in_parts
from .target import end_pool, import_entry, open_target, refuse_existing, start_pool

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"})
DECODE_MODES = ("none", "rgb", "gray")


class Item(NamedTuple):
    """One file to import: where it is, its key in the dataset and its label (None: no label)."""

    path: str
    key: str
    label: int | None


class Options(NamedTuple):
    """What a worker needs to turn a path into a record value; small, so cheap to pickle."""

    decode: str
    resize: tuple[int, int] | None


# ---------------------------------------------------------------- public entry points

@import_entry
def import_folder(src: str | os.PathLike[str], dataset: str | os.PathLike[str], *, decode: str = "none",
                  resize: tuple[int, int] | None = None, shuffle: bool = True, seed: int = 0, workers: int = 0,
                  shard_size: int | str | None = None, compress: bool = False, progress: bool | None = None,
                  existing: str = "refuse") -> dict[str, Any]:
    """Import every image under `src` (ImageFolder layout: src/<class>/.../<file>) into `dataset`.

    The label of a file is the index of its top-level directory among the sorted
    class directory names, which are stored as the dataset's classes; files lying
    directly in `src` get no label. Keys are paths relative to `src` with "/".
    Files with other extensions are skipped and counted in the summary.
    existing: what to do with a dataset already at `dataset`: "refuse", "append" (only keys it
    lacks) or "overwrite" (replace its contents); see kvdata.importers.target.
    """
    started = time.perf_counter()
    opts = _check_options(decode, resize, workers, shard_size)
    refuse_existing(dataset, existing)
    root = Path(src)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such directory; pass the folder that holds the class directories")
    items, classes, skipped = scan_folder(root)
    if not items:
        raise ConfigError(f"{root}: no image files found ({', '.join(sorted(IMAGE_EXTENSIONS))}); check the path")
    n, writers, counts = _write(items, dataset, opts, classes=classes, shuffle=shuffle, seed=seed, workers=workers,
                                shard_size=shard_size, compress=compress, progress=progress, existing=existing)
    return summary(dataset, n, skipped, len(classes), started, writers, counts)


@import_entry
def import_listfile(listfile: str | os.PathLike[str], dataset: str | os.PathLike[str], *,
                    root: str | os.PathLike[str], decode: str = "none", resize: tuple[int, int] | None = None,
                    shuffle: bool = True, seed: int = 0, workers: int = 0, shard_size: int | str | None = None,
                    compress: bool = False, progress: bool | None = None, existing: str = "refuse") -> dict[str, Any]:
    """Import the images named by a Caffe list file ("relative/path label" per line) into `dataset`.

    Files are `root`/relative/path and keys are the paths as written. The list
    gives labels but no class names, so the dataset's classes are numbered "0".."max label"
    (common.numbered_classes; names it already has that cover the labels are kept), and the
    summary's "classes" is their count, as `kvdata info` shows it. existing: as for import_folder.
    """
    started = time.perf_counter()
    opts = _check_options(decode, resize, workers, shard_size)
    refuse_existing(dataset, existing)
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"root {base}: no such directory; pass the folder the list file's paths are relative to")
    items = parse_listfile(listfile, base)
    if not items:
        raise ConfigError(f"{listfile}: the list file names no images; write one 'relative/path label' per line")
    numbered = numbered_classes(it.label for it in items if it.label is not None)
    n, writers, counts = _write(items, dataset, opts, classes=numbered, shuffle=shuffle, seed=seed, workers=workers,
                                shard_size=shard_size, compress=compress, progress=progress, existing=existing,
                                numbered=True)
    return summary(dataset, n, 0, classes_of(dataset, numbered), started, writers, counts)


# ---------------------------------------------------------------- finding the files

def is_image(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def scan_folder(src: Path) -> tuple[list[Item], list[str], int]:
    """(items sorted by key, sorted class names, number of non-image files skipped)."""
    found: list[str] = []
    skipped = 0
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(src).as_posix()
        for name in filenames:
            if is_image(name):
                found.append(name if rel_dir == "." else f"{rel_dir}/{name}")
            else:
                skipped += 1
    found.sort()
    classes = sorted({key.split("/", 1)[0] for key in found if "/" in key})
    class_of = {c: i for i, c in enumerate(classes)}
    items = [Item(str(src / key), key, class_of[key.split("/", 1)[0]] if "/" in key else None) for key in found]
    for it in items:
        fmt.check_key(it.key)
    return items, classes, skipped


def parse_listfile(listfile: str | os.PathLike[str], root: Path) -> list[Item]:
    """Items of a convert_imageset list file, checked line by line before anything is written."""
    where = Path(listfile)
    try:
        text = where.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such list file; check the path") from None
    except UnicodeDecodeError:
        raise InvalidValueError(f"{where}: the list file is not UTF-8 text; re-save it as UTF-8") from None
    items: list[Item] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.rsplit(None, 1)  # the path may hold spaces: the label is the last word
        if len(parts) != 2:
            raise InvalidValueError(f"{where}:{lineno}: expected 'relative/path label', got {line.strip()!r}")
        rel, label_text = parts[0].strip(), parts[1]
        try:
            label = int(label_text)
        except ValueError:
            raise InvalidValueError(f"{where}:{lineno}: label {label_text!r} is not an integer; "
                                    "write 'relative/path label'") from None
        if not fmt.NO_LABEL < label < (1 << 63):
            raise InvalidValueError(f"{where}:{lineno}: label {label} does not fit in int64")
        if rel in first_line:
            raise InvalidValueError(f"{where}:{lineno}: {rel!r} is already listed on line {first_line[rel]}; "
                                    "remove the duplicate")
        first_line[rel] = lineno
        fmt.check_key(rel)
        path = root / rel
        if not path.is_file():
            raise InvalidValueError(f"{where}:{lineno}: image file {path} does not exist; fix the path or the root")
        items.append(Item(str(path), rel, label))
    return items


# ---------------------------------------------------------------- reading one image (runs in workers)

def load_value(path: str, opts: Options) -> dict[str, Any]:
    """The record fields of one file: {"image": its bytes}, or its decoded (and resized) pixels as HWC uint8."""
    if opts.decode == "none":
        try:
            return {"image": Path(path).read_bytes()}  # the field every importer names the image (common.py)
        except OSError as e:
            raise InvalidValueError(f"{path}: cannot read the image file ({e.strerror}); check it exists") from None
    from PIL import Image

    try:
        with Image.open(path) as opened:
            im = opened.convert("RGB" if opts.decode == "rgb" else "L")
            if opts.resize is not None:
                im = im.resize(opts.resize, Image.Resampling.BILINEAR)
            pixels = np.asarray(im, dtype=np.uint8)
    except FileNotFoundError:
        raise InvalidValueError(f"{path}: the image file is missing; restore it or remove it from the input") from None
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, DecompressionBombError ...
        raise InvalidValueError(f"{path}: Pillow cannot decode this image ({type(e).__name__}: {e}); "
                                "replace or remove the file") from None
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return {"image": np.ascontiguousarray(pixels)}


def _load_task(task: tuple[str, Options]) -> dict[str, Any]:
    return load_value(*task)


# ---------------------------------------------------------------- writing

def classes_of(dataset: str | os.PathLike[str], fallback: list[str]) -> int:
    """The number of classes `dataset` has after an import (what `kvdata info` shows)."""
    try:
        with open_dataset(dataset) as store:
            return len(store.classes)
    except Exception:  # noqa: BLE001 (a summary must not fail an import that committed)
        return len(fallback)


def _check_options(decode: str, resize: Any, workers: Any, shard_size: int | str | None) -> Options:
    """Reject bad settings before any file is touched."""
    if decode not in DECODE_MODES:
        raise ConfigError(f"decode: must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
    if resize is not None:
        if decode == "none":
            raise ConfigError("resize: needs decode='rgb' or 'gray' (with decode='none' the file bytes are stored as is)")
        try:
            w, h = resize
            ok = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in (w, h))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"resize: expected (width, height) as two positive ints, got {resize!r}")
        resize = (int(w), int(h))
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 0:
        raise ConfigError(f"workers: expected a count >= 0, got {workers!r}")
    if shard_size is not None:
        parse_size(shard_size, "shard_size")
    if decode != "none":
        try:
            import PIL.Image  # noqa: F401
        except ImportError:
            raise ConfigError(f"decode={decode!r} needs Pillow; install it with `pip install kvdata[images]`") from None
    return Options(decode, resize)


def _ordered(items: list[Item], shuffle: bool, seed: int) -> list[Item]:
    if not shuffle:
        return items
    return [items[i] for i in np.random.default_rng(seed).permutation(len(items)).tolist()]


def _values(items: list[Item], opts: Options, pool: Any, workers: int) -> Iterator[dict[str, Any]]:
    """Record values in item order: ordered imap makes the order independent of the worker count."""
    tasks = ((it.path, opts) for it in items)
    if pool is None:
        return map(_load_task, tasks)
    return pool.imap(_load_task, tasks, chunksize=max(1, min(64, len(items) // (workers * 8))))


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


def _make_pool(workers: int) -> Any:
    """The decoding processes (they ignore Ctrl-C: the parent ends them), or None for in-process."""
    if workers <= 1:
        return None
    return start_pool(_context(), workers)


def _write(items: list[Item], dataset: str | os.PathLike[str], opts: Options, *, classes: list[str] | None,
           shuffle: bool, seed: int, workers: int, shard_size: int | str | None, compress: bool,
           progress: bool | None, existing: str, numbered: bool = False) -> tuple[int, int, dict[str, Any] | None]:
    """Put every item and commit once; on any error (or Ctrl-C) nothing of this import is committed.
    Returns (records written, writer processes, the target's counts: None for a new dataset)."""
    items = _ordered(items, shuffle, seed)
    if int(workers) > 1 and len(items) > 1 and is_new_local(dataset):
        writers = min(int(workers), len(items))
        n = write_in_parts(dataset, items, writers, _write_part, (opts, classes, shard_size, compress),
                           ctx=_context(), progress=progress)
        return n, writers, None
    pool = None
    bar = None
    try:
        pool = _make_pool(int(workers))  # before the store opens: children inherit no LMDB handle or lock
        bar = make_progress(total=len(items), label="import", enabled=progress)
        with open_target(dataset, existing, shard_size=shard_size, compress=compress) as target:
            if numbered:
                target.number_classes(range(len(classes or ())))  # a list file's labels have no names
            elif classes is not None:
                target.set_classes(classes, "the class folders being imported")
            todo = [it for it in items if target.wants(it.key)]  # an append skips keys it has, undecoded
            bar.update(len(items) - len(todo))
            for it, value in zip(todo, _values(todo, opts, pool, int(workers))):
                if it.label is not None:
                    value["label"] = it.label
                target.put(it.key, value, label=it.label)
                bar.update(1)
            target.commit()
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            end_pool(pool)
    return target.added + target.overwritten, 1, target.counts()


def _write_part(part: str, items: list[Item], tick: Any, opts: Options, classes: list[str] | None,
                shard_size: int | str | None, compress: bool) -> None:
    """One parallel writer (a worker process): decode and put its slice into the new part
    dataset `part`, sealed and committed once at the end."""
    with open_dataset(part, "a", shard_size=shard_size, compress=compress) as store:
        if classes is not None:
            store.set_classes(classes)
        for it in items:
            value = load_value(it.path, opts)
            if it.label is not None:
                value["label"] = it.label
            store.put(it.key, value, label=it.label)
            tick()
        store.seal()
        store.commit()

