"""The tail shard a Writer appends to: its LMDB env and write transaction, the slots and bytes in
it, sealing it when full and starting the next.

Only LMDB mechanics live here; what the records are, which keys they hold and when a failure
discards the pending writes is the Writer's business. Every method raises what LMDB or the
filesystem raised (lmdb.Error, OSError, CorruptDatasetError from the seal's checks): the Writer
turns it into recovery and one CommitError.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from .. import format as fmt
from ..format import ShardEntry, names
from .sealing import Hasher, seal
from .shards import ENVS, open_tail_for_write, release_dead_pages, truncate_tail

LMDB_TXN_BYTES = 64 << 20  # commit the LMDB transaction this often to bound dirty memory
RECORD_OVERHEAD = 64       # LMDB's per-record bytes beyond the value, for sealing decisions


class OpenTail:
    """One writer's open tail (`id`, `slots` records, about `bytes` bytes in LMDB) and the envs of
    the tails sealed since the last commit, kept open until the commit removes their names."""

    def __init__(self, shards_dir: Path) -> None:
        self.shards_dir = shards_dir
        self.shard_size = 0
        self.env: Any = None
        self.txn: Any = None
        self.id = 0
        self.slots = 0
        self.bytes = 0
        self.txn_bytes = 0
        self.sealed_envs: dict[int, Any] = {}  # tail id -> env, tails sealed since the last commit

    def reopen(self, path: Path, tail_id: int, committed: int, shard_size: int) -> None:
        """Open the tail at `path` (recovery: walked first, cut back to its `committed` slots)."""
        self.shard_size = shard_size
        self.env = open_tail_for_write(path, shard_size, check_pages=True)
        truncate_tail(self.env, committed)
        release_dead_pages(self.env, path)
        self.id, self.slots, self.txn_bytes = tail_id, committed, 0
        self.bytes = (self.env.info()["last_pgno"] + 1) * 4096 if committed else 0

    def full_for(self, need: int) -> bool:
        """Whether a record taking `need` bytes must go to the next tail (this one holds records)."""
        return bool(self.slots) and self.bytes + need > self.shard_size

    def write_txn(self) -> Any:
        """The tail's write transaction, begun if none is open."""
        if self.txn is None:
            self.txn = self.env.begin(write=True)
            ENVS.mark_busy(self.env, 1)
        return self.txn

    def append(self, rec: bytes, need: int) -> int:
        """Put one record into this tail (the caller sealed a full one first); its slot."""
        slot = self.slots
        self.write_txn().put(fmt.slot_key(slot), rec, append=True)
        self._added(1, need)
        return slot

    def append_run(self, recs: list[bytes], ends: list[int], start: int) -> tuple[int, int]:
        """Put recs[start:stop] into this tail with one putmulti, as many as fit in it and in the
        current transaction (at least one); `ends` are the running sums of the records' needs.
        Returns (first slot, stop)."""
        before = ends[start - 1] if start else 0  # bytes of the records already appended
        fit = bisect_right(ends, before + self.shard_size - self.bytes, lo=start)       # within the shard
        reach = bisect_left(ends, before + LMDB_TXN_BYTES - self.txn_bytes, lo=start) + 1  # the txn's last
        stop = max(start + 1, min(fit, reach, len(recs)))
        slot, n = self.slots, stop - start
        slot_keys = np.arange(slot, slot + n, dtype=">u8").tobytes()
        keys = [slot_keys[8 * i:8 * i + 8] for i in range(n)]
        consumed, added = self.write_txn().cursor().putmulti(zip(keys, recs[start:stop]), append=True)
        if consumed != n or added != n:
            raise lmdb.Error(f"LMDB appended {added} of {n} records")
        self._added(n, ends[stop - 1] - before)
        return slot, stop

    def _added(self, records: int, nbytes: int) -> None:
        self.slots += records
        self.bytes += nbytes
        self.txn_bytes += nbytes
        if self.txn_bytes >= LMDB_TXN_BYTES:
            self.flush()

    def flush(self) -> None:
        """Commit the open write transaction, if any."""
        if self.txn is not None:
            txn, self.txn = self.txn, None
            ENVS.mark_busy(self.env, -1)
            txn.commit()
        self.txn_bytes = 0

    def sync(self) -> None:
        """Commit and fsync: every appended record is durable."""
        self.flush()
        self.env.sync(True)

    def names_of_seal(self, incarnation: int) -> set[str]:
        """The files sealing this tail and starting the next one create."""
        shard = names.shard_name(self.id, incarnation)
        next_tail = names.tail_name(self.id + 1, incarnation)
        return {shard, names.zst_name(shard), next_tail, names.lmdb_lock_name(next_tail)}

    def seal(self, compress: bool, incarnation: int) -> tuple[ShardEntry, np.ndarray, Hasher]:
        """Seal this tail in place (sealing.seal, its sha256 on a thread) and open the next one;
        this tail's env stays open in `sealed_envs` until the commit."""
        self.sync()
        entry, records, hasher = seal(self.env, self.shards_dir, self.id, compress, incarnation)
        try:
            env = open_tail_for_write(self.shards_dir / names.tail_name(self.id + 1, incarnation), self.shard_size)
        except BaseException:
            hasher.wait()  # recovery is about to cut this file back: nothing may still read it
            raise
        self.sealed_envs[self.id] = self.env
        self.id += 1
        self.env = env
        self.slots = 0
        self.bytes = 0
        return entry, records, hasher

    def close(self, abort: bool) -> None:
        """End the transaction (abort or commit it) and let every env go."""
        if self.txn is not None:
            ENVS.mark_busy(self.env, -1)
            try:
                self.txn.abort() if abort else self.txn.commit()
            except lmdb.Error:
                pass
            self.txn = None
        for e in list(self.sealed_envs.values()) + ([self.env] if self.env is not None else []):
            ENVS.release(e)
        self.sealed_envs.clear()
        self.env = None
