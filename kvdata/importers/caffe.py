"""Importing a Caffe LMDB: the `Datum` records convert_imageset (or Caffe's Python API) wrote.

The `Datum` message is built at run time from a descriptor that matches
caffe.proto field for field (proto2, package `caffe`), and records are parsed by
the protobuf library; protobuf is imported only when a Caffe LMDB is read, so
`import kvdata` never loads it.

Record mapping (kvdata stores images HWC; BatchReader makes NCHW):

- raw `data` (uint8, CHW) -> {"image": uint8 (H, W, C)}. Channels stay in the
  order they were stored: convert_imageset writes OpenCV's BGR, so such images
  stay BGR.
- `float_data` (when `data` is empty) -> {"image": float32 (H, W, C)}, same layout.
- `encoded` (JPEG/PNG file bytes) -> decoded by Pillow to uint8 (H, W, C) with the
  image's own channel count (grayscale H x W x 1, RGB, RGBA; palette images become
  RGB), or its file bytes in "image" as stored with keep_encoded=True (as every importer
  names the image, common.py).
- every record gets "label" (int) and the index label; the key is the LMDB key
  (`%08d_<filename>` from convert_imageset), and LMDB order is the sample order.

Like the other importers, an import is all-or-nothing: the source is checked
before the dataset is opened, and everything is one commit at the end, so a
record that does not parse or decode leaves the dataset at its previous generation.
"""

from __future__ import annotations

import functools
import io
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import format as fmt
from .._util.progress import progress as make_progress
from .._util.sizes import parse_size
from ..errors import ConfigError, InvalidKeyError, InvalidValueError
from .common import summary
from .target import import_entry, open_target, refuse_existing

INSTALL_HINT = "pip install 'kvdata[caffe]'"
# Pillow modes stored as decoded (uint8, their own channel count) and the ones converted first.
_MODES_AS_IS = frozenset({"L", "LA", "RGB", "RGBA"})
_MODES_CONVERTED = {"1": "L", "P": "RGB", "PA": "RGB", "CMYK": "RGB", "YCbCr": "RGB", "LAB": "RGB", "HSV": "RGB"}
_MODES_16BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})

# caffe.proto: message Datum (name, number, type, label); `encoded` has [default = false].
_DATUM_FIELDS = (
    ("channels", 1, "TYPE_INT32", "LABEL_OPTIONAL"),
    ("height", 2, "TYPE_INT32", "LABEL_OPTIONAL"),
    ("width", 3, "TYPE_INT32", "LABEL_OPTIONAL"),
    ("data", 4, "TYPE_BYTES", "LABEL_OPTIONAL"),
    ("label", 5, "TYPE_INT32", "LABEL_OPTIONAL"),
    ("float_data", 6, "TYPE_FLOAT", "LABEL_REPEATED"),
    ("encoded", 7, "TYPE_BOOL", "LABEL_OPTIONAL"),
)


# ---------------------------------------------------------------- the Datum message

def datum_class() -> type:
    """The `caffe.Datum` message class (built once per process, in a private descriptor pool
    so it never clashes with a caffe_pb2 the caller has loaded)."""
    return _build_datum_class()


@functools.lru_cache(maxsize=1)
def _build_datum_class() -> type:
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError:
        raise ConfigError(f"reading a Caffe LMDB needs protobuf; install it with `{INSTALL_HINT}`") from None
    fdp = descriptor_pb2.FileDescriptorProto(name="kvdata/caffe_datum.proto", package="caffe", syntax="proto2")
    msg = fdp.message_type.add(name="Datum")
    F = descriptor_pb2.FieldDescriptorProto
    for name, number, type_name, label_name in _DATUM_FIELDS:
        field = msg.field.add(name=name, number=number, type=F.Type.Value(type_name),
                              label=F.Label.Value(label_name))
        if name == "encoded":
            field.default_value = "false"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    descriptor = pool.FindMessageTypeByName("caffe.Datum")
    get_class = getattr(message_factory, "GetMessageClass", None)
    if get_class is not None:
        return get_class(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)  # protobuf < 4.22


# ---------------------------------------------------------------- public entry point

@import_entry
def import_caffe(src: str | os.PathLike[str], dataset: str | os.PathLike[str], *, keep_encoded: bool = False,
                 shard_size: int | str | None = None, compress: bool = False,
                 progress: bool | None = None, existing: str = "refuse") -> dict[str, Any]:
    """Import every `Datum` record of the Caffe LMDB `src` (a directory holding data.mdb, or
    the data file itself) into `dataset`, keeping keys, key order and labels.

    Encoded records are decoded to pixels unless `keep_encoded`. Datums carry no class
    names, so the classes are numbered "0".."max label" (common.numbered_classes; names the
    dataset has that cover the labels are kept) and the summary's "classes" is their count,
    as `kvdata info` shows it. existing: what to do with a dataset already there ("refuse",
    "append", "overwrite": target.py).
    """
    started = time.perf_counter()
    if shard_size is not None:
        parse_size(shard_size, "shard_size")
    refuse_existing(dataset, existing)
    datum_type = datum_class()
    path = Path(src)
    env = _open_source(path)
    try:
        with env.begin(buffers=False) as txn:
            total = _check_source(path, env, txn, datum_type, keep_encoded)
            n, classes, counts = _write(path, txn, datum_type, total, dataset, keep_encoded=keep_encoded,
                                    shard_size=shard_size, compress=compress, progress=progress, existing=existing)
    finally:
        env.close()
    return summary(dataset, n, 0, classes, started, counts=counts)


# ---------------------------------------------------------------- the source LMDB

def _open_source(path: Path) -> Any:
    """The source LMDB environment, read-only and without a lock file (we never write it)."""
    import lmdb

    if not path.exists():
        raise ConfigError(f"{path}: no such Caffe LMDB; pass the directory convert_imageset wrote")
    if path.is_dir() and not (path / "data.mdb").is_file():
        raise ConfigError(f"{path}: no data.mdb in this directory, so it is not an LMDB; pass the directory "
                          "convert_imageset wrote")
    try:
        return lmdb.open(str(path), readonly=True, lock=False, subdir=path.is_dir(), create=False,
                         max_dbs=0, readahead=True)
    except lmdb.Error as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0].removeprefix(f"{path}: ")
        raise ConfigError(f"{path}: not a readable LMDB ({reason}); pass the directory that holds "
                          "convert_imageset's data.mdb") from None


def _check_source(path: Path, env: Any, txn: Any, datum_type: type, keep_encoded: bool) -> int:
    """Before the dataset is opened: the LMDB has records, the first is a Datum, and
    Pillow is there if encoded records need decoding. Returns the record count."""
    total = int(env.stat()["entries"])
    if total == 0:
        raise ConfigError(f"{path}: the LMDB holds no records; check the path")
    with txn.cursor() as cur:
        cur.first()
        key = _key(path, cur.key())
        datum = _parse(path, key, cur.value(), datum_type)
    if datum.encoded and not keep_encoded:
        try:
            import PIL.Image  # noqa: F401
        except ImportError:
            raise ConfigError(f"{path}: its records are encoded images and decoding them needs Pillow; "
                              f"install it with `{INSTALL_HINT}` or pass --keep-encoded") from None
    return total


def _key(path: Path, raw: bytes) -> str:
    try:
        key = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidKeyError(f"{path}: key {raw!r} is not valid UTF-8; kvdata keys are UTF-8 text") from None
    fmt.check_key(key)
    return key


def _parse(path: Path, key: str, value: bytes, datum_type: Any) -> Any:
    from google.protobuf.message import DecodeError

    try:
        return datum_type.FromString(value)
    except (DecodeError, ValueError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InvalidValueError(f"{path}: record {key!r} is not a Caffe Datum ({reason}); "
                                "is this a convert_imageset LMDB?") from None


# ---------------------------------------------------------------- one record

def datum_to_value(datum: Any, key: str, *, keep_encoded: bool = False, where: str = "") -> dict[str, Any]:
    """The kvdata record fields of one parsed Datum (see the module docstring)."""
    at = f"{where}: record {key!r}" if where else f"record {key!r}"
    label = int(datum.label)
    if datum.encoded:
        if keep_encoded:
            return {"image": bytes(datum.data), "label": label}  # the file bytes, as every importer keeps them
        return {"image": _decode_image(datum.data, at), "label": label}
    c, h, w = int(datum.channels), int(datum.height), int(datum.width)
    if c <= 0 or h <= 0 or w <= 0:
        raise InvalidValueError(f"{at}: channels x height x width = {c} x {h} x {w}, all must be positive; "
                                "the record is damaged")
    if datum.data:
        if len(datum.data) != c * h * w:
            raise InvalidValueError(f"{at}: data holds {len(datum.data)} bytes, not channels x height x width = "
                                    f"{c} x {h} x {w}; the record is damaged")
        chw = np.frombuffer(datum.data, dtype=np.uint8)
    elif len(datum.float_data):
        if len(datum.float_data) != c * h * w:
            raise InvalidValueError(f"{at}: float_data holds {len(datum.float_data)} values, not channels x "
                                    f"height x width = {c} x {h} x {w}; the record is damaged")
        chw = np.asarray(datum.float_data, dtype=np.float32)
    else:
        raise InvalidValueError(f"{at}: the Datum has neither data nor float_data; the record is empty")
    hwc = np.ascontiguousarray(chw.reshape(c, h, w).transpose(1, 2, 0))
    return {"image": hwc, "label": label}


def _decode_image(data: bytes, at: str) -> np.ndarray:
    """HWC uint8 pixels of encoded image bytes, with the image's own channel count."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as opened:
            opened.load()
            im: Any = opened
            mode = im.mode
            if mode in _MODES_CONVERTED:
                im = im.convert(_MODES_CONVERTED[mode])
            elif mode not in _MODES_AS_IS and mode not in _MODES_16BIT:
                raise InvalidValueError(f"{at}: Pillow mode {mode!r} images are not decoded to uint8 pixels; "
                                        "import with --keep-encoded")
            pixels = np.asarray(im)
    except InvalidValueError:
        raise
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, DecompressionBombError ...
        reason = str(e).splitlines()[0] if str(e) else ""
        raise InvalidValueError(f"{at}: Pillow cannot decode the encoded image ({type(e).__name__}: {reason}); "
                                "the record is damaged, or import with --keep-encoded") from None
    if mode in _MODES_16BIT:  # 16-bit PNG: scale to 8 bits as OpenCV's imread does in Caffe
        if pixels.size and (pixels.min() < 0 or pixels.max() > 0xFFFF):
            raise InvalidValueError(f"{at}: {mode!r} pixels outside 0..65535 cannot become uint8; "
                                    "import with --keep-encoded")
        pixels = (pixels.astype(np.uint32) >> 8).astype(np.uint8)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return np.ascontiguousarray(pixels, dtype=np.uint8)


# ---------------------------------------------------------------- writing

def _write(path: Path, txn: Any, datum_type: Any, total: int, dataset: str | os.PathLike[str], *,
           keep_encoded: bool, shard_size: int | str | None, compress: bool, progress: bool | None,
           existing: str) -> tuple[int, int, dict[str, Any]]:
    """Put every record in LMDB key order and commit once; on any error nothing is committed.
    Returns the records written, the dataset's classes (numbered, common.numbered_classes) and
    the target's counts."""
    labels: list[int] = []
    where = str(path)
    bar = None
    try:
        bar = make_progress(total=total, label="import", enabled=progress)
        with open_target(dataset, existing, shard_size=shard_size, compress=compress) as target:
            with txn.cursor() as cur:
                for raw_key, raw_value in cur:
                    key = _key(path, raw_key)
                    bar.update(1)
                    if not target.wants(key):
                        continue
                    value = datum_to_value(_parse(path, key, raw_value, datum_type), key,
                                           keep_encoded=keep_encoded, where=where)
                    target.put(key, value, label=value["label"])
                    labels.append(value["label"])
            classes = target.number_classes(labels)
            target.commit()
    finally:
        if bar is not None:
            bar.close()
    return len(labels), classes, target.counts()
