"""Datasets from Python: `kvdata.from_iterable(path, dicts)` and `kvdata.from_arrays(path, x=..., y=...)`.

Each item becomes one record of fields (numpy arrays, bytes, str, int, float, bool; lists
and tuples of numbers become arrays). Like the other importers, a call is all-or-nothing:
everything is one commit at the end, so an item that cannot be stored leaves the dataset
as it was (a dataset this call created is removed again).

mode says what happens to a dataset already at `path`, because silently adding to (or
wiping) someone's data is the surprise a user can least afford:
- "x" (default): create it; refuse if `path` already holds a dataset with records;
- "a": add to it (a key it already holds is replaced, the rest kept), all-or-nothing;
- "w": replace it, as `kvdata.open(path, "w")`: the dataset is emptied when the call
  starts, so if the call then fails it is left empty.
Keys come from a field (key="id": each item's "id", str or int, kept as a field too) or are
generated: the item's number, zero-padded to 10 digits, counting on from the records
already there in mode "a".
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .._util.progress import progress as make_progress
from .._util.sizes import parse_size
from ..errors import ConfigError, InvalidKeyError, InvalidValueError
from ..reader.open import open_dataset
from .common import numbered_classes, summary

MODES = ("x", "a", "w")
KEY_DIGITS = 10


def from_iterable(path: str | os.PathLike[str], iterable: Iterable[Mapping[str, Any]], *, key: str | None = None,
                  mode: str = "x", shard_size: int | str | None = None, compress: bool = False,
                  progress: bool | None = None) -> dict[str, Any]:
    """Write one record per dict of `iterable` into the dataset at `path` and commit once.

    key: the field holding each record's key (str or int; unique), or None for generated
    keys. mode: "x", "a" or "w" (module docstring). A "label" field holding an int is also
    the index label. progress: a bar (default: when stderr is a terminal; the total is
    known when the iterable has a len()). Returns the importer summary."""
    started = time.perf_counter()
    if mode not in MODES:
        raise ConfigError(f"mode: must be 'x' (create), 'a' (add) or 'w' (replace), not {mode!r}")
    if key is not None and (not isinstance(key, str) or not key):
        raise ConfigError(f"key: the name of the field holding each record's key, not {key!r}")
    if shard_size is not None:
        parse_size(shard_size, "shard_size")
    total = len(iterable) if hasattr(iterable, "__len__") else None  # type: ignore[arg-type]
    seen: dict[str, int] = {}
    labels: set[int] = set()
    overwritten = 0
    bar = None
    try:
        bar = make_progress(total=total, label="import", enabled=progress)
        with open_dataset(path, "w" if mode == "w" else "a", shard_size=shard_size, compress=compress) as store:
            already = len(store)
            if mode == "x" and already:
                raise ConfigError(f"{path} already holds a dataset of {already} records; pass mode='a' to add "
                                  "to it or mode='w' to replace it")
            for i, item in enumerate(iterable):
                if not isinstance(item, Mapping):
                    raise InvalidValueError(f"item {i}: expected a dict of fields, got a {type(item).__name__}")
                rkey = _key_of(item, key, i, already)
                if rkey in seen:
                    raise InvalidKeyError(f"item {i}: key {rkey!r} was already used by item {seen[rkey]}; "
                                          "keys must be unique")
                if key is None and mode == "a" and already and rkey in store:
                    raise InvalidKeyError(f"item {i}: generated key {rkey!r} is already in {path} (its keys are "
                                          "not all generated); pass key=FIELD")
                seen[rkey] = i
                if mode == "a" and already and rkey in store:
                    overwritten += 1
                value = {name: _field(name, v, i) for name, v in item.items()}
                lv = value.get("label")
                store.put(rkey, value)
                if isinstance(lv, (int, np.integer)) and not isinstance(lv, bool):
                    labels.add(int(lv))
                bar.update(1)
            if not seen and not already:
                raise InvalidValueError("the iterable yielded no items; nothing was written")
            old, names = list(store.classes), numbered_classes(labels)  # as every importer records classes
            classes = len(old)  # (store.classes is the last commit's until this one)
            if len(names) > len(old) and (not old or old == names[:len(old)]):
                store.set_classes(names)
                classes = len(names)
            store.seal()  # read by memory-map offset right away, and can be staged and pushed
            store.commit()
    finally:
        if bar is not None:
            bar.close()
    # (mode "w" empties the dataset when it opens: its counts are those of a new one)
    counts = {"mode": {"x": "new", "a": "append" if already else "new", "w": "overwrite"}[mode],
              "added": len(seen) - overwritten, "overwritten": overwritten, "kept": 0, "removed": 0}
    return summary(path, len(seen), 0, classes, started, counts=counts)


def from_arrays(path: str | os.PathLike[str], fields: Mapping[str, Any] | None = None, /, *, mode: str = "x",
                shard_size: int | str | None = None, compress: bool = False, progress: bool | None = None,
                **arrays: Any) -> dict[str, Any]:
    """Write record i = {name: array[i] for each array} into the dataset at `path`.

    Arrays (anything numpy.asarray takes) must have the same length; each is one field
    (a field named like an option -- mode, shard_size, compress, progress -- goes in the
    `fields` mapping instead). Keys are generated (see from_iterable); mode as there."""
    named: dict[str, Any] = dict(fields or {})
    for name in arrays:
        if name in named:
            raise ConfigError(f"array {name!r} is given twice (in fields and as a keyword)")
    named.update(arrays)
    if not named:
        raise ConfigError("from_arrays: pass at least one array, e.g. from_arrays(path, image=x, label=y)")
    columns: dict[str, np.ndarray] = {}
    for name, a in named.items():
        arr = np.asarray(a)
        if arr.ndim == 0:
            raise InvalidValueError(f"array {name!r} is a scalar; every array needs one row per record")
        if arr.dtype.kind not in "biufc":
            raise InvalidValueError(f"array {name!r} has dtype {arr.dtype}; only numeric arrays can be fields "
                                    "(use from_iterable for bytes and str)")
        columns[name] = arr
    first, n = next(iter(columns.items()))[0], len(next(iter(columns.values())))
    for name, arr in columns.items():
        if len(arr) != n:
            raise InvalidValueError(f"array {name!r} has {len(arr)} rows but {first!r} has {n}; every array "
                                    "needs one row per record")
    return from_iterable(path, _Rows(columns, n), mode=mode, shard_size=shard_size, compress=compress,
                         progress=progress)


class _Rows:
    """The records of from_arrays, with a len() for the progress bar."""

    def __init__(self, columns: dict[str, np.ndarray], n: int) -> None:
        self.columns, self.n = columns, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        for i in range(self.n):
            yield {name: arr[i] for name, arr in self.columns.items()}


def _key_of(item: Mapping[str, Any], key: str | None, i: int, already: int) -> str:
    if key is None:
        return f"{already + i:0{KEY_DIGITS}d}"
    if key not in item:
        raise InvalidKeyError(f"item {i} has no {key!r} field to take its key from")
    k = item[key]
    if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
        return str(int(k))
    if isinstance(k, bytes):
        try:
            k = k.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidKeyError(f"item {i}: key field {key!r} holds bytes that are not UTF-8") from None
    if not isinstance(k, str):
        raise InvalidKeyError(f"item {i}: key field {key!r} holds a {type(k).__name__}; keys are str or int")
    return k


def _field(name: Any, v: Any, i: int) -> Any:
    """A value the record format stores: lists and tuples of numbers become arrays."""
    if isinstance(v, (list, tuple)):
        arr = np.asarray(v)
        if arr.dtype.kind not in "biufc":
            raise InvalidValueError(f"item {i}, field {name!r}: a {type(v).__name__} of "
                                    f"{arr.dtype} values cannot be stored; use an array of numbers, bytes or str")
        return arr
    return v
