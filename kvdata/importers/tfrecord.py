"""Importing TFRecord files of `tf.train.Example` protos, without TensorFlow.

A TFRecord file is a sequence of frames: uint64 length (little-endian), the masked
CRC-32C of those 8 bytes, `length` bytes of data, the masked CRC-32C of the data
(mask: ((crc >> 15) | (crc << 17)) + 0xa282ead8 mod 2**32). Both CRCs are checked:
the length's in the parent's scan (a bad one means the framing is lost, so the file
is refused naming the record number), the data's in the workers (in the parent with
decode="none", records.decode_workers; a bad record fails the import, or is left out
with skip_bad). Record numbers in messages count from 0.

CRC-32C comes from google-crc32c (C) when it is installed (`kvdata[tfrecord]`), else
from a table-driven pure-Python version (correct, about 100x slower).

The `Example` messages (tensorflow/core/example/{example,feature}.proto, proto3) are
built at run time in a private descriptor pool, as the Caffe importer builds `Datum`,
so neither TensorFlow nor generated code is needed. Features become fields named by
the feature:

- int64_list: one value -> int, otherwise an int64 array (empty: an empty array);
- float_list: one value -> float, otherwise a float32 array;
- bytes_list: one value -> bytes (or, with decode="rgb"/"gray" and bytes that start like
  an image file, HWC uint8 pixels); several values -> fields "name[0]", "name[1]", ...;
  none -> b"".
By default the features TensorFlow's image datasets use are named as every importer names
them (common.py): "image/encoded" is the field "image" and "image/class/label" the field
"label"; `fields` (`--field FEATURE=NAME`) maps any feature to another name. The field
"label" holding one int is also the index label. Keys come from a
feature (key_feature: one bytes value in UTF-8, or one int) or are "<file name>/<record
number, 8 digits>".
"""

from __future__ import annotations

import functools
import os
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._util.sizes import parse_size
from ..errors import ConfigError, InvalidValueError
from .common import IMAGE_FIELD, LABEL_FIELD, parse_fields
from .records import Bad, Loaded, check_common, decode_image, key_problem, looks_like_image, open_same, worker_pool, write_records
from .target import import_entry, refuse_existing

INSTALL_HINT = "pip install 'kvdata[tfrecord]'"
DEFAULT_MAX_RECORD = "256MB"
RECORDS_PER_TASK = 64
_MASK_DELTA = 0xA282EAD8
_HEAD = struct.Struct("<QI")
_CRC = struct.Struct("<I")
# What features are called by default: the README's field names (common.py).
DEFAULT_FIELDS = {"image/encoded": IMAGE_FIELD, "image/class/label": LABEL_FIELD}


def _crc_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_TABLE = _crc_table()


def crc32c_py(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, table-driven, in pure Python."""
    crc = 0xFFFFFFFF
    table = _TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@functools.lru_cache(maxsize=1)
def _crc_function() -> Any:
    try:
        import google_crc32c
    except ImportError:
        return crc32c_py
    return google_crc32c.value


def crc32c(data: bytes) -> int:
    """CRC-32C of `data` (google-crc32c when installed, else crc32c_py)."""
    return int(_crc_function()(data))


def masked_crc(data: bytes) -> int:
    """The TFRecord checksum of `data`: its CRC-32C, rotated right by 15 bits, plus a constant."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord frame around `data` (what TensorFlow's TFRecordWriter writes)."""
    head = struct.pack("<Q", len(data))
    return head + _CRC.pack(masked_crc(head)) + data + _CRC.pack(masked_crc(data))


# ---------------------------------------------------------------- the Example message

def example_class() -> type:
    """The `tensorflow.Example` message class (built once per process, in a private pool)."""
    return _build_example_class()


@functools.lru_cache(maxsize=1)
def _build_example_class() -> type:
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError:
        raise ConfigError(f"reading TFRecords needs protobuf; install it with `{INSTALL_HINT}`") from None
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="kvdata/tf_example.proto", package="tensorflow", syntax="proto3")
    for name, type_ in (("BytesList", F.TYPE_BYTES), ("FloatList", F.TYPE_FLOAT), ("Int64List", F.TYPE_INT64)):
        fdp.message_type.add(name=name).field.add(name="value", number=1, type=type_, label=F.LABEL_REPEATED)
    feature = fdp.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (name, type_name) in enumerate((("bytes_list", "BytesList"), ("float_list", "FloatList"),
                                                ("int64_list", "Int64List")), 1):
        feature.field.add(name=name, number=number, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                          type_name=f".tensorflow.{type_name}", oneof_index=0)
    features = fdp.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                    type_name=".tensorflow.Feature")
    features.field.add(name="feature", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                       type_name=".tensorflow.Features.FeatureEntry")
    fdp.message_type.add(name="Example").field.add(name="features", number=1, type=F.TYPE_MESSAGE,
                                                   label=F.LABEL_OPTIONAL, type_name=".tensorflow.Features")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    descriptor = pool.FindMessageTypeByName("tensorflow.Example")
    get_class = getattr(message_factory, "GetMessageClass", None)
    if get_class is not None:
        return get_class(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)  # protobuf < 4.22


# ---------------------------------------------------------------- public entry point

class Task(NamedTuple):
    """A run of records of one file for a worker: (record number, data offset, length) each."""

    path: str
    records: tuple[tuple[int, int, int], ...]
    decode: str
    key_feature: str | None
    ident: tuple[int, int]  # (st_dev, st_ino) of the file the scan read


@import_entry
def import_tfrecord(sources: list[str | os.PathLike[str]], dataset: str | os.PathLike[str], *,
                    decode: str = "none", key_feature: str | None = None, workers: int = 0, skip_bad: bool = False,
                    max_record_size: int | str = DEFAULT_MAX_RECORD, shard_size: int | str | None = None,
                    compress: bool = False, progress: bool | None = None, existing: str = "refuse",
                    fields: Sequence[str] | Mapping[str, str] | None = None) -> dict[str, Any]:
    """Import the Example records of TFRecord files (or of every file in a directory, in name
    order) into `dataset`, in file order. Returns the summary (with "bad" as in import_wds).
    existing: what to do with a dataset already there ("refuse", "append", "overwrite": target.py).
    fields: {feature: field name} (or "FEATURE=NAME" strings) over DEFAULT_FIELDS; the key
    feature is the key, not also a field."""
    started = time.perf_counter()
    field_names = {**DEFAULT_FIELDS, **parse_fields(fields)}
    check_common(decode, workers, shard_size, INSTALL_HINT)
    refuse_existing(dataset, existing)
    limit = parse_size(max_record_size, "max_record_size")
    if key_feature is not None and not key_feature:
        raise ConfigError("key: name the feature that holds each record's key")
    example_class()  # protobuf is there, before anything is read
    files = find_files(sources)
    names = [Path(f).name for f in files]
    if key_feature is None and len(set(names)) != len(names):
        raise ConfigError("two TFRecord files share a file name, so generated keys would collide; "
                          "pass --key FEATURE or rename one")
    tasks: list[Task] = []
    scan_bad: list[Bad] = []
    total = 0
    for path in files:
        frames, bad, ident = scan_file(path, limit)
        if bad and not skip_bad:
            raise InvalidValueError(f"{bad[0].where}: {bad[0].reason}; nothing was imported "
                                    "(pass --skip-bad to leave such records out)")
        scan_bad.extend(bad)
        total += len(frames)
        for i in range(0, len(frames), RECORDS_PER_TASK):
            tasks.append(Task(path, tuple(frames[i:i + RECORDS_PER_TASK]), decode, key_feature, ident))
    if total == 0:
        raise InvalidValueError(f"{', '.join(files[:3])}: no TFRecord records found; nothing was written")
    with worker_pool(workers, decode) as pool:
        return write_records(tasks, load_task, dataset, total=total, pool=pool, workers=workers, skip_bad=skip_bad,
                             scan_bad=scan_bad, shard_size=shard_size, compress=compress, progress=progress,
                             started=started, existing=existing, fields=field_names)


def find_files(sources: list[str | os.PathLike[str]]) -> list[str]:
    """The files named: files as given, a directory's regular files in name order."""
    if not sources:
        raise ConfigError("no source given; pass TFRecord files or a directory of them")
    files: list[str] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            found = sorted(str(c) for c in p.iterdir() if c.is_file() and not c.is_symlink()
                           and not c.name.startswith("."))
            if not found:
                raise ConfigError(f"{p}: no files in this directory; pass the folder holding the TFRecords")
            files.extend(found)
        elif p.is_file():
            files.append(str(p))
        else:
            raise ConfigError(f"{p}: no such TFRecord file or directory; check the path")
    if len(set(files)) != len(files):
        raise ConfigError("the same TFRecord file is named twice; name each file once")
    return files


def scan_file(path: str, limit: int) -> tuple[list[tuple[int, int, int]], list[Bad], tuple[int, int]]:
    """(record number, data offset, length) of every frame, from the headers alone; the
    length CRCs are checked here. Framing that cannot be trusted raises InvalidValueError
    naming the file and record; a record over `limit` bytes is a Bad record."""
    frames: list[tuple[int, int, int]] = []
    bad: list[Bad] = []
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            size, ident = st.st_size, (st.st_dev, st.st_ino)
            offset = 0
            n = 0
            while offset < size:
                where = f"{path}: record {n} at byte {offset}"
                head = f.read(_HEAD.size)
                if len(head) < _HEAD.size:
                    raise InvalidValueError(f"{where}: the file ends inside a record header; the file is "
                                            "truncated or not a TFRecord file")
                length, length_crc = _HEAD.unpack(head)
                if n == 0 and head.startswith(b"\x1f\x8b"):
                    raise InvalidValueError(f"{path}: the file is gzip-compressed (TFRecordOptions GZIP); "
                                            "gunzip it first")
                if masked_crc(head[:8]) != length_crc:
                    raise InvalidValueError(f"{where}: the length's CRC does not match; the file is damaged "
                                            "or not a TFRecord file")
                end = offset + _HEAD.size + length + _CRC.size
                if end > size:
                    raise InvalidValueError(f"{where}: the record's {length} bytes run past the end of the file "
                                            f"({size} bytes); the file is truncated")
                if length > limit:
                    bad.append(Bad(f"record {n}", where, f"the record holds {length} bytes, over the {limit}-byte "
                                                         "limit (raise --max-record-size)"))
                else:
                    frames.append((n, offset + _HEAD.size, length))
                f.seek(end)
                offset = end
                n += 1
    except OSError as e:
        raise InvalidValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    return frames, bad, ident


# ---------------------------------------------------------------- loading records (runs in workers)

def load_task(task: Task) -> list[Loaded | Bad]:
    """The records of one task, each Loaded or Bad (never raises for bad input)."""
    out: list[Loaded | Bad] = []
    example_type: Any = example_class()
    name = Path(task.path).name
    try:
        fd = open_same(task.path, task.ident)
    except (OSError, InvalidValueError) as e:
        why = f"cannot open the file ({e.strerror})" if isinstance(e, OSError) else str(e)
        return [Bad(f"{name}/{n:08d}", f"{task.path}: record {n}", why) for n, _, _ in task.records]
    try:
        for n, offset, length in task.records:
            where = f"{task.path}: record {n}"
            key = f"{name}/{n:08d}"
            try:
                blob = os.pread(fd, length + _CRC.size, offset)
            except OSError as e:
                out.append(Bad(key, where, f"cannot read it ({e.strerror})"))
                continue
            if len(blob) != length + _CRC.size:
                out.append(Bad(key, where, "the file shrank while importing"))
                continue
            data = blob[:length]
            if masked_crc(data) != _CRC.unpack_from(blob, length)[0]:
                out.append(Bad(key, where, "the data's CRC does not match; the record is damaged"))
                continue
            out.append(_record(example_type, data, key, where, task))
    finally:
        os.close(fd)
    return out


def _record(example_type: Any, data: bytes, key: str, where: str, task: Task) -> Loaded | Bad:
    from google.protobuf.message import DecodeError

    try:
        example = example_type.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return Bad(key, where, f"not a tf.train.Example ({reason})")
    value: dict[str, Any] = {}
    try:
        for fname in sorted(example.features.feature):
            _put_feature(value, fname, example.features.feature[fname], task.decode)
    except InvalidValueError as e:
        return Bad(key, where, str(e))
    if task.key_feature is not None:
        k = value.pop(task.key_feature, None)
        if isinstance(k, bytes):
            try:
                k = k.decode("utf-8")
            except UnicodeDecodeError:
                return Bad(key, where, f"key feature {task.key_feature!r} is not UTF-8 text")
        elif isinstance(k, int):
            k = str(k)
        if not isinstance(k, str):
            return Bad(key, where, f"no key feature {task.key_feature!r} holding one bytes or int64 value "
                                   "(check --key)")
        key = k
    problem = key_problem(key)
    if problem is not None:
        return Bad(key, where, problem)
    label = value.get("label")
    return Loaded(key, value, label if isinstance(label, int) else None, where)


def _put_feature(value: dict[str, Any], name: str, feature: Any, decode: str) -> None:
    kind = feature.WhichOneof("kind")
    if kind == "int64_list":
        ints = feature.int64_list.value
        value[name] = int(ints[0]) if len(ints) == 1 else np.array(ints, dtype=np.int64)
    elif kind == "float_list":
        floats = feature.float_list.value
        value[name] = float(floats[0]) if len(floats) == 1 else np.array(floats, dtype=np.float32)
    elif kind == "bytes_list":
        items = feature.bytes_list.value
        if len(items) == 1:
            value[name] = _bytes_value(name, bytes(items[0]), decode)
        elif not items:
            value[name] = b""
        else:
            for i, item in enumerate(items):
                value[f"{name}[{i}]"] = _bytes_value(f"{name}[{i}]", bytes(item), decode)
    # a feature with no kind set holds nothing: it is left out


def _bytes_value(name: str, data: bytes, decode: str) -> Any:
    if decode != "none" and looks_like_image(data):
        try:
            return decode_image(data, decode)
        except InvalidValueError as e:
            raise InvalidValueError(f"feature {name!r}: {e}") from None
    return data
