"""The record path of a Writer (RecordPath): records appended to the writer's open tail (sealed first
when it is full), their rows kept in the writes since the last commit (Pending), and the fields their
layouts use. Every put, put_many chunk and delete writes through it; the Writer's commit takes its
Pending and starts it over, and so does the Writer's recovery.

A failed tail write or seal discards every write since the last commit (`discard`, the Writer's
recovery, which starts this record path over) and is raised as one CommitError.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate, repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np

from .. import format as fmt
from ..errors import CommitError, CorruptDatasetError, RecordTooLargeError
from ..format import Manifest
from .open_tail import RECORD_OVERHEAD, OpenTail
from .pending import Pending
from .write_errors import failure_message

if TYPE_CHECKING:
    from .reader import Reader


class RecordPath:
    """Records into `tail` and their rows into `pending`, after the committed generation that
    `committed` reads (manifest `m`: its incarnation names sealed shards, its generation is what a
    failure says the dataset is left at)."""

    def __init__(self, root: Path, tail: OpenTail, committed: Reader, m: Manifest,
                 discard: Callable[[], None]) -> None:
        self._root = root
        self.tail = tail
        self._committed = committed
        self._discard = discard
        self._m = m
        self.pending = Pending()
        self.written: set[str] = set()  # shard-dir files created since the last commit: recovery may remove them
        self.schema: dict[str, Any] = dict(m.fields)  # the fields of every record (the next manifest's)
        self._last_schema: dict[str, Any] | None = None  # the last record's own fields (most layouts repeat)

    @property
    def shard_size(self) -> int:
        return self.tail.shard_size

    def restart(self, m: Manifest) -> None:
        """Every write since the last commit was discarded (recovery): start over after `m`."""
        self._m = m
        self.pending = Pending()
        self.schema = dict(m.fields)
        self._last_schema = None

    def committed_as(self, m: Manifest) -> None:
        """The pending writes were committed as `m`: start the next ones."""
        self._m = m
        self.pending = Pending()
        self.written.clear()

    def wait_hashing(self) -> None:
        """Let the sha256 threads of discarded seals finish before their files are touched."""
        self.pending.wait_hashing()

    # ------------------------------------------------------------ keys

    def committed_pos(self, skey: str, key_hash: int) -> int | None:
        """The committed sample `skey` overwrites, if any (None too for a key written since)."""
        if skey in self.pending.new_keys:
            return None
        reader = self._committed
        for p in reader.gen.index.candidates(key_hash):
            if p not in self.pending.deleted and reader.metas([p])[0][1]["k"] == skey:
                return p
        return None

    # ------------------------------------------------------------ records

    def put(self, skey: str, h: int, rec: bytes, label: int | None, layout: list, committed: int | None) -> None:
        """One encoded record of key `skey` (hash `h`), replacing the committed sample `committed`
        if not None, or the key's pending one."""
        slot = self.append(skey, rec)
        row = (self.tail.id, slot, fmt.NO_LABEL if label is None else int(label))
        p = self.pending
        i = p.new_keys.get(skey)
        if i is not None:
            p.set_row(i, row)
        elif committed is not None:
            p.over[committed] = row
        else:
            p.add(skey, row, h)
        if layout:
            sch = fmt.field_schema(layout)
            if sch != self._last_schema:
                self.schema = fmt.merge_schema(self.schema, sch)
                self._last_schema = sch

    def delete(self, skey: str, kb: bytes) -> bool:
        """A tombstone for `skey` (UTF-8 bytes `kb`), its sample gone at the commit; False if the
        dataset does not hold the key (nothing written)."""
        p = self.pending
        i = p.new_keys.pop(skey, None)
        committed = None if i is not None else self.committed_pos(skey, fmt.key_hash(kb))
        if i is None and committed is None:
            return False
        self.append(skey, fmt.encode_tombstone(skey))
        if i is not None:
            p.new_alive[i] = 0
        elif committed is not None:
            p.deleted.add(committed)
            p.over.pop(committed, None)
        return True

    def append(self, skey: str, rec: bytes) -> int:
        """Put one record into the tail (sealing it first if full); return its slot."""
        need = len(rec) + RECORD_OVERHEAD
        if need > self.shard_size:
            raise RecordTooLargeError(
                f"key {skey!r}: record of {len(rec)} bytes does not fit in a shard of {self.shard_size} bytes; "
                "use a larger --shard-size"
            )
        if self.tail.full_for(need):
            self.seal()
        try:
            slot = self.tail.append(rec, need)
        except (OSError, lmdb.Error) as e:
            raise self._tail_failed(e) from None
        self.pending.dirty = True
        return slot

    def append_new(self, keys: list[str], recs: list[bytes], needs: list[int], hashes: np.ndarray) -> None:
        """Records of new samples without labels (their keys distinct, none committed or pending,
        each record taking needs[i] bytes of a shard, no more than a shard holds), appended a run at
        a time, the tail sealed whenever the next one does not fit."""
        ends = list(accumulate(needs))
        i = 0
        while i < len(recs):
            if self.tail.full_for(needs[i]):
                self.seal()
            try:
                slot, j = self.tail.append_run(recs, ends, i)
            except (OSError, lmdb.Error) as e:
                raise self._tail_failed(e) from None
            self.pending.dirty = True
            self.pending.add_many(keys[i:j], self.tail.id, slot, repeat(fmt.NO_LABEL, j - i), hashes[i:j])
            i = j

    def _tail_failed(self, e: BaseException) -> CommitError:
        """Discard every write since the last commit after a failed tail write (e.g. the disk
        filled while LMDB spilled dirty pages); the error to raise."""
        self._discard()
        if isinstance(e, lmdb.MapFullError):
            return CommitError(f"{self._root}: the tail shard's map is full; commit more often or lower --shard-size")
        return CommitError(failure_message(self._root, self._m.generation, e))

    def seal(self) -> None:
        """Turn the full tail into an immutable shard; later records go to a new tail.

        Sealing and opening the next tail are one step: if either fails, everything since the
        last commit is discarded (recovery), so no state can name records that do not exist."""
        inc = self._m.incarnation
        try:
            self.written |= self.tail.names_of_seal(inc)
            entry, records, hasher = self.tail.seal(self._m.compress, inc)
        except (OSError, lmdb.Error, CorruptDatasetError) as e:
            self._discard()
            raise CommitError(failure_message(self._root, self._m.generation, e)) from None
        self.pending.sealed.append((entry, records))
        self.pending.hashing[entry.id] = hasher
