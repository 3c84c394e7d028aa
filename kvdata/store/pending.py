"""The writes of a Writer since its last commit (Pending): discarded as one on failure, or
turned into the next generation's index rows by the commit (store.new_generation)."""

from __future__ import annotations

import dataclasses
import errno
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from .. import format as fmt
from ..format import ShardEntry
from .sealing import Hasher

SampleRow = tuple[int, int, int]  # (shard id, slot, label) of one sample


@dataclass
class Pending:
    """Everything written since the last commit, discarded as one on failure.

    The new samples' rows are kept column by column in arrays (a put_many of 1 KiB records adds
    a chunk of them in one call each, and the commit reads them as numpy without a pass in Python)."""

    sealed: list[tuple[ShardEntry, np.ndarray]] = field(default_factory=list)  # (entry, record rows)
    hashing: dict[int, Hasher] = field(default_factory=dict)  # shard id -> its sha256 in progress
    new_keys: dict[str, int] = field(default_factory=dict)  # key -> position in the new_* columns
    new_shard: array = field(default_factory=lambda: array("I"))
    new_slot: array = field(default_factory=lambda: array("I"))
    new_label: array = field(default_factory=lambda: array("q"))
    new_hash: array = field(default_factory=lambda: array("Q"))
    new_alive: bytearray = field(default_factory=bytearray)
    over: dict[int, SampleRow] = field(default_factory=dict)  # committed position -> new row
    deleted: set[int] = field(default_factory=set)  # committed positions
    dirty: bool = False
    seal_requested: bool = False

    def add(self, key: str, row: SampleRow, key_hash: int) -> None:
        """A new sample (its key not committed, not pending)."""
        self.new_keys[key] = len(self.new_slot)
        self.new_shard.append(row[0])
        self.new_slot.append(row[1])
        self.new_label.append(row[2])
        self.new_hash.append(key_hash)
        self.new_alive.append(1)

    def add_many(self, keys: list[str], shard: int, first_slot: int, labels: Iterable[int],
                 key_hashes: np.ndarray) -> None:
        """New samples in consecutive slots of one shard (their keys distinct, none committed or pending)."""
        n = len(keys)
        self.new_keys.update(zip(keys, range(len(self.new_slot), len(self.new_slot) + n)))
        self.new_shard.extend(repeat(shard, n))
        self.new_slot.extend(range(first_slot, first_slot + n))
        self.new_label.extend(labels)
        self.new_hash.frombytes(np.ascontiguousarray(key_hashes, dtype=np.uint64).tobytes())
        self.new_alive.extend(b"\x01" * n)

    def consistent(self) -> bool:
        """Whether every new-sample column has a row per sample (an interrupt between the appends
        of add, in a put that then raised KeyboardInterrupt, can leave one short)."""
        n = len(self.new_slot)
        return (len(self.new_shard) == len(self.new_label) == len(self.new_hash) == len(self.new_alive) == n
                and (not self.new_keys or max(self.new_keys.values()) < n))

    def set_row(self, i: int, row: SampleRow) -> None:
        self.new_shard[i], self.new_slot[i], self.new_label[i] = row

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """(sample rows, key hashes) of the new samples not deleted since, in the order added."""
        alive = np.frombuffer(self.new_alive, dtype=np.uint8).astype(bool)
        rows = np.zeros(int(alive.sum()), dtype=fmt.SAMPLE_DTYPE)
        rows["shard"] = np.frombuffer(self.new_shard, dtype=np.uint32)[alive]
        rows["slot"] = np.frombuffer(self.new_slot, dtype=np.uint32)[alive]
        rows["label"] = np.frombuffer(self.new_label, dtype=np.int64)[alive]
        return rows, np.frombuffer(self.new_hash, dtype=np.uint64)[alive]

    def hashed(self) -> None:
        """Put the sha256 of every shard sealed since the last commit into its entry (waiting for
        the hashing threads); a file that changed size since its seal fails the commit (OSError)."""
        done = []
        for entry, records in self.sealed:
            h = self.hashing.get(entry.id)
            if h is not None:
                size, sha = h.result()
                if size != entry.bytes:
                    raise OSError(errno.EIO, f"shard {entry.name} changed size while it was sealed "
                                             f"({entry.bytes} -> {size} bytes)")
                entry = dataclasses.replace(entry, sha256=sha)
            done.append((entry, records))
        self.sealed = done
        self.hashing.clear()

    def wait_hashing(self) -> None:
        """Let the sha256 threads of discarded seals finish before their files are touched."""
        for h in self.hashing.values():
            h.wait()
