"""kvdata.Dataset under real DataLoader workers (fork and spawn) and the BatchReader thread."""

from __future__ import annotations

import pickle
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import kvdata
from kvdata.errors import KVDataError

N = 300
SHAPE = (24, 16, 3)


def image(i: int) -> np.ndarray:
    return (np.arange(np.prod(SHAPE), dtype=np.uint32).reshape(SHAPE) + i).astype(np.uint8)


@pytest.fixture(scope="module")
def dataset_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("loader") / "ds.kv"
    with kvdata.open(p, "w", shard_size="64KB") as s:
        s.put_many((f"k{i:04d}", {"image": image(i), "label": i, "name": f"n{i}"}) for i in range(N))
        s.seal()
    return p


def check_batch(b: dict) -> list[int]:
    labels = b["label"].tolist()
    for row, i in zip(b["image"], labels):
        np.testing.assert_array_equal(np.asarray(row), image(i))
    return labels


def epoch_labels(loader: DataLoader) -> list[int]:
    seen: list[int] = []
    for b in loader:
        seen += check_batch(b)
    return seen


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("collate", ["kvdata", "default"])
def test_two_workers_see_every_sample_once(dataset_path: Path, context: str, collate: str) -> None:
    ds = kvdata.Dataset(dataset_path)
    sampler = kvdata.ShardShuffleSampler(ds, seed=5, window=2)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2, multiprocessing_context=context,
                        collate_fn=kvdata.collate if collate == "kvdata" else None,
                        persistent_workers=True, pin_memory=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable NumPy array" warning
        for epoch in range(2):
            sampler.set_epoch(epoch)
            seen = epoch_labels(loader)
            assert sorted(seen) == list(range(N)), f"epoch {epoch}: a sample was lost or repeated"
    first = list(sampler.indices(0))
    assert first != list(sampler.indices(1))


def test_num_workers_zero_and_pin_memory(dataset_path: Path) -> None:
    ds = kvdata.Dataset(dataset_path, fields=["image", "label"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # CPU-only torch has no pinned memory
        loader = DataLoader(ds, batch_size=50, shuffle=True, num_workers=0, pin_memory=True,
                            collate_fn=kvdata.collate)
        batches = list(loader)
    assert set(batches[0]) == {"image", "label"}
    assert sorted(sum((check_batch(b) for b in batches), [])) == list(range(N))


def test_samples_and_default_collate(dataset_path: Path) -> None:
    ds = kvdata.Dataset(dataset_path)
    s = ds[7]
    assert s["label"] == 7 and s["name"] == "n7" and s["image"].flags.writeable
    np.testing.assert_array_equal(s["image"], image(7))
    items = ds.__getitems__([3, 1])
    assert isinstance(items[0]["image"], torch.Tensor) and items[1]["label"] == 1
    np.testing.assert_array_equal(items[1]["image"].numpy(), image(1))
    b = torch.utils.data.default_collate(items)
    assert b["image"].shape == (2, *SHAPE) and b["label"].tolist() == [3, 1] and b["name"] == ["n3", "n1"]
    assert type(b["image"]) is torch.Tensor and b["image"].data_ptr() == items[0]["image"].data_ptr()  # no copy
    fast = kvdata.collate(items)
    assert torch.equal(fast["image"], b["image"]) and fast["label"].tolist() == [3, 1]
    items[0]["image"][0, 0, 0] = 7  # rows are writable views of the batch
    assert int(torch.utils.data.default_collate(items)["image"][0, 0, 0, 0]) == 7


def test_transform_gets_views_and_collate_stacks(dataset_path: Path) -> None:
    def flip(sample: dict) -> dict:
        return {"image": sample["image"][:, ::-1], "label": sample["label"]}

    ds = kvdata.Dataset(dataset_path, transform=flip)
    loader = DataLoader(ds, batch_size=16, num_workers=0, collate_fn=kvdata.collate)
    b = next(iter(loader))
    assert b["image"].shape == (16, *SHAPE)
    np.testing.assert_array_equal(b["image"][3].numpy(), image(3)[:, ::-1])


def test_dataset_pickles_without_handles(dataset_path: Path) -> None:
    ds = kvdata.Dataset(dataset_path)
    ds[0]
    blob = pickle.dumps(ds)
    assert len(blob) < 2000
    clone = pickle.loads(blob)
    assert clone._store is None and len(clone) == N and clone[5]["label"] == 5


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def _collate_with_rss(samples: list) -> tuple:
    return kvdata.collate(samples)["label"], _rss_anon()


def test_worker_anonymous_memory_does_not_grow(tmp_path: Path) -> None:
    p = tmp_path / "big.kv"
    n, shape = 1200, (128, 128, 3)  # 59 MB of samples, 12x the worker's 4.9 MB of batch buffers
    with kvdata.open(p, "w", shard_size="4MB") as s:
        s.put_many((f"k{i}", {"image": np.full(shape, i % 256, np.uint8), "label": i}) for i in range(n))
        s.seal()
    ds = kvdata.Dataset(p)
    loader = DataLoader(ds, batch_size=100, sampler=kvdata.ShardShuffleSampler(ds, seed=1), num_workers=1,
                        collate_fn=_collate_with_rss, prefetch_factor=2)
    rss = []
    seen = []
    for labels, r in loader:
        rss.append(r)
        seen += labels.tolist()
    assert sorted(seen) == list(range(n))
    growth = max(rss[1:]) - rss[1]
    assert growth < 16 << 20, f"worker RssAnon grew by {growth / 2**20:.1f} MiB over the epoch"


def test_batch_reader_threads_and_errors(dataset_path: Path, tmp_path: Path) -> None:
    before = set(threading.enumerate())
    with kvdata.BatchReader(str(dataset_path), batch_size=64, prefetch=2) as r:
        x, y = next(r)
        assert x.shape == (64, SHAPE[2], SHAPE[0], SHAPE[1]) and y.tolist() == list(range(64))
        np.testing.assert_array_equal(x[5], image(5).transpose(2, 0, 1))
    assert not set(threading.enumerate()) - before, "BatchReader left a thread running"
    r = kvdata.BatchReader(str(dataset_path), batch_size=64)
    next(r)
    r.close()
    r.close()
    assert not set(threading.enumerate()) - before
    with pytest.raises(StopIteration):
        next(r)

    bad = tmp_path / "mixed.kv"
    with kvdata.open(bad, "w") as s:
        s.put_many((f"k{i}", {"image": np.zeros((8, 8, 3) if i < 20 else (9, 8, 3), np.uint8), "label": i})
                   for i in range(40))
    r = kvdata.BatchReader(str(bad), batch_size=30)
    with pytest.raises(KVDataError, match="shape"):
        next(r)
    r.close()
    assert not set(threading.enumerate()) - before


def test_batch_reader_epochs_striding_and_transforms(dataset_path: Path) -> None:
    with kvdata.BatchReader(str(dataset_path), batch_size=100, rank=1, world_size=3) as r:
        labels = np.concatenate([next(r)[1] for _ in range(3)])
        assert labels[:5].tolist() == [1, 4, 7, 10, 13] and r.epoch == 3
        assert set(labels.tolist()) == set(range(1, N, 3))
    with kvdata.BatchReader(str(dataset_path), batch_size=50, crop_size=8, mean=[10, 20, 30], scale=0.5,
                            train=False) as r:
        x, y = next(r)
        expect = (image(0)[8:16, 4:12].transpose(2, 0, 1).astype(np.float32)
                  - np.array([10, 20, 30], np.float32)[:, None, None]) * 0.5
        assert x.dtype == np.float32 and x.shape == (50, 3, 8, 8)
        np.testing.assert_allclose(x[0], expect)
    with kvdata.BatchReader(str(dataset_path), batch_size=50, crop_size=8, mirror=True, seed=1) as r:
        x, _ = next(r)
        assert x.shape == (50, 3, 8, 8)
    with kvdata.BatchReader(str(dataset_path), batch_size=60, shuffle_shards=True, seed=2) as r:
        e0 = np.concatenate([next(r)[1] for _ in range(5)])
        e1 = np.concatenate([next(r)[1] for _ in range(5)])
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(N))
    assert e0.tolist() != e1.tolist() and e0.tolist() != list(range(N))
    with kvdata.BatchReader(str(dataset_path), batch_size=10, transform=lambda x, y: (x.sum(), y)) as r:
        total, y = next(r)
        assert int(total) == int(sum(image(i).astype(np.int64).sum() for i in range(10)))


def _ring_allocations(samples: list) -> torch.Tensor:
    """How many buffers this worker's ring has allocated so far."""
    ring = getattr(samples, "ring", None)
    return torch.tensor(ring.allocations if ring is not None else -1)


def _collate_with_ring_stats(samples: list) -> dict:
    """kvdata.collate, plus the worker ring's allocations so far."""
    out = kvdata.collate(samples)
    out["ring_allocations"] = _ring_allocations(samples)
    return out


def test_batches_the_loop_keeps_are_never_overwritten(dataset_path: Path) -> None:
    ds = kvdata.Dataset(dataset_path)
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, collate_fn=kvdata.collate)
    kept = list(loader)  # every batch held: no worker may reuse any of their buffers
    views = [b["image"][0] for b in loader]  # only a view of each batch kept
    seen: list[int] = []
    for b in kept:
        seen += check_batch(b)
    assert sorted(seen) == list(range(N))
    for v in views:  # each view still shows a whole image (image(i)[0, 0, 0] == i % 256)
        i = int(np.asarray(v)[0, 0, 0])
        assert any(np.array_equal(np.asarray(v), image(j)) for j in range(i % 256, N, 256))


def _default_collate_with_ring_stats(samples: list) -> dict:
    """What users write (torch's default_collate), plus the worker ring's allocations so far."""
    out = torch.utils.data.default_collate(samples)
    out["ring_allocations"] = _ring_allocations(samples)
    return out


def _stack_collate(samples: list) -> tuple:
    """A hand-written collate: torch.stack of the rows (no copy: the stack is the batch)."""
    return (torch.stack([s["image"] for s in samples]), torch.stack([s["label"] for s in samples]),
            _ring_allocations(samples))


def _copying_collate(samples: list) -> tuple:
    """A collate that copies every row (np.stack): nothing of the ring leaves the worker."""
    return (torch.from_numpy(np.stack([np.asarray(s["image"]) for s in samples])),
            torch.tensor([int(s["label"]) for s in samples]), _ring_allocations(samples))


def _identity_collate(samples: list) -> list:
    return samples


def _as_batch(b: object) -> dict:
    if isinstance(b, tuple):
        return {"image": b[0], "label": b[1], "ring_allocations": b[2]}
    if isinstance(b, list):  # the samples themselves
        return {"image": torch.stack([s["image"] for s in b]), "label": torch.stack([s["label"] for s in b])}
    assert isinstance(b, dict)
    return b


@pytest.mark.parametrize(("collate", "context"), [(_collate_with_ring_stats, "fork"), (_collate_with_ring_stats, "spawn"),
                                                    (_default_collate_with_ring_stats, "fork"),
                                                    (_default_collate_with_ring_stats, "spawn"),
                                                    (_stack_collate, "fork"), (_copying_collate, "fork")])
def test_workers_reuse_their_batch_buffers_once_the_loop_lets_go(dataset_path: Path, context: str,
                                                                 collate: object) -> None:
    """Each batch dropped before the next: its buffer goes back to its worker, with kvdata.collate,
    torch's default_collate (regression, issue 13: it copied every batch into a fresh shared-memory
    segment; now the rows stack back into the worker's ring buffer), a hand-written torch.stack,
    or a collate that copies the rows (its buffer is free at once)."""
    ds = kvdata.Dataset(dataset_path)
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context=context,
                        collate_fn=collate, persistent_workers=True)
    allocs = []
    for _epoch in range(3):
        seen: list[int] = []
        for raw in loader:
            b = _as_batch(raw)
            assert type(b["image"]) is torch.Tensor and b["image"].shape[1:] == SHAPE
            seen += check_batch(b)
            allocs.append(int(b["ring_allocations"]))
        assert sorted(seen) == list(range(N))
    assert max(allocs) <= 6, allocs  # a few buffers per worker, not one per batch (~57 per worker here)
    assert 3 * -(-N // 8) > 10 * max(allocs)


@pytest.mark.parametrize("collate", [None, _stack_collate, _identity_collate])
def test_batches_kept_by_the_loop_with_any_collate_are_never_overwritten(dataset_path: Path, collate: object) -> None:
    ds = kvdata.Dataset(dataset_path)
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, collate_fn=collate)
    kept = list(loader)  # every batch held (as default_collate, a stack or the rows themselves)
    rows = [_as_batch(b)["image"][3] if collate is not _identity_collate else b[3]["image"] for b in loader]
    seen: list[int] = []
    for b in kept:
        seen += check_batch(_as_batch(b))
    assert sorted(seen) == list(range(N))
    for v in rows:  # each kept row still shows a whole image
        i = int(np.asarray(v)[0, 0, 0])
        assert any(np.array_equal(np.asarray(v), image(j)) for j in range(i % 256, N, 256))


def test_stacks_that_are_not_the_whole_batch_copy(dataset_path: Path) -> None:
    items = kvdata.Dataset(dataset_path).__getitems__([5, 6, 7, 8])
    rows = [s["image"] for s in items]
    whole = torch.stack(rows)
    assert whole.data_ptr() == rows[0].data_ptr() and type(whole) is torch.Tensor
    for part in (rows[1:], rows[:3], rows[::-1], [rows[0], rows[0], rows[2], rows[3]]):
        got = torch.stack(part)
        assert got.data_ptr() != rows[0].data_ptr()
        assert torch.equal(got, torch.stack([r.clone() for r in part]))
    assert torch.stack(rows, dim=1).shape == (SHAPE[0], 4, *SHAPE[1:])  # another dim: torch's own stack
    out = torch.empty(4, *SHAPE, dtype=torch.uint8)
    assert torch.stack(rows, out=out) is out and torch.equal(out, whole)  # a caller's out is filled
    assert type(rows[0] + 1) is torch.Tensor and type(rows[0][1:]) is torch.Tensor
    copied = pickle.loads(pickle.dumps(items))
    assert type(copied[0]["image"]) is torch.Tensor and torch.equal(copied[0]["image"], rows[0])


def test_batch_reader_is_deterministic_across_threads_and_can_reuse_buffers(dataset_path: Path) -> None:
    def first_batches(**kw: object) -> list[tuple[np.ndarray, np.ndarray]]:
        with kvdata.BatchReader(str(dataset_path), batch_size=40, crop_size=8, mirror=True, seed=3,
                                shuffle_shards=True, **kw) as r:
            return [(x.copy(), y.copy()) for x, y in (next(r) for _ in range(12))]

    one, two = first_batches(copy_threads=1), first_batches(copy_threads=2)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(one, two))
    with kvdata.BatchReader(str(dataset_path), batch_size=40, prefetch=2, reuse_buffers=True) as r:
        held = []
        for _ in range(10):
            x, y = next(r)
            held.append((x, y.copy()))
            for hx, hy in held[-2:]:  # the last `prefetch` batches are intact
                for row, i in zip(hx, hy):
                    np.testing.assert_array_equal(row, image(int(i)).transpose(2, 0, 1))
        assert len({id(x) for x, _ in held}) <= 10 and len({x.ctypes.data for x, _ in held}) <= 4
    with kvdata.BatchReader(str(dataset_path), batch_size=40) as r:  # the default: every batch kept valid
        kept = [next(r) for _ in range(10)]
    for x, y in kept:
        for row, i in zip(x, y):
            np.testing.assert_array_equal(row, image(int(i)).transpose(2, 0, 1))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_leave_no_shared_memory_segments_or_threads(dataset_path: Path, context: str) -> None:
    import gc
    import os

    def shm() -> set[str]:
        # sem.mp-*: the named semaphores of multiprocessing's own queues (spawn), which its
        # finalizers and resource tracker unlink on their own schedule; not batch memory
        names = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        return {n for n in names if not n.startswith("sem.mp-")}

    before, threads = shm(), set(threading.enumerate())
    ds = kvdata.Dataset(dataset_path)
    for collate in (kvdata.collate, None):
        loader = DataLoader(ds, batch_size=16, sampler=kvdata.ShardShuffleSampler(ds), num_workers=2,
                            multiprocessing_context=context, collate_fn=collate)
        kept = []
        for k, b in enumerate(loader):
            check_batch(b)
            if k % 5 == 0:
                kept.append(b)
        del loader, kept, b
    gc.collect()
    assert shm() - before == set()
    # DataLoader's shutdown closes its queues; their feeder threads (QueueFeederThread) end on
    # their own a moment later (seen once still alive right after the loop, in a CI run)
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - threads and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not set(threading.enumerate()) - threads
