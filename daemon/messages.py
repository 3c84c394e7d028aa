"""kvdatad's requests and replies as types: a frame's fields decoded and checked once, here, at the
edge (`decode`: a one-line BadRequest naming the first field that is wrong), so no handler reads a
raw map; a reply says which fields it puts on the wire, in the order they go (`Reply.wire`), and
which descriptors go with it.

The wire is kvdata.protocol's table, unchanged: the frames accepted and refused, and the errors
refused ones get, are what they were when the handlers checked the maps themselves. What depends
on the daemon's state stays with the handlers (handlers.py): a home allowed by the config, a
dataset open for this uid, a shard id within its manifest (a field that is not an integer id is
decoded as None, so that check refuses it with the manifest's range, as before), a passed file's
kind against its shard, a tier name in the config. (So a request wrong twice over, in a field and
in what the daemon finds of its dataset, is told about the field: its dataset is not opened.)

Which fields a request must carry can depend on who asks (docs/SECURITY.md): the shard files a
request passes (`ahead`) are read only from a peer that may not name local paths, for a local
dataset; from any other peer their descriptors are not needed and the items are not looked at.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdata._util.digest import is_sha256
from kvdata.config import normalize_home_url
from kvdata.errors import BadRequest, ConfigError
from kvdata.protocol import MAX_FDS, PROTOCOL_VERSION, SHARD_KINDS, close_fds

MAX_LOCATION = 4096
MAX_READER = 256
MAX_CATCH_UP = 64        # reader positions one need/want may carry
MAX_WANT = 4096          # shards one `want` may name


class Passed:
    """The descriptors that came with one request: a handler takes what it keeps, the
    server closes whatever is left after the reply."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = list(fds)

    def __len__(self) -> int:
        return len(self._fds)

    def take(self) -> int:
        return self._fds.pop(0)

    def close(self) -> None:
        close_fds(self._fds)
        self._fds = []


# ------------------------------------------------------------ fields


def is_url(location: str) -> bool:
    return location.startswith(("s3://", "http://", "https://"))


def check_location(value: Any) -> str:
    """A dataset location a client may name (a normalized URL or a clean absolute path), or BadRequest."""
    if not isinstance(value, str) or not value or len(value) > MAX_LOCATION or "\x00" in value:
        raise BadRequest("dataset must be a non-empty string without NUL bytes")
    if is_url(value):
        try:
            return normalize_home_url(value)
        except ConfigError as e:
            raise BadRequest(f"dataset URL: {e}") from None
    p = Path(value)
    if not p.is_absolute():
        raise BadRequest(f"dataset {value!r} must be an absolute path or an s3:// / http(s):// URL")
    if ".." in p.parts:
        raise BadRequest(f"dataset path {value!r} may not contain '..'")
    return str(p)


def _reader(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_READER or "\x00" in value:
        raise BadRequest("reader must be a short non-empty string")
    return value


def _position(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest("position must be a non-negative integer")
    return value


def _shard_id(value: Any) -> int | None:
    """A shard id as sent; None for anything but an integer (no id of any manifest)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _kind(value: Any) -> str | None:
    """"mdb" or "zst" (which file of a shard a passed descriptor is); None for anything else."""
    return value if isinstance(value, str) and value in SHARD_KINDS else None


def _tier(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise BadRequest("tier must be a tier name")
    return value


def _reads_passed(dataset: str, may_name_paths: bool) -> bool:
    """Whether the daemon reads this dataset for this peer only from the files it passes."""
    return not is_url(dataset) and not may_name_paths


@dataclass(frozen=True)
class ShardFile:
    """One item of `ahead`: a shard's file passed with the request (one descriptor each, in order)."""

    shard: int | None   # None: not an integer id
    kind: str | None    # "mdb" or "zst"; None: neither


def _shard_files(value: Any, fds: Passed, read: bool) -> tuple[ShardFile, ...] | None:
    """`ahead` [[shard id, kind], ...], one descriptor passed per item; None if absent. Its items
    are read only where `read` (the daemon reads the dataset from passed files), else ()."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != len(fds) or len(value) > MAX_FDS:
        raise BadRequest("ahead must be a list of [shard id, kind] pairs, one per descriptor passed")
    if not read:
        return ()
    out = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise BadRequest("ahead must be a list of [shard id, kind] pairs")
        out.append(ShardFile(_shard_id(item[0]), _kind(item[1])))
    return tuple(out)


@dataclass(frozen=True)
class ReaderAt:
    """A reader's position (progress a need or want carries: what its client held back)."""

    reader: str
    position: int


def _catch_up(value: Any) -> tuple[ReaderAt, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_CATCH_UP:
        raise BadRequest(f"progress must be a list of at most {MAX_CATCH_UP} [reader, position] pairs")
    moves = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise BadRequest("progress must be a list of [reader, position] pairs")
        moves.append(ReaderAt(_reader(item[0]), _position(item[1])))
    return tuple(moves)


# ------------------------------------------------------------ requests


@dataclass(frozen=True)
class HelloRequest:
    pid: int | None  # the client's pid, if it sent an integer (the kernel's, SO_PEERCRED, comes first)


@dataclass(frozen=True)
class OpenRequest:
    dataset: str
    fds: Passed  # the manifest, passed by a reader who may not name local paths


@dataclass(frozen=True)
class AnnounceRequest:
    dataset: str
    reader: str
    shards: tuple[int | None, ...]  # the order, by shard id
    position: int
    next_start: int | None          # an index into shards: where the next epoch starts
    ahead: tuple[ShardFile, ...] | None
    fds: Passed


@dataclass(frozen=True)
class Prefetch:
    """The next shards' files a progress passes, and their dataset."""

    dataset: str
    ahead: tuple[ShardFile, ...]


@dataclass(frozen=True)
class ProgressRequest:
    reader: str
    position: int
    stall: float | None  # seconds the client waited for shards in all (None: absent or not a sane number)
    prefetch: Prefetch | None
    fds: Passed


@dataclass(frozen=True)
class NeedRequest:
    dataset: str
    shard: int | None
    shard_named: str  # the shard as the request gave it (said when it is not in the reader's manifest)
    sha256: str | None
    kind: str | None  # of the one descriptor passed, if one is ("mdb" unless it says otherwise)
    catch_up: tuple[ReaderAt, ...]
    fds: Passed


@dataclass(frozen=True)
class WantedShard:
    shard: int | None
    sha256: str | None  # None: not a string (so the same as no shard's)


@dataclass(frozen=True)
class WantRequest:
    dataset: str
    shards: tuple[WantedShard, ...]  # none: the request asks how the dataset is read
    kinds: tuple[str | None, ...] | None  # of the descriptors passed, for the first shards in order
    catch_up: tuple[ReaderAt, ...]
    fds: Passed


@dataclass(frozen=True)
class ReleaseRequest:
    reader: str


@dataclass(frozen=True)
class StageRequest:
    dataset: str
    tier: str | None
    wait: bool
    ahead: tuple[ShardFile, ...] | None  # read only from a peer whose dataset is read from passed files
    fds: Passed


@dataclass(frozen=True)
class EvictRequest:
    dataset: str
    tier: str | None


@dataclass(frozen=True)
class StatusRequest:
    pass


@dataclass(frozen=True)
class ReloadRequest:
    pass


Request = (HelloRequest | OpenRequest | AnnounceRequest | ProgressRequest | NeedRequest | WantRequest | ReleaseRequest
           | StageRequest | EvictRequest | StatusRequest | ReloadRequest)


def _hello(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> HelloRequest:
    pid = msg.get("pid")
    if msg.get("version") != PROTOCOL_VERSION:
        raise BadRequest(f"protocol version {msg.get('version')!r} is not {PROTOCOL_VERSION}; upgrade kvdata")
    return HelloRequest(pid if isinstance(pid, int) and not isinstance(pid, bool) else None)


def _open(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> OpenRequest:
    return OpenRequest(check_location(msg.get("dataset")), fds)


def _announce(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> AnnounceRequest:
    dataset = check_location(msg.get("dataset"))
    reader = _reader(msg.get("reader"))
    shards = msg.get("shards")
    if not isinstance(shards, list):
        raise BadRequest("shards must be a list of integer shard ids")
    position = _position(msg.get("position", 0))
    next_start = msg.get("next_start")
    if next_start is not None and (type(next_start) is not int or not 0 <= next_start <= len(shards)):
        raise BadRequest(f"next_start must be an integer index into shards (0..{len(shards)}), "
                         f"not {next_start!r}")
    ahead = _shard_files(msg.get("ahead"), fds, _reads_passed(dataset, may_name_paths))
    return AnnounceRequest(dataset, reader, tuple(_shard_id(s) for s in shards), position, next_start, ahead, fds)


def _progress(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> ProgressRequest:
    reader = _reader(msg.get("reader"))
    position = _position(msg.get("position", 0))
    prefetch = None
    if msg.get("ahead") is not None:
        dataset = check_location(msg.get("dataset"))
        ahead = _shard_files(msg.get("ahead"), fds, _reads_passed(dataset, may_name_paths))
        assert ahead is not None
        prefetch = Prefetch(dataset, ahead)
    stall = msg.get("stall")
    if not isinstance(stall, (int, float)) or isinstance(stall, bool) or not 0 <= stall < 1e9:
        stall = None  # (not a sane number of seconds: ignored)
    return ProgressRequest(reader, position, None if stall is None else float(stall), prefetch, fds)


def _need(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> NeedRequest:
    dataset = check_location(msg.get("dataset"))
    catch_up = _catch_up(msg.get("progress"))
    sha256 = msg.get("sha256")
    if sha256 is not None and not is_sha256(sha256):
        raise BadRequest("sha256 must be 64 lowercase hex digits")
    shard = msg.get("shard")
    named = str(shard) if sha256 is not None else ""  # (said only of a request that names the sha256)
    return NeedRequest(dataset, _shard_id(shard), named, sha256, _kind(msg.get("kind", "mdb")), catch_up, fds)


def _want(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> WantRequest:
    dataset = check_location(msg.get("dataset"))
    catch_up = _catch_up(msg.get("progress"))
    shards = msg.get("shards")
    if not isinstance(shards, list) or len(shards) > MAX_WANT:
        raise BadRequest("shards must be a list of [id, sha256] pairs")
    kinds = msg.get("kinds")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != len(fds) or len(kinds) > len(shards)):
        raise BadRequest("kinds must name the kind of each descriptor passed, in the order of shards")
    wanted = []
    for item in shards:
        if not isinstance(item, list) or len(item) != 2:
            raise BadRequest("shards must be a list of [id, sha256] pairs")
        wanted.append(WantedShard(_shard_id(item[0]), item[1] if isinstance(item[1], str) else None))
    return WantRequest(dataset, tuple(wanted), None if kinds is None else tuple(_kind(k) for k in kinds), catch_up, fds)


def _release(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> ReleaseRequest:
    return ReleaseRequest(_reader(msg.get("reader")))


def _stage(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> StageRequest:
    dataset = check_location(msg.get("dataset"))
    tier = _tier(msg.get("tier"))
    reads_passed = _reads_passed(dataset, may_name_paths)
    ahead = _shard_files(msg.get("ahead"), fds, True) if reads_passed else None
    return StageRequest(dataset, tier, bool(msg.get("wait")), ahead, fds)


def _evict(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> EvictRequest:
    return EvictRequest(check_location(msg.get("dataset")), _tier(msg.get("tier")))


def _status(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> StatusRequest:
    return StatusRequest()


def _reload(msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> ReloadRequest:
    return ReloadRequest()


_DECODERS: dict[str, Callable[[dict[str, Any], Passed, bool], Request]] = {
    "hello": _hello, "open": _open, "announce": _announce, "progress": _progress, "need": _need,
    "want": _want, "release": _release, "stage": _stage, "evict": _evict, "status": _status, "reload": _reload}


def decode(t: str, msg: dict[str, Any], fds: Passed, may_name_paths: bool) -> Request:
    """The request of type `t` (one of kvdata.protocol.TYPES) a frame's map holds, with the
    descriptors that came with it, for a peer that may (or may not) name local paths;
    BadRequest (one line) for the first field that is wrong."""
    return _DECODERS[t](msg, fds, may_name_paths)


# ------------------------------------------------------------ replies


class Reply:
    """A reply's fields, in the order they go on the wire, and the descriptors sent with it."""

    def wire(self) -> dict[str, Any]:
        return {}

    def descriptors(self) -> list[int]:
        return []


class Done(Reply):
    """A request done, with nothing to say (announce, progress, release)."""


@dataclass(frozen=True)
class HelloReply(Reply):
    version: int
    pid: int
    uid: int
    paths: bool  # the daemon opens local paths this client names

    def wire(self) -> dict[str, Any]:
        return {"version": self.version, "pid": self.pid, "uid": self.uid, "paths": self.paths}


@dataclass(frozen=True)
class OpenReply(Reply):
    root: str
    generation: int
    shards: int
    files: tuple[tuple[str, int], ...] | None = None  # a remote dataset's mirror: (name, descriptor), manifest first

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"root": self.root, "generation": self.generation, "shards": self.shards}
        if self.files is not None:
            out["files"] = [name for name, _fd in self.files]
        return out

    def descriptors(self) -> list[int]:
        return [fd for _name, fd in self.files or ()]


@dataclass(frozen=True)
class NeedReply(Reply):
    path: str
    staged: bool
    fd: int           # a read-only descriptor of the copy
    congested: bool   # a private copy while the tiers are congested: ask how to read again

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "staged": self.staged}
        if self.congested:
            out["congested"] = True
        return out

    def descriptors(self) -> list[int]:
        return [self.fd]


@dataclass(frozen=True)
class ReadMode:
    """How a dataset is read (docs/DAEMON.md): "shard-aware", or "random" with its resident set's
    largest sha256; while the tiers are congested, which shards have a copy (`staged`); for a
    shard-aware dataset larger than the tiers, which shards are worth a whole copy (`whole`)."""

    mode: str
    resident_below: str
    staged: bytes | None = None  # (congested) one bit per shard of the manifest
    whole: bytes | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "resident_below": self.resident_below}
        if self.staged is not None:
            out["congested"] = True
            out["staged"] = self.staged
        elif self.whole is not None:
            out["whole"] = self.whole
        return out


@dataclass(frozen=True)
class WantReply(Reply):
    started: int
    read_mode: ReadMode | None = None  # the answer to a `want` of no shards

    def wire(self) -> dict[str, Any]:
        return {"started": self.started, **(self.read_mode.wire() if self.read_mode is not None else {})}


@dataclass(frozen=True)
class StageReply(Reply):
    shards: int
    queued: int
    jobs: tuple[Future[Path], ...] = ()  # the staging jobs (a `wait` waits for them; not sent)

    def wire(self) -> dict[str, Any]:
        return {"shards": self.shards, "queued": self.queued}


@dataclass(frozen=True)
class EvictReply(Reply):
    evicted: int
    kept: int

    def wire(self) -> dict[str, Any]:
        return {"evicted": self.evicted, "kept": self.kept}


@dataclass(frozen=True)
class StatusReply(Reply):
    state: dict[str, Any]  # what `kvdata status --json` shows, as it shows it

    def wire(self) -> dict[str, Any]:
        return dict(self.state)


@dataclass(frozen=True)
class ReloadReply(Reply):
    tiers: tuple[str, ...]

    def wire(self) -> dict[str, Any]:
        return {"tiers": list(self.tiers)}
