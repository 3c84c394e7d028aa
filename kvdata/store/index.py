"""The numpy memmap side-index: sample -> (shard, slot, label), record offsets, key hashes.

Files under ``index/`` (all raw little-endian arrays; the manifest gives counts):

- ``samples-G.bin``: one SAMPLE_DTYPE row per live sample. Appends write past the
  committed count in place (readers of older generations never look there); a
  commit that overwrites or deletes writes a new file with a new generation G.
- ``records-G.bin``: one RECORD_DTYPE row per slot of each sealed shard, shard
  after shard, appended when a shard is sealed. ``base[shard] + slot`` finds a row.
- ``keys-G-N.bin``: sorted runs of key hashes, ``n`` uint64 hashes then ``n``
  uint64 positions. Each commit of new keys adds a run; runs merge like a binary
  counter, so there are O(log n) runs and a lookup is O(log n) searchsorted calls.

The index is derived state: ``rebuild.py`` recreates it from the shards alone.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .. import format as fmt
from .._util.fsutil import write_at
from ..errors import CorruptDatasetError
from ..format import KeyRunEntry, Manifest, names


def _corrupt(path: Path, what: str) -> CorruptDatasetError:
    return CorruptDatasetError(f"index file {path} {what}; run `kvdata reindex {path.parent.parent}` to rebuild it")


def load_array(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """The first `count` rows of `path`, read-only, memory-mapped."""
    if count == 0:
        return np.zeros(0, dtype=dtype)
    try:
        st = os.stat(path)
    except FileNotFoundError:  # load_generation retries (a commit may have replaced it) or names it
        raise
    except OSError as e:  # a symlink loop, a path through a file, ...
        raise _corrupt(path, f"cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _corrupt(path, "is not a regular file")
    size = st.st_size
    if size < count * dtype.itemsize:
        raise _corrupt(path, f"is truncated ({size} bytes, {count * dtype.itemsize} expected)")
    # a plain ndarray view of the map (the map stays alive as its base): np.memmap's Python-level
    # __getitem__ / __array_finalize__ cost more than the lookup on every single-sample read
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,)).view(np.ndarray)


class KeyRun:
    __slots__ = ("path", "hashes", "pos")

    def __init__(self, path: Path, count: int) -> None:
        arr = load_array(path, fmt.HASH_DTYPE, 2 * count)
        self.path = path
        self.hashes = arr[:count]
        self.pos = arr[count:]

    def bad_position(self, count: int) -> CorruptDatasetError:
        return _corrupt(self.path, f"holds a sample position past the {count} samples")


class Index:
    """The side-index of one generation, as read-only memmaps."""

    def __init__(self, index_dir: Path, manifest: Manifest) -> None:
        idx = manifest.index
        self.count = manifest.count
        if (self.count and not idx.samples) or (idx.records_count and not idx.records):
            raise CorruptDatasetError(f"{index_dir.parent / names.MANIFEST}: counts samples or records but names no "
                                      f"index file for them; run `kvdata reindex {index_dir.parent}`")
        self.samples = load_array(index_dir / idx.samples, fmt.SAMPLE_DTYPE, self.count) \
            if idx.samples else np.zeros(0, fmt.SAMPLE_DTYPE)
        self.records_count = idx.records_count
        self.records = load_array(index_dir / idx.records, fmt.RECORD_DTYPE, self.records_count) \
            if idx.records else np.zeros(0, fmt.RECORD_DTYPE)
        self.runs = [KeyRun(index_dir / r.name, r.count) for r in idx.keys]
        total = sum(s.records for s in manifest.shards)  # Python ints: a hostile manifest cannot overflow it
        if total != self.records_count:
            raise _corrupt(index_dir / (idx.records or "records"),
                           f"has {self.records_count} rows but the shards hold {total}")
        shard_records = np.array([s.records for s in manifest.shards], dtype=np.int64)
        self.base = np.zeros(len(shard_records) + 1, dtype=np.int64)
        np.cumsum(shard_records, out=self.base[1:])
        self.n_sealed = len(shard_records)
        self.tail_records = manifest.tail.records
        self.shard_bytes = np.array([s.bytes for s in manifest.shards] + [0], dtype=np.int64)

    def candidates(self, h: int) -> list[int]:
        """Positions whose key hash equals h (usually zero or one)."""
        out: list[int] = []
        hv = np.uint64(h)
        for run in reversed(self.runs):
            hashes = run.hashes
            lo = int(hashes.searchsorted(hv, "left"))
            if lo < len(hashes) and hashes[lo] == hv:
                hi = int(hashes.searchsorted(hv, "right"))
                found = [int(p) for p in run.pos[lo:hi]]
                if any(p >= self.count for p in found):
                    raise run.bad_position(self.count)
                out.extend(found)
        return out

    def candidates_many(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(query index, position) pairs for every hash match of a batch of hashes."""
        qs: list[int] = []
        ps: list[int] = []
        hashes = np.asarray(hashes, dtype=np.uint64)
        for run in self.runs:
            if not len(run.hashes):
                continue
            lo = np.searchsorted(run.hashes, hashes, "left")
            hit = lo < len(run.hashes)
            hit[hit] = run.hashes[lo[hit]] == hashes[hit]
            if not hit.any():
                continue
            hi = np.searchsorted(run.hashes, hashes[hit], "right")
            qi = np.nonzero(hit)[0]
            for q, a, b in zip(qi.tolist(), lo[hit].tolist(), hi.tolist()):
                for p in run.pos[a:b].tolist():
                    if p >= self.count:
                        raise run.bad_position(self.count)
                    qs.append(q)
                    ps.append(p)
        return np.array(qs, dtype=np.int64), np.array(ps, dtype=np.int64)

    def resolve(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, slot, record row or -1 for the tail) of sample positions, bounds-checked."""
        rows = self.samples[positions]
        shard = rows["shard"].astype(np.int64)
        slot = rows["slot"].astype(np.int64)
        sealed = shard < self.n_sealed
        rec = np.full(len(positions), -1, dtype=np.int64)
        rec[sealed] = self.base[shard[sealed]] + slot[sealed]
        bad = (shard > self.n_sealed) | (sealed & (rec >= self.base[np.minimum(shard + 1, self.n_sealed)])) \
            | (~sealed & (slot >= self.tail_records))
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise CorruptDatasetError(
                f"side-index points sample {int(positions[i])} at shard {int(shard[i])} slot {int(slot[i])}, "
                "which does not exist; run `kvdata reindex`"
            )
        return shard, slot, rec


# ---------------------------------------------------------------- writing


def append_rows(path: Path, start_row: int, rows: np.ndarray) -> None:
    """Write rows at `start_row` (past what any reader was told exists) and fsync."""
    if len(rows):
        write_at(path, start_row * rows.dtype.itemsize, np.ascontiguousarray(rows).data.cast("B"))
    elif not path.exists():
        write_at(path, 0, b"")


def _create(path: Path) -> BinaryIO:
    """A new index file opened for writing; a symbolic link planted at its name is refused (ELOOP),
    never written through."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "wb")


def write_new(path: Path, rows: np.ndarray) -> None:
    """A whole new index file (not yet referenced by any manifest), fsync'ed."""
    with _create(path) as f:
        f.write(np.ascontiguousarray(rows).data.cast("B"))
        f.flush()
        os.fsync(f.fileno())


def write_key_run(path: Path, hashes: np.ndarray, pos: np.ndarray) -> int:
    order = np.argsort(hashes, kind="stable")
    with _create(path) as f:
        f.write(np.ascontiguousarray(hashes[order], dtype=fmt.HASH_DTYPE).tobytes())
        f.write(np.ascontiguousarray(pos[order], dtype=fmt.POS_DTYPE).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return len(order)


def add_key_run(index_dir: Path, runs: tuple[KeyRunEntry, ...], generation: int,
                hashes: np.ndarray, pos: np.ndarray) -> list[KeyRunEntry]:
    """Runs after adding one: the new run merges with its elders while they are
    no more than twice its size, which keeps O(log n) runs."""
    out = list(runs)
    if not len(hashes):
        return out
    while out and out[-1].count <= 2 * len(hashes):
        old = KeyRun(index_dir / out[-1].name, out[-1].count)
        hashes = np.concatenate([np.asarray(old.hashes), hashes])
        pos = np.concatenate([np.asarray(old.pos), pos])
        out.pop()
    name = names.keys_name(generation, len(out))
    write_key_run(index_dir / name, hashes, pos)
    out.append(KeyRunEntry(name, int(len(hashes))))
    return out


def all_key_hashes(index: Index) -> np.ndarray:
    """hash of every sample position, gathered from the runs (for rewrites)."""
    out = np.zeros(index.count, dtype=np.uint64)
    for run in index.runs:
        if len(run.pos) and int(run.pos.max()) >= index.count:
            raise run.bad_position(index.count)
        out[np.asarray(run.pos, dtype=np.int64)] = run.hashes
    return out

