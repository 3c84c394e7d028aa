"""Round trips of the record format and size parsing (no files touched)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvdata import format as fmt
from kvdata._util.sizes import parse_size
from kvdata.errors import ConfigError, InvalidKeyError, InvalidValueError

DTYPES = [np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64, np.bool_, np.complex64, ">i4"]


def decode(rec: bytes):
    h = fmt.RecordHeader(rec)
    meta = h.meta(rec)
    if h.kind == fmt.KIND_RAW:
        return meta, bytes(rec[h.head:])
    u8 = np.frombuffer(rec, np.uint8)
    return meta, fmt.decode_fields(u8, 0, h.head, h.layout(rec), copy=True)


@settings(max_examples=60, deadline=None)
@given(key=st.text(min_size=1, max_size=40).filter(
           lambda k: "\x00" not in k and k.encode("utf-8", "ignore") == k.encode("utf-8", "surrogatepass")),
       payload=st.binary(max_size=3000))
def test_raw_round_trip(key: str, payload: bytes) -> None:
    rec, label, layout = fmt.encode_record(key, payload, 7)
    assert fmt.record_crc_ok(rec)
    meta, value = decode(rec)
    assert meta == {"k": key, "l": 7} and value == payload and layout == []


@settings(max_examples=60, deadline=None)
@given(arr=hnp.arrays(st.sampled_from(DTYPES), hnp.array_shapes(min_dims=0, max_dims=4, max_side=6)),
       i=st.integers(-(2**63), 2**64 - 1), f=st.floats(allow_nan=False), b=st.booleans(),
       s=st.text(max_size=20), raw=st.binary(max_size=50))
def test_fields_round_trip(arr: np.ndarray, i: int, f: float, b: bool, s: str, raw: bytes) -> None:
    value = {"a": arr, "i": i, "f": f, "b": b, "s": s, "raw": raw, "none": None, "np": np.float32(1.5)}
    rec, label, layout = fmt.encode_record("k", value)
    assert fmt.record_crc_ok(rec)
    _meta, out = decode(rec)
    assert list(out) == list(value)
    assert out["a"].dtype == arr.dtype and out["a"].shape == arr.shape
    np.testing.assert_array_equal(out["a"], arr)
    assert out["i"] == i and type(out["i"]) is int
    assert out["f"] == f and out["b"] is b and out["s"] == s and out["raw"] == raw and out["none"] is None
    assert out["np"].dtype == np.float32 and out["np"] == 1.5


def test_fields_are_aligned_views() -> None:
    rec, _l, _ = fmt.encode_record("k", {"a": np.arange(3, dtype=np.uint8), "b": np.arange(5, dtype=np.float64)})
    h = fmt.RecordHeader(rec)
    assert h.head % 8 == 0
    for _name, _code, _shape, off, _n in h.layout(rec):
        assert off % 8 == 0


def test_equal_shapes_share_one_layout() -> None:
    """Scalars live in the payload, so the layout (and its cached plan) is shared."""
    a = fmt.encode_record("k1", {"x": np.zeros((2, 3), np.float32), "label": 1})[0]
    b = fmt.encode_record("key-two", {"x": np.ones((2, 3), np.float32), "label": 99})[0]
    ha, hb = fmt.RecordHeader(a), fmt.RecordHeader(b)
    la = a[fmt.PREFIX_SIZE:fmt.PREFIX_SIZE + ha.layout_len]
    assert la == b[fmt.PREFIX_SIZE:fmt.PREFIX_SIZE + hb.layout_len]


def test_label_taken_from_label_field() -> None:
    assert fmt.encode_record("k", {"x": b"", "label": np.int64(4)})[1] == 4
    assert fmt.encode_record("k", {"x": b"", "label": 4}, label=9)[1] == 9
    assert fmt.encode_record("k", {"x": b"", "label": True})[1] is None


def test_crc_detects_any_flipped_byte() -> None:
    rec = bytearray(fmt.encode_record("key", {"a": np.arange(100, dtype=np.int32)})[0])
    for pos in (0, 5, 30, len(rec) // 2, len(rec) - 1):
        bad = bytearray(rec)
        bad[pos] ^= 0x10
        assert not fmt.record_crc_ok(bytes(bad))


@pytest.mark.parametrize("key", ["", b"\xff\xfe", "a\x00b", "x" * 5000, 12, "\udcff"])
def test_bad_keys(key) -> None:
    with pytest.raises(InvalidKeyError):
        fmt.check_key(key)


@pytest.mark.parametrize("value", [{"o": np.array([object()])}, {"u": np.array(["a"])}, {"x": [1, 2]}, 3.5, {"": b""}])
def test_bad_values(value) -> None:
    with pytest.raises(InvalidValueError):
        fmt.encode_record("k", value)


def test_object_dtype_message_names_key_and_field() -> None:
    with pytest.raises(InvalidValueError, match=r"key 'img7', field 'x'.*object"):
        fmt.encode_record("img7", {"x": np.array([None, 1], dtype=object)})


@pytest.mark.parametrize("text,expected", [("256MB", 256_000_000), ("256MiB", 256 << 20), ("1gib", 1 << 30),
                                           (4096, 4096), ("64 KB", 64_000), ("1.5MiB", 3 << 19)])
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "-1MB", "0", "12 parsecs", True])
def test_parse_size_errors(text) -> None:
    with pytest.raises(ConfigError, match="shard_size"):
        parse_size(text, "shard_size")


def test_manifest_version_and_damage() -> None:
    from kvdata.errors import CorruptDatasetError, FormatVersionError

    m = fmt.new_manifest(1 << 20, True).to_json()
    assert fmt.parse_manifest(fmt.dump_manifest(m), "x")["version"] == fmt.FORMAT_VERSION
    m["version"] = fmt.FORMAT_VERSION + 1
    with pytest.raises(FormatVersionError, match="upgrade"):
        fmt.parse_manifest(fmt.dump_manifest(m), "x")
    with pytest.raises(CorruptDatasetError, match="reindex"):
        fmt.parse_manifest(fmt.dump_manifest(fmt.new_manifest(1, True))[:40], "x")


def test_the_records_crc32_is_zlibs() -> None:
    """kvdata._util.checksum.crc32 (ISA-L where installed) gives zlib's values, seeded or not:
    records written with either verify with the other."""
    import random
    import zlib

    from kvdata._util.checksum import crc32

    rng = random.Random(0)
    for n in (0, 1, 7, 64, 1000, 151 * 1024 + 3):
        data = rng.randbytes(n)
        seed = rng.getrandbits(32)
        assert crc32(data) == zlib.crc32(data) and crc32(data, seed) == zlib.crc32(data, seed)
        assert crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])


@pytest.mark.parametrize("size", [0, 1, 4 << 20, (4 << 20) + 7, 9 << 20])
def test_mapped_sha256_is_the_file_sha256(tmp_path, size: int) -> None:
    """The sealing writer hashes its own shard from a map (no read() copies): same digest."""
    from kvdata.format.codec import file_sha256, mapped_file_sha256

    p = tmp_path / "f.bin"
    p.write_bytes(np.random.default_rng(size).bytes(size))
    assert mapped_file_sha256(p) == file_sha256(p)
