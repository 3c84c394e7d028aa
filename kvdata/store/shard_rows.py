"""The record rows of a shard file: where each slot's value lies in the file, its payload size,
its head and kind (format.RECORD_DTYPE), as the side-index keeps them for memory-map reads.

Offsets come from LMDB's own layout: the B-tree walked in numpy (format.frames.lmdb_values)
or, where that has any doubt, the values' addresses in LMDB's map of the file.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np

from .. import format as fmt
from ..errors import CorruptDatasetError
from ..format import frames
from .shards import ENVS, open_sealed_lmdb


def _map_base(path: Path, addr: int) -> int | None:
    """File offset 0's address in the mapping of `path` that contains `addr`."""
    ino = os.stat(path).st_ino
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 5 or int(parts[4]) != ino:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    return lo - int(parts[2], 16)
    except OSError:
        return None
    return None


_PREFIX_DTYPE = np.dtype([("magic", "u1"), ("kind", "u1"), ("version", "u1"), ("flags", "u1"), ("head", "<u4"),
                          ("layout_len", "<u4"), ("meta_len", "<u4"), ("crc", "<u4")])
assert _PREFIX_DTYPE.itemsize == fmt.PREFIX_SIZE


def rows_from_pages(path: Path) -> np.ndarray | None:
    """Record rows of the shard file at `path` from its LMDB pages and record prefixes, read
    in numpy (format.frames.lmdb_values, then the records' 20-byte prefixes); None when anything
    is in doubt (the caller walks the records through LMDB, which also says what is wrong).
    About 100x faster than a walk through LMDB for 1 KiB records."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return rows_from_fd(fd)
    finally:
        os.close(fd)


def rows_from_fd(fd: int) -> np.ndarray | None:
    """rows_from_pages of the file open at `fd` (a shard being written: store.shard_writer)."""
    size = os.fstat(fd).st_size
    if size < 2 * 512:
        return None
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm, memoryview(mm) as mv:
        try:
            return _rows(mv)
        except (MemoryError, ValueError, IndexError, OverflowError):  # in doubt; the frames holding
            return None                                               # views of the map are gone here


ROWS_CHUNK = 1 << 16  # record prefixes read at once: the temporaries stay a few MB


def _rows(mv: memoryview) -> np.ndarray | None:
    slots = frames.lmdb_values(mv)
    return None if slots is None else rows_of_values(mv, slots)


def rows_of_values(mv: memoryview, slots: np.ndarray) -> np.ndarray | None:
    """Record rows (format.RECORD_DTYPE) of LMDB values at (offset, size) `slots` of the map
    `mv` (frames.lmdb_values' rows, positions already checked against the map), from the
    records' prefixes; None if any prefix is not a record's. May raise what numpy raises on a
    map that is not what its pages claim (MemoryError, ValueError, IndexError)."""
    u8 = np.frombuffer(mv, np.uint8)  # every array made below is a copy: none outlives the map
    windows = np.lib.stride_tricks.sliding_window_view(u8, fmt.PREFIX_SIZE)
    rows = np.zeros(len(slots), dtype=fmt.RECORD_DTYPE)
    for at in range(0, len(slots), ROWS_CHUNK):
        part = slots[at:at + ROWS_CHUNK]
        off = part["offset"].astype(np.int64)
        dsize = part["size"].astype(np.int64)
        if (dsize < fmt.PREFIX_SIZE).any():
            return None
        pre = windows[off].view(_PREFIX_DTYPE).ravel()
        head = pre["head"].astype(np.int64)
        if (pre["magic"] != fmt.MAGIC).any() or (pre["kind"] > fmt.KIND_TOMBSTONE).any() \
                or (pre["version"] > fmt.RECORD_VERSION).any() or (head > dsize).any() \
                or (head < fmt.PREFIX_SIZE + pre["layout_len"].astype(np.int64) + pre["meta_len"]).any() \
                or (head > fmt.MAX_HEAD).any():
            return None
        out = rows[at:at + ROWS_CHUNK]
        out["offset"] = off
        out["size"] = dsize - head
        out["head_kind"] = head | (pre["kind"].astype(np.int64) << fmt.KIND_SHIFT)
    return rows


def scan(path: Path, on_record: Callable[[int, fmt.RecordHeader, memoryview], None] | None = None) -> np.ndarray:
    """Record rows (offset, size, head|kind) of every slot of a shard file, in slot order.

    Offsets come from where LMDB's own map places each value; if they cannot be
    determined (no /proc), rows carry UNKNOWN_OFFSET and reads go through LMDB.
    `on_record(slot, header, value)` sees each record (for a rebuild of the index).
    """
    env = open_sealed_lmdb(path)
    try:
        return scan_env(env, path, on_record)
    finally:
        ENVS.release(env)


def scan_env(env: lmdb.Environment, path: Path,
              on_record: Callable[[int, fmt.RecordHeader, memoryview], None] | None = None) -> np.ndarray:
    """scan() through an open env of the file at `path` (a sealing tail's own env, a compacted
    shard's writer): without on_record, from the file's pages (rows_from_pages) unless they are
    in doubt."""
    if on_record is None:
        rows = rows_from_pages(path)
        if rows is not None:
            return rows
    addrs: list[int] = []
    sizes: list[int] = []
    head_kind: list[int] = []
    try:
        with ENVS.read(env, buffers=True) as txn:
            n = txn.stat()["entries"]
            for i, (k, v) in enumerate(txn.cursor()):
                if fmt.slot_of(bytes(k)) != i:
                    raise CorruptDatasetError(f"{path}: slot {i} is missing; the shard is damaged")
                h = fmt.RecordHeader(v)
                addrs.append(np.frombuffer(v, np.uint8).ctypes.data)
                sizes.append(len(v) - h.head)
                head_kind.append(h.head | (h.kind << fmt.KIND_SHIFT))
                if on_record is not None:
                    on_record(i, h, v)
            base = _map_base(path, addrs[0]) if addrs else None
    except lmdb.Error as e:
        raise CorruptDatasetError(f"{path}: LMDB cannot read this shard ({e}); restore it from a copy") from None
    if len(addrs) != n:
        raise CorruptDatasetError(f"{path}: holds {len(addrs)} of its {n} records; the shard is damaged")
    rows = np.zeros(n, dtype=fmt.RECORD_DTYPE)
    if base is not None:
        rows["offset"] = np.array(addrs, dtype=np.uint64) - np.uint64(base)
    else:
        rows["offset"] = fmt.UNKNOWN_OFFSET
    rows["size"] = np.array(sizes, dtype=np.uint32)
    rows["head_kind"] = np.array(head_kind, dtype=np.uint32)
    if base is not None and n:
        _check_offsets(path, rows)
    return rows


def written_rows(env: lmdb.Environment, path: Path, head_kind: np.ndarray, fd: int | None = None) -> np.ndarray:
    """Record rows of a shard just written by a caller that knows every record's head and kind
    (`head_kind`, in slot order): like scan_env, but only each value's place in LMDB's map is
    learned, not its header (a compaction writes tens of thousands of records a second).
    fd: the file open for writing, read through it (its path may be a /proc/self/fd link)."""
    rows = rows_from_pages(path) if fd is None else rows_from_fd(fd)
    if rows is not None and np.array_equal(rows["head_kind"], head_kind):
        return rows
    try:
        with ENVS.read(env, buffers=True) as txn:
            views = list(txn.cursor().iternext(keys=False))
            addrs = [np.frombuffer(v, np.uint8).__array_interface__["data"][0] for v in views]
            sizes = [len(v) for v in views]
            base = _map_base(path, addrs[0]) if addrs else None
            del views
    except lmdb.Error as e:
        raise CorruptDatasetError(f"{path}: LMDB cannot read this shard ({e}); it was just written") from None
    if len(addrs) != len(head_kind):
        raise CorruptDatasetError(f"{path}: holds {len(addrs)} of the {len(head_kind)} records written")
    rows = np.zeros(len(addrs), dtype=fmt.RECORD_DTYPE)
    rows["head_kind"] = head_kind
    rows["size"] = np.array(sizes, dtype=np.int64) - (np.asarray(head_kind, np.int64) & fmt.MAX_HEAD)
    if base is not None:
        rows["offset"] = np.array(addrs, dtype=np.uint64) - np.uint64(base)
        _check_offsets(path, rows)
    else:
        rows["offset"] = fmt.UNKNOWN_OFFSET
    return rows


def _check_offsets(path: Path, rows: np.ndarray) -> None:
    """Cross-check a few offsets against the file itself; fall back to LMDB reads if off."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for i in sorted({0, len(rows) // 2, len(rows) - 1}):
            off = int(rows["offset"][i])
            head = os.pread(f.fileno(), fmt.PREFIX_SIZE, off) if off + fmt.PREFIX_SIZE <= size else b""
            ok = len(head) == fmt.PREFIX_SIZE
            if ok:
                magic, kind, _v, _f, hd, _ll, _ml, _crc = fmt.PREFIX.unpack(head)
                ok = magic == fmt.MAGIC and (hd | kind << fmt.KIND_SHIFT) == int(rows["head_kind"][i])
            if not ok:
                rows["offset"] = fmt.UNKNOWN_OFFSET
                return
