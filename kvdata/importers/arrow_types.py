"""Arrow column types -> kvdata field values, for `kvdata import parquet|hf`.

Apart from the driver (arrow.py) and the inputs (arrow_sources.py) because this is the part
that knows pyarrow's type system: which Arrow types a column may have and how each becomes
a field -- integers, floats and bools as numbers, strings as str, binary as bytes, lists
(fixed-size or not, nested) of numbers as numpy arrays, dates/times/decimals as ISO text,
nulls as None, HF Image structs {bytes, path} as their bytes. A value that cannot be
stored (a null inside a list, ragged inner lists, an image with only a path) comes back as
a marker string, so the driver decides whether it fails the import or is skipped.

pyarrow is imported here only when a function runs (require_pyarrow).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..errors import ConfigError

INSTALL = {"parquet": "pip install 'kvdata[parquet]'", "hf": "pip install 'kvdata[hf]'"}

# Column kinds: how a column's values become field values.
INT, FLOAT, BOOL, STR, BYTES, IMAGE, ARRAY, TEXT, NULL = ("int", "float", "bool", "str", "bytes", "image",
                                                          "array", "text", "null")


def require_pyarrow() -> Any:
    """pyarrow, or one line naming the extra that installs it."""
    try:
        import pyarrow
    except ImportError:
        raise ConfigError("reading Parquet/Arrow needs pyarrow; install it with "
                          f"`{INSTALL['parquet']}`") from None
    return pyarrow


class Column(NamedTuple):
    """One column to read: its name, kind and (arrays) leaf dtype and nesting depth."""

    name: str
    kind: str
    dtype: str | None = None
    depth: int = 0


def _storage(t: Any) -> Any:
    pa = require_pyarrow()
    while isinstance(t, pa.ExtensionType):
        t = t.storage_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    return t


def column_of(name: str, t: Any, image: bool, where: str) -> Column:
    """How a column of Arrow type `t` is stored, or one line saying it cannot be."""
    pa = require_pyarrow()
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
    types = require_pyarrow().types
    return bool(types.is_binary(t) or types.is_large_binary(t) or types.is_fixed_size_binary(t)
                or getattr(types, "is_binary_view", lambda _t: False)(t))


def _is_list(t: Any) -> bool:
    types = require_pyarrow().types
    return bool(types.is_list(t) or types.is_large_list(t) or types.is_fixed_size_list(t)
                or getattr(types, "is_list_view", lambda _t: False)(t)
                or getattr(types, "is_large_list_view", lambda _t: False)(t))


def column_values(col: Column, arr: Any) -> list[Any]:
    """Field values of one column of a batch (None for nulls)."""
    pa = require_pyarrow()
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
                out.append(NoBytes(p) if d is None else d)
        return out
    values = arr.to_pylist()
    if col.kind == FLOAT:
        return [None if v is None else float(v) for v in values]  # float16 comes as numpy scalars
    if col.kind == TEXT:
        return [None if v is None else v.isoformat() if hasattr(v, "isoformat") else str(v) for v in values]
    return values


class NoBytes(str):
    """An image entry that has only a path (its file is not read: paths in data are not trusted)."""


def _arrays(arr: Any, dtype: np.dtype, depth: int) -> list[Any]:
    """Numpy arrays of a list column; an entry holding nulls or ragged inner lists becomes a
    BadValue string naming the problem."""
    pa = require_pyarrow()
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
                out.append(BadValue("a null inside the list"))
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
            out.append(BadValue("a null inside the list"))
            continue
        try:
            got = np.asarray(v, dtype=dtype)
        except (ValueError, TypeError):  # ragged inner lists, or a null inside
            out.append(BadValue("ragged inner lists or a null inside the list"))
            continue
        out.append(got if got.ndim == depth else BadValue("ragged inner lists"))
    return out


def _has_none(v: list[Any]) -> bool:
    level = v
    while level:
        if any(x is None for x in level):
            return True
        level = [y for x in level if isinstance(x, list) for y in x]
    return False


def _all_fixed(t: Any) -> bool:
    types = require_pyarrow().types
    while types.is_fixed_size_list(t):
        t = _storage(t.value_type)
    return not _is_list(t)


def _no_nulls_below(arr: Any) -> bool:
    types = require_pyarrow().types
    while types.is_fixed_size_list(arr.type):
        arr = arr.flatten()
        if arr.null_count:
            return False
    return True


class BadValue(str):
    """A value that makes its row bad (the text says why)."""
