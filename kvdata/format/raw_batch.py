"""Many raw records at once: the keys checked and hashed, the records encoded, for put_many.

A 1 KiB record costs LMDB about 2 us to append; encoding it one at a time through
`record.encode_record` (a dict for the meta, msgpack, a header struct, the crc in pieces) cost
5 us more, and checking and hashing its key another 1. Records of one key length share
everything but the key, the payload and the crc, so this module builds those parts once per
key length and each record with one crc32 over its variable bytes and one join. The bytes are
exactly what `encode_record` makes (tests/unit/test_raw_batch.py holds them equal), so readers
and `verify` see no difference. Anything this path does not cover -- a key that is not a
clean str, a value that is not bytes or bytearray, a label -- makes the caller take the
record-at-a-time path, which raises the precise error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from .._util.checksum import crc32
from .record import ALIGN, KIND_RAW, MAGIC, MAX_KEY_BYTES, PREFIX, PREFIX_SIZE, RECORD_VERSION, check_key

_META_HEAD = b"\x81\xa1k"  # msgpack {"k": <str>}: a map of one entry, the key "k"
_ZEROS = bytes(ALIGN)


def _str_header(n: int) -> bytes:
    """msgpack's header of a str of n UTF-8 bytes (fixstr, str8 or str16; keys are <= 4 KiB)."""
    if n < 32:
        return bytes([0xA0 | n])
    if n < 256:
        return b"\xd9" + bytes([n])
    return b"\xda" + n.to_bytes(2, "big")


def check_keys(keys: Sequence[Any]) -> list[bytes] | None:
    """The UTF-8 bytes of every key if all are valid str keys (record.check_key's rules),
    else None: the caller checks them one at a time, which names the bad one."""
    if set(map(type, keys)) != {str}:
        return None
    try:
        kbs = [k.encode("utf-8") for k in keys]
    except UnicodeEncodeError:
        return None
    lens = list(map(len, kbs))
    if not lens or min(lens) == 0 or max(lens) > MAX_KEY_BYTES or b"\x00" in b"".join(kbs):
        return None
    return kbs


def chunk_keys(given: Sequence[Any]) -> tuple[list[str], list[bytes]]:
    """(keys as str, their UTF-8 bytes) of a chunk's keys, checked at once where they are clean
    str keys, else one at a time (record.check_key: the first bad key raises its own error)."""
    kbs = check_keys(given)
    if kbs is not None:
        return list(given), kbs
    kbs = [check_key(k) for k in given]
    return [kb.decode("utf-8") for kb in kbs], kbs


def key_hashes(kbs: Sequence[bytes]) -> np.ndarray:
    """record.key_hash of every key, as uint64 (the digests joined and read at once)."""
    b2 = hashlib.blake2b
    return np.frombuffer(b"".join([b2(kb, digest_size=8).digest() for kb in kbs]), "<u8").astype(np.uint64)


MAX_PAYLOAD = (1 << 32) - 1  # a record's payload limit (record.encode_record names the record above it)


def raw_values(values: Sequence[Any]) -> bool:
    """Whether every value is stored as a raw record by this module (bytes or bytearray under
    the payload limit)."""
    return set(map(type, values)) <= {bytes, bytearray} and (not values or max(map(len, values)) <= MAX_PAYLOAD)


def raw_chunk_values(chunk: Sequence[tuple[Any, ...]], keys: Sequence[str]) -> list[Any] | None:
    """The values of a chunk of (key, value) pairs if this module encodes it whole: no labels,
    every value bytes or bytearray, no key twice. None: the record-at-a-time path."""
    if set(map(len, chunk)) != {2} or len(set(keys)) != len(keys):
        return None
    values = [item[1] for item in chunk]
    return values if raw_values(values) else None


@lru_cache(maxsize=MAX_KEY_BYTES + 1)
def _fixed_parts(n: int) -> tuple[bytes, bytes, int, int, int]:
    """What a key length fixes in a raw record: (meta's head, the padding, the crc32 of the
    prefix without its crc field, head, meta length); a pure function of n, computed once."""
    meta_len = len(_META_HEAD) + len(_str_header(n)) + n
    head = (PREFIX_SIZE + meta_len + ALIGN - 1) & ~(ALIGN - 1)
    crc0 = crc32(PREFIX.pack(MAGIC, KIND_RAW, RECORD_VERSION, 0, head, 0, meta_len, 0)[:PREFIX_SIZE - 4])
    return _META_HEAD + _str_header(n), _ZEROS[:head - PREFIX_SIZE - meta_len], crc0, head, meta_len


def record_size(key_bytes: int, value_bytes: int) -> int:
    """The bytes of a raw record of a key and a value of these sizes (encode_raw_records's)."""
    return _fixed_parts(key_bytes)[3] + value_bytes


def encode_raw_records(kbs: Sequence[bytes], values: Sequence[bytes | bytearray]) -> list[bytes]:
    """The records of raw values without labels, byte for byte as record.encode_record makes them.

    Payloads must be at most MAX_PAYLOAD bytes (raw_values checks)."""
    out: list[bytes] = []
    append = out.append
    pack = PREFIX.pack
    parts = _fixed_parts
    for kb, v in zip(kbs, values):
        meta_head, pad, crc0, head, meta_len = parts(len(kb))
        rest = meta_head + kb + pad
        append(b"".join((pack(MAGIC, KIND_RAW, RECORD_VERSION, 0, head, 0, meta_len, crc32(v, crc32(rest, crc0))),
                         rest, v)))
    return out


def is_raw_value(value: Any) -> bool:
    """raw_values for one value."""
    return type(value) in (bytes, bytearray) and len(value) <= MAX_PAYLOAD
