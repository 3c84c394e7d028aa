"""The reader <-> kvdatad protocol: framing, message types, socket path rule, and a client.

Transport: a Unix stream socket. Every message is one frame: a 4-byte big-endian
length, then a msgpack map (at most MAX_FRAME bytes). Requests carry "t" (type)
and "id"; each gets exactly one reply {"id", "ok": true, ...} or
{"id", "ok": false, "error": "<one line>", "code": "<kind>"}.

| t        | request fields                                  | reply fields                 |
|----------|-------------------------------------------------|------------------------------|
| hello    | version, pid                                    | version, pid                 |
| open     | dataset (abs path, s3://, http(s)://)           | root (local manifest+index), generation, shards |
| announce | dataset, reader, shards [int ids in order], position | -                       |
| progress | reader, position, stall (seconds, cumulative)   | -                            |
| need     | dataset, shard (int id), sha256 (its checksum in the client's manifest) | path, staged |
| want     | dataset, shards [[int id, sha256], ...]         | started (staging begun now, not awaited) |
| release  | reader                                          | -                            |
| stage    | dataset, tier (optional), wait (bool)           | shards, queued               |
| evict    | dataset, tier (optional)                        | evicted                      |
| status   | -                                               | the daemon's state (see kvdata status --json) |
| reload   | -                                               | tiers                        |

A connection that closes releases everything its readers announced. Shards are
named by integer id into the dataset's manifest, never by path, so a client
cannot make the daemon touch a file outside the dataset and its tiers.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack

from .errors import DaemonError, DaemonUnavailable, ProtocolError

PROTOCOL_VERSION = 1
MAX_FRAME = 16 << 20
HEADER = struct.Struct(">I")
TYPES = ("hello", "open", "announce", "progress", "need", "want", "release", "stage", "evict", "status", "reload")


def encode(msg: Mapping[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte frame limit")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"frame is not valid msgpack ({e.__class__.__name__})") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame must hold a msgpack map")
    return msg


def default_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """$XDG_RUNTIME_DIR/kvdata/kvdatad.sock for a user service, else /run/kvdata/kvdatad.sock."""
    env = os.environ if env is None else env
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "kvdata" / "kvdatad.sock"
    return Path("/run/kvdata/kvdatad.sock")


def socket_path(config_socket: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The rule clients follow: $KVDATA_SOCKET, else [daemon] socket in the config, else the default."""
    env = os.environ if env is None else env
    if env.get("KVDATA_SOCKET"):
        return Path(env["KVDATA_SOCKET"])
    if config_socket is not None:
        return Path(config_socket)
    return default_socket_path(env)


class Client:
    """A blocking client; one request at a time per client (thread-safe)."""

    def __init__(self, path: str | os.PathLike[str], timeout: float = 30.0) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        self._next = 0
        self._pid = os.getpid()
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(timeout)
            self._sock.connect(self.path)
        except OSError as e:
            raise DaemonUnavailable(f"no kvdatad answers on {self.path} ({e.strerror or e})") from None
        self.server = self.request("hello", version=PROTOCOL_VERSION, pid=os.getpid())

    def request(self, t: str, **fields: Any) -> dict[str, Any]:
        if os.getpid() != self._pid:
            raise DaemonUnavailable("a daemon connection cannot be used after fork; connect again")
        with self._lock:
            self._next += 1
            rid = self._next
            try:
                self._sock.sendall(encode({"t": t, "id": rid, **fields}))
                reply = self._read()
            except (OSError, EOFError) as e:
                self.close()
                raise DaemonUnavailable(f"kvdatad on {self.path} went away ({e})") from None
        if reply.get("id") != rid:
            raise ProtocolError(f"reply id {reply.get('id')} does not match request {rid}")
        if not reply.get("ok"):
            raise DaemonError(str(reply.get("error") or "the daemon refused the request"))
        return reply

    def _read(self) -> dict[str, Any]:
        head = self._recv(HEADER.size)
        (n,) = HEADER.unpack(head)
        if n > MAX_FRAME:
            raise ProtocolError(f"reply frame of {n} bytes exceeds the limit")
        return decode_body(self._recv(n))

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("connection closed")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(config_socket: Path | None = None, timeout: float = 30.0) -> Client | None:
    """A client if a daemon answers on the socket the rule names, else None."""
    path = socket_path(config_socket)
    if not path.exists():
        return None
    try:
        return Client(path, timeout=timeout)
    except (DaemonUnavailable, ProtocolError, DaemonError):
        return None
