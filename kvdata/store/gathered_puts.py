"""The raw puts a Writer has accepted but not yet written (GatheredPuts).

A loop of `put(key, bytes)` is the most common way to fill a dataset. Written one at a time,
each put costs an encode, an LMDB call, a key hash and an index row in Python (~9 us for a 1 KiB
record, 0.22x a raw LMDB append loop); gathered and written as one put_many chunk
(format.raw_batch: one encode pass, one putmulti, the rows as array columns) it costs what
put_many costs. A put is gathered only when it is a valid raw record that fits in a shard: its
key is checked here (record.check_key's rules and errors) and its size against the shard, so
bad input still fails the put that gave it. Nothing reads pending writes before a commit, and
the Writer writes the gathered puts before any other write, commit or close, so the dataset is
the same as one put at a time.
"""

from __future__ import annotations

from typing import Any

from .. import format as fmt
from ..format import raw_batch

GATHER_RECORDS = 1024        # puts gathered before they are written (put_many's chunk)
GATHER_BYTES = 4 << 20       # ... or values of this many bytes, whichever comes first


class GatheredPuts:
    """(key, bytes) pairs in put order, with what decides whether a put may join them."""

    def __init__(self, shard_size: int, record_overhead: int) -> None:
        self.items: list[tuple[Any, ...]] = []
        self.bytes = 0
        self._shard_size = shard_size
        self._record_overhead = record_overhead
        self._rooms: dict[int, int] = {}  # key length in bytes -> the largest value it may have

    def take(self, key: Any, value: Any) -> bool:
        """Gather a put of a raw `bytes` value (True), after checking its key (InvalidKeyError
        naming it); False: the caller writes it one at a time (another kind of value, or one
        too large, whose error the record path names)."""
        if type(value) is not bytes:
            return False
        if type(key) is str and key.isascii() and key and "\x00" not in key:
            skey, key_bytes = key, len(key)  # check_key's rules hold but the length (_room's -1)
        else:
            kb = fmt.check_key(key)
            skey, key_bytes = (key if type(key) is str else kb.decode("utf-8")), len(kb)
        if len(value) > self._room(key_bytes):
            return False
        self.items.append((skey, value))
        self.bytes += len(value)
        return True

    @property
    def full(self) -> bool:
        return len(self.items) >= GATHER_RECORDS or self.bytes >= GATHER_BYTES

    def drain(self) -> list[tuple[Any, ...]]:
        """The gathered puts, in order; none are left."""
        items, self.items, self.bytes = self.items, [], 0
        return items

    def _room(self, key_bytes: int) -> int:
        """The largest raw value a key of this many UTF-8 bytes can have (a valid record that
        fits in a shard); -1 for a key longer than the limit."""
        room = self._rooms.get(key_bytes)
        if room is None:
            if key_bytes > fmt.MAX_KEY_BYTES:
                room = -1
            else:
                room = min(raw_batch.MAX_PAYLOAD,
                           self._shard_size - self._record_overhead - raw_batch.record_size(key_bytes, 0))
            self._rooms[key_bytes] = room
        return room
