"""torchdata's StatefulDataLoader over kvdata.Dataset + ShardShuffleSampler (what torchtitan and
Lightning checkpoint): a state taken at any point, loaded into a new Dataset, sampler and loader
(as after a restart), continues with exactly the samples of the uninterrupted run, in its order:
mid-epoch, before the first batch, and at an epoch's end, with 0 and 2 worker processes."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata

sdl = pytest.importorskip("torchdata.stateful_dataloader")   # and so torch, which torchdata needs

# torchdata 0.11's StatefulDataLoader calls torch.set_vital, which torch 2.13 deprecates (third-party noise)
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

N, BATCH, EPOCHS = 301, 8, 2     # 38 batches an epoch, the last one of 5
BATCHES = -(-N // BATCH)
SEED, WINDOW = 5, 2


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """301 samples in ~17 sealed shards; sample i holds x = [i]*200 and i."""
    p = tmp_path_factory.mktemp("sdl") / "ds.kv"
    with kvdata.open(p, "w", shard_size="16KB") as s:
        s.put_many((f"k{i:04d}", {"x": np.full(200, i, dtype=np.int32), "i": i}) for i in range(N))
        s.seal()
    assert len(np.unique(kvdata.Dataset(p).sample_shards)) >= 10
    return p


def make(path: Path, workers: int, **kw: Any) -> tuple[kvdata.ShardShuffleSampler, Any]:
    """A new Dataset, sampler and StatefulDataLoader, as a restarted job builds them."""
    ds = kvdata.Dataset(path)
    sampler = kvdata.ShardShuffleSampler(ds, seed=SEED, window=WINDOW)
    dl = sdl.StatefulDataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=workers, **kw)
    return sampler, dl


def ids(batch: dict[str, Any]) -> list[int]:
    i = batch["i"].tolist()
    assert batch["x"][:, 0].tolist() == i          # the record is sample i's
    return i


def checkpointed(state: dict[str, Any]) -> dict[str, Any]:
    """What a restarted job reads back: torch.save'd, loaded weights_only (plain data only)."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.fixture(scope="module")
def reference(path: Path) -> list[list[int]]:
    """The uninterrupted run: each epoch's sample indices, in order."""
    sampler, dl = make(path, 0)
    out = []
    for e in range(EPOCHS):
        sampler.set_epoch(e)
        out.append([i for b in dl for i in ids(b)])
    for e in range(EPOCHS):
        assert out[e] == sampler.indices(e).tolist()      # the sampler's order, batch after batch
        assert sorted(out[e]) == list(range(N))
    assert out[0] != out[1]
    return out


def interrupted(path: Path, workers: int, stop_epoch: int, stop_batch: int, **kw: Any) -> tuple[list[int], Any]:
    """The loop until it has received `stop_batch` batches of epoch `stop_epoch` (0: right after
    set_epoch, before the first one; BATCHES: the last one, still inside the loop), then the
    loader's state_dict() and a crash."""
    sampler, dl = make(path, workers, **kw)
    seen: list[int] = []
    for e in range(stop_epoch + 1):
        sampler.set_epoch(e)
        if e == stop_epoch and stop_batch == 0:
            break
        for k, b in enumerate(dl, 1):
            seen += ids(b)
            if e == stop_epoch and k == stop_batch:
                break
    state = checkpointed(dl.state_dict())
    del dl
    return seen, state


def resumed(path: Path, workers: int, state: dict[str, Any], first_epoch: int, **kw: Any) -> list[int]:
    """A restarted job: new Dataset, sampler and loader, load_state_dict, then the loop from
    `first_epoch` (what its own checkpoint says), set_epoch at the top of each epoch."""
    sampler, dl = make(path, workers, **kw)
    dl.load_state_dict(state)
    out: list[int] = []
    for e in range(first_epoch, EPOCHS):
        sampler.set_epoch(e)
        out += [i for b in dl for i in ids(b)]
    return out


def whole(reference: list[list[int]]) -> list[int]:
    return [i for e in reference for i in e]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_epoch,stop_batch", [(0, 1), (0, 13), (0, BATCHES - 1), (1, 20)])
def test_resume_mid_epoch(path: Path, reference: list[list[int]], workers: int, stop_epoch: int,
                          stop_batch: int) -> None:
    seen, state = interrupted(path, workers, stop_epoch, stop_batch)
    assert len(seen) == stop_epoch * N + stop_batch * BATCH
    rest = resumed(path, workers, state, stop_epoch)
    assert seen + rest == whole(reference)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_epoch", [0, 1])
def test_resume_from_a_state_taken_before_the_first_batch(path: Path, reference: list[list[int]], workers: int,
                                                          stop_epoch: int) -> None:
    """Epoch 0: a fresh loader's state (StatefulDataLoader starts its iterator, and with workers
    prefetches, to take it). Epoch 1: after epoch 0 ran out and set_epoch(1)."""
    seen, state = interrupted(path, workers, stop_epoch, 0)
    assert seen == whole(reference[:stop_epoch])
    assert resumed(path, workers, state, stop_epoch) == whole(reference[stop_epoch:])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("first_epoch", [0, 1])
def test_resume_from_the_last_batch_of_an_epoch(path: Path, reference: list[list[int]], workers: int,
                                                first_epoch: int) -> None:
    """The state taken after the last batch of epoch 0, inside the loop. The restarted loop either
    enters epoch 0 again (its checkpoint counted epochs begun: that epoch has nothing left) or
    starts at epoch 1 (it counted epochs done, as Lightning does at an epoch's end: set_epoch(1)
    comes before the loader loads a state of finished epoch 0, and epoch 1 is read whole)."""
    seen, state = interrupted(path, workers, 0, BATCHES)
    assert seen == reference[0]
    assert resumed(path, workers, state, first_epoch) == reference[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_from_a_state_taken_after_the_epoch_ran_out(path: Path, reference: list[list[int]],
                                                           workers: int) -> None:
    """The loop's for ran to its end (the loader's iterator is finished) and the state is taken
    before set_epoch(1): the restarted loop starts at epoch 1 and reads it whole."""
    sampler, dl = make(path, workers)
    sampler.set_epoch(0)
    seen = [i for b in dl for i in ids(b)]
    state = checkpointed(dl.state_dict())
    del dl
    assert seen == reference[0]
    assert resumed(path, workers, state, 1) == reference[1]


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_a_state_taken_between_iter_and_the_first_batch(path: Path, reference: list[list[int]], workers: int,
                                                        persistent: bool) -> None:
    """No set_epoch: the loop reads epoch 0 twice. The second pass's iter(loader) draws no index
    with num_workers=0, and with workers snapshots the sampler before its prefetch: the sampler's
    state then is that pass's start, not where the first pass ended."""
    sampler, dl = make(path, workers, persistent_workers=persistent)
    assert [i for b in dl for i in ids(b)] == reference[0]
    it = iter(dl)
    state = checkpointed(dl.state_dict())
    assert [i for b in it for i in ids(b)] == reference[0]
    del it, dl
    assert resumed(path, workers, state, 0, persistent_workers=persistent) == reference[0] + reference[1]


def test_set_epoch_after_an_early_state_dict_still_applies(path: Path, reference: list[list[int]]) -> None:
    """dl.state_dict() before the loop creates the loader's iterator (and the sampler's); with
    num_workers=0 nothing is drawn yet, so a set_epoch after it still picks the epoch read."""
    sampler, dl = make(path, 0)
    state = checkpointed(dl.state_dict())
    assert state["_sampler_iter_state"]["sampler_state"]["position"] == 0
    sampler.set_epoch(1)
    assert [i for b in dl for i in ids(b)] == reference[1]


def test_resume_with_workers_snapshotting_every_few_steps(path: Path, reference: list[list[int]]) -> None:
    """snapshot_every_n_steps=5: the state holds the last snapshot and the batches since, which
    the loader replays on load; the sampler state in the snapshot is that of its batch."""
    kw = dict(snapshot_every_n_steps=5, prefetch_factor=3)
    seen, state = interrupted(path, 2, 0, 17, **kw)
    assert seen + resumed(path, 2, state, 0, **kw) == whole(reference)


def test_every_stop_of_an_epoch_resumes_exactly(path: Path, reference: list[list[int]]) -> None:
    """num_workers=0, a state after every batch of epoch 0, each into a new loader."""
    sampler, dl = make(path, 0)
    sampler.set_epoch(0)
    seen: list[int] = []
    states = [checkpointed(dl.state_dict())]
    it = iter(dl)
    for b in it:
        seen += ids(b)
        states.append(checkpointed(dl.state_dict()))
    assert seen == reference[0]
    for k, state in enumerate(states):
        assert state["_index_sampler_state"] is None    # the state is the batch sampler's, holding ours
        inner = state["_sampler_iter_state"]["sampler_state"]
        assert inner["epoch"] == 0 and inner["position"] == min(k * BATCH, N), k
        _, fresh = make(path, 0)
        fresh.load_state_dict(state)
        assert [i for b in fresh for i in ids(b)] == reference[0][k * BATCH:], k


def test_the_sampler_state_in_a_worker_loaders_state_counts_the_batches_received(path: Path) -> None:
    """With workers the main process draws indices prefetch_factor * num_workers batches ahead;
    the sampler state saved with each batch is the one taken as that batch's indices were drawn."""
    sampler, dl = make(path, 2, prefetch_factor=4)
    sampler.set_epoch(0)
    for k, _ in enumerate(dl, 1):
        ahead = sampler.state_dict()["position"]        # what the main process has drawn
        saved = dl.state_dict()["_snapshot"]["_main_snapshot"]["_sampler_iter_state"]["sampler_state"]
        assert saved["position"] == min(k * BATCH, N), k
        assert ahead == min((k + 8) * BATCH, N), k
        if k == 10:
            break


def test_the_sampler_rule_for_a_state_of_an_earlier_epoch(path: Path) -> None:
    """What the epoch-boundary resumes rest on, on the sampler alone: a state at its epoch's end
    loaded after set_epoch(later) leaves the later epoch whole; a mid-epoch state sets its own
    epoch back (the data's position wins over the loop's count). The same with locality, the end
    state loaded onto another world."""
    ds = kvdata.Dataset(path)

    def at(e: int, k: int, **kw: Any) -> tuple[dict[str, Any], list[int]]:
        s = kvdata.ShardShuffleSampler(ds, seed=SEED, window=WINDOW, **kw)
        s.set_epoch(e)
        it = iter(s)
        head = [next(it) for _ in range(k)]
        return s.state_dict(), head + list(it)

    for kw, other in [({}, {}), (dict(locality=True, nodes=2, world_size=4, rank=1),
                                 dict(locality=True, nodes=1, world_size=2, rank=1))]:
        end, ref0 = at(0, len(kvdata.ShardShuffleSampler(ds, **kw)), **kw)
        assert end["position"] == end["end"] == len(ref0)
        t = kvdata.ShardShuffleSampler(ds, seed=SEED, window=WINDOW, **other)
        ref1 = list(kvdata.ShardShuffleSampler(ds, seed=SEED, window=WINDOW, **other).indices(1))
        t.set_epoch(1)
        t.load_state_dict(end)
        assert (t.epoch, t.state_dict()["position"]) == (1, 0)
        assert list(t) == ref1

    mid, ref0 = at(0, 100)
    t = kvdata.ShardShuffleSampler(ds, seed=SEED, window=WINDOW)
    t.set_epoch(1)
    t.load_state_dict(mid)
    assert t.epoch == 0 and list(t) == ref0[100:]


def test_kvdata_uses_no_torchdata(path: Path) -> None:
    """torchdata is only the tests': kvdata and its sampler work where it cannot be imported."""
    code = ("import sys; sys.modules['torchdata'] = None\n"
            "import kvdata\n"
            f"ds = kvdata.Dataset({str(path)!r}); s = kvdata.ShardShuffleSampler(ds, seed=1)\n"
            "it = iter(s); head = [next(it) for _ in range(10)]; st = s.state_dict()\n"
            "t = kvdata.ShardShuffleSampler(ds, seed=1); t.load_state_dict(st)\n"
            "assert head + list(t) == list(s)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    src = Path(kvdata.__file__).parent
    assert not [p for p in src.rglob("*.py") if re.search(r"^\s*(import|from)\s+torchdata", p.read_text(), re.M)]
