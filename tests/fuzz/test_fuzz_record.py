"""Fuzz the record decoders (kvdata/format/record.py and Reader.decode_value): headers, layouts,
meta maps and payloads from damaged shards may raise only CorruptDatasetError.

The regression tests below are named after the bugs the fuzzing found; each was an escaping
IndexError/struct.error/ValueError/TypeError/UnicodeDecodeError (or a silent wrong read) before."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvdata
from kvdata.errors import CorruptDatasetError
from kvdata.format import record as rec

import fuzzlib as fl
from fuzzlib import fuzz_settings


@pytest.fixture(scope="module")
def ctx() -> Iterator[fl.Ctx]:
    with fl.context() as c:
        yield c


# ---------------------------------------------------------------- properties


def test_fuzz_record_header(ctx: fl.Ctx) -> None:
    @fuzz_settings(400)
    @given(st.one_of(st.binary(max_size=80), st.randoms(use_true_random=False).map(
        lambda r: fl.TARGETS["record_header"].gen(r, ctx))))
    def case(buf: bytes) -> None:
        fl.check("record_header", buf, ctx)
    case()


def test_fuzz_record_layout(ctx: fl.Ctx) -> None:
    @fuzz_settings(300)
    @given(st.randoms(use_true_random=False))
    def case(r: Any) -> None:
        fl.check("record_layout", fl.TARGETS["record_layout"].gen(r, ctx), ctx)
    case()


def test_fuzz_record_decode_value(ctx: fl.Ctx) -> None:
    @fuzz_settings(300)
    @given(st.randoms(use_true_random=False))
    def case(r: Any) -> None:
        fl.check("record_decode", fl.TARGETS["record_decode"].gen(r, ctx), ctx)
    case()


_DTYPES = ("|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8", ">f4", ">i8", "|b1", "<c8",
           "<c16")
_fields = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.one_of(
        st.builds(lambda dt, shape: np.zeros(shape, dtype=dt), st.sampled_from(_DTYPES),
                  st.lists(st.integers(0, 4), max_size=3).map(tuple)),
        st.binary(max_size=20), st.text(max_size=20), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=False),
        st.booleans(), st.none()),
    max_size=6)


@fuzz_settings(200)
@given(_fields)
def test_valid_records_still_decode_exactly(fields: dict[str, Any]) -> None:
    """The validation added to layouts and metas rejects nothing a writer writes."""
    data, _label, _layout = rec.encode_record("key", fields, 5)
    h = rec.RecordHeader(data)
    assert rec.record_crc_ok(data)
    assert h.meta(data) == {"k": "key", "l": 5}
    plan = rec.layout_plan(data[rec.PREFIX_SIZE:rec.PREFIX_SIZE + h.layout_len])
    u8 = np.frombuffer(data, np.uint8)
    out = rec.decode_plan(plan, u8, memoryview(data), h.head, True, len(data))
    assert out.keys() == fields.keys()
    for k, v in fields.items():
        if isinstance(v, np.ndarray):
            assert out[k].dtype == v.dtype and out[k].shape == v.shape and out[k].tobytes() == v.tobytes()
        else:
            assert out[k] == v and type(out[k]) is type(v) or (isinstance(v, bytes) and bytes(out[k]) == v)


# ---------------------------------------------------------------- regressions, one per bug


def _record(fields: dict[str, Any] | bytes, key: str = "k") -> bytearray:
    return bytearray(rec.encode_record(key, fields)[0])


def _with_layout(layout: Any, payload: bytes = b"\x00" * 64, meta: Any = None) -> bytes:
    lay = msgpack.packb(layout, use_bin_type=True)
    mb = msgpack.packb({"k": "x"} if meta is None else meta, use_bin_type=True)
    head = (rec.PREFIX_SIZE + len(lay) + len(mb) + 7) & ~7
    body = rec.PREFIX.pack(rec.MAGIC, rec.KIND_FIELDS, 1, 0, head, len(lay), len(mb), 0) + lay + mb
    return body + b"\x00" * (head - len(body)) + payload


def test_record_crc_ok_of_a_record_shorter_than_its_header_is_false_not_struct_error() -> None:
    assert rec.record_crc_ok(b"K\x01") is False
    assert rec.record_crc_ok(memoryview(b"")) is False


def test_record_meta_that_is_not_msgpack_is_corrupt_not_extradata() -> None:
    data = _record(b"payload")
    h = rec.RecordHeader(bytes(data))
    data[rec.PREFIX_SIZE] = 0xC1  # msgpack's "never used" byte
    with pytest.raises(CorruptDatasetError, match="meta is not valid msgpack"):
        h.meta(bytes(data))


@pytest.mark.parametrize("meta", [[1, 2], {"l": 3}, {"k": 5}, {"k": "x", "l": "3"}, {"k": "x", "l": 1 << 63},
                                  {"k": "x", "l": True}])
def test_record_meta_without_a_str_key_or_with_a_bad_label_is_corrupt_not_keyerror(meta: Any) -> None:
    data = _with_layout([], meta=meta)
    with pytest.raises(CorruptDatasetError, match="meta"):
        rec.RecordHeader(data).meta(data)


@pytest.mark.parametrize("layout", [
    [["a", "O", [2], 0, 16]],             # object dtype: numpy raised TypeError viewing bytes as references
    [["a", "V8", [1], 0, 8]],             # void, structured, strings, datetimes: not stored by any writer
    [["a", "i4,i4", [1], 0, 8]],
    [["a", "M8[ns]", [1], 0, 8]],
    [["a", "float32", [2], 0, 8]],        # not the canonical dtype.str spelling
    [["a", "<f4", [-1], 0, 8]],           # negative dimension
    [["a", "<f4", [1 << 40, 1 << 40], 0, 8]],  # shape that does not match nbytes (reshape ValueError)
    [["a", "<f4", None, 0, 8]],           # array without a shape
    [["a", "int", None, 0, 2]],           # an int scalar is 8 bytes
    [["a", "str", [3], 0, 3]],            # a str with a shape
    [[1, "str", None, 0, 3]],             # name not a str (TypeError downstream)
    [["a", "str", None, -8, 3]],          # negative offset (read before the payload)
    [["a", "str", None, 0]],              # four items (ValueError: not enough values to unpack)
    "not a list", 5, [["a", 1.5, None, 0, 0]],
])
def test_layout_that_no_writer_writes_is_corrupt_not_typeerror_or_valueerror(layout: Any) -> None:
    with pytest.raises(CorruptDatasetError, match="layout"):
        rec.make_plan(layout)
    data = _with_layout(layout)
    with pytest.raises(CorruptDatasetError, match="layout"):
        rec.RecordHeader(data).layout(data)


def test_layout_bytes_that_are_not_msgpack_are_corrupt_not_extradata() -> None:
    for b in (b"\xc1", b"\x91\x95", msgpack.packb([]) + b"\x00", b"\xd4\x80\x00"):
        with pytest.raises(CorruptDatasetError, match="layout"):
            rec.layout_plan(b)


def test_field_past_the_end_of_its_record_is_corrupt_not_struct_error_or_a_read_of_the_next_record() -> None:
    data = _with_layout([["n", "int", None, 56, 8], ["s", "str", None, 0, 4]], payload=b"\x00" * 16)
    plan = rec.make_plan(rec.RecordHeader(data).layout(data))
    u8 = np.frombuffer(data, np.uint8)
    head = rec.RecordHeader(data).head
    with pytest.raises(CorruptDatasetError, match="runs past the end"):
        rec.decode_plan(plan, u8, memoryview(data), head, False)
    # followed by other bytes (the next record in a shard map): still refused at the record's end
    longer = data + b"\x01" * 64
    with pytest.raises(CorruptDatasetError, match="runs past the end"):
        rec.decode_plan(plan, np.frombuffer(longer, np.uint8), memoryview(longer), head, False, len(data))


def test_str_field_that_is_not_utf8_is_corrupt_not_unicodedecodeerror() -> None:
    data = _with_layout([["s", "str", None, 0, 2]], payload=b"\xff\xfe" + b"\x00" * 6)
    h = rec.RecordHeader(data)
    plan = rec.make_plan(h.layout(data))
    with pytest.raises(CorruptDatasetError, match="UTF-8"):
        rec.decode_plan(plan, np.frombuffer(data, np.uint8), memoryview(data), h.head, True)


def test_decode_value_of_a_tombstone_is_corrupt_not_an_empty_sample(ctx: fl.Ctx) -> None:
    with pytest.raises(CorruptDatasetError, match="deleted record"):
        ctx.store.reader().decode_value(rec.encode_tombstone("gone"), False)


def test_decode_value_of_a_record_with_a_layout_of_garbage_is_corrupt(ctx: fl.Ctx) -> None:
    data = bytearray(_record({"a": np.ones(3, "<f4")}))
    data[rec.PREFIX_SIZE:rec.PREFIX_SIZE + 2] = b"\xc1\xc1"
    with pytest.raises(CorruptDatasetError, match="layout is not valid msgpack"):
        ctx.store.reader().decode_value(bytes(data), True)


def test_header_lengths_past_the_record_are_corrupt_not_struct_error() -> None:
    data = bytearray(_record(b"x"))
    struct.pack_into("<I", data, 8, 0xFFFFFFFF)  # layout length
    with pytest.raises(CorruptDatasetError, match="bad lengths"):
        rec.RecordHeader(bytes(data))


def test_sealed_record_whose_prefix_does_not_match_the_index_is_corrupt_not_struct_error(tmp_path: Any) -> None:
    """A fields record whose bytes in the shard were overwritten (the index row still points there)."""
    ds = tmp_path / "ds"
    with kvdata.open(ds, "a") as s:
        s.put("a", {"x": np.arange(4, dtype="<i8")})
        s.put("b", {"x": np.arange(4, dtype="<i8")})
        s.seal()
        s.commit()
    with kvdata.open(ds) as s:
        off = int(s.reader().gen.index.records["offset"][1])
        shard = s.reader().gen.shard_path(s.manifest.shards[0])
    with open(shard, "r+b") as f:
        f.seek(off + 8)
        f.write(struct.pack("<I", 0x7FFFFFFF))  # the layout length
    with kvdata.open(ds) as s:
        assert s.get_many([0])[0]["x"].tolist() == [0, 1, 2, 3]
        with pytest.raises(CorruptDatasetError, match=r"record at offset .* does not match the side-index"):
            s.get_many([1])
