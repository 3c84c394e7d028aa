"""kvdata.order.blocked: the seeded, shard-blocked epoch order and the split across ranks (numpy only)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdata.order import blocked as om

# ---------------------------------------------------------------- helpers

def layout(counts: list[int], ids: list[int] | None = None, scramble: int | None = None) -> np.ndarray:
    """sample_shards for shards holding `counts` samples (shard ids `ids`, default 0..k-1),
    in shard order, or scrambled (samples not grouped by shard) with seed `scramble`."""
    ids = list(range(len(counts))) if ids is None else ids
    s = np.repeat(np.asarray(ids, dtype=np.uint32), counts)
    if scramble is not None:
        s = np.random.default_rng(scramble).permutation(s)
    return s


def windows_of(groups: om.ShardGroups, seed: int, epoch: int, window: int) -> list[tuple[int, int, set[int]]]:
    """(start, stop, shard ids) of each window of `window` shards, in shard-permutation order."""
    perm = om.shard_permutation(groups, seed, epoch)
    out, pos = [], 0
    for k in range(0, len(perm), window):
        block = perm[k:k + window]
        n = int(groups.counts[block].sum())
        out.append((pos, pos + n, {int(x) for x in groups.shard_ids[block]}))
        pos += n
    return out


def first_use_reference(shards) -> list[int]:
    seen: dict[int, None] = {}
    for s in shards:
        seen.setdefault(int(s), None)
    return list(seen)


shard_counts = st.lists(st.integers(1, 12), min_size=0, max_size=25)


# ---------------------------------------------------------------- group_by_shard

def test_group_by_shard_sorted_and_scrambled() -> None:
    ss = layout([3, 1, 2], ids=[2, 5, 9])
    g = om.group_by_shard(ss)
    assert g.shard_ids.tolist() == [2, 5, 9] and g.counts.tolist() == [3, 1, 2]
    assert g.starts.tolist() == [0, 3, 4] and g.by_shard.tolist() == list(range(6))
    assert g.num_samples == 6

    scrambled = np.array([9, 2, 5, 2, 9, 2], dtype=np.uint32)
    g = om.group_by_shard(scrambled)
    assert g.shard_ids.tolist() == [2, 5, 9] and g.counts.tolist() == [3, 1, 2]
    assert g.by_shard.tolist() == [1, 3, 5, 2, 0, 4]  # stable within a shard

    g = om.group_by_shard(np.zeros(0, dtype=np.uint32))
    assert g.num_samples == 0 and len(g.shard_ids) == 0
    assert len(om.epoch_order(g, 0, 0)) == 0


# ---------------------------------------------------------------- epoch_order

@settings(max_examples=80, deadline=None)
@given(counts=shard_counts, scramble=st.none() | st.integers(0, 2**16), seed=st.integers(0, 2**40),
       epoch=st.integers(0, 1000), window=st.integers(1, 9))
def test_epoch_order_is_a_shard_blocked_permutation(counts, scramble, seed, epoch, window) -> None:
    ss = layout(counts, scramble=scramble)
    g = om.group_by_shard(ss)
    order = om.epoch_order(g, seed, epoch, window)
    n = len(ss)
    # a permutation of 0..n-1
    assert order.dtype == om.index_dtype(n)
    assert np.array_equal(np.sort(order), np.arange(n))
    # deterministic in (seed, epoch)
    assert np.array_equal(order, om.epoch_order(om.group_by_shard(ss.copy()), seed, epoch, window))
    # every window of `window` shards (in shard-permutation order) is one contiguous range
    # of the order holding exactly that window's samples
    wins = windows_of(g, seed, epoch, window)
    assert (wins[-1][1] if wins else 0) == n
    for a, b, shards in wins:
        got = order[a:b]
        assert {int(x) for x in ss[got]} == shards
        assert np.array_equal(np.sort(got), np.sort(np.nonzero(np.isin(ss, list(shards)))[0]))


def test_window_1_keeps_shards_contiguous_in_permuted_order() -> None:
    ss = layout([10] * 12)
    g = om.group_by_shard(ss)
    order = om.epoch_order(g, 5, 2, window=1)
    runs = ss[order].reshape(12, 10)
    assert (runs == runs[:, :1]).all()                      # each shard one run
    assert runs[:, 0].tolist() == om.shard_permutation(g, 5, 2).tolist()
    assert not np.array_equal(order, np.arange(120))          # but shuffled within


def test_windows_mix_their_shards() -> None:
    ss = layout([100] * 8)
    order = om.epoch_order(om.group_by_shard(ss), 0, 0, window=8)
    # every block of 50 consecutive samples draws from several shards
    per_block = [len(np.unique(ss[order[i:i + 50]])) for i in range(0, 800, 50)]
    assert min(per_block) >= 4, per_block


def test_epochs_and_seeds_differ() -> None:
    g = om.group_by_shard(layout([10] * 20))
    base = om.epoch_order(g, 0, 0)
    assert not np.array_equal(base, om.epoch_order(g, 0, 1))
    assert not np.array_equal(base, om.epoch_order(g, 1, 0))
    assert not np.array_equal(om.shard_permutation(g, 0, 0), om.shard_permutation(g, 0, 1))
    assert not np.array_equal(om.epoch_order(g, 0, 0, window=4), om.epoch_order(g, 0, 0, window=8))
    # pure function: recomputing any (seed, epoch) in any order gives the same result
    assert np.array_equal(om.epoch_order(g, 0, 1), om.epoch_order(g, 0, 1))
    assert np.array_equal(base, om.epoch_order(g, 0, 0))


def test_unsorted_sample_shards_non_contiguous_ids() -> None:
    ss = layout([7, 3, 11, 5, 9], ids=[40, 3, 17, 8, 1000], scramble=1)
    assert not np.all(ss[1:] >= ss[:-1])
    g = om.group_by_shard(ss)
    for window in (1, 2, 4):
        order = om.epoch_order(g, 11, 3, window)
        assert np.array_equal(np.sort(order), np.arange(len(ss)))
        for a, b, shards in windows_of(g, 11, 3, window):
            assert {int(x) for x in ss[order[a:b]]} == shards
            assert b - a == int(np.isin(ss, list(shards)).sum())


def test_no_shuffle_is_stored_order_and_bad_window() -> None:
    g = om.group_by_shard(layout([4, 4, 4], scramble=0))
    assert om.epoch_order(g, 3, 9, shuffle=False).tolist() == list(range(12))
    with pytest.raises(ValueError, match="window"):
        om.epoch_order(g, 0, 0, window=0)


# ---------------------------------------------------------------- rank_share

@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 120), world=st.integers(1, 12), drop_last=st.booleans(), seed=st.integers(0, 99))
def test_rank_share_equal_disjoint_covering(n, world, drop_last, seed) -> None:
    order = np.random.default_rng(seed).permutation(n).astype(np.int32)
    shares = [om.rank_share(order, r, world, drop_last) for r in range(world)]
    per = om.samples_per_rank(n, world, drop_last)
    assert all(len(s) == per for s in shares)
    cat = np.concatenate(shares) if shares else np.zeros(0, dtype=np.int32)
    if drop_last:
        assert per == n // world
        assert np.array_equal(cat, order[:per * world])      # contiguous slices, disjoint
        assert 0 <= n - len(cat) < world                       # drops fewer than `world` samples
    else:
        pad = per * world - n
        assert 0 <= pad < world
        assert np.array_equal(cat[:n], order)                  # every sample, in order
        if n:
            # padding is the wrap-around (DistributedSampler-style): order[0], order[1], ...
            assert np.array_equal(cat[n:], np.resize(order, pad))
            assert set(cat.tolist()) == set(range(n))
        else:
            assert per == 0


def test_rank_share_world_larger_than_n() -> None:
    order = np.array([7, 3, 5])
    shares = [om.rank_share(order, r, 5, False).tolist() for r in range(5)]
    assert shares == [[7], [3], [5], [7], [3]]
    assert [om.rank_share(order, r, 5, True).tolist() for r in range(5)] == [[]] * 5
    shares = [om.rank_share(np.array([4]), r, 3, False).tolist() for r in range(3)]
    assert shares == [[4], [4], [4]]


def test_rank_share_bad_rank() -> None:
    with pytest.raises(ValueError, match="rank"):
        om.rank_share(np.arange(4), 2, 2, False)
    with pytest.raises(ValueError, match="rank"):
        om.rank_share(np.arange(4), -1, 2, False)


@pytest.mark.parametrize("seed,epoch", [(0, 0), (0, 1), (7, 3), (123, 99)])
def test_each_rank_touches_few_shards(seed, epoch) -> None:
    shards, per_shard, window, world = 64, 100, 4, 4
    ss = layout([per_shard] * shards)
    order = om.epoch_order(om.group_by_shard(ss), seed, epoch, window)
    touched = [set(ss[om.rank_share(order, r, world, False)].tolist()) for r in range(world)]
    for t in touched:
        assert len(t) <= shards // world + 2 * window, [len(x) for x in touched]
    assert set().union(*touched) == set(range(shards))


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(1, 30), min_size=1, max_size=40), window=st.integers(1, 6),
       world=st.integers(1, 6), seed=st.integers(0, 999))
def test_rank_touches_only_windows_overlapping_its_slice(counts, window, world, seed) -> None:
    """A rank's shards are those of the windows its contiguous slice overlaps, and no others."""
    ss = layout(counts)
    g = om.group_by_shard(ss)
    order = om.epoch_order(g, seed, 0, window)
    n, per = len(order), om.samples_per_rank(len(order), world, True)
    wins = windows_of(g, seed, 0, window)
    for r in range(world):
        lo, hi = r * per, (r + 1) * per
        allowed = set().union(*[s for a, b, s in wins if a < hi and b > lo]) if per else set()
        assert set(ss[om.rank_share(order, r, world, True)].tolist()) <= allowed
    assert n == sum(counts)


# ---------------------------------------------------------------- first_use_order

def test_first_use_order_examples() -> None:
    assert om.first_use_order(np.array([3, 3, 1, 2, 1, 3, 0])).tolist() == [3, 1, 2, 0]
    assert om.first_use_order(np.zeros(0, dtype=np.uint32)).tolist() == []
    assert om.first_use_order(np.array([5], dtype=np.uint32)).tolist() == [5]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=200))
def test_first_use_order_matches_reference(xs) -> None:
    assert om.first_use_order(np.array(xs, dtype=np.int64)).tolist() == first_use_reference(xs)


def test_first_use_order_of_a_window1_epoch_is_the_shard_permutation() -> None:
    ss = layout([5] * 30, ids=list(range(100, 130)))
    g = om.group_by_shard(ss)
    order = om.epoch_order(g, 1, 4, window=1)
    assert om.first_use_order(ss[order]).tolist() == g.shard_ids[om.shard_permutation(g, 1, 4)].tolist()


# ---------------------------------------------------------------- planning speed

def test_plans_10m_samples(capsys: pytest.CaptureFixture[str]) -> None:
    n, per_shard = 10_000_000, 10_000
    ss = np.repeat(np.arange(n // per_shard, dtype=np.uint32), per_shard)
    t0 = time.perf_counter()
    g = om.group_by_shard(ss)
    t1 = time.perf_counter()
    order = om.epoch_order(g, 0, 1, window=8)
    t2 = time.perf_counter()
    share = om.rank_share(order, 3, 8, False)
    t3 = time.perf_counter()
    assert order.dtype == np.int32 and len(order) == n and len(share) == n // 8
    assert (np.bincount(order, minlength=n) == 1).all()
    with capsys.disabled():
        print(f"\n[plan 10M samples / 1000 shards] group {t1 - t0:.2f}s, epoch_order {t2 - t1:.2f}s, "
              f"rank_share {t3 - t2:.3f}s")


def test_a_sampler_over_a_dataset_nobody_stages_does_no_order_bookkeeping() -> None:
    pytest.importorskip("torch", reason="needs torch (pip install 'kvdata[torch]')")
    from kvdata.reader.sampler import ShardShuffleSampler

    class Listening:
        wants_orders = True

        def __init__(self) -> None:
            self.sample_shards = np.repeat(np.arange(10, dtype=np.uint32), 20)
            self.announced: list = []

        def announce(self, reader: str, seq: list, position: int = 0) -> None:
            self.announced.append(seq)

        def progress(self, reader: str, position: int) -> None:
            pass

    class InPlace(Listening):
        wants_orders = False

    loud, quiet = Listening(), InPlace()
    a, b = list(ShardShuffleSampler(loud, seed=1)), list(ShardShuffleSampler(quiet, seed=1))
    assert a == b and sorted(a) == list(range(200))
    assert len(loud.announced) == 1 and len(loud.announced[0]) == 20  # this epoch's shards, then the next's
    assert quiet.announced == []


def test_the_order_and_the_next_are_announced_before_the_first_index() -> None:
    """The stager must know this epoch's shard sequence and the next epoch's before the first
    reads: its keep set (the shards the next pass reads first) decides which shards are staged
    whole, and a worker reading before the announcement would stage whole a shard read once
    (test_record_reads.py::test_dataloader_workers_stage_only_the_keep_set_of_the_samplers_order)."""
    pytest.importorskip("torch", reason="needs torch (pip install 'kvdata[torch]')")
    from kvdata.reader.sampler import ShardShuffleSampler

    class Listening:
        wants_orders = True

        def __init__(self, n: int) -> None:
            self.sample_shards = np.repeat(np.arange(10, dtype=np.uint32), n // 10)
            self.announced: list[tuple[int, list, int]] = []
            self.drawn = 0

        def announce(self, reader: str, seq: list, position: int = 0) -> None:
            self.announced.append((self.drawn, seq, position))

        def progress(self, reader: str, position: int) -> None:
            pass

    ds = Listening(2000)
    sampler = ShardShuffleSampler(ds, seed=3)
    out = []
    for i in sampler:
        out.append(i)
        ds.drawn += 1
    assert sorted(out) == list(range(2000))
    assert len(ds.announced) == 1
    drawn, seq, position = ds.announced[0]
    assert drawn == 0 and position == 0 and len(seq) == 20
    shards = ds.sample_shards[np.array(out)]
    _, first = np.unique(shards, return_index=True)
    assert seq[:10] == shards[np.sort(first)].tolist()  # this epoch's shards in first-use order
    from kvdata.order import blocked as om

    groups = om.group_by_shard(ds.sample_shards)  # then the next epoch's, planned from its shard permutation
    assert seq[10:] == om.planned_shard_sequence(groups, 3, 1, sampler.window, 0, 1, False).tolist()
    assert sorted(seq[10:]) == sorted(set(ds.sample_shards[sampler.indices(1)].tolist()))


def test_the_sampler_says_where_the_next_epoch_starts_in_what_it_announces() -> None:
    """With many ranks a rank's next epoch may share no shard with this one, and the stager
    cannot find the boundary itself (policy.next_pass_start): the sampler passes it to an
    announce() that takes `next_start`; a wrapper with the older signature still gets the order."""
    pytest.importorskip("torch", reason="needs torch (pip install 'kvdata[torch]')")
    from kvdata.reader.sampler import ShardShuffleSampler

    class Listening:
        wants_orders = True

        def __init__(self) -> None:
            self.sample_shards = np.repeat(np.arange(64, dtype=np.uint32), 4)
            self.announced: list[tuple[list, int | None]] = []

        def announce(self, reader: str, seq: list, position: int = 0, next_start: int | None = None) -> None:
            self.announced.append((seq, next_start))

        def progress(self, reader: str, position: int) -> None:
            pass

    class KeywordsOnly(Listening):
        def announce(self, reader: str, seq: list, position: int = 0, **kw) -> None:  # type: ignore[override]
            self.announced.append((seq, kw.get("next_start")))

    for ds in (Listening(), KeywordsOnly()):
        for rank in range(8):  # 8 ranks of 8 shards each: some ranks' next 8 share none of this epoch's
            mine = list(ShardShuffleSampler(ds, seed=5, world_size=8, rank=rank))
            seq, next_start = ds.announced[-1]
            this = sorted(set(ds.sample_shards[mine].tolist()))
            assert next_start == len(this) and sorted(seq[:next_start]) == this
            assert len(seq) - next_start == len(set(seq[next_start:]))


@pytest.mark.parametrize("seed", range(6))
def test_planned_shard_sequence_covers_the_ranks_shards_in_window_order(seed: int) -> None:
    """order.planned_shard_sequence (the next epoch's plan announced with this epoch's order)
    lists every shard the rank will read, windows in reading order, and at most the shards of
    the two windows cut at the slice's ends besides."""
    from kvdata.order import blocked as om

    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 40, rng.integers(1, 60))
    shards = np.repeat(np.arange(len(counts)), counts).astype(np.uint32)
    groups = om.group_by_shard(shards)
    for world, window, drop_last in ((1, 8, False), (3, 2, False), (4, 3, True), (7, 1, False)):
        order = om.epoch_order(groups, seed, 5, window)
        for rank in range(world):
            mine = om.rank_share(order, rank, world, drop_last)
            exact = om.first_use_order(shards[mine])
            planned = om.planned_shard_sequence(groups, seed, 5, window, rank, world, drop_last)
            assert len(set(planned.tolist())) == len(planned)
            assert set(exact.tolist()) <= set(planned.tolist())
            assert len(planned) - len(exact) <= 2 * window
            # windows come in reading order: a shard's window never goes back in the exact order
            perm = groups.shard_ids[om.shard_permutation(groups, seed, 5)]
            window_of = {int(s): i // window for i, s in enumerate(perm)}
            if not drop_last and world * -(-len(shards) // world) > len(shards):
                continue  # the wrap-around padding starts the order again
            w = [window_of[int(s)] for s in exact]
            assert w == sorted(w)
