"""What a compaction keeps, what it rewrites, and how it packs the rewritten records (numpy, no I/O).

The rule that decides everything: after a compaction, records lie in the shards in sample
order -- sample i's record comes before sample i+1's in (shard, slot) order. That is what
`kvdata reindex` replays (a key's position is where it first appears), so a compacted dataset
rebuilds to the very same order, with no tombstone or dead copy left to say otherwise.

- A sealed shard is **kept** (hard-linked under the new incarnation's name, not copied) when
  every slot is a live sample, its slots are consecutive samples in order, and it is not small.
- Every other record -- of shards with overwritten or deleted records or tombstones, of shards
  whose live records are out of sample order (overwrites that landed there), of small shards
  (under SMALL_FRACTION of shard_size), and every live record of the open tail -- is copied.
  Each maximal run of such samples is packed, in sample order, into new shards of at most
  shard_size (LMDB's per-record overhead counted as the writer counts it), balanced so the
  last one is not a sliver.
- A run whose sealed records are exactly one small shard, whole and in order, gains nothing
  from a copy: that shard is kept (a clean tail next to it does not make it worth copying).
- The tail ends empty: the new generation's records are all sealed.

A compaction is needed when some sealed shard would be rewritten or dropped, or the tail holds
dead records; a dataset whose only change would be sealing its clean tail is left alone
(`kvdata seal` does that).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .open_tail import RECORD_OVERHEAD  # LMDB's bytes per record beyond the value, as the writer counts them

SMALL_FRACTION = 0.5    # a sealed shard under this fraction of shard_size is merged with its neighbours
BALANCE_SLACK = 1.02    # balanced pieces may be this much fuller than total/k before k grows


@dataclass(frozen=True)
class Piece:
    """One shard of the new generation: an old shard kept as is (`kept` >= 0), or a new one
    holding the records of `positions` (sample positions, in slot order)."""

    kept: int
    positions: np.ndarray
    bytes_estimate: int = 0   # a new shard: its values plus LMDB's per-record overhead


@dataclass(frozen=True)
class CompactionPlan:
    pieces: tuple[Piece, ...]
    rewritten: np.ndarray      # old sealed shard ids not kept: their records are copied or dropped
    records_copied: int
    records_dropped: int       # slots not carried over: overwritten, deleted, tombstones (tail included)
    tail_dead: int

    @property
    def needed(self) -> bool:
        return bool(len(self.rewritten)) or self.tail_dead > 0

    @property
    def new_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if p.kept < 0]


def plan(samples: np.ndarray, shard_records: np.ndarray, shard_bytes: np.ndarray, lengths: np.ndarray,
         tail_records: int, shard_size: int) -> CompactionPlan:
    """The compaction of one generation (see the module docstring).

    samples: the SAMPLE_DTYPE rows; shard_records / shard_bytes: per sealed shard; lengths: the
    whole record's bytes (prefix to payload end) of every sample's record, in sample order."""
    n = len(samples)
    n_sealed = len(shard_records)
    shard = samples["shard"].astype(np.int64)
    slot = samples["slot"].astype(np.int64)
    keepable = _whole_in_order(shard, slot, np.asarray(shard_records, np.int64))
    small = np.asarray(shard_bytes, np.int64) < int(shard_size * SMALL_FRACTION)
    keep = np.append(keepable & ~small, False)  # index n_sealed: the tail, never kept
    kept_pos = keep[shard]
    # a run of copied samples whose sealed records are one small shard, whole and in order (the
    # tail's records, if any, before or after it): that shard is kept instead
    for a, b in _runs(~kept_pos):
        sealed_at = np.flatnonzero(shard[a:b] < n_sealed)
        if not len(sealed_at):
            continue
        c, d = a + int(sealed_at[0]), a + int(sealed_at[-1]) + 1
        s = int(shard[c])
        if keepable[s] and d - c == len(sealed_at) == int(shard_records[s]) and bool((shard[c:d] == s).all()):
            keep[s] = True
            kept_pos[c:d] = True
    pieces: list[Piece] = []
    need = np.asarray(lengths, np.int64) + RECORD_OVERHEAD
    copied = 0
    for a, b, is_kept in _segments(kept_pos, shard):
        if is_kept:
            pieces.append(Piece(int(shard[a]), np.arange(a, b, dtype=np.int64)))
            continue
        copied += b - a
        for lo, hi in _pack(need[a:b], shard_size):
            pieces.append(Piece(-1, np.arange(a + lo, a + hi, dtype=np.int64), int(need[a + lo:a + hi].sum())))
    rewritten = np.flatnonzero(~keep[:n_sealed])
    live_tail = int((shard == n_sealed).sum()) if n else 0
    dropped = int(np.asarray(shard_records, np.int64)[rewritten].sum()) + tail_records - copied
    return CompactionPlan(tuple(pieces), rewritten, copied, dropped, tail_records - live_tail)


def _whole_in_order(shard: np.ndarray, slot: np.ndarray, shard_records: np.ndarray) -> np.ndarray:
    """Per sealed shard: all of its slots are live samples, consecutive and in slot order."""
    n_sealed = len(shard_records)
    out = np.zeros(n_sealed, dtype=bool)
    n = len(shard)
    if not n:
        return out
    change = np.ones(n, dtype=bool)
    change[1:] = shard[1:] != shard[:-1]
    starts = np.flatnonzero(change)
    run_id = np.cumsum(change) - 1
    in_order = slot == np.arange(n) - starts[run_id]
    run_ok = np.logical_and.reduceat(in_order, starts)
    run_shard = shard[starts]
    run_len = np.diff(np.append(starts, n))
    sealed = run_shard < n_sealed
    runs_per_shard = np.bincount(run_shard[sealed], minlength=n_sealed)
    r = np.flatnonzero(sealed & run_ok)
    cand = run_shard[r]
    good = (runs_per_shard[cand] == 1) & (run_len[r] == shard_records[cand])
    out[cand[good]] = True
    return out


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[a, b) of each maximal run of True."""
    if not len(mask):
        return []
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def _segments(kept_pos: np.ndarray, shard: np.ndarray) -> list[tuple[int, int, bool]]:
    """Sample order cut into kept shards (one segment each) and runs of copied samples."""
    n = len(kept_pos)
    if not n:
        return []
    cut = np.ones(n, dtype=bool)
    cut[1:] = (kept_pos[1:] != kept_pos[:-1]) | (kept_pos[1:] & (shard[1:] != shard[:-1]))
    starts = np.flatnonzero(cut).tolist()
    ends = starts[1:] + [n]
    return [(a, b, bool(kept_pos[a])) for a, b in zip(starts, ends)]


def _greedy(cum: np.ndarray, limit: float) -> list[int]:
    """Ends of pieces filled greedily up to `limit` bytes each (a record larger alone is a piece)."""
    ends = []
    start, base, m = 0, 0, len(cum)
    while start < m:
        end = int(np.searchsorted(cum, base + limit, "right"))
        end = max(end, start + 1)
        ends.append(end)
        start, base = end, int(cum[end - 1])
    return ends


def _pack(need: np.ndarray, shard_size: int) -> list[tuple[int, int]]:
    """[lo, hi) of each new shard for records of these sizes, in order: as few as greedy
    filling to shard_size needs, as even as that count allows."""
    cum = np.cumsum(need)
    ends = _greedy(cum, shard_size)
    k = len(ends)
    if k > 1:
        even = _greedy(cum, min(shard_size, float(cum[-1]) / k * BALANCE_SLACK))
        if len(even) == k:
            ends = even
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))
