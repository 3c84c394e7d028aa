"""The bytes of a dataset: record layout, side-index dtypes, manifest schema, file names, codec.

Nothing in this package opens a dataset; everything here is pure or works on a
single stream. `from kvdata import format as fmt` gives the record and manifest
names below; file names live in `kvdata.format.names`.
"""

from ..errors import InvalidKeyError
from .manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    IndexFiles,
    KeyRunEntry,
    Manifest,
    ShardEntry,
    TailEntry,
    ZstCopy,
    checked_extra,
    dump_manifest,
    manifest_from_json,
    new_manifest,
    parse_manifest,
)
from .names import shard_name, tail_name
from .record import (
    ALIGN,
    F_ARRAY,
    F_BOOL,
    F_BYTES,
    F_FLOAT,
    F_INT,
    F_NONE,
    F_STR,
    F_UINT,
    HASH_DTYPE,
    KIND_FIELDS,
    KIND_RAW,
    KIND_SHIFT,
    KIND_TOMBSTONE,
    MAGIC,
    MAX_HEAD,
    MAX_KEY_BYTES,
    NO_LABEL,
    POS_DTYPE,
    PREFIX,
    PREFIX_HEAD,
    PREFIX_LAYOUT_LEN,
    PREFIX_META_LEN,
    PREFIX_SIZE,
    RECORD_DTYPE,
    RECORD_VERSION,
    SAMPLE_DTYPE,
    SCALAR_TYPES,
    UNKNOWN_OFFSET,
    Plan,
    RecordHeader,
    check_key,
    decode_fields,
    decode_plan,
    encode_record,
    encode_tombstone,
    field_schema,
    key_hash,
    layout_plan,
    make_plan,
    merge_schema,
    parse_meta,
    record_crc_ok,
    slot_key,
    slot_of,
)

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "IndexFiles", "KeyRunEntry", "Manifest", "ShardEntry", "TailEntry",
    "ZstCopy", "checked_extra", "dump_manifest", "manifest_from_json", "new_manifest", "parse_manifest", "ALIGN", "F_ARRAY",
    "F_BOOL", "F_BYTES", "F_FLOAT", "F_INT", "F_NONE", "F_STR", "F_UINT", "HASH_DTYPE", "KIND_FIELDS",
    "KIND_RAW", "KIND_SHIFT", "KIND_TOMBSTONE", "MAGIC", "MAX_HEAD", "MAX_KEY_BYTES", "NO_LABEL",
    "POS_DTYPE", "PREFIX", "PREFIX_HEAD", "PREFIX_LAYOUT_LEN", "PREFIX_META_LEN", "PREFIX_SIZE",
    "RECORD_DTYPE", "RECORD_VERSION", "SAMPLE_DTYPE", "SCALAR_TYPES", "UNKNOWN_OFFSET", "Plan",
    "RecordHeader", "check_key", "decode_fields", "decode_plan", "encode_record", "encode_tombstone",
    "field_schema", "key_hash", "layout_plan", "make_plan", "merge_schema", "parse_meta", "record_crc_ok", "slot_key", "slot_of",
    "shard_name", "tail_name", "InvalidKeyError",
]
