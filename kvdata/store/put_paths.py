"""put and put_many of a Writer (a part of store.writer.Writer): a record at a time, raw puts
gathered (store.gathered_puts) and written a chunk at a time, and put_many's chunks, whose raw
records are encoded and appended at once (format.raw_batch) and whose other records go through
the record-at-a-time path. Kept apart from the Writer's lock, commit and recovery; every write
here lands in the Writer's Pending through _put_record or Pending.add_many.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate, islice, repeat
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np

from .. import format as fmt
from .._util.interrupts import interrupts_deferred
from ..errors import CommitError, KVDataError
from ..format import Manifest, raw_batch
from . import record_metas
from .gathered_puts import GATHER_RECORDS
from .open_tail import RECORD_OVERHEAD, OpenTail

if TYPE_CHECKING:
    from .gathered_puts import GatheredPuts
    from .pending import Pending
    from .reader import Reader

PUT_CHUNK = GATHER_RECORDS  # put_many looks up existing keys this many at a time, as many as put gathers


class PutPaths:
    """The put paths of store.writer.Writer, which provides what is declared here."""

    if TYPE_CHECKING:
        m: Manifest
        pending: Pending
        tail: OpenTail
        failed: bool
        _failed_why: str
        _gathered: GatheredPuts

        @property
        def shard_size(self) -> int: ...
        def _check(self) -> None: ...
        def _committed(self) -> Reader: ...
        def _committed_pos(self, skey: str, key_hash: int) -> int | None: ...
        def _put_record(self, skey: str, h: int, rec: bytes, label: int | None, layout: list,
                        committed: int | None) -> None: ...
        def _seal(self) -> None: ...
        def _tail_failed(self, e: BaseException) -> CommitError: ...
        def _fail(self) -> None: ...

    def put(self, key: str, value: Any, label: int | None) -> None:
        """Write one record (visible at the next commit). A raw `bytes` value without a label is
        checked now and gathered (store.gathered_puts), then written with the next ones as one
        put_many chunk: a disk failure is raised by the call that writes them."""
        self._check()
        if label is None and self._gathered.take(key, value):
            if self._gathered.full:
                self.flush_puts()
            return
        self.flush_puts()
        self._put_now(key, value, label)

    def _put_now(self, key: Any, value: Any, label: int | None) -> None:
        """One record, through the record-at-a-time path (which names what is wrong with it)."""
        kb = fmt.check_key(key)
        skey = kb.decode("utf-8")
        layout: list
        if label is None and raw_batch.is_raw_value(value):  # the same bytes, a few us sooner
            rec, layout = raw_batch.encode_raw_records([kb], [value])[0], []
        else:
            rec, label, layout = fmt.encode_record(skey, value, label)
        h = fmt.key_hash(kb)
        self._put_record(skey, h, rec, label, layout, self._committed_pos(skey, h))

    def flush_puts(self) -> None:
        """Write the gathered puts as one put_many chunk, a Ctrl-C held until it is done
        (_util.interrupts). Their keys are looked up first; if that fails (a damaged committed
        record), nothing is written yet and they go one at a time (_put_each). A tail failure
        discards the pending writes and says so (CommitError); anything else would leave the
        chunk half written after its puts returned: the pending writes are discarded and the
        writer fails, saying why."""
        if not self._gathered.items:
            return
        chunk = self._gathered.drain()
        with interrupts_deferred():
            try:
                looked = self._look_up(chunk)
            except (KVDataError, OSError):
                self._put_each(chunk)
                return
            try:
                self._write_chunk(chunk, *looked)
            except CommitError:
                raise
            except BaseException as e:
                self._fail()
                self.failed = True
                self._failed_why = (f" (writing {len(chunk)} gathered puts failed: {type(e).__name__}: {e}; "
                                    f"the writes since generation {self.m.generation} were discarded)")
                raise

    def _put_each(self, chunk: list[tuple[Any, ...]]) -> None:
        """Gathered puts one at a time, as they would have been written: each that fails is left
        out, and the first failure is raised naming its key (and how many more failed)."""
        failed: list[tuple[Any, Exception]] = []
        for key, value in chunk:
            try:
                self._put_now(key, value, None)
            except CommitError:
                raise
            except (KVDataError, OSError) as e:
                failed.append((key, e))
        if failed:
            first_key, first = failed[0]
            more = f"; {len(failed) - 1} more gathered put(s) failed too and were not written" if len(failed) > 1 else ""
            if isinstance(first, KVDataError):
                raise type(first)(f"key {first_key!r} (put earlier, written now) was not written: {first}{more}") from None
            raise first

    def put_many(self, pairs: Iterable[tuple[Any, ...]]) -> int:
        self._check()
        self.flush_puts()
        n = 0
        items = iter(pairs)
        while chunk := list(islice(items, PUT_CHUNK)):
            self.flush_puts()  # puts the iterable itself made while the chunk was taken go first
            n += self._put_chunk(chunk)
        return n

    def _put_chunk(self, chunk: list[tuple[Any, ...]]) -> int:
        return self._write_chunk(chunk, *self._look_up(chunk))

    def _look_up(self, chunk: list[tuple[Any, ...]]) -> tuple[list[str], list[bytes], np.ndarray, dict[int, int]]:
        """(keys as str, their UTF-8 bytes, their hashes, {chunk position: committed sample}); reads only."""
        keys, kbs = raw_batch.chunk_keys([item[0] for item in chunk])
        hashes = raw_batch.key_hashes(kbs)
        return keys, kbs, hashes, record_metas.find_many(self._committed(), keys, hashes)

    def _write_chunk(self, chunk: list[tuple[Any, ...]], keys: list[str], kbs: list[bytes], hashes: np.ndarray,
                     found: dict[int, int]) -> int:
        if not found and self._put_raw_batch(chunk, keys, kbs, hashes):
            return len(chunk)
        deleted = self.pending.deleted
        for i, (item, skey, h) in enumerate(zip(chunk, keys, hashes.tolist())):
            value = item[1]
            label = item[2] if len(item) > 2 else None
            rec, label, layout = fmt.encode_record(skey, value, label)
            pos = found.get(i)
            self._put_record(skey, h, rec, label, layout, None if pos is None or pos in deleted else pos)
        return len(chunk)

    def _put_raw_batch(self, chunk: list[tuple[Any, ...]], keys: list[str], kbs: list[bytes],
                       hashes: np.ndarray) -> bool:
        """Append a chunk of new raw records at once (raw_batch), if it is one: every value bytes,
        no label, every key new to the dataset and distinct. False: nothing was written."""
        values = raw_batch.raw_chunk_values(chunk, keys)
        if values is None or not self.pending.new_keys.keys().isdisjoint(keys):
            return False
        recs = raw_batch.encode_raw_records(kbs, values)
        needs = [len(r) + RECORD_OVERHEAD for r in recs]
        if max(needs) > self.shard_size:
            return False  # the record-at-a-time path names the record too large
        ends = list(accumulate(needs))
        i = 0
        while i < len(recs):
            if self.tail.full_for(needs[i]):
                self._seal()
            try:
                slot, j = self.tail.append_run(recs, ends, i)
            except (OSError, lmdb.Error) as e:
                raise self._tail_failed(e) from None
            self.pending.dirty = True
            self.pending.add_many(keys[i:j], self.tail.id, slot, repeat(fmt.NO_LABEL, j - i), hashes[i:j])
            i = j
        return True
