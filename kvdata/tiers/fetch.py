"""Fetching one shard copy from the fastest source, verified: another tier, the home's
uncompressed file, or the home's .zst (concurrent ranged parts, streamed through zstd).

The engine decides what to stage where (kvdata.engine); this module only moves and checks
bytes. Nothing partial is ever trusted: the caller writes into a temp file and renames it
only after copy_verified returns.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import zstandard

from .._util.fsutil import is_regular
from ..errors import ChecksumMismatchError, RemoteError, StagingAbortedError
from ..format import ShardEntry
from ..format.codec import CHUNK
from .homes import Home
from .tier import Tier


class Fetcher:
    """Copies shards into open files, checking every byte against the manifest."""

    def __init__(self, pool: ThreadPoolExecutor, part_size: int, in_flight: int, abort: threading.Event,
                 on_home_bytes: Callable[[int], None]) -> None:
        self._pool, self._part_size, self._in_flight = pool, part_size, in_flight
        self._abort, self._on_home_bytes = abort, on_home_bytes

    def copy_verified(self, tiers: list[Tier], home: Home, entry: ShardEntry, target: Tier, out: BinaryIO) -> None:
        """Write the shard's uncompressed bytes to `out` from the fastest source, verified.

        From another tier or an uncompressed home file: sha256 of the bytes written. From
        a .zst: the sha256 of the compressed object (as push recorded it), zstd's own
        frame checksum of the content, and the exact size -- which together prove the
        bytes are the shard the manifest names, at a fraction of the cost; decompression
        and hashing/writing run on two threads.
        """
        where = home.where(f"shards/{entry.name}")
        for t in tiers:  # promotion: a complete copy in another tier
            if t is not target and t.has(entry.sha256):
                try:
                    with open(t.path(entry.sha256), "rb") as f:
                        self._check(where, entry, *self._hash_copy(iter(lambda: f.read(CHUNK), b""), out))
                    return
                except FileNotFoundError:  # evicted meanwhile: fall through to the next source
                    out.seek(0)
                    out.truncate()
        local = home.local_path(f"shards/{entry.name}")
        if local is not None and is_regular(local):
            with open(local, "rb") as f:
                digest, n = self._hash_copy(iter(lambda: f.read(CHUNK), b""), out)
            self._on_home_bytes(n)
            self._check(where, entry, digest, n)
            return
        z = entry.zst
        if not z:
            raise RemoteError(f"{where}.zst: the home has no compressed copy of this shard; push the dataset again")
        name = f"shards/{z.name}"
        zsha = hashlib.sha256()
        dobj = zstandard.ZstdDecompressor().decompressobj()
        fetched = n = 0
        writer = _Writer(out, self._abort, zsha)
        try:
            for part in self._home_bytes(home, name, z.bytes):
                fetched += len(part)
                if part:
                    data = dobj.decompress(part)
                    n += len(data)
                    writer.put(data, part)
            writer.finish()
            if not dobj.eof:
                raise zstandard.ZstdError("the stream ends before its frame does")
        except zstandard.ZstdError as e:
            raise ChecksumMismatchError(
                f"{home.where(name)}: the compressed copy of shard {entry.name} is damaged ({e}); it was not "
                "staged. Restore the home copy (kvdata push)") from None
        finally:
            writer.finish()
            self._on_home_bytes(fetched)
        if zsha.hexdigest() != z.sha256 or fetched != z.bytes:
            raise ChecksumMismatchError(
                f"{home.where(name)}: shard {entry.name}'s compressed copy has sha256 {zsha.hexdigest()[:16]}... "
                f"({fetched} bytes), the manifest says {z['sha256'][:16]}... ({z['bytes']} bytes); it was not staged. "
                "Restore the home copy (kvdata push)")
        if n != entry.bytes:
            raise ChecksumMismatchError(f"{where}: decompressed to {n} bytes, the manifest says {entry.bytes}; not staged")

    def _hash_copy(self, chunks: Iterator[bytes], out: BinaryIO) -> tuple[str, int]:
        sha = hashlib.sha256()
        n = 0
        for chunk in chunks:
            if self._abort.is_set():
                raise StagingAbortedError("staging abandoned: the engine is closing")
            sha.update(chunk)
            out.write(chunk)
            n += len(chunk)
        return sha.hexdigest(), n

    @staticmethod
    def _check(where: str, entry: ShardEntry, digest: str, n: int) -> None:
        if digest != entry.sha256 or n != entry.bytes:
            raise ChecksumMismatchError(
                f"{where}: shard {entry.name} has sha256 {digest[:16]}... ({n} bytes), the manifest says "
                f"{entry.sha256[:16]}... ({entry.bytes} bytes); it was not staged. Restore the home copy "
                "(kvdata verify/push)")

    def _home_bytes(self, home: Home, name: str, size: int) -> Iterator[bytes]:
        local = home.local_path(name)
        if local is not None:
            if not is_regular(local):
                raise RemoteError(f"{local} is missing or not a regular file at the home")
            with open(local, "rb") as f:
                while chunk := f.read(CHUNK):
                    yield chunk
            return
        yield from home.parts(name, size, self._pool, self._part_size, self._in_flight)


class _Writer:
    """Hashes the compressed stream and writes the decompressed one on its own thread
    (hashlib, zstd and file I/O release the GIL, so the two halves run on two cores);
    bounded so memory stays small."""

    def __init__(self, out: BinaryIO, abort: threading.Event, sha: Any) -> None:
        self._out, self._abort, self._sha = out, abort, sha
        self._q: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(maxsize=8)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvdata-stage-write", daemon=True)
        self._thread.start()
        self._done = False

    def _run(self) -> None:
        try:
            while (item := self._q.get()) is not None:
                if self._error is None:
                    self._out.write(item[0])
                    self._sha.update(item[1])
        except BaseException as e:
            self._error = e
            while self._q.get() is not None:  # drain so the producer never blocks
                pass

    def put(self, data: bytes, compressed: bytes) -> None:
        if self._abort.is_set():
            raise StagingAbortedError("staging abandoned: the engine is closing")
        if self._error is not None:
            raise self._error
        self._q.put((data, compressed))

    def finish(self) -> None:
        if not self._done:
            self._done = True
            self._q.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error
