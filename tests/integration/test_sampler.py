"""ShardShuffleSampler over a real kvdata dataset: per-rank lengths, determinism, the stager's
shard order, exact mid-epoch resume, and a DataLoader epoch that reads every sample once."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch.utils.data

import kvdata
from kvdata.order import blocked as om
from kvdata.reader.sampler import ShardShuffleSampler

PER_SHARD, FULL_SHARDS, EXTRA = 25, 40, 3
N = PER_SHARD * FULL_SHARDS + EXTRA          # 1003: odd, and not divisible by 3 either


def build(path: Path) -> Path:
    """40 sealed shards of 25 samples (+ a 3-sample shard); sample i holds x = [i]*600 and i."""
    with kvdata.open(path, "w", shard_size="64KB") as s:
        s.put_many((f"k{i:05d}", {"x": np.full(600, i, dtype=np.int32), "i": i}) for i in range(N))
        s.seal()
    return path


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> kvdata.Dataset:
    d = kvdata.Dataset(build(tmp_path_factory.mktemp("sampler") / "ds.kv"))
    counts = np.bincount(d.sample_shards)
    assert len(d) == N and counts[:FULL_SHARDS].tolist() == [PER_SHARD] * FULL_SHARDS, counts
    assert counts[FULL_SHARDS:].sum() == EXTRA
    return d


def epoch(sampler: ShardShuffleSampler, e: int) -> list[int]:
    sampler.set_epoch(e)
    return list(sampler)


def first_use(shards) -> list[int]:
    return list(dict.fromkeys(int(s) for s in shards))


def test_dataset_layout_and_defaults(ds) -> None:
    s = ShardShuffleSampler(ds)                   # no torch.distributed: one rank
    assert (s.rank, s.world_size, s.seed, s.window) == (0, 1, 0, 8)
    got = epoch(s, 0)
    assert len(s) == N and sorted(got) == list(range(N))
    assert all(type(i) is int for i in got[:10])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("drop_last", [False, True])
def test_len_equal_per_rank(ds, world, drop_last) -> None:
    shares = []
    for r in range(world):
        s = ShardShuffleSampler(ds, seed=1, window=4, rank=r, world_size=world, drop_last=drop_last)
        shares.append(epoch(s, 2))
        assert len(shares[-1]) == len(s) == om.samples_per_rank(N, world, drop_last)
    flat = list(itertools.chain(*shares))
    if drop_last:
        assert len(set(flat)) == len(flat) and N - len(flat) < world
    else:
        assert set(flat) == set(range(N)) and len(flat) - N < world


def test_bad_arguments(ds) -> None:
    with pytest.raises(ValueError, match="window"):
        ShardShuffleSampler(ds, window=0)
    with pytest.raises(ValueError, match="rank"):
        ShardShuffleSampler(ds, rank=2, world_size=2)


def test_set_epoch_and_seed(ds) -> None:
    a, b = ShardShuffleSampler(ds, seed=5), ShardShuffleSampler(ds, seed=5)
    e0, e1 = epoch(a, 0), epoch(a, 1)
    assert e0 != e1 and sorted(e0) == sorted(e1)
    assert epoch(b, 1) == e1 and epoch(b, 0) == e0           # same seed, any epoch order
    assert epoch(a, 0) == e0                                 # going back reproduces it
    assert epoch(ShardShuffleSampler(ds, seed=6), 0) != e0
    assert list(ShardShuffleSampler(ds, seed=5)) == e0       # epoch 0 without set_epoch
    assert epoch(ShardShuffleSampler(ds, seed=5, shuffle=False), 3) == list(range(N))


@pytest.mark.parametrize("window", [1, 4])
def test_shard_order_is_first_use_order(ds, window) -> None:
    shards = np.asarray(ds.sample_shards)
    for r in range(3):
        s = ShardShuffleSampler(ds, seed=2, window=window, rank=r, world_size=3)
        for e in (0, 1):
            planned = s.shard_order(e).tolist()             # planned before the epoch starts
            assert planned == first_use(shards[epoch(s, e)])
    # planning the next epoch mid-epoch (what the stager does) does not disturb this one
    s = ShardShuffleSampler(ds, seed=2, window=window)
    ref = epoch(ShardShuffleSampler(ds, seed=2, window=window), 0)
    s.set_epoch(0)
    it = iter(s)
    head = list(itertools.islice(it, 100))
    nxt = s.shard_order(1).tolist()
    assert head + list(it) == ref
    assert nxt == first_use(shards[epoch(ShardShuffleSampler(ds, seed=2, window=window), 1)])


def _resumed(ds, state: dict, **kw) -> list[int]:
    """A fresh sampler (as after a restart) loads `state`; the training loop calls set_epoch."""
    s = ShardShuffleSampler(ds, **kw)
    s.load_state_dict(json.loads(json.dumps(state)))        # checkpoints are plain JSON
    s.set_epoch(state["epoch"])
    return list(s)


@pytest.mark.parametrize("k", [0, 1, 17, 256, 501, 502])
def test_resume_mid_epoch(ds, k) -> None:
    kw = dict(seed=9, window=4, rank=1, world_size=2)
    ref = ShardShuffleSampler(ds, **kw)
    ref_e1, ref_e2 = epoch(ref, 1), epoch(ref, 2)
    assert len(ref_e1) == 502

    s = ShardShuffleSampler(ds, **kw)
    s.set_epoch(1)
    it = iter(s)
    head = list(itertools.islice(it, k))
    state = s.state_dict()
    assert state["epoch"] == 1 and state["position"] == k
    t = ShardShuffleSampler(ds, **kw)
    t.load_state_dict(state)
    assert t.state_dict()["position"] == k                   # before iterating: still k
    rest = list(t)
    assert head + rest == ref_e1
    assert rest == ref_e1[k:]
    assert list(t) == ref_e1                                 # iterating the epoch again: from the start
    assert epoch(t, 2) == ref_e2                             # and the next epoch is unaffected


def test_rank0_state_resumes_every_rank(ds) -> None:
    """Only rank 0 writes the checkpoint; positions are the same on every rank, so the
    other ranks load it and continue their own shares."""
    kw = dict(seed=9, window=4, world_size=3)
    r0 = ShardShuffleSampler(ds, rank=0, **kw)
    r0.set_epoch(2)
    list(itertools.islice(iter(r0), 40))
    state = r0.state_dict()
    for r in (1, 2):
        ref = epoch(ShardShuffleSampler(ds, rank=r, **kw), 2)
        assert _resumed(ds, state, rank=r, **kw) == ref[40:]


def test_resume_without_set_epoch_and_consumed(ds) -> None:
    kw = dict(seed=4, window=8)
    ref = epoch(ShardShuffleSampler(ds, **kw), 3)
    s = ShardShuffleSampler(ds, **kw)
    s.set_epoch(3)
    it = iter(s)
    list(itertools.islice(it, 130))        # e.g. a DataLoader prefetched past what training used
    state = s.state_dict(consumed=96)
    assert state["position"] == 96
    t = ShardShuffleSampler(ds, **kw)
    t.load_state_dict(state)               # no set_epoch: the state's epoch is used
    assert t.epoch == 3 and list(t) == ref[96:]


def test_resume_through_dataloader_batches(ds) -> None:
    kw = dict(seed=8, window=2, rank=0, world_size=2)
    ref = epoch(ShardShuffleSampler(ds, **kw), 1)
    s = ShardShuffleSampler(ds, **kw)
    s.set_epoch(1)
    dl = torch.utils.data.DataLoader(ds, sampler=s, batch_size=8, num_workers=0, collate_fn=kvdata.collate)
    seen = []
    for step, batch in enumerate(dl):
        seen += batch["i"].tolist()
        if step == 9:
            break
    state = s.state_dict(consumed=10 * 8)
    assert seen == ref[:80]
    t = ShardShuffleSampler(ds, **kw)
    t.load_state_dict(state)
    dl = torch.utils.data.DataLoader(ds, sampler=t, batch_size=8, num_workers=0, collate_fn=kvdata.collate)
    rest = [i for batch in dl for i in batch["i"].tolist()]
    assert seen + rest == ref


def test_state_dict_right_after_set_epoch(ds) -> None:
    kw = dict(seed=1, window=4)
    ref = epoch(ShardShuffleSampler(ds, **kw), 1)
    s = ShardShuffleSampler(ds, **kw)
    epoch(s, 0)                        # a whole epoch
    s.set_epoch(1)                     # the loop moves on; a checkpoint is written here
    state = s.state_dict()
    assert _resumed(ds, state, **kw) == ref
    assert state["position"] == 0


@pytest.mark.parametrize("change", [dict(seed=10), dict(world_size=3), dict(window=2),
                                    dict(drop_last=True), dict(shuffle=False)])
def test_load_state_dict_rejects_other_settings(ds, change) -> None:
    kw = dict(seed=9, window=4, rank=0, world_size=2, drop_last=False, shuffle=True)
    s = ShardShuffleSampler(ds, **kw)
    s.set_epoch(1)
    list(itertools.islice(iter(s), 5))
    state = s.state_dict()
    other = ShardShuffleSampler(ds, **{**kw, **change})
    with pytest.raises(ValueError, match=next(iter(change))):
        other.load_state_dict(state)


def test_load_state_dict_rejects_bad_state(ds, tmp_path) -> None:
    s = ShardShuffleSampler(ds, seed=1)
    good = s.state_dict()
    for bad, word in [({**good, "version": 99}, "version"), ({**good, "position": N + 1}, "position"),
                      ({**good, "position": -1}, "position")]:
        with pytest.raises(ValueError, match=word):
            ShardShuffleSampler(ds, seed=1).load_state_dict(bad)
    path = build(tmp_path / "grown.kv")
    with kvdata.open(path, "a") as w:
        w.put("one-more", {"x": np.zeros(600, dtype=np.int32), "i": -1})
    grown = kvdata.Dataset(path)
    with pytest.raises(ValueError, match="dataset_size"):
        ShardShuffleSampler(grown, seed=1).load_state_dict(good)


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
def test_dataloader_reads_every_index_once(ds, world, rank) -> None:
    s = ShardShuffleSampler(ds, seed=3, window=4, rank=rank, world_size=world)
    dl = torch.utils.data.DataLoader(ds, sampler=s, batch_size=8, num_workers=0, collate_fn=kvdata.collate)
    epochs = []
    for e in (0, 1):
        s.set_epoch(e)
        got = []
        for batch in dl:
            i = batch["i"]
            assert batch["x"].shape == (len(i), 600)
            assert (batch["x"] == i[:, None].to(batch["x"].dtype)).all()   # the sample read is sample i
            got += i.tolist()
        assert got == list(s)                                   # exactly the sampler's order
        epochs.append(got)
    assert epochs[0] != epochs[1]
    if world == 1:
        assert all(sorted(g) == list(range(N)) for g in epochs)
    else:
        other = ShardShuffleSampler(ds, seed=3, window=4, rank=0, world_size=world)
        for e, got in enumerate(epochs):
            mine, theirs = got, epoch(other, e)
            assert len(mine) == len(theirs) == (N + 1) // 2
            assert set(mine) | set(theirs) == set(range(N))
            assert set(mine) & set(theirs) == {theirs[0]}       # the one wrap-around pad
            assert mine[-1] == theirs[0]
