"""A new sealed shard written in one pass from record values (compaction's output files).

The file is created exclusively (O_EXCL|O_NOFOLLOW: never an existing file, never through a
link planted at its name) and LMDB is handed that very file through /proc/self/fd, so a name
swapped meanwhile cannot redirect the write. Values are appended in slot order with
MDB_APPEND (pages packed full, no B-tree splits to the left), a transaction every
TXN_BYTES to bound dirty memory, without LMDB's lock file (nobody else opens a file that no
manifest names yet). `finish` syncs it, learns every value's offset from LMDB's own map
(shard_rows.written_rows: the caller gives each record's head and kind) and returns the side-index
rows; nothing here hashes it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from .. import format as fmt
from .._util.fsutil import unlink_quiet
from ..errors import CorruptDatasetError
from .shard_rows import written_rows
from .shards import tail_map_size

TXN_BYTES = 64 << 20  # commit this often: LMDB keeps a transaction's dirty pages in memory
PUT_BATCH = 256       # values handed to LMDB per putmulti call


class ShardBuilder:
    """One shard file being written; `finish()` or `abort()` ends it."""

    def __init__(self, path: Path, expected_bytes: int) -> None:
        """expected_bytes: about how large it will be (sizes the map, with the usual slack)."""
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self._via = Path(f"/proc/self/fd/{self._fd}") if os.path.isdir("/proc/self/fd") else path
        try:
            self._env: Any = lmdb.open(str(self._via), subdir=False, map_size=tail_map_size(max(expected_bytes, 1)),
                                       lock=False, sync=False, metasync=False, readahead=False, meminit=False,
                                       max_dbs=0, max_spare_txns=0)
        except BaseException:
            self.abort()
            raise
        self._txn: Any = None
        self._txn_bytes = 0
        self.slots = 0
        self._head_kind: list[np.ndarray] = []

    def add(self, values: list[Any], head_kind: np.ndarray) -> None:
        """Append values (bytes or buffers of whole records) in order as the next slots;
        head_kind: each record's `head | kind << KIND_SHIFT`, as the side-index keeps it."""
        if len(head_kind) != len(values):
            raise ValueError("one head_kind per value")
        self._head_kind.append(np.asarray(head_kind, dtype=np.uint32))
        batch: list[tuple[bytes, Any]] = []
        for v in values:
            batch.append((fmt.slot_key(self.slots + len(batch)), v))
            self._txn_bytes += len(v)
            if len(batch) >= PUT_BATCH:
                self._put(batch)
                batch = []
        if batch:
            self._put(batch)

    def _put(self, batch: list[tuple[bytes, Any]]) -> None:
        if self._txn is None:
            self._txn = self._env.begin(write=True)
        consumed, added = self._txn.cursor().putmulti(batch, append=True)
        if added != len(batch):
            raise CorruptDatasetError(f"{self.path}: LMDB stored {added} of {len(batch)} records")
        self.slots += len(batch)
        if self._txn_bytes >= TXN_BYTES:
            self._commit()

    def _commit(self) -> None:
        if self._txn is not None:
            txn, self._txn = self._txn, None
            txn.commit()
        self._txn_bytes = 0

    def finish(self) -> tuple[np.ndarray, int]:
        """(record rows, file size) of the complete, synced file."""
        self._commit()
        hk = np.concatenate(self._head_kind) if self._head_kind else np.zeros(0, np.uint32)
        rows = written_rows(self._env, self._via, hk, self._fd)
        self._env.close()
        self._env = None
        assert self._fd is not None
        os.fsync(self._fd)  # every page LMDB wrote (it was told not to sync each transaction)
        size = os.fstat(self._fd).st_size
        os.close(self._fd)
        self._fd = None
        if len(rows) != self.slots:
            raise CorruptDatasetError(f"{self.path}: holds {len(rows)} of the {self.slots} records written")
        return rows, size

    def abort(self) -> None:
        """Drop the file (it was never named by a manifest)."""
        if getattr(self, "_txn", None) is not None:
            self._txn.abort()
            self._txn = None
        if getattr(self, "_env", None) is not None:
            self._env.close()
            self._env = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            unlink_quiet(self.path)
