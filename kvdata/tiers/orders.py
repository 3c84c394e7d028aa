"""Announced orders shared between the processes that stage into one tier.

Why: a DataLoader's workers each read through an engine of their own, while the sampler
that announces the order runs in the main process. A worker that stages a shard on demand
has to make room, and with no order of its own it would evict in an arbitrary order --
throwing out the shards the next epoch reads first, which the main process's planner kept
for exactly that (measured: 1.05-1.3 datasets fetched per warm epoch at a 25% budget with
two workers, against the optimum of 0.75). So every engine publishes the orders its readers
announce in each tier it stages into, and evicts by everyone's (kvdata.tiers.policy).

A published order is a file `locks/claims-<uid>/order-<uid>-<pid>-<n>` that its publisher
holds a shared flock on (Tier.publish): a 64-byte header `kvorder1 <position> <count>
[<next_start>]` (the position rewritten in place as the reader moves; next_start where the
announcer gave its next pass's start), then `count` raw 32-byte sha256s.
A file nobody holds is a dead process's and goes. Only this uid's files are read (the
claims directory is its own, 0700), and each is still checked before use.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence

from .policy import Demand
from .tier import Tier

HEADER = 64
MAGIC = b"kvorder1"
MAX_SHARDS = 1 << 22  # a longer published order is not read (128 MiB of sha256s)


def _header(position: int, count: int, next_start: int | None = None) -> bytes:
    if next_start is None:
        return (b"%s %d %d\n" % (MAGIC, position, count)).ljust(HEADER)
    return (b"%s %d %d %d\n" % (MAGIC, position, count, next_start)).ljust(HEADER)


def parse_header(raw: bytes) -> tuple[int, int, int | None] | None:
    """(position, count, next_start or None), or None for a header this version did not write."""
    parts = raw.split()
    if len(parts) not in (3, 4) or parts[0] != MAGIC or not all(p.isdigit() for p in parts[1:]):
        return None
    position, count = int(parts[1]), int(parts[2])
    next_start = int(parts[3]) if len(parts) == 4 else None
    if count > MAX_SHARDS or position > count or (next_start is not None and next_start > count):
        return None
    return position, count, next_start


class SharedOrders:
    """This process's announced orders, published in the tiers, and the other processes'."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._serial = itertools.count()
        # reader -> (count, next_start, [(tier, name, fd)])
        self._mine: dict[str, tuple[int, int | None, list[tuple[Tier, str, int]]]] = {}
        self._seen: dict[tuple[str, str, int], tuple[str, ...]] = {}  # (tier dir, name, inode) -> order

    def _prefix(self) -> str:
        return f"order-{os.geteuid()}-"

    def _settle(self) -> None:
        """After a fork (call with the lock held): the child inherited its parent's descriptors
        but not its orders, so it closes its copies (the parent still holds its flocks) and
        forgets them."""
        if os.getpid() == self._pid:
            return
        for _count, _next, held in self._mine.values():
            for _t, _n, fd in held:
                os.close(fd)
        self._mine = {}
        self._pid = os.getpid()

    def publish(self, tiers: Sequence[Tier], reader: str, sequence: Sequence[str], position: int,
                next_start: int | None = None) -> None:
        """Publish (or replace) `reader`'s order in each of `tiers` (best effort: a tier that
        cannot take it is skipped; its evictions then go by this process's order only)."""
        if next_start is not None and not 0 <= next_start <= len(sequence):
            next_start = None
        body = _header(position, len(sequence), next_start) + b"".join(bytes.fromhex(s) for s in sequence)
        made = []
        for t in tiers:
            name = f"{self._prefix()}{os.getpid()}-{next(self._serial)}"
            try:
                made.append((t, name, t.publish(name, body)))
            except OSError:
                continue
        with self._lock:
            self._settle()
            _count, _next, old = self._mine.pop(reader, (0, None, []))
            self._mine[reader] = (len(sequence), next_start, made)
        for t, name, fd in old:
            t.withdraw(name, fd)

    def move(self, reader: str, position: int) -> None:
        with self._lock:
            self._settle()
            count, next_start, held = self._mine.get(reader, (0, None, []))
        head = _header(min(position, count), count, next_start)
        for _t, _name, fd in held:
            try:
                os.pwrite(fd, head, 0)
            except OSError:
                pass

    def withdraw(self, reader: str) -> None:
        with self._lock:
            self._settle()
            _count, _next, held = self._mine.pop(reader, (0, None, []))
        for t, name, fd in held:
            t.withdraw(name, fd)

    def close(self) -> None:
        with self._lock:
            self._settle()
            readers = list(self._mine)
        for r in readers:
            self.withdraw(r)

    def others(self, tier: Tier) -> list[Demand]:
        """The orders other processes (and a parent, seen from a forked child) published in
        this tier, at their current positions."""
        mine = f"{self._prefix()}{os.getpid()}-"
        out: list[Demand] = []
        live: set[tuple[str, str, int]] = set()
        for name, fd, st in tier.published(self._prefix()):
            if name.startswith(mine):
                continue
            try:
                got = parse_header(os.pread(fd, HEADER, 0))
                if got is None or st.st_size != HEADER + 32 * got[1]:
                    continue
                key = (str(tier.dir), name, st.st_ino)
                seq = self._seen.get(key)
                if seq is None:
                    raw = os.pread(fd, 32 * got[1], HEADER)
                    if len(raw) != 32 * got[1]:
                        continue
                    seq = tuple(raw[i:i + 32].hex() for i in range(0, len(raw), 32))
                    with self._lock:
                        self._seen[key] = seq
            except OSError:
                continue
            live.add(key)
            out.append(Demand(seq, got[0], got[2]))
        with self._lock:
            for key in [k for k in self._seen if k[0] == str(tier.dir) and k not in live]:
                del self._seen[key]
        return out
