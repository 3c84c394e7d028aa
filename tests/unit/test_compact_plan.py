"""kvdata.store.compact_plan: which shards a compaction keeps and how it packs the rest (no I/O)."""

from __future__ import annotations

import numpy as np

from kvdata.format import SAMPLE_DTYPE, names
from kvdata.store.compact_plan import RECORD_OVERHEAD, plan


def _samples(rows: list[tuple[int, int]]) -> np.ndarray:
    out = np.zeros(len(rows), dtype=SAMPLE_DTYPE)
    if rows:
        out["shard"], out["slot"] = zip(*rows)
    out["label"] = np.arange(len(rows))
    return out


def _covered(p, n: int) -> None:
    """Pieces hold every sample once, in sample order."""
    pos = np.concatenate([piece.positions for piece in p.pieces]) if p.pieces else np.zeros(0, np.int64)
    assert pos.tolist() == list(range(n))


def test_full_live_in_order_shards_are_kept_and_a_shard_with_a_dead_record_is_rewritten() -> None:
    # three shards of 4 slots; sample 5's record was overwritten into the tail (slot 0)
    rows = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (3, 0), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)]
    p = plan(_samples(rows), np.array([4, 4, 4]), np.array([1000] * 3), np.full(12, 100), 1, 1000)
    assert p.needed and [piece.kept for piece in p.pieces] == [0, -1, 2]
    assert p.pieces[1].positions.tolist() == [4, 5, 6, 7] and p.rewritten.tolist() == [1]
    assert p.records_copied == 4 and p.records_dropped == 1 and p.tail_dead == 0
    _covered(p, 12)


def test_a_shard_whose_live_records_are_out_of_sample_order_is_rewritten() -> None:
    # shard 1 holds overwrites of samples 3 and 0 (their old slots in shard 0 are dead)
    rows = [(1, 1), (0, 1), (0, 2), (1, 0)]
    p = plan(_samples(rows), np.array([4, 2]), np.array([1000, 1000]), np.full(4, 100), 0, 1000)
    assert [piece.kept for piece in p.pieces] == [-1] and sorted(p.rewritten.tolist()) == [0, 1]
    assert p.records_dropped == 2
    _covered(p, 4)


def test_small_shards_are_merged_but_a_lone_small_shard_is_left_alone() -> None:
    size = 10_000
    # ten small shards of 3 records each, then a full one, then one small one
    rows = [(s, j) for s in range(10) for j in range(3)] + [(10, j) for j in range(20)] + [(11, 0)]
    recs = np.array([3] * 10 + [20, 1])
    nbytes = np.array([1500] * 10 + [9000, 600])
    lengths = np.full(len(rows), 400)
    p = plan(_samples(rows), recs, nbytes, lengths, 0, size)
    kinds = [piece.kept for piece in p.pieces]
    assert kinds[-2:] == [10, 11] and all(k == -1 for k in kinds[:-2])
    new = p.new_pieces
    assert len(new) == 2  # 30 records of 464 bytes: two shards, not three
    assert all(piece.bytes_estimate <= size for piece in new)
    assert abs(new[0].bytes_estimate - new[1].bytes_estimate) <= 464  # balanced, no sliver at the end
    assert p.records_dropped == 0 and p.rewritten.tolist() == list(range(10))
    _covered(p, len(rows))


def test_the_tail_is_sealed_into_the_last_run_and_only_dead_tail_records_make_work() -> None:
    rows = [(0, j) for j in range(5)] + [(1, 0), (1, 2)]  # tail slot 1 is dead (overwritten or deleted)
    clean = plan(_samples(rows[:5] + [(1, 0), (1, 1)]), np.array([5]), np.array([900]), np.full(7, 100), 2, 1000)
    assert not clean.needed  # sealing a clean tail is `kvdata seal`'s job
    p = plan(_samples(rows), np.array([5]), np.array([900]), np.full(7, 100), 3, 1000)
    assert p.needed and p.tail_dead == 1 and [piece.kept for piece in p.pieces] == [0, -1]
    assert p.pieces[1].positions.tolist() == [5, 6]


def test_a_record_larger_than_the_shard_size_gets_a_shard_of_its_own() -> None:
    rows = [(0, j) for j in range(4)]
    lengths = np.array([100, 5000, 100, 100])
    p = plan(_samples(rows), np.array([5]), np.array([6000]), lengths, 0, 1000)
    assert [piece.positions.tolist() for piece in p.pieces] == [[0], [1], [2, 3]]
    assert p.pieces[1].bytes_estimate == 5000 + RECORD_OVERHEAD


def test_everything_deleted_leaves_no_shard() -> None:
    p = plan(_samples([]), np.array([3, 3]), np.array([500, 500]), np.zeros(0), 2, 1000)
    assert p.needed and p.pieces == () and p.records_dropped == 8 and p.rewritten.tolist() == [0, 1]


def test_compaction_file_names_parse_back() -> None:
    assert names.parse_reader_pin_name(names.reader_pin_name(12)) == 12
    assert names.parse_compact_journal_name(names.compact_journal_name(7)) == 7
    assert names.incarnation_of(names.shard_name(3, 9)) == 9 and names.incarnation_of("000003.mdb") == 0
    assert names.incarnation_of(names.lmdb_lock_name(names.tail_name(4, 9))) == 9
    assert names.incarnation_of(names.zst_name(names.shard_name(1, 5))) == 5
    for bad in ("../000001.mdb", "readers-i1.lock", "manifest.json", "000001.mdb.tmp", 3):
        assert names.incarnation_of(bad) is None
    assert names.index_generation("samples-00000004.bin") == 4 and names.index_generation("x.bin") is None


def test_a_lone_small_shard_next_to_a_clean_tail_makes_no_work() -> None:
    rows = [(0, j) for j in range(20)] + [(1, j) for j in range(3)] + [(2, 0), (2, 1)]
    p = plan(_samples(rows), np.array([20, 3]), np.array([9000, 1500]), np.full(25, 400), 2, 10_000)
    assert not p.needed
    dirty = plan(_samples(rows), np.array([20, 3]), np.array([9000, 1500]), np.full(25, 400), 3, 10_000)
    assert dirty.needed and [piece.kept for piece in dirty.pieces] == [0, 1, -1]  # only the tail is copied
