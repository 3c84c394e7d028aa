"""kvdata.protocol: framing (4-byte big-endian length + one msgpack map of at most MAX_FRAME
bytes), the message types, the socket path rule, and the client's handling of bad frames.

Every malformed frame must raise ProtocolError (kvdata.errors), never another exception
type, so the daemon can answer it with one error line and the client can fall back.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvdata.protocol as protocol
from kvdata.errors import DaemonUnavailable, KVDataError, ProtocolError
from kvdata.protocol import HEADER, MAX_FRAME, TYPES, Client, decode_body, default_socket_path, encode, socket_path

# msgpack values as the protocol carries them: str keys, nested lists and maps
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
           | st.text(max_size=50) | st.binary(max_size=50))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=20)
messages = st.dictionaries(st.text(max_size=20), values, max_size=8)


# ---------------------------------------------------------------- framing


def test_header_is_a_4_byte_big_endian_length() -> None:
    assert HEADER.size == 4
    assert HEADER.pack(1) == b"\x00\x00\x00\x01"
    assert HEADER.pack(0x01020304) == b"\x01\x02\x03\x04"
    assert MAX_FRAME < 2**32


@settings(max_examples=100, deadline=None)
@given(messages)
def test_encode_is_a_header_and_the_msgpack_body(msg: dict[str, Any]) -> None:
    frame = encode(msg)
    (n,) = HEADER.unpack(frame[:HEADER.size])
    body = frame[HEADER.size:]
    assert n == len(body) <= MAX_FRAME
    assert decode_body(body) == msg


def test_request_frames_carry_type_and_id() -> None:
    frame = encode({"t": "status", "id": 7})
    assert decode_body(frame[HEADER.size:]) == {"t": "status", "id": 7}


def test_encoding_a_message_over_max_frame_is_refused() -> None:
    with pytest.raises(ProtocolError, match=str(MAX_FRAME)):
        encode({"t": "announce", "pad": b"x" * MAX_FRAME})
    just = encode({"p": b"x" * (MAX_FRAME - 16)})  # near the limit is fine
    assert len(just) - HEADER.size <= MAX_FRAME


@pytest.mark.parametrize("body", [
    b"",                                       # nothing
    b"\xc1",                                   # a byte msgpack never uses
    b"\x82\xa1t",                              # a map cut short
    msgpack.packb({"t": "status"})[:-1],       # a valid frame missing its last byte
    b"\x81\xa1t\xa6status\x00",                # extra data after the map
    b"\xdd\xff\xff\xff\xff",                   # an array claiming 4 billion items
], ids=["empty", "reserved-byte", "truncated-map", "truncated-frame", "trailing-bytes", "huge-array"])
def test_garbage_bodies_raise_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_body(body)


@pytest.mark.parametrize("top", [[1, 2], 3, "status", b"x", None, True, 1.5],
                         ids=["array", "int", "str", "bin", "nil", "bool", "float"])
def test_a_frame_must_hold_a_map(top: Any) -> None:
    with pytest.raises(ProtocolError, match="map"):
        decode_body(msgpack.packb(top, use_bin_type=True))


@pytest.mark.parametrize("msg", [{1: "a"}, {None: 1}, {"ok": {2.5: 1}}], ids=["int-key", "nil-key", "nested-float-key"])
def test_map_keys_must_be_strings(msg: dict) -> None:
    with pytest.raises(ProtocolError):
        decode_body(msgpack.packb(msg, use_bin_type=True))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_to_a_map_or_raise_protocol_error(body: bytes) -> None:
    try:
        msg = decode_body(body)
    except ProtocolError as e:
        assert isinstance(e, KVDataError) and str(e)
    else:
        assert isinstance(msg, dict)


@settings(max_examples=60, deadline=None)
@given(messages, st.data())
def test_every_cut_of_a_valid_body_is_refused(msg: dict[str, Any], data: st.DataObject) -> None:
    body = encode(msg)[HEADER.size:]
    cut = data.draw(st.integers(0, len(body) - 1))
    with pytest.raises(ProtocolError):
        decode_body(body[:cut])


# ---------------------------------------------------------------- message types


def test_types_are_unique_names() -> None:
    assert len(TYPES) == len(set(TYPES))
    assert all(isinstance(t, str) and t.isidentifier() and t.islower() for t in TYPES)
    assert {"hello", "open", "need", "status", "release"} <= set(TYPES)


def test_every_type_is_documented_in_the_module_table() -> None:
    doc = protocol.__doc__ or ""
    rows = [line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| ")]
    documented = [r for r in rows if r and r != "t"]
    assert sorted(documented) == sorted(TYPES)


# ---------------------------------------------------------------- socket path rule


def test_socket_path_rule(tmp_path: Path) -> None:
    env = {"KVDATA_SOCKET": str(tmp_path / "env.sock"), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    assert socket_path(tmp_path / "config.sock", env) == tmp_path / "env.sock"  # $KVDATA_SOCKET first
    env.pop("KVDATA_SOCKET")
    assert socket_path(tmp_path / "config.sock", env) == tmp_path / "config.sock"  # then the config's
    assert socket_path(None, env) == tmp_path / "run" / "kvdata" / "kvdatad.sock"  # then the user runtime dir
    assert socket_path(None, {}) == Path("/run/kvdata/kvdatad.sock")  # then the system service's
    assert default_socket_path({"XDG_RUNTIME_DIR": ""}) == Path("/run/kvdata/kvdatad.sock")


def test_this_process_finds_no_daemon(hermetic_env: dict[str, Path]) -> None:
    """The hermetic fixture (tests/conftest.py) must send every client to an empty runtime dir."""
    path = socket_path()
    assert path.is_relative_to(hermetic_env["XDG_RUNTIME_DIR"]) and not path.exists()
    assert protocol.connect() is None


# ---------------------------------------------------------------- the client against a fake daemon


@contextmanager
def fake_daemon(tmp_path: Path, reply: Callable[[dict[str, Any]], bytes]) -> Iterator[Path]:
    """A Unix socket server for one connection: answers hello properly, then every other
    request with the raw bytes `reply(request)` returns (b"" closes the connection)."""
    path = tmp_path / "fake.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    srv.settimeout(10)

    def read_exact(conn: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def serve() -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            try:
                while True:
                    (n,) = HEADER.unpack(read_exact(conn, HEADER.size))
                    req = decode_body(read_exact(conn, n))
                    if req["t"] == "hello":
                        conn.sendall(encode({"id": req["id"], "ok": True, "version": req["version"], "pid": 1}))
                        continue
                    out = reply(req)
                    if not out:
                        return
                    conn.sendall(out)
            except (EOFError, OSError):
                return

    thread = threading.Thread(target=serve, name="fake-kvdatad")
    thread.start()
    try:
        yield path
    finally:
        srv.close()
        thread.join(15)
        assert not thread.is_alive()


def test_client_round_trip(tmp_path: Path) -> None:
    with fake_daemon(tmp_path, lambda req: encode({"id": req["id"], "ok": True, "echo": req["t"]})) as path:
        with Client(path, timeout=5) as c:
            assert c.server["ok"] is True
            assert c.request("status")["echo"] == "status"


def test_client_refuses_a_reply_header_over_max_frame_without_reading_it(tmp_path: Path) -> None:
    # only the header is sent: a client that tried to read the body would time out instead
    with fake_daemon(tmp_path, lambda req: HEADER.pack(MAX_FRAME + 1)) as path:
        with Client(path, timeout=5) as c, pytest.raises(ProtocolError, match="exceeds"):
            c.request("status")


def test_client_refuses_a_reply_that_is_not_a_map(tmp_path: Path) -> None:
    body = msgpack.packb([1, 2, 3])
    with fake_daemon(tmp_path, lambda req: HEADER.pack(len(body)) + body) as path:
        with Client(path, timeout=5) as c, pytest.raises(ProtocolError):
            c.request("status")


def test_client_refuses_garbage_in_a_reply(tmp_path: Path) -> None:
    body = b"\xc1\xc1\xc1"
    with fake_daemon(tmp_path, lambda req: HEADER.pack(len(body)) + body) as path:
        with Client(path, timeout=5) as c, pytest.raises(ProtocolError):
            c.request("status")


def test_client_refuses_a_reply_to_another_request(tmp_path: Path) -> None:
    with fake_daemon(tmp_path, lambda req: encode({"id": req["id"] + 1, "ok": True})) as path:
        with Client(path, timeout=5) as c, pytest.raises(ProtocolError, match="does not match"):
            c.request("status")


def test_daemon_that_hangs_up_mid_frame_is_unavailable_not_a_crash(tmp_path: Path) -> None:
    with fake_daemon(tmp_path, lambda req: b"") as path:
        with Client(path, timeout=5) as c, pytest.raises(DaemonUnavailable):
            c.request("status")


def test_stale_socket_file_means_daemon_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays, nobody listens: what a SIGKILLed daemon leaves
    with pytest.raises(DaemonUnavailable, match=str(path)):
        Client(path, timeout=2)
    assert protocol.connect(path) is None


def test_flags_round_trip_and_read_nothing_past_the_end() -> None:
    from kvdata.protocol import flag_set, pack_flags

    for n in (0, 1, 7, 8, 9, 1000):
        flags = [(i * 7919) % 3 == 0 for i in range(n)]
        packed = pack_flags(flags)
        assert len(packed) == (n + 7) // 8
        assert [flag_set(packed, i) for i in range(n)] == flags
        assert not flag_set(packed, -1) and not flag_set(packed, len(packed) * 8) and not flag_set(packed, 10**9)
