"""Record-granular reads from a remote home: a few samples of a shard that has no staged copy.

The shard's cold copy is framed (kvdata.format.frames): zstd frames cut at record
boundaries and a seek table whose size and sha256 the manifest records. A read fetches the
table once per shard (cached, checked against the manifest), finds the frames holding the
requested slots, fetches them with ranged GETs -- adjacent frames (or ones a small gap apart) coalesced, every GET of
the call in flight at once on a shared pool --, checks each frame against the table's
digest before decompressing it, and cuts the records out. A frame that does not match is
refused (ChecksumMismatchError naming the shard and the frame); nothing unverified is ever
returned, and nothing is kept but tables.

Local (and NFS) homes are read in place by the reader, and old single-frame copies (no seek
table) are staged whole: `read` answers None for both.

A table fetched once is also kept in the dataset's index mirror (`tables`, named by its sha256
and checked against it whenever it is read back): DataLoader workers are new processes every
epoch, and without it each fetched the table of every shard it read by record again -- a GET
and a round trip more for each shard, about 7% of a warm epoch's requests at 151 KB samples.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import zstandard

from .._util.fsutil import atomic_write, read_regular
from ..errors import ChecksumMismatchError, CorruptDatasetError, RemoteError
from ..format import ShardEntry, frames, names
from ..format.codec import CHUNK
from ..homes import Home

T = TypeVar("T")
IN_FLIGHT = 32            # ranged GETs in flight per process (one per pool thread)
MAX_TABLES = 256          # seek tables kept per home
MAX_RUN = 8 << 20         # adjacent frames coalesced into one GET up to this many compressed bytes
GAP_BYTES = 16 << 10      # ... across frames not wanted of at most this many bytes (a GET costs more)


@dataclass(frozen=True)
class _Plan:
    """One shard's part of a read: the object, its table, each slot's [a, b) in the shard,
    how many bytes of each frame are needed, and the [lo, hi) frame runs to GET."""

    name: str
    table: frames.SeekTable
    want: list[tuple[int, int]]
    needed: dict[int, int]
    runs: list[tuple[int, int]]


class RecordReader:
    """Reads records of one home's shards from their framed cold copies."""

    def __init__(self, home: Home, on_home_bytes: Callable[[int], None] | None = None,
                 tables: Path | None = None) -> None:
        self.home = home
        self.on_home_bytes = on_home_bytes
        self.tables = tables  # where fetched seek tables are kept for other processes (an index mirror's)
        self._lock = threading.Lock()
        self._tables: OrderedDict[tuple[str, str], frames.SeekTable] = OrderedDict()
        self._loading: dict[tuple[str, str], Future[frames.SeekTable]] = {}
        self._pid = os.getpid()
        self.bytes_fetched = 0   # from the home: tables and frames
        self.requests = 0

    def usable(self, entry: ShardEntry) -> bool:
        """Whether this shard can be read record by record from this home."""
        z = entry.zst
        return (z is not None and z.seek_sha256 is not None and entry.records > 0
                and self.home.local_path("") is None and self.home.trusted_manifest)

    def _fetch(self, name: str, start: int, length: int) -> bytes:
        data = self.home.read_range(name, start, length)
        with self._lock:
            self.bytes_fetched += len(data)
            self.requests += 1
        if self.on_home_bytes is not None:
            self.on_home_bytes(len(data))
        if len(data) != length:
            raise RemoteError(f"{self.home.where(name)}: answered {len(data)} bytes for a range of {length}; "
                              "the home copy changed or is truncated")
        return data

    # ------------------------------------------------------------ seek tables

    def table(self, entry: ShardEntry) -> frames.SeekTable:
        """The shard's seek table: fetched once (one ranged GET), checked against the manifest."""
        z = entry.zst
        assert z is not None and z.seek_sha256 is not None
        key = (z.sha256, z.seek_sha256)
        if self._pid != os.getpid():  # a forked child (a DataLoader worker): the parent's loads never finish here
            self._lock, self._loading, self._pid = threading.Lock(), {}, os.getpid()
        with self._lock:
            got = self._tables.get(key)
            if got is not None:
                self._tables.move_to_end(key)
                return got
            fut = self._loading.get(key)
            mine = fut is None
            if fut is None:
                fut = self._loading[key] = Future()
        if not mine:
            return fut.result()
        try:
            t = self._load_table(entry)
        except BaseException as e:
            with self._lock:
                self._loading.pop(key, None)
            fut.set_exception(e)
            raise
        with self._lock:
            self._loading.pop(key, None)
            self._tables[key] = t
            while len(self._tables) > MAX_TABLES:
                self._tables.popitem(last=False)
        fut.set_result(t)
        return t

    def _load_table(self, entry: ShardEntry) -> frames.SeekTable:
        z = entry.zst
        assert z is not None and z.seek_sha256 is not None
        name = f"{names.SHARDS_DIR}/{z.name}"
        where = self.home.where(name)
        if not frames.MIN_TABLE <= z.seek_bytes <= z.bytes:
            raise CorruptDatasetError(f"{where}: the manifest gives a seek table of {z.seek_bytes} bytes in a "
                                      f"{z.bytes}-byte copy; push the dataset again")
        kept = self._kept_table(z.seek_sha256, z.seek_bytes)
        blob = kept if kept is not None else self._fetch(name, z.bytes - z.seek_bytes, z.seek_bytes)
        if kept is None and hashlib.sha256(blob).hexdigest() != z.seek_sha256:
            raise ChecksumMismatchError(f"{where}: the seek table of shard {entry.name} does not match the sha256 "
                                        "the manifest gives; it was not used. Restore the home copy (kvdata push)")
        t = frames.decode_seek_table(blob, zst_bytes=z.bytes, shard_bytes=entry.bytes, records=entry.records,
                                     where=where)
        if kept is None and self.tables is not None:
            try:  # best effort: the next process reads it here instead of from the home
                self.tables.mkdir(exist_ok=True)
                atomic_write(self.tables / names.seek_table_name(z.seek_sha256), blob)
            except OSError:
                pass
        return t

    def _kept_table(self, sha: str, size: int) -> bytes | None:
        """A seek table another process kept (`tables`), if it is there and still is what its
        name says; else None (fetch it)."""
        if self.tables is None:
            return None
        try:
            blob = read_regular(self.tables / names.seek_table_name(sha), size)
        except OSError:
            return None
        return blob if len(blob) == size and hashlib.sha256(blob).hexdigest() == sha else None

    # ------------------------------------------------------------ records

    def read(self, entry: ShardEntry, slots: Sequence[int]) -> list[bytes] | None:
        """The LMDB values of these slots, verified; None when this shard cannot be read so
        (no seek table or slot directory, a local home): the caller stages it whole."""
        return self.read_many([(entry, slots)])[0]

    def read_many(self, requests: Sequence[tuple[ShardEntry, Sequence[int]]]) -> list[list[bytes] | None]:
        """`read` for the shards of a whole batch at once: the seek tables not yet known load
        concurrently, then every frame GET of every shard is in flight together on the shared
        pool -- the batch waits about one round trip, not one per shard, and no thread is
        started per batch."""
        out: list[list[bytes] | None] = [None] * len(requests)
        usable = [i for i, (entry, _slots) in enumerate(requests) if self.usable(entry)]
        loads = {i: _POOL.submit(self.table, requests[i][0]) for i in usable if not self._known(requests[i][0])}
        plans: list[tuple[int, _Plan, list[Future[bytes]]]] = []
        try:
            for i in usable:
                entry, slots = requests[i]
                fut = loads.get(i)
                t = fut.result() if fut is not None else self.table(entry)
                plan = self._plan(entry, t, slots)
                if plan is None:
                    continue
                futs = [_POOL.submit(self._fetch, plan.name, int(t.c_off[lo]), int(t.c_off[hi] - t.c_off[lo]))
                        for lo, hi in plan.runs]
                plans.append((i, plan, futs))
            for i, plan, futs in plans:
                out[i] = self._finish(requests[i][0], plan, futs)
        finally:
            for fut in loads.values():
                fut.cancel()
            for _i, _plan, futs in plans:
                for f in futs:
                    f.cancel()
        return out

    def _known(self, entry: ShardEntry) -> bool:
        z = entry.zst
        assert z is not None
        with self._lock:
            return (z.sha256, z.seek_sha256) in self._tables

    def _plan(self, entry: ShardEntry, t: frames.SeekTable, slots: Sequence[int]) -> _Plan | None:
        """Which byte range of the shard each slot is, and which runs of frames hold them."""
        if t.slot_off is None or t.slot_size is None:
            return None
        z = entry.zst
        assert z is not None
        name = f"{names.SHARDS_DIR}/{z.name}"
        want: list[tuple[int, int]] = []
        needed: dict[int, int] = {}   # frame -> how many of its bytes the wanted records need
        for s in slots:
            s = int(s)
            if not 0 <= s < len(t.slot_off):
                raise CorruptDatasetError(f"{self.home.where(name)}: shard {entry.name} has no slot {s}")
            a = int(t.slot_off[s])
            b = a + int(t.slot_size[s])
            want.append((a, b))
            if b > a:
                for f in t.frames_of(a, b):
                    needed[f] = max(needed.get(f, 0), min(b, int(t.u_off[f + 1])) - int(t.u_off[f]))
        return _Plan(name, t, want, needed, _runs(sorted(needed), t))

    def _finish(self, entry: ShardEntry, plan: _Plan, futs: list[Future[bytes]]) -> list[bytes]:
        """The records of one shard once its GETs answer: each frame checked, then cut."""
        t = plan.table
        plain: dict[int, bytes] = {}
        dctx = zstandard.ZstdDecompressor()
        for (lo, hi), fut in zip(plan.runs, futs):
            blob = memoryview(fut.result())
            base = int(t.c_off[lo])
            for f in range(lo, hi):
                if f not in plan.needed:  # a gap between wanted frames, fetched to save a GET
                    continue
                frame = blob[int(t.c_off[f]) - base:int(t.c_off[f + 1]) - base]
                plain[f] = self._decompress(entry, t, f, frame, dctx, plan.needed[f])
        out: list[bytes] = []
        for a, b in plan.want:
            if b == a:
                out.append(b"")
                continue
            parts = []
            for f in t.frames_of(a, b):
                u0 = int(t.u_off[f])
                data = plain[f]
                parts.append(data[max(a - u0, 0):min(b - u0, len(data))])
            out.append(parts[0] if len(parts) == 1 else b"".join(parts))
        return out

    def _decompress(self, entry: ShardEntry, t: frames.SeekTable, f: int, frame: memoryview,
                    dctx: zstandard.ZstdDecompressor, upto: int) -> bytes:
        """The first `upto` bytes of frame `f`, once its digest matches the table. Only what the
        wanted records need is decompressed, through a stream reader a chunk at a time: a frame
        that claims (or would expand to) more cannot make a reader hold more."""
        z = entry.zst
        assert z is not None
        where = self.home.where(f"{names.SHARDS_DIR}/{z.name}")
        if frames.frame_digest(frame) != t.digests[f].tobytes():
            raise ChecksumMismatchError(
                f"{where}: frame {f} of shard {entry.name} (bytes {int(t.c_off[f])}..{int(t.c_off[f + 1])}) does "
                "not match its checksum in the seek table; it was not used. Restore the home copy (kvdata push)")
        usize = int(t.u_off[f + 1] - t.u_off[f])
        try:
            declared = zstandard.frame_content_size(frame)
            if declared != usize:
                raise ChecksumMismatchError(f"{where}: frame {f} of shard {entry.name} declares {declared} bytes, the "
                                            f"seek table says {usize}; it was not used")
            parts = []
            got = 0
            with dctx.stream_reader(frame, read_across_frames=False) as r:
                while got < upto and (chunk := r.read(min(upto - got, CHUNK))):
                    parts.append(chunk)
                    got += len(chunk)
        except zstandard.ZstdError as e:
            raise ChecksumMismatchError(f"{where}: frame {f} of shard {entry.name} cannot be decompressed ({e}); "
                                        "it was not used. Restore the home copy (kvdata push)") from None
        if got != upto:
            raise ChecksumMismatchError(f"{where}: frame {f} of shard {entry.name} decompresses to {got} bytes, the "
                                        f"seek table says {usize}; it was not used")
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        with self._lock:
            self._tables.clear()


class _Pool:
    """A few daemon threads running the GETs of record reads, shared by the process: started
    as needed up to `n`, again after fork; they never keep a process alive."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._lock = threading.Lock()
        self._q: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
        self._threads = 0
        self._idle = 0
        self._pid = os.getpid()

    def after_fork(self) -> None:
        """In a forked child: the parent's threads (and maybe a held lock) are not here."""
        self._lock = threading.Lock()
        self._q, self._threads, self._idle, self._pid = queue.SimpleQueue(), 0, 0, os.getpid()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        if self._pid != os.getpid():
            self.after_fork()
        with self._lock:
            self._q.put((fut, fn, args))
            if self._q.qsize() > self._idle and self._threads < self._n:
                self._threads += 1
                threading.Thread(target=self._run, args=(self._q,), name=f"kvdata-records-{self._threads}",
                                 daemon=True).start()
        return fut

    def _run(self, q: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]) -> None:
        while True:
            with self._lock:
                self._idle += 1
            fut, fn, args = q.get()
            with self._lock:
                self._idle -= 1
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:
                    fut.set_exception(e)
            del fut, fn, args


_POOL = _Pool(IN_FLIGHT)
os.register_at_fork(after_in_child=_POOL.after_fork)


def _runs(frame_ids: list[int], t: frames.SeekTable) -> list[tuple[int, int]]:
    """[lo, hi) runs of frames to GET, each at most MAX_RUN compressed bytes (or one frame):
    wanted frames that are adjacent, or apart by at most GAP_BYTES of frames not wanted (the
    page header and padding between two values are frames of their own), share one GET."""
    runs: list[tuple[int, int]] = []
    for f in frame_ids:
        if runs and int(t.c_off[f] - t.c_off[runs[-1][1]]) <= GAP_BYTES \
                and int(t.c_off[f + 1] - t.c_off[runs[-1][0]]) <= MAX_RUN:
            runs[-1] = (runs[-1][0], f + 1)
        else:
            runs.append((f, f + 1))
    return runs


_READERS_LOCK = threading.Lock()


def _new_readers_lock() -> None:
    global _READERS_LOCK
    _READERS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_readers_lock)


def reader_for(home: Home, on_home_bytes: Callable[[int], None] | None = None,
               tables: Path | None = None) -> RecordReader:
    """The RecordReader of a home (one per Home object, kept on it, so its seek tables are
    shared by every source reading that home in this process and go with it); `tables`: the
    directory of the dataset's index mirror where seek tables are kept across processes."""
    with _READERS_LOCK:
        r = home.record_reader
        if not isinstance(r, RecordReader):
            r = home.record_reader = RecordReader(home, on_home_bytes=on_home_bytes, tables=tables)
        elif r.tables is None:
            r.tables = tables
        return r
