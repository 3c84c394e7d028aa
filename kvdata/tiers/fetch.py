"""Fetching one shard copy from the fastest source, verified: another tier, the home's
uncompressed file, or the home's .zst (concurrent ranged parts, streamed through zstd).

The engine decides what to stage where (kvdata.engine); this module only moves and checks
bytes. Nothing partial is ever trusted: the caller writes into a temp file and renames it
only after copy_verified returns.
"""

from __future__ import annotations

import hashlib
import os
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
from ..homes import Home
from ..homes.local import pread_chunks
from .tier import Tier


class Fetcher:
    """Copies shards into open files, checking every byte against the manifest."""

    def __init__(self, pool: ThreadPoolExecutor, part_size: int, in_flight: int, abort: threading.Event,
                 on_home_bytes: Callable[[int], None], verify_content: bool = False) -> None:
        """verify_content: also hash the decompressed bytes of a .zst (kvdatad: a copy's name
        is then a proof of its content, whatever a home's manifest claims)."""
        self._pool, self._part_size, self._in_flight = pool, part_size, in_flight
        self._abort, self._on_home_bytes = abort, on_home_bytes
        self.verify_content = verify_content

    def copy_verified(self, tiers: list[Tier], home: Home, entry: ShardEntry, target: Tier | None,
                      out: BinaryIO) -> None:
        """Write the shard's uncompressed bytes to `out` from the fastest source, verified.
        Never more than the manifest's size is written (`out` may be a reservation of exactly
        that size: it is rewritten from its start, never truncated).

        From another tier or an uncompressed home file: sha256 of the bytes written. From
        a .zst: the sha256 of the compressed object (as push recorded it), zstd's own
        frame checksum of the content, and the exact size -- which together prove the
        bytes are the shard the manifest names, at a fraction of the cost; decompression
        and hashing/writing run on two threads. With verify_content, or from a home whose
        manifest nothing vouches for (descriptors a client passed), the decompressed bytes'
        sha256 must match too.
        """
        where = home.where(f"shards/{entry.name}")
        full = self.verify_content or not home.trusted_manifest
        for t in tiers:  # promotion: a complete copy in another tier
            if t is not target and t.has(entry.sha256):
                try:
                    with open(t.path(entry.sha256), "rb") as f:
                        self._check(where, entry, *self._hash_copy(iter(lambda: f.read(CHUNK), b""), out,
                                                                   entry, where))
                    return
                except FileNotFoundError:  # evicted meanwhile: fall through to the next source
                    out.seek(0)
        passed = home.open_passed(entry.sha256)
        if passed is not None:  # a descriptor the client opened: nothing else of its dataset is read
            fd, kind = passed
            try:
                if kind == "mdb":
                    digest, n = self._hash_copy(_source(pread_chunks(fd, entry.bytes, CHUNK), where), out, entry, where)
                    self._on_home_bytes(n)
                    self._check(where, entry, digest, n)
                elif entry.zst:
                    self._copy_zst(home, entry, _source(pread_chunks(fd, entry.zst.bytes, CHUNK), where), out, True)
                else:
                    raise RemoteError(f"{where}: a compressed file was passed for a shard without one")
            finally:
                os.close(fd)
            home.mark_proven(entry.sha256)
            return
        local = home.local_path(f"shards/{entry.name}")
        if local is not None and is_regular(local):
            try:
                f = open(local, "rb")
            except OSError as e:  # the home's trouble, not the tier's
                raise RemoteError(f"{local}: {e.strerror or e}") from None
            with f:
                digest, n = self._hash_copy(_source(iter(lambda: f.read(CHUNK), b""), str(local)), out, entry,
                                            where)
            self._on_home_bytes(n)
            self._check(where, entry, digest, n)
            return
        z = entry.zst
        if not z:
            raise RemoteError(f"{where}.zst: the home has no compressed copy of this shard; push the dataset again")
        name = f"shards/{z.name}"
        self._copy_zst(home, entry, _source(self._home_bytes(home, name, z.bytes), home.where(name)), out, full)

    def _copy_zst(self, home: Home, entry: ShardEntry, parts: Iterator[bytes], out: BinaryIO, full: bool) -> None:
        z = entry.zst
        assert z is not None
        where = home.where(f"shards/{entry.name}")
        name = f"shards/{z.name}"
        zsha = hashlib.sha256()
        content = hashlib.sha256() if full else None
        src = _Parts(parts)
        # a stream reader bounds what one call decompresses (a few KB of zstd can expand to
        # GBs): memory stays at a few chunks whatever the home or a client sends. A framed copy
        # (kvdata.format.frames) is many frames and a skippable seek table: read across them
        dec = zstandard.ZstdDecompressor().stream_reader(src, read_size=CHUNK, read_across_frames=True)  # type: ignore[arg-type]
        n = 0
        writer = _Writer(out, self._abort, zsha, content)
        try:
            while data := dec.read(CHUNK):
                n += len(data)
                if n > entry.bytes:
                    raise ChecksumMismatchError(f"{where}: decompresses past the {entry.bytes} bytes the manifest gives; "
                                                "it was not staged. Restore the home copy (kvdata push)")
                writer.put(data, src.take())
            for part in src.rest():  # after the last frame: only hashed (anything there, the sha catches)
                writer.put(b"", part)
            writer.finish()
        except zstandard.ZstdError as e:
            raise ChecksumMismatchError(
                f"{home.where(name)}: the compressed copy of shard {entry.name} is damaged ({e}); it was not "
                "staged. Restore the home copy (kvdata push)") from None
        finally:
            writer.finish()
            self._on_home_bytes(src.fetched)
        fetched = src.fetched
        if zsha.hexdigest() != z.sha256 or fetched != z.bytes:
            raise ChecksumMismatchError(
                f"{home.where(name)}: shard {entry.name}'s compressed copy has sha256 {zsha.hexdigest()[:16]}... "
                f"({fetched} bytes), the manifest says {z['sha256'][:16]}... ({z['bytes']} bytes); it was not staged. "
                "Restore the home copy (kvdata push)")
        if n != entry.bytes:
            raise ChecksumMismatchError(f"{where}: decompressed to {n} bytes, the manifest says {entry.bytes}; not staged")
        if content is not None and content.hexdigest() != entry.sha256:
            raise ChecksumMismatchError(f"{where}: the compressed copy decompresses to other content than the manifest's "
                                        f"sha256 {entry.sha256[:16]}...; it was not staged")

    def _hash_copy(self, chunks: Iterator[bytes], out: BinaryIO, entry: ShardEntry, where: str) -> tuple[str, int]:
        sha = hashlib.sha256()
        n = 0
        for chunk in chunks:
            if self._abort.is_set():
                raise StagingAbortedError("staging abandoned: the engine is closing")
            if n + len(chunk) > entry.bytes:  # never write past the room reserved for it
                raise ChecksumMismatchError(f"{where}: shard {entry.name} is larger than the {entry.bytes} bytes the "
                                            "manifest gives; it was not staged. Restore the home copy (kvdata verify/push)")
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


class _Parts:
    """A file-like view of an iterator of byte parts (for zstd's stream reader), remembering
    which parts were pulled since the last `take` so the writer thread can hash them."""

    def __init__(self, parts: Iterator[bytes]) -> None:
        self._it = iter(parts)
        self._buf = memoryview(b"")
        self._pulled: list[bytes] = []
        self.fetched = 0

    def _pull(self) -> bool:
        for part in self._it:
            self._pulled.append(part)
            self.fetched += len(part)
            if part:
                self._buf = memoryview(part)
                return True
        return False

    def read(self, n: int = -1) -> bytes | memoryview:
        if not self._buf and not self._pull():
            return b""
        k = len(self._buf) if n < 0 else min(n, len(self._buf))
        out, self._buf = self._buf[:k], self._buf[k:]
        return out

    def take(self) -> bytes:
        pulled, self._pulled = self._pulled, []
        return pulled[0] if len(pulled) == 1 else b"".join(pulled)

    def rest(self) -> Iterator[bytes]:
        self._buf = memoryview(b"")
        if self._pulled:
            yield self.take()
        while self._pull():
            yield self.take()


def content_matches(fd: int, kind: str, entry: ShardEntry) -> bool:
    """Whether an open file holds the shard's content: its bytes ("mdb") or a zstd stream of
    them ("zst") must hash to the manifest's sha256 and size. Read with pread; a read error
    or a damaged stream is simply False."""
    h = hashlib.sha256()
    n = 0
    try:
        if kind == "mdb":
            size = os.fstat(fd).st_size
            if size != entry.bytes:
                return False
            for chunk in pread_chunks(fd, size, CHUNK):
                h.update(chunk)
                n += len(chunk)
        else:
            src = _Parts(pread_chunks(fd, os.fstat(fd).st_size, CHUNK))
            dec = zstandard.ZstdDecompressor().stream_reader(src, read_size=CHUNK, read_across_frames=True)  # type: ignore[arg-type]
            while data := dec.read(CHUNK):
                n += len(data)
                if n > entry.bytes:
                    return False
                h.update(data)
    except (OSError, RemoteError, zstandard.ZstdError):
        return False
    return n == entry.bytes and h.hexdigest() == entry.sha256


def _source(chunks: Iterator[bytes], where: str) -> Iterator[bytes]:
    """A source's read errors as RemoteError: a failing home (or a passed file on a failing
    disk) is never taken for a failing tier."""
    while True:
        try:
            chunk = next(chunks)
        except StopIteration:
            return
        except OSError as e:
            raise RemoteError(f"{where}: cannot be read ({e.strerror or e})") from None
        yield chunk


class _Writer:
    """Hashes the compressed stream and writes the decompressed one on its own thread
    (hashlib, zstd and file I/O release the GIL, so the two halves run on two cores);
    bounded so memory stays small."""

    def __init__(self, out: BinaryIO, abort: threading.Event, sha: Any, content: Any = None) -> None:
        self._out, self._abort, self._sha, self._content = out, abort, sha, content
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
                    if self._content is not None:
                        self._content.update(item[0])
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
