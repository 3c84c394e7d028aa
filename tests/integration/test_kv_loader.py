"""kvdata.Loader: the ring of reused buffers, samplers, resume, errors and shutdown."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

import kvdata
from kvdata.errors import KVDataError

N = 300
SHAPE = (24, 16, 3)


def image(i: int) -> np.ndarray:
    return (np.arange(np.prod(SHAPE), dtype=np.uint32).reshape(SHAPE) + i).astype(np.uint8)


def tokens(i: int) -> np.ndarray:
    return np.arange(i % 5, dtype=np.int32) + i


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("kvloader") / "ds.kv"
    with kvdata.open(p, "w", shard_size="64KB") as s:
        s.put_many((f"k{i:04d}", {"image": image(i), "label": i, "tok": tokens(i), "name": f"n{i}"})
                   for i in range(N))
    return p


def labels_checked(b: dict) -> list[int]:
    labels = [int(x) for x in b["label"]]
    for row, i in zip(b["image"], labels):
        np.testing.assert_array_equal(np.asarray(row), image(i))
    assert b["name"] == [f"n{i}" for i in labels]
    return labels


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvdata-loader")]


@pytest.mark.parametrize("threads", [1, 2])
def test_every_sample_once_in_sampler_order(path: Path, threads: int) -> None:
    ds = kvdata.Dataset(path)
    sampler = kvdata.ShardShuffleSampler(ds, seed=3, window=2)
    loader = kvdata.Loader(ds, 32, sampler=sampler, threads=threads)
    assert len(loader) == -(-N // 32)
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen: list[int] = []
        for b in loader:
            assert isinstance(b["image"], torch.Tensor) and b["image"].dtype == torch.uint8
            seen += labels_checked(b)
        assert seen == sampler.indices(epoch).tolist()
    assert not loader_threads()


def test_the_ring_never_hands_out_a_buffer_still_in_use(path: Path) -> None:
    prefetch = 2
    loader = kvdata.Loader(path, 16, prefetch=prefetch, threads=2, sampler=RandomSampler(range(N)))
    held: list[tuple[dict, list[int]]] = []
    for b in loader:
        held.append((b, [int(x) for x in b["label"]]))
        # the batches the loop got in the last `prefetch` asks are still intact
        for old, want in held[-prefetch:]:
            assert [int(x) for x in old["label"]] == want
            labels_checked(old)
    allocated = loader.allocations
    for _ in range(2):  # later epochs reuse the ring: no new buffers
        for b in loader:
            labels_checked(b)
    assert loader.allocations == allocated
    # copy=True: every batch stays valid forever
    kept = [(b, [int(x) for x in b["label"]]) for b in kvdata.Loader(path, 16, prefetch=1, copy=True)]
    for b, want in kept:
        assert [int(x) for x in b["label"]] == want
        labels_checked(b)
    assert sorted(x for _, w in kept for x in w) == list(range(N))


def test_the_last_batches_of_an_epoch_stay_valid_into_the_next(path: Path) -> None:
    loader = kvdata.Loader(path, 32, prefetch=3)
    last = list(loader)[-3:]
    want = [[int(x) for x in b["label"]] for b in last]
    it = iter(loader)
    next(it)  # one ask in the next epoch: the two newest batches of the last one are still valid
    for b, w in zip(last[1:], want[1:]):
        assert [int(x) for x in b["label"]] == w
        labels_checked(b)
    it.close()


def test_resume_mid_epoch_continues_identically(path: Path) -> None:
    ds = kvdata.Dataset(path)
    full = kvdata.Loader(ds, 20, sampler=kvdata.ShardShuffleSampler(ds, seed=9))
    full.set_epoch(1)
    reference = [[int(x) for x in b["label"]] for b in full]

    first = kvdata.Loader(ds, 20, sampler=kvdata.ShardShuffleSampler(ds, seed=9))
    first.set_epoch(1)
    got = []
    for k, b in enumerate(first):
        got.append([int(x) for x in b["label"]])
        if k == 4:
            state = first.state_dict()
            break
    assert not loader_threads()
    again = kvdata.Loader(ds, 20, sampler=kvdata.ShardShuffleSampler(ds, seed=9))
    again.load_state_dict(state)
    got += [[int(x) for x in b["label"]] for b in again]
    assert got == reference

    # a sampler without a state of its own: the loader skips the batches already read
    order = list(np.random.default_rng(1).permutation(N))
    plain = kvdata.Loader(ds, 25, sampler=order)
    it = iter(plain)
    head = [[int(x) for x in next(it)["label"]] for _ in range(3)]
    state = plain.state_dict()
    it.close()
    again = kvdata.Loader(ds, 25, sampler=order)
    again.load_state_dict(state)
    tail = [[int(x) for x in b["label"]] for b in again]
    assert sum(head + tail, []) == [int(i) for i in order]


def test_distributed_ranks_split_the_samples(path: Path) -> None:
    ds = kvdata.Dataset(path)
    seen: list[int] = []
    for rank in range(2):
        for sampler in (DistributedSampler(range(N), num_replicas=2, rank=rank, shuffle=True, seed=1),):
            for b in kvdata.Loader(ds, 32, sampler=sampler):
                seen += labels_checked(b)
    assert sorted(seen) == list(range(N))
    aware: list[int] = []
    for rank in range(3):
        s = kvdata.ShardShuffleSampler(ds, seed=2, rank=rank, world_size=3)
        for b in kvdata.Loader(ds, 32, sampler=s):
            aware += labels_checked(b)
    assert sorted(aware) == list(range(N))


def test_fields_numpy_ragged_drop_last_and_transform(path: Path) -> None:
    b = next(iter(kvdata.Loader(path, 10, fields=["tok", "label"], to="numpy")))
    assert set(b) == {"tok", "label"} and isinstance(b["label"], np.ndarray)
    tok = b["tok"]
    assert isinstance(tok, kvdata.Ragged)
    for k, i in enumerate(b["label"].tolist()):
        np.testing.assert_array_equal(tok.values[tok.offsets[k]:tok.offsets[k + 1]], tokens(i))
    assert len(list(kvdata.Loader(path, 64, drop_last=True))) == N // 64
    assert sum(len(b["label"]) for b in kvdata.Loader(path, 64)) == N

    def to_float_nchw(batch: dict) -> dict:
        return {"x": batch["image"].permute(0, 3, 1, 2).float() / 255, "y": batch["label"]}

    b = next(iter(kvdata.Loader(path, 8, transform=to_float_nchw)))
    assert b["x"].shape == (8, 3, *SHAPE[:2]) and b["x"].dtype == torch.float32
    np.testing.assert_allclose(b["x"][3].permute(1, 2, 0).numpy(), image(int(b["y"][3])) / 255, rtol=1e-6)


def test_byte_records(tmp_path: Path) -> None:
    p = tmp_path / "raw.kv"
    with kvdata.open(p, "w") as s:
        s.put_many((f"r{i}", bytes([i % 256]) * (i + 1)) for i in range(50))
    got = [x for b in kvdata.Loader(p, 8) for x in b]
    assert got == [bytes([i % 256]) * (i + 1) for i in range(50)]


def test_errors_reach_the_loop_and_stop_the_threads(path: Path) -> None:
    def boom(batch: dict) -> dict:
        raise RuntimeError("transform failed")

    with pytest.raises(RuntimeError, match="transform failed"):
        for _ in kvdata.Loader(path, 16, transform=boom, threads=2):
            pass
    assert not loader_threads()
    with pytest.raises(IndexError):
        list(kvdata.Loader(path, 16, sampler=[0, 1, N + 5]))
    assert not loader_threads()


def test_break_and_close_leave_no_threads(path: Path) -> None:
    loader = kvdata.Loader(path, 8, threads=2, prefetch=3)
    for k, _b in enumerate(loader):
        if k == 2:
            break
    assert not loader_threads()
    it = iter(loader)
    next(it)
    assert loader_threads()
    loader.close()
    assert not loader_threads()


def test_device_and_pinning_without_cuda(path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CUDA path is measured in bench/loader.py")
    with pytest.raises(KVDataError, match="cuda is not available"):
        kvdata.Loader(path, 8, device="cuda")
    with pytest.warns(UserWarning, match="no accelerator"):
        loader = kvdata.Loader(path, 8, pin_memory=True)
    assert labels_checked(next(iter(loader)))
    loader.close()
    b = next(iter(kvdata.Loader(path, 8, device="cpu", transform=lambda x: {"n": x["image"].sum()})))
    assert int(b["n"]) == int(sum(image(i).astype(np.int64).sum() for i in range(8)))


def test_bad_arguments(path: Path) -> None:
    for kwargs in ({"batch_size": 0}, {"batch_size": 4, "threads": 0}, {"batch_size": 4, "prefetch": 0},
                   {"batch_size": 4, "to": "jax"}):
        with pytest.raises(ValueError):
            kvdata.Loader(path, **kwargs)
