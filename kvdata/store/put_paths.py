"""A Writer's put and put_many (PutPaths, a part the Writer owns): a record at a time, raw puts
gathered (store.gathered_puts) and written a chunk at a time, and put_many's chunks, whose raw
records are encoded and appended at once (format.raw_batch) and whose other records go through
the record-at-a-time path. Every record goes through the Writer's record path (store.record_path),
which keeps its row in the pending writes; the Writer's lock, commit and recovery are not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import format as fmt
from .._util.interrupts import interrupts_deferred
from ..errors import CommitError, KVDataError
from ..format import raw_batch
from . import record_metas
from .gathered_puts import GATHER_RECORDS, GatheredPuts
from .open_tail import RECORD_OVERHEAD
from .record_path import RecordPath

if TYPE_CHECKING:
    from .reader import Reader

PUT_CHUNK = GATHER_RECORDS  # put_many looks up existing keys this many at a time, as many as put gathers


class PutPaths:
    """The puts of one Writer: records encoded and written through `records`, existing keys looked
    up in the generation `committed` reads. `give_up(what)` is the Writer's: discard the writes
    since the last commit and fail, saying `what` happened (a gathered chunk written halfway).
    The Writer checks that it is open before each call."""

    def __init__(self, records: RecordPath, committed: Reader, give_up: Callable[[str], None]) -> None:
        self._records = records
        self._committed = committed
        self._give_up = give_up
        self._gathered = GatheredPuts(records.shard_size, RECORD_OVERHEAD)  # raw puts not yet written

    def restart(self) -> None:
        """The writes since the last commit were discarded (recovery): so are the gathered puts."""
        self._gathered = GatheredPuts(self._records.shard_size, RECORD_OVERHEAD)

    def drop_gathered(self) -> None:
        """Forget the gathered puts, unwritten (the writer closes without committing)."""
        self._gathered.drain()

    def put(self, key: str, value: Any, label: int | None) -> None:
        """Write one record (visible at the next commit). A raw `bytes` value without a label is
        checked now and gathered (store.gathered_puts), then written with the next ones as one
        put_many chunk: a disk failure is raised by the call that writes them."""
        if label is None and self._gathered.take(key, value):
            if self._gathered.full:
                self.flush()
            return
        self.flush()
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
        self._records.put(skey, h, rec, label, layout, self._records.committed_pos(skey, h))

    def flush(self) -> None:
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
                self._give_up(f"writing {len(chunk)} gathered puts failed: {type(e).__name__}: {e}")
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
        self.flush()
        n = 0
        items = iter(pairs)
        while chunk := list(islice(items, PUT_CHUNK)):
            self.flush()  # puts the iterable itself made while the chunk was taken go first
            n += self._put_chunk(chunk)
        return n

    def _put_chunk(self, chunk: list[tuple[Any, ...]]) -> int:
        return self._write_chunk(chunk, *self._look_up(chunk))

    def _look_up(self, chunk: list[tuple[Any, ...]]) -> tuple[list[str], list[bytes], np.ndarray, dict[int, int]]:
        """(keys as str, their UTF-8 bytes, their hashes, {chunk position: committed sample}); reads only."""
        keys, kbs = raw_batch.chunk_keys([item[0] for item in chunk])
        hashes = raw_batch.key_hashes(kbs)
        return keys, kbs, hashes, record_metas.find_many(self._committed, keys, hashes)

    def _write_chunk(self, chunk: list[tuple[Any, ...]], keys: list[str], kbs: list[bytes], hashes: np.ndarray,
                     found: dict[int, int]) -> int:
        if not found and self._put_raw_batch(chunk, keys, kbs, hashes):
            return len(chunk)
        deleted = self._records.pending.deleted
        for i, (item, skey, h) in enumerate(zip(chunk, keys, hashes.tolist())):
            value = item[1]
            label = item[2] if len(item) > 2 else None
            rec, label, layout = fmt.encode_record(skey, value, label)
            pos = found.get(i)
            self._records.put(skey, h, rec, label, layout, None if pos is None or pos in deleted else pos)
        return len(chunk)

    def _put_raw_batch(self, chunk: list[tuple[Any, ...]], keys: list[str], kbs: list[bytes],
                       hashes: np.ndarray) -> bool:
        """Append a chunk of new raw records at once (raw_batch), if it is one: every value bytes,
        no label, every key new to the dataset and distinct. False: nothing was written."""
        values = raw_batch.raw_chunk_values(chunk, keys)
        if values is None or not self._records.pending.new_keys.keys().isdisjoint(keys):
            return False
        recs = raw_batch.encode_raw_records(kbs, values)
        needs = [len(r) + RECORD_OVERHEAD for r in recs]
        if max(needs) > self._records.shard_size:
            return False  # the record-at-a-time path names the record too large
        self._records.append_new(keys, recs, needs, hashes)
        return True
