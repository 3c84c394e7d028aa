"""Pure bytes <-> objects: the record layout and the side-index dtypes.

Nothing here touches a file. Layouts are explicit little-endian numpy/struct types
with a version, so a reader can refuse a dataset written by a newer format.

Record (one LMDB value)::

    prefix  20 bytes  '<BBBBIIII': magic 0x4B, kind, version, flags,
                      head (payload start), layout_len, meta_len, crc32
    layout  msgpack   list of [name, code, shape, offset, nbytes]; code is a numpy
                      dtype string, or bytes/str/int/uint/float/bool/none
    meta    msgpack   {"k": key, "l": label}
    padding           up to `head`, a multiple of 8
    payload           raw field bytes, each field 8-byte aligned

The crc32 covers every byte except the crc field itself. A RAW record stores one
opaque byte string as its payload and has an empty layout, so reading it needs
no header parse at all: the index knows where its payload starts.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from .._util.checksum import crc32
from ..errors import CorruptDatasetError, InvalidKeyError, InvalidValueError

RECORD_VERSION = 1
MAGIC = 0x4B

KIND_RAW = 0
KIND_FIELDS = 1
KIND_TOMBSTONE = 2

PREFIX = struct.Struct("<BBBBIIII")
PREFIX_SIZE = PREFIX.size  # 20
# positions in PREFIX.unpack(...) of the fields readers pick out one at a time
PREFIX_HEAD, PREFIX_LAYOUT_LEN, PREFIX_META_LEN = 4, 5, 6
KIND_SHIFT = 24  # the index's head_kind = payload start | kind << KIND_SHIFT
ALIGN = 8
_ZEROS = bytes(ALIGN)  # padding: every gap the record layout leaves is shorter than ALIGN
MAX_KEY_BYTES = 4096
MAX_HEAD = (1 << 24) - 1

NO_LABEL = int(np.iinfo(np.int64).min)

# Side-index rows. One SAMPLE row per live sample, in sample order.
SAMPLE_DTYPE = np.dtype([("shard", "<u4"), ("slot", "<u4"), ("label", "<i8")])
# One RECORD row per slot of every sealed shard, shard after shard: where the value
# lies in the sealed file, so reads slice a memory map instead of walking a B-tree.
# head_kind = payload start within the value | kind << 24.
RECORD_DTYPE = np.dtype([("offset", "<u8"), ("size", "<u4"), ("head_kind", "<u4")])
UNKNOWN_OFFSET = np.uint64(0xFFFFFFFFFFFFFFFF)
HASH_DTYPE = np.dtype("<u8")
POS_DTYPE = np.dtype("<u8")

SCALAR_TYPES = (bool, int, float, type(None))
_ARRAY_KINDS = "biufc"

# Field kinds of a decoding plan. Scalars live in the payload (not the layout), so
# records with equal field shapes share byte-identical layouts and one cached plan.
F_ARRAY, F_BYTES, F_STR, F_INT, F_UINT, F_FLOAT, F_BOOL, F_NONE = range(8)
_SCALAR_CODES = {"int": F_INT, "uint": F_UINT, "float": F_FLOAT, "bool": F_BOOL, "none": F_NONE}
_I8 = struct.Struct("<q")
_U8 = struct.Struct("<Q")
_F8 = struct.Struct("<d")
_U1 = np.dtype(np.uint8)


def _pack_scalar(key: str, name: str, v: Any) -> tuple[str, bytes]:
    if v is None:
        return "none", b""
    if isinstance(v, bool):
        return "bool", b"\x01" if v else b"\x00"
    if isinstance(v, float):
        return "float", _F8.pack(v)
    if -(1 << 63) <= v < (1 << 63):
        return "int", _I8.pack(v)
    if 0 <= v < (1 << 64):
        return "uint", _U8.pack(v)
    raise InvalidValueError(f"key {key!r}, field {name!r}: int {v} does not fit in 64 bits; store it as str")


def slot_key(slot: int) -> bytes:
    """LMDB key of a slot: big-endian so cursor order is append order."""
    return slot.to_bytes(8, "big")


def slot_of(lmdb_key: bytes) -> int:
    return int.from_bytes(lmdb_key, "big")


def check_key(key: Any) -> bytes:
    """UTF-8 bytes of a valid key, or InvalidKeyError saying what is wrong."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        try:
            key = bytes(key).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidKeyError(f"key {bytes(key)!r} is not valid UTF-8; use a UTF-8 string as key") from None
    if not isinstance(key, str):
        raise InvalidKeyError(f"key {key!r} must be a str, not {type(key).__name__}")
    if not key:
        raise InvalidKeyError("empty key: every record needs a non-empty key")
    try:
        kb = key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKeyError(
            f"key {key.encode('utf-8', 'backslashreplace').decode()!r} is not valid UTF-8 "
            "(a file name in another encoding?); rename it or pass --key"
        ) from None
    if len(kb) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"key {key[:40]!r}... is {len(kb)} bytes; the limit is {MAX_KEY_BYTES}")
    if "\x00" in key:
        raise InvalidKeyError(f"key {key!r} contains a NUL byte")
    return kb


def key_hash(key_bytes: bytes) -> int:
    """64-bit hash of a key's UTF-8 bytes, as stored in the sorted key index."""
    return int.from_bytes(hashlib.blake2b(key_bytes, digest_size=8).digest(), "little")


def _pad(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def encode_record(key: str, value: Any, label: int | None = None) -> tuple[bytes, int | None, list]:
    """Serialize one sample; return (record bytes, label for the index or None, field layout)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        kind = KIND_RAW
        layout: list = []
        layout_b = b""
        parts: list[memoryview] = [memoryview(value).cast("B")]
        offsets = [0]
        total = parts[0].nbytes
    elif isinstance(value, Mapping):
        kind = KIND_FIELDS
        layout, parts, offsets, total = _layout_of(key, value)
        if label is None:
            lv = value.get("label")
            if isinstance(lv, (int, np.integer)) and not isinstance(lv, bool):
                label = int(lv)
        layout_b = msgpack.packb(layout, use_bin_type=True)
    else:
        raise InvalidValueError(
            f"key {key!r}: cannot store a {type(value).__name__}; pass bytes or a dict of fields"
        )
    return _assemble(kind, key, label, layout_b, parts, offsets, total), label, layout


def encode_tombstone(key: str) -> bytes:
    """A record that marks `key` deleted, so a reindex from the shards agrees."""
    return _assemble(KIND_TOMBSTONE, key, None, b"", [], [], 0)


def _assemble(kind: int, key: str, label: int | None, layout_b: bytes,
              parts: list[memoryview], offsets: list[int], total: int) -> bytes:
    meta: dict[str, Any] = {"k": key}
    if label is not None:
        if not -(1 << 63) < int(label) < (1 << 63):
            raise InvalidValueError(f"key {key!r}: label {label} does not fit in int64")
        meta["l"] = int(label)
    meta_b = msgpack.packb(meta, use_bin_type=True)
    head = _pad(PREFIX_SIZE + len(layout_b) + len(meta_b))
    if head > MAX_HEAD:
        raise InvalidValueError(f"key {key!r}: record header is {head} bytes; use fewer or shorter field names")
    if total >= 1 << 32:
        raise InvalidValueError(f"key {key!r}: payload of {total} bytes exceeds the 4 GiB record limit")
    # one allocation and one copy of the payload: the pieces are checksummed in order, then
    # joined behind the prefix (a zero-filled buffer written piece by piece and copied to bytes
    # cost two more passes over a 151 KB image)
    pieces: list[Any] = [layout_b, meta_b, _ZEROS[:head - PREFIX_SIZE - len(layout_b) - len(meta_b)]]
    at = 0
    for part, off in zip(parts, offsets):
        if off > at:
            pieces.append(_ZEROS[:off - at])
        pieces.append(part)
        at = off + part.nbytes
    if total > at:
        pieces.append(_ZEROS[:total - at])
    crc = crc32(PREFIX.pack(MAGIC, kind, RECORD_VERSION, 0, head, len(layout_b), len(meta_b), 0)[:PREFIX_SIZE - 4])
    for piece in pieces:
        crc = crc32(piece, crc)
    pieces.insert(0, PREFIX.pack(MAGIC, kind, RECORD_VERSION, 0, head, len(layout_b), len(meta_b), crc))
    return b"".join(pieces)


def _layout_of(key: str, fields: Mapping[Any, Any]) -> tuple[list, list[memoryview], list[int], int]:
    layout: list[list[Any]] = []
    parts: list[memoryview] = []
    offsets: list[int] = []
    total = 0
    for name, v in fields.items():
        if not isinstance(name, str) or not name:
            raise InvalidValueError(f"key {key!r}: field names must be non-empty str, got {name!r}")
        if isinstance(v, np.generic):
            v = np.asarray(v)
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in _ARRAY_KINDS:
                raise InvalidValueError(
                    f"key {key!r}, field {name!r}: dtype {v.dtype} cannot be stored "
                    "(object/string/structured arrays are not raw data); convert it to a numeric "
                    "array, or store bytes/str fields"
                )
            if not v.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
                v = v.copy(order="C")
            mv = v.reshape(-1).view(np.uint8).data if v.size else memoryview(b"")
            entry = [name, v.dtype.str, list(v.shape), total, mv.nbytes]
        elif isinstance(v, (bytes, bytearray, memoryview)):
            mv = memoryview(v).cast("B")
            entry = [name, "bytes", None, total, mv.nbytes]
        elif isinstance(v, str):
            mv = memoryview(v.encode("utf-8"))
            entry = [name, "str", None, total, mv.nbytes]
        elif isinstance(v, SCALAR_TYPES):
            code, packed = _pack_scalar(key, name, v)
            mv = memoryview(packed)
            entry = [name, code, None, total, mv.nbytes]
        else:
            raise InvalidValueError(
                f"key {key!r}, field {name!r}: cannot store a {type(v).__name__}; "
                "use a numpy array, bytes, str, int, float or bool"
            )
        layout.append(entry)
        parts.append(mv)
        offsets.append(total)
        total = _pad(total + mv.nbytes)
    return layout, parts, offsets, total


class RecordHeader:
    """The parsed prefix (and, on demand, layout and meta) of one record.

    Records come from shard files, which may be damaged: every length is checked against
    the buffer, and layout() / meta() validate what they decode, raising
    CorruptDatasetError (never a msgpack, struct or unicode error)."""

    __slots__ = ("kind", "head", "layout_len", "meta_len", "crc")

    def __init__(self, buf: Any) -> None:
        if len(buf) < PREFIX_SIZE:
            raise CorruptDatasetError(f"record of {len(buf)} bytes is shorter than its header; run `kvdata verify`")
        magic, kind, version, _flags, head, ll, ml, crc = PREFIX.unpack_from(buf, 0)
        if magic != MAGIC or kind > KIND_TOMBSTONE or version > RECORD_VERSION:
            raise CorruptDatasetError("record header is damaged (bad magic/kind/version); run `kvdata verify`")
        if head < PREFIX_SIZE + ll + ml or head > len(buf):
            raise CorruptDatasetError("record header is damaged (bad lengths); run `kvdata verify`")
        self.kind, self.head, self.layout_len, self.meta_len, self.crc = kind, head, ll, ml, crc

    def layout(self, buf: Any) -> list:
        """The record's field layout, validated (an empty list for raw records and tombstones)."""
        if not self.layout_len:
            return []
        return [list(e[:5]) for e in _check_layout(_unpack(buf[PREFIX_SIZE:PREFIX_SIZE + self.layout_len], "layout"))]

    def meta(self, buf: Any) -> dict:
        """{"k": key, "l": label (optional), ...}, validated."""
        s = PREFIX_SIZE + self.layout_len
        return parse_meta(buf[s:s + self.meta_len])


def _damaged(what: str) -> CorruptDatasetError:
    return CorruptDatasetError(f"record {what}; run `kvdata verify`")


def _unpack(b: Any, what: str) -> Any:
    """msgpack from a record, or CorruptDatasetError (msgpack raises many unrelated types on garbage)."""
    try:
        return msgpack.unpackb(b, raw=False)
    except Exception as e:
        raise _damaged(f"{what} is not valid msgpack ({e.__class__.__name__})") from None


def parse_meta(b: Any) -> dict[str, Any]:
    """A record's meta map from its msgpack bytes: "k" a str key, "l" (optional) an int64 label."""
    meta = _unpack(b, "meta")
    if not isinstance(meta, dict) or not isinstance(meta.get("k"), str):
        raise _damaged("meta is damaged (no key)")
    label = meta.get("l")
    if label is not None and (isinstance(label, bool) or not isinstance(label, int)
                              or not -(1 << 63) < label < (1 << 63)):
        raise _damaged(f"meta of key {meta['k'][:80]!r} is damaged (label is not an int64)")
    return meta


def record_crc_ok(buf: Any) -> bool:
    """True when the crc32 stored in the record matches its bytes (False for a record shorter than its header)."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
    if mv.nbytes < PREFIX_SIZE:
        return False
    stored = struct.unpack_from("<I", mv, PREFIX_SIZE - 4)[0]
    return crc32(mv[PREFIX_SIZE:], crc32(mv[:PREFIX_SIZE - 4])) == stored


Plan = tuple  # tuple of (name, kind, dtype | None, shape, offset, nbytes) per field

MAX_NDIM = 32
_SCALAR_BYTES = {F_INT: 8, F_UINT: 8, F_FLOAT: 8, F_BOOL: 1, F_NONE: 0}


def _nonneg(v: Any, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= hi


def _check_layout(layout: Any) -> list[tuple[str, str, Any, int, int, int, Any]]:
    """(name, code, shape, offset, nbytes, field kind, dtype) of every field of a layout
    read from a record; CorruptDatasetError naming the first field that cannot be decoded."""
    if not isinstance(layout, (list, tuple)):
        raise _damaged("layout is damaged (not a list of fields)")
    out = []
    for entry in layout:
        if not isinstance(entry, (list, tuple)) or len(entry) != 5:
            raise _damaged("layout is damaged (a field entry is not [name, code, shape, offset, nbytes])")
        name, code, shape, off, nbytes = entry
        if not isinstance(name, str) or not name or not isinstance(code, str):
            raise _damaged("layout is damaged (a field name or type code is not a string)")
        if not _nonneg(off, 0xFFFFFFFF) or not _nonneg(nbytes, 0xFFFFFFFF):
            raise _damaged(f"layout is damaged (field {name[:80]!r} has a bad offset or size)")
        dt = None
        if code == "bytes":
            kind = F_BYTES
        elif code == "str":
            kind = F_STR
        elif code in _SCALAR_CODES:
            kind = _SCALAR_CODES[code]
            if nbytes != _SCALAR_BYTES[kind]:
                raise _damaged(f"layout is damaged (field {name[:80]!r}: a {code} of {nbytes} bytes)")
        else:
            kind = F_ARRAY
            dt = _array_dtype(code)
            if dt is None or not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM \
                    or not all(_nonneg(d, 0xFFFFFFFF) for d in shape):
                raise _damaged(f"layout is damaged (field {name[:80]!r}: dtype {code[:40]!r}, shape {type(shape).__name__})")
            count = 1
            for d in shape:
                count *= d
            if count * dt.itemsize != nbytes:
                raise _damaged(f"layout is damaged (field {name[:80]!r}: shape {list(shape)} of {code} is not {nbytes} bytes)")
            shape = tuple(shape)
        if kind != F_ARRAY and shape is not None:
            raise _damaged(f"layout is damaged (field {name[:80]!r}: a {code} with a shape)")
        out.append((name, code, shape, off, nbytes, kind, dt))
    return out


def _array_dtype(code: str) -> np.dtype | None:
    """The numpy dtype a layout code names, if it is one a writer stores (a plain number type in
    its canonical `dtype.str` spelling); None otherwise."""
    if len(code) > 8:
        return None
    try:
        dt = np.dtype(code)
    except (TypeError, ValueError, SyntaxError):
        return None
    if dt.kind not in _ARRAY_KINDS or dt.fields is not None or dt.subdtype is not None or dt.str != code:
        return None
    return dt


def make_plan(layout: list) -> Plan:
    """Precompiled decoding steps for one layout (dtypes built once, not per record); the layout
    is validated (CorruptDatasetError), so decode_plan only has to bound it by the record."""
    return tuple((name, kind, (_U1 if dt == _U1 else dt) if kind == F_ARRAY else None, shape, off, nbytes)
                 for name, _code, shape, off, nbytes, kind, dt in _check_layout(layout))


def layout_plan(layout_bytes: bytes) -> Plan:
    """The decoding plan of a record's msgpack layout bytes."""
    return make_plan(_unpack(layout_bytes, "layout"))


def decode_plan(plan: Plan, u8: np.ndarray, mv: Any, base: int, copy: bool, end: int | None = None) -> dict[str, Any]:
    """Fields of a record whose payload starts at u8[base] and ends before u8[end] (default: the
    buffer's end); arrays are views unless copy. A field past `end` raises CorruptDatasetError."""
    if end is None:
        end = len(u8)
    out: dict[str, Any] = {}
    try:
        for name, kind, dt, shape, off, n in plan:
            a = base + off
            if a + n > end:
                raise _damaged(f"field {name[:80]!r} runs past the end of its record")
            if kind == F_ARRAY:
                arr = u8[a:a + n].reshape(shape) if dt is _U1 else u8[a:a + n].view(dt).reshape(shape)
                out[name] = arr.copy() if copy else arr
            elif kind == F_INT:
                out[name] = _I8.unpack_from(mv, a)[0]
            elif kind == F_FLOAT:
                out[name] = _F8.unpack_from(mv, a)[0]
            elif kind == F_BYTES:
                out[name] = bytes(mv[a:a + n]) if copy else mv[a:a + n]
            elif kind == F_STR:
                out[name] = bytes(mv[a:a + n]).decode("utf-8")
            elif kind == F_BOOL:
                out[name] = mv[a] != 0
            elif kind == F_UINT:
                out[name] = _U8.unpack_from(mv, a)[0]
            else:
                out[name] = None
    except UnicodeDecodeError:
        raise _damaged(f"field {name[:80]!r} is not valid UTF-8") from None
    return out


def decode_fields(u8: np.ndarray, start: int, head: int, layout: list, copy: bool) -> dict[str, Any]:
    """Fields of a record whose value starts at u8[start] (uncached path)."""
    return decode_plan(make_plan(layout), u8, u8.data, start + head, copy)


def field_schema(layout: list) -> dict[str, dict[str, Any]]:
    """Schema summary of one record's fields, merged across records by merge_schema."""
    out: dict[str, dict[str, Any]] = {}
    for name, code, shape, _off, _n in layout:
        if code in ("bytes", "str") or code in _SCALAR_CODES:
            out[name] = {"type": code}
        else:
            out[name] = {"type": "array", "dtype": code, "shape": list(shape)}
    return out


def merge_schema(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Union of two schemas; dimensions that differ become None (ragged)."""
    merged = {k: dict(v) for k, v in old.items()}
    for name, spec in new.items():
        cur = merged.get(name)
        if cur is None:
            merged[name] = dict(spec)
        elif cur != spec:
            if cur.get("type") == spec.get("type") == "array" and cur["dtype"] == spec["dtype"] \
                    and cur["shape"] is not None and len(cur["shape"]) == len(spec["shape"]):
                cur["shape"] = [a if a == b else None for a, b in zip(cur["shape"], spec["shape"])]
            elif cur.get("type") == spec.get("type") == "array" and cur["dtype"] == spec["dtype"]:
                cur["shape"] = None
            else:
                cur.update({"type": "mixed"})
                cur.pop("dtype", None)
                cur.pop("shape", None)
    return merged
