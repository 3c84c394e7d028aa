"""The reader <-> kvdatad protocol: framing, message types, socket path rule, and a client.

Transport: a Unix stream socket. Every message is one frame: a 4-byte big-endian
length, then a msgpack map (at most MAX_FRAME bytes, checked before the body is
read; decoded under REQUEST_LIMITS). Requests carry "t" (type) and "id"; each gets
exactly one reply {"id", "ok": true, ...} or {"id", "ok": false, "error": "<one line>",
"code": "<kind>"}.

File descriptors travel with a frame as SCM_RIGHTS ancillary data, sent in the same
sendmsg as the frame's first byte; the frame's "fds" field says how many it carries
(at most MAX_FDS). Requests pass descriptors the client opened itself (a local
dataset's manifest and shard files: the daemon never opens a client's local path
unless the client's uid is root or the daemon's own); replies pass read-only
descriptors of staged copies (`need`) and of a remote dataset's verified manifest and
index (`open`). docs/SECURITY.md is the trust model.

| t        | request fields                                  | reply fields                 |
|----------|-------------------------------------------------|------------------------------|
| hello    | version, pid                                    | version, pid, uid, paths (may name local paths) |
| open     | dataset (abs path, s3://, http(s)://) [fd: manifest] | root, generation, shards, files (+ fds) |
| announce | dataset, reader, shards [int ids in order], position [next_start, ahead, fds] | - |
| progress | reader, position, stall (seconds, cumulative) [dataset, ahead, fds] | -          |
| need     | dataset, shard (int id), sha256 [kind, fd: the shard file] | path, staged, fd: read-only copy, congested? |
| want     | dataset, shards [[int id, sha256], ...] [kinds, fds] | started (staging begun now, not awaited) |
| release  | reader                                          | -                            |
| stage    | dataset, tier (optional), wait (bool) [ahead, fds] | shards, queued            |
| evict    | dataset, tier (optional)                        | evicted, kept                |
| status   | -                                               | the daemon's state (kvdata status --json); own clients only |
| reload   | -                                               | tiers                        |

A `want` with no shards asks how the dataset is read: its reply has mode, resident_below and,
while the tiers are congested, congested and staged; for a shard-aware dataset larger than the
tiers, whole (see docs/DAEMON.md).

Bracketed fields are what a client whose uid may not name local paths sends for a
local dataset: `ahead` is [[id, kind], ...] and `kinds` [kind, ...] (kind "mdb" or
"zst": which file of the shard the descriptor is), one descriptor each, in order.
`open` of a remote dataset replies with descriptors of its verified mirror, named by
`files` (manifest.json first), for a reader who cannot read the daemon's tier.

A connection that closes releases everything its readers announced. Shards are
named by integer id into the dataset's manifest, never by path, so a client
cannot make the daemon touch a file outside the dataset and its tiers.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack

from .errors import DaemonError, DaemonUnavailable, ProtocolError

PROTOCOL_VERSION = 2
# The largest real message is an announce of a whole epoch (one int per shard: 200,000
# shards fit in 1 MiB); a longer frame is refused from its 4-byte header, before its body
# is read, by the daemon and by the client alike.
MAX_FRAME = 1 << 20
# Decoding limits: without them a 16 MiB frame of empty arrays decodes to over 1 GB of
# Python objects (~70 bytes per byte). Array elements plus map entries of a whole frame
# (an announce of a million shard ids fits), and arrays plus maps of a whole frame
# (messages hold a few; each costs a Python call here).
MAX_ITEMS = 1 << 20
MAX_CONTAINERS = 1 << 16
MAX_ERROR_TEXT = 1000
MAX_FDS = 64                 # descriptors one frame may carry (the kernel's limit is 253)
HEADER = struct.Struct(">I")
TYPES = ("hello", "open", "announce", "progress", "need", "want", "release", "stage", "evict", "status", "reload")
SHARD_KINDS = ("mdb", "zst")  # which file of a shard a passed descriptor is


def encode(msg: Mapping[str, Any]) -> bytes:
    try:
        body = msgpack.packb(msg, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as e:  # nested past msgpack's limit (512 before 1.1), an odd type
        raise ProtocolError(f"message cannot be encoded: {e}") from None
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte frame limit")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    """The message map of one frame's body; ProtocolError for anything else (garbage, a
    top level that is not a map, more than MAX_ITEMS elements or MAX_CONTAINERS arrays and maps)."""
    items, containers = MAX_ITEMS, MAX_CONTAINERS

    def count(container: Any) -> Any:
        nonlocal items, containers
        items -= len(container)
        containers -= 1
        if items < 0 or containers < 0:
            raise ProtocolError(f"frame holds more than {MAX_ITEMS} array elements and map entries or "
                                f"{MAX_CONTAINERS} arrays and maps; the daemon protocol needs far fewer")
        return container

    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, list_hook=count, object_hook=count,
                              max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"frame is not valid msgpack ({e.__class__.__name__})") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame must hold a msgpack map")
    return msg


def send_frame(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """A whole frame on a blocking socket, the descriptors with its first bytes."""
    view = memoryview(data)
    if fds:
        sent = socket.send_fds(sock, [view], list(fds))
        view = view[sent:]
    if view:
        sock.sendall(view)


def recv_with_fds(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    """Up to n bytes (b"" at EOF); descriptors that arrive with them are appended to `fds`
    (close-on-exec). A message whose descriptors did not fit is a protocol error."""
    anc = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    data, ancdata, flags, _addr = sock.recvmsg(n, anc, socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    if flags & socket.MSG_CTRUNC:
        raise ProtocolError(f"more than {MAX_FDS} descriptors arrived with one message")
    return data


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def pack_flags(flags: Sequence[bool]) -> bytes:
    """One bit per item, item i in byte i // 8, bit i % 8 (a reply's `staged`: which shards of
    the dataset have a copy, by index in its manifest)."""
    out = bytearray((len(flags) + 7) // 8)
    for i, f in enumerate(flags):
        if f:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def flag_set(flags: bytes, index: int) -> bool:
    """Whether pack_flags set item `index` (False past the end: a shorter or stale field)."""
    return 0 <= index < len(flags) * 8 and bool(flags[index >> 3] >> (index & 7) & 1)


def _short(v: Any) -> str:
    """A value from a frame, shown in one short line (never a huge or deeply nested repr)."""
    if isinstance(v, (bool, float)) or v is None or (isinstance(v, int) and v.bit_length() <= 64):
        return repr(v)
    if isinstance(v, (str, bytes)):
        return repr(v[:60])
    return f"a {type(v).__name__}"


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
    """A blocking client; one request at a time per client (thread-safe).

    `request` sends descriptors given as `fds=[...]` (the client keeps and closes its own)
    and closes any the reply carries; `request_fds` returns them to the caller instead."""

    def __init__(self, path: str | os.PathLike[str], timeout: float = 30.0) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        self._next = 0
        self._pid = os.getpid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(self.path)
        except OSError as e:
            self._sock.close()
            raise DaemonUnavailable(f"no kvdatad answers on {self.path} ({e.strerror or e})") from None
        try:
            self.server = self.request("hello", version=PROTOCOL_VERSION, pid=os.getpid())
        except BaseException:  # a refused or garbled hello must not leave the socket open
            self.close()
            raise

    @property
    def may_name_paths(self) -> bool:
        """Whether the daemon opens local paths this client names (its uid is root or the
        daemon's own); otherwise a local dataset's files are passed as descriptors."""
        return bool(self.server.get("paths", False))

    def request(self, t: str, *, fds: Sequence[int] = (), **fields: Any) -> dict[str, Any]:
        reply, got = self.request_fds(t, fds=fds, **fields)
        close_fds(got)
        return reply

    def request_fds(self, t: str, *, fds: Sequence[int] = (), **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """(reply, descriptors it carried, owned by the caller); `fds` go with the request
        (the caller keeps and closes its own)."""
        if os.getpid() != self._pid:
            raise DaemonUnavailable("a daemon connection cannot be used after fork; connect again")
        if len(fds) > MAX_FDS:
            raise ProtocolError(f"at most {MAX_FDS} descriptors go with one request, not {len(fds)}")
        got: list[int] = []
        with self._lock:
            self._next += 1
            rid = self._next
            msg: dict[str, Any] = {"t": t, "id": rid, **fields}
            if fds:
                msg["fds"] = len(fds)
            try:
                send_frame(self._sock, encode(msg), fds)
                reply = self._read(got)
            except (OSError, EOFError) as e:
                close_fds(got)
                self.close()
                raise DaemonUnavailable(f"kvdatad on {self.path} went away ({e})") from None
            except ProtocolError:  # the stream cannot be trusted past a bad frame
                close_fds(got)
                self.close()
                raise
        if reply.get("id") != rid:
            close_fds(got)
            raise ProtocolError(f"reply id {_short(reply.get('id'))} does not match request {rid}")
        if not reply.get("ok"):
            close_fds(got)
            error = reply.get("error")
            text = error.splitlines()[0][:MAX_ERROR_TEXT] if isinstance(error, str) and error.strip() else ""
            code = reply.get("code")
            raise DaemonError(text or "the daemon refused the request", code if isinstance(code, str) else None)
        return reply, got

    def _read(self, fds: list[int]) -> dict[str, Any]:
        head = self._recv(HEADER.size, fds)
        (n,) = HEADER.unpack(head)
        if n > MAX_FRAME:
            raise ProtocolError(f"reply frame of {n} bytes exceeds the limit")
        return decode_body(self._recv(n, fds))

    def _recv(self, n: int, fds: list[int]) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = recv_with_fds(self._sock, n - len(buf), fds)
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
