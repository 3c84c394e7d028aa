"""Fuzz the daemon protocol's decoders (kvdata/protocol.py): frame bodies (random bytes, mutated
messages, truncated frames, huge declared lengths, msgpack with huge containers and deep
nesting) and the client reading a fake daemon's garbage replies. Only ProtocolError,
DaemonError and DaemonUnavailable (KVDataError) may escape, and decoding a frame costs memory
in proportion to its size."""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdata import protocol
from kvdata.errors import DaemonError, ProtocolError

import fuzzlib as fl
from fuzzlib import fuzz_settings


@pytest.fixture(scope="module")
def ctx() -> Iterator[fl.Ctx]:
    with fl.context() as c:
        yield c


def test_fuzz_protocol_frames(ctx: fl.Ctx) -> None:
    @fuzz_settings(400)
    @given(st.one_of(st.binary(max_size=64), st.randoms(use_true_random=False).map(
        lambda r: fl.TARGETS["protocol_frame"].gen(r, ctx))))
    def case(body: bytes) -> None:
        fl.check("protocol_frame", body, ctx)
    case()


def test_fuzz_client_against_a_garbage_daemon(ctx: fl.Ctx) -> None:
    @fuzz_settings(60)
    @given(st.randoms(use_true_random=False))
    def case(r: Any) -> None:
        fl.check("protocol_client", fl.TARGETS["protocol_client"].gen(r, ctx), ctx)
    case()


_msg = st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False) | st.text(max_size=10)
    | st.binary(max_size=10), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=15), max_size=6)


@fuzz_settings(200)
@given(_msg)
def test_messages_round_trip_through_the_limits(msg: dict[str, Any]) -> None:
    """The decoding limits refuse nothing a client or the daemon sends."""
    assert protocol.decode_body(protocol.encode(msg)[protocol.HEADER.size:]) == msg


# ---------------------------------------------------------------- regressions, one per bug


def _peak(fn: Any) -> tuple[int, Any]:
    tracemalloc.start()
    try:
        try:
            out: Any = fn()
        except ProtocolError as e:
            out = e
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("item", [b"\x90", b"\x80", b"\xa2ab", b"\xcd\x01\x02"],
                         ids=["empty arrays", "empty maps", "2-char strings", "uint16s"])
def test_frame_of_a_million_small_objects_is_refused_with_bounded_memory_not_gigabytes(item: bytes) -> None:
    """A 16 MiB frame of empty arrays decoded to more than 1 GB of Python objects (issue 11)."""
    n = protocol.MAX_ITEMS
    inner = b"\xdd" + n.to_bytes(4, "big") + item * n
    body = b"\x81\xa1t\x92" + inner + inner
    peak, out = _peak(lambda: protocol.decode_body(body))
    assert isinstance(out, ProtocolError) and "more than" in str(out)
    assert peak < 160 << 20, f"{peak / 1e6:.0f} MB to refuse a {len(body) / 1e6:.1f} MB frame"


def test_frame_declaring_a_container_longer_than_the_limit_is_refused_before_decoding() -> None:
    for header in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdd" + (protocol.MAX_ITEMS + 1).to_bytes(4, "big")):
        peak, out = _peak(lambda h=header: protocol.decode_body(b"\x81\xa1t" + h + b"\x90" * 100))
        assert isinstance(out, ProtocolError) and peak < 1 << 20


def test_deeply_nested_frame_is_a_protocolerror_not_recursionerror() -> None:
    for nest in (b"\x91" * 5000, b"\x81\xa1k" * 5000):
        with pytest.raises(ProtocolError):
            protocol.decode_body(b"\x81\xa1t" + nest + b"\xc0")


def _client_gets(ctx: fl.Ctx, reply: bytes) -> BaseException | None:
    try:
        fl.TARGETS["protocol_client"].run(reply, ctx)
    except (ProtocolError, DaemonError, protocol.DaemonUnavailable) as e:
        return e
    return None


def test_daemon_error_reply_nested_1000_deep_is_one_line_daemonerror_not_recursionerror(ctx: fl.Ctx) -> None:
    body = b"\x83\xa2id\x01\xa2ok\xc2\xa5error" + b"\x91" * 1000 + b"\xc0"
    e = _client_gets(ctx, protocol.HEADER.pack(len(body)) + body)
    assert isinstance(e, DaemonError) and str(e) == "the daemon refused the request"


def test_daemon_error_reply_with_newlines_keeps_its_first_line(ctx: fl.Ctx) -> None:
    e = _client_gets(ctx, protocol.encode({"id": 1, "ok": False, "error": "no such dataset\nTraceback (most recent"}))
    assert isinstance(e, DaemonError) and str(e) == "no such dataset"


def test_reply_id_that_is_a_huge_or_nested_value_is_a_short_protocolerror(ctx: fl.Ctx) -> None:
    body = b"\x82\xa2ok\xc3\xa2id" + b"\x91" * 1000 + b"\xc0"
    e = _client_gets(ctx, protocol.HEADER.pack(len(body)) + body)
    assert isinstance(e, ProtocolError) and "a list" in str(e) and len(str(e)) < 200


def test_client_closes_its_socket_when_the_hello_reply_is_refused(ctx: fl.Ctx) -> None:
    """Client() left its socket open (a ResourceWarning at garbage collection) when hello failed."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        assert isinstance(_client_gets(ctx, protocol.encode({"id": 7, "ok": True})), ProtocolError)
    assert len(os.listdir("/proc/self/fd")) <= before


def test_msgpack_with_bad_utf8_or_non_str_keys_is_a_protocolerror() -> None:
    for body in (b"\x81\xa2\xff\xfe\x01", b"\x81\x01\x02", b"\x81\x91\x01\x02", msgpack.packb({"a": 1}) + b"\x00"):
        with pytest.raises(ProtocolError):
            protocol.decode_body(body)
