"""The Home interface: where a dataset's truth lives, as one small set of operations on
names relative to the dataset (kvdata.homes.local has the local and passed-file homes,
kvdata.homes.s3_home and http_home the S3 and HTTP ones, kvdata.homes.fsspec_home any other
fsspec filesystem, and kvdata.homes.open_home picks one by URL scheme)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ChecksumMismatchError, KVDataError, ReadOnlyError, RemoteError

PART_SIZE = 8 << 20
READ_LIMIT = 1 << 30   # default cap of Home.read (callers reading metadata pass a smaller one)


def is_url(path: str | os.PathLike[str]) -> bool:
    return isinstance(path, str) and ("://" in path)


@dataclass(frozen=True)
class ObjectInfo:
    """What a home tells of one object without reading it (`Home.info`)."""

    size: int
    sha256: str | None = None   # the sha256 recorded when it was uploaded or copied (None: not recorded)
    tag: str | None = None      # the version a conditional copy pins (an S3 ETag), where the home has one


class Home:
    """A dataset's home. Names are relative paths inside the dataset ("manifest.json",
    "index/samples-1.bin", "shards/000000.mdb.zst")."""

    writable = False
    trusted_manifest = True   # its manifest binds compressed copies to content hashes (see PassedFiles)
    #: the kvdata.tiers.records.RecordReader of this home, made on its first record read and kept with
    #: it, so every source reading this home in the process shares its verified seek tables
    record_reader: Any = None
    #: whether readers can read this home's shards record by record (kvdata.tiers.records: remote homes,
    #: whose framed cold copies take ranged GETs); a local home is read in place instead
    record_reads = False

    def __init__(self, url: str) -> None:
        """url: where the dataset lives, as messages and logs name it (a local home: its path)."""
        self.url = url

    def local_path(self, name: str) -> Path | None:
        """A path that can be read in place, or None for remote homes."""
        return None

    def size(self, name: str) -> int:
        raise NotImplementedError

    def read_range(self, name: str, start: int, length: int) -> bytes:
        raise NotImplementedError

    def read(self, name: str, limit: int = READ_LIMIT) -> bytes:
        """The whole object, streamed with a cap: RemoteError naming the URL and the limit
        if it holds more than `limit` bytes (a home cannot make a reader hold more)."""
        size = self.size(name)
        if size > limit:
            raise RemoteError(f"{self.where(name)} has {size} bytes, more than the {limit}-byte limit for it")
        data = self.read_range(name, 0, size)
        if len(data) != size:
            raise RemoteError(f"{self.where(name)} changed while being read ({len(data)} of {size} bytes)")
        return data

    def sha256(self, name: str) -> str | None:
        """The sha256 of the object `name` at this home, where the home can tell it without
        reading the object over the network -- or None: missing, never recorded, not a regular
        file, or no way to tell (HTTP, passed files). `kvdata push` uploads an object again
        unless this equals the sha256 its manifest gives, so None only costs an upload."""
        return None

    def info(self, name: str) -> ObjectInfo | None:
        """The object's size and recorded sha256, or None if there is no such object."""
        try:
            size = self.size(name)
        except RemoteError:
            return None
        return ObjectInfo(size, self.sha256(name))

    def can_copy_from(self, src: Home) -> bool:
        """Whether `copy_from(src, ...)` copies inside the store that holds both homes."""
        return False

    def copy_from(self, src: Home, src_name: str, name: str, info: ObjectInfo, sha256: str) -> None:
        """Make `name` here a copy of `src_name` at `src` (as `info` described it) without its bytes
        passing through this process, recording `sha256` (already checked against what `src`
        recorded) where the home records one. `kvdata merge` places shards at a home this way."""
        raise KVDataError(f"{self.url} cannot copy objects from {src.url} in place; merge parts at one s3:// or fsspec "
                          "home, or merge local copies of the parts and push the result")

    def put_file(self, name: str, path: Path, sha256: str | None = None) -> None:
        """Upload the local file `path` as `name`. With `sha256`, the file must hash to it
        (ChecksumMismatchError, nothing published, if it does not) and the home records it
        for `sha256()`."""
        raise ReadOnlyError(f"{self.url} is read-only; push to a local path or s3://")

    def check_upload(self, name: str, path: Path, sha256: str, digest: str) -> None:
        """ChecksumMismatchError, before anything is published as `name`, when the file being
        uploaded does not hash to the sha256 its manifest gives."""
        if digest != sha256:
            raise ChecksumMismatchError(
                f"{path} has sha256 {digest}, not the {sha256} its manifest gives; nothing was "
                f"uploaded to {self.where(name)} (run `kvdata verify` on the dataset)")

    def where(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def open_passed(self, sha: str) -> tuple[int, str] | None:
        """A descriptor of the shard's file that a client passed (PassedFiles only)."""
        return None

    def mark_proven(self, sha: str) -> None:
        """A verified copy of `sha` was just made from this home's own bytes."""

    def can_stage(self, sha: str) -> bool:
        """Whether this home can supply the shard now (a PassedFiles only holds some)."""
        return True

    def parts(self, name: str, size: int, pool: ThreadPoolExecutor, part_size: int = PART_SIZE,
              in_flight: int = 8) -> Iterator[bytes]:
        """The object's bytes in order, fetched as concurrent ranged parts (bounded memory)."""
        starts = list(range(0, size, part_size))
        pending: list[Future[bytes]] = []
        nxt = 0
        while nxt < len(starts) or pending:
            while nxt < len(starts) and len(pending) < in_flight:
                a = starts[nxt]
                pending.append(pool.submit(self.read_range, name, a, min(part_size, size - a)))
                nxt += 1
            yield pending.pop(0).result()

    def close(self) -> None:
        pass


