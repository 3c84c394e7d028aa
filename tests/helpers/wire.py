"""Importer inputs written byte for byte as their own tools write them, independent of kvdata's code.

- protobuf wire bytes by hand: `varint`, `ld`, a Caffe `Datum` (`datum_bytes`, in field-number
  order as Caffe's C++ serializes it) and a `tf.train.Example` (`example_bytes`), so a wrong
  field number or type in kvdata's run-time descriptors fails the tests that read them;
- TFRecord framing (`tfrecord_frame`): length, masked CRC-32C of the length, data, masked
  CRC-32C of the data, with the CRC-32C function the caller passes (google-crc32c);
- a Caffe LMDB as convert_imageset writes it (`write_caffe_lmdb`).

Used by tests/integration/test_caffe_import.py, test_import_wds_tfrecord.py and bench/imports.py.
Only the standard library here; lmdb is imported by write_caffe_lmdb.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from pathlib import Path


def varint(n: int) -> bytes:
    """A protobuf varint; negative int32/int64 as their 64-bit two's complement (10 bytes), as protobuf does."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def datum_bytes(*, channels: int | None = None, height: int | None = None, width: int | None = None,
                data: bytes | None = None, label: int | None = None, float_data: Sequence[float] | None = None,
                encoded: bool | None = None) -> bytes:
    """caffe.Datum serialized as Caffe's C++ does: set fields in field-number order;
    float_data is proto2 `repeated float`, so not packed (one fixed32 per value)."""
    out = bytearray()
    for number, v in ((1, channels), (2, height), (3, width)):
        if v is not None:
            out += varint(number << 3) + varint(v)
    if data is not None:
        out += ld(4, data)
    if label is not None:
        out += varint(5 << 3) + varint(label)
    for f in float_data or ():
        out += varint(6 << 3 | 5) + struct.pack("<f", f)
    if encoded is not None:
        out += varint(7 << 3) + varint(int(encoded))
    return bytes(out)


def example_bytes(features: dict[str, tuple[str, list]]) -> bytes:
    """tf.train.Example wire bytes (feature.proto field numbers): {name: ("bytes"|"float"|"int", values)}."""
    entries = b""
    for name, (kind, values) in features.items():
        if kind == "bytes":
            inner = ld(1, b"".join(ld(1, v) for v in values))
        elif kind == "float":
            inner = ld(2, ld(1, struct.pack(f"<{len(values)}f", *values)))
        else:
            inner = ld(3, ld(1, b"".join(varint(v) for v in values)))
        entries += ld(1, ld(1, name.encode()) + ld(2, inner))
    return ld(1, entries)


def tfrecord_frame(data: bytes, crc32c: Callable[[bytes], int]) -> bytes:
    """One TFRecord frame; crc32c is the CRC-32C function (google_crc32c.value)."""
    def masked(b: bytes) -> int:
        crc = crc32c(b)
        return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF

    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked(head)) + data + struct.pack("<I", masked(data))


def write_caffe_lmdb(path: Path, records: Sequence[tuple[str, bytes]]) -> list[str]:
    """convert_imageset: db::NEW (an LMDB directory), key "%08d_%s" % (line_id, filename),
    a commit every 1000 puts. Returns the keys in line order."""
    import lmdb

    map_size = max(1 << 26, int(sum(len(v) for _name, v in records) * 1.5) + (64 << 20))
    env = lmdb.open(str(path), map_size=map_size, subdir=True)
    keys = []
    try:
        txn = env.begin(write=True)
        for line_id, (filename, value) in enumerate(records):
            key = f"{line_id:08d}_{filename}"
            txn.put(key.encode("utf-8"), value)
            keys.append(key)
            if (line_id + 1) % 1000 == 0:
                txn.commit()
                txn = env.begin(write=True)
        txn.commit()
    finally:
        env.close()
    return keys
