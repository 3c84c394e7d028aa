"""kvdata/reader/torch_seam.py: the self-check of the zero-copy collate, and the fallback when it fails.

The fallback is forced the way a test (or a user diagnosing a torch release) does it, with
KVDATA_ZERO_COPY_COLLATE=off in the environment: the self-check then fails for real, in the main
process and in DataLoader workers (forked or spawned), and everything after it -- plain rows, the
ring's buffers disowned, the one warning -- is the code a torch that breaks the zero-copy path runs.
"""

from __future__ import annotations

import gc
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data
from torch.utils.data import DataLoader

import kvdata
from kvdata.reader.torch_seam import (
    ENV,
    StorageRef,
    ZeroCopyCheck,
    ZeroCopyCollateWarning,
    shared_storage,
    zero_copy_collate_works,
)

N = 120
SHAPE = (8, 6, 3)
BATCH = 16


def image(i: int) -> np.ndarray:
    return (np.arange(np.prod(SHAPE), dtype=np.uint32).reshape(SHAPE) * 7 + i).astype(np.uint8)


@pytest.fixture(scope="module")
def dataset_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("seam") / "ds.kv"
    with kvdata.open(p, "w", shard_size="16KB") as s:
        s.put_many((f"k{i:04d}", {"image": image(i), "label": i, "name": f"n{i}"}) for i in range(N))
        s.seal()
    return p


def assert_exact(batches: list[dict[str, Any]], order: list[int]) -> None:
    """Batch k holds exactly the stored records order[k*BATCH:(k+1)*BATCH], in that order."""
    assert len(batches) == -(-len(order) // BATCH)
    for k, b in enumerate(batches):
        want = order[k * BATCH:(k + 1) * BATCH]
        assert b["label"].tolist() == want, f"batch {k}"
        assert list(b["name"]) == [f"n{i}" for i in want], f"batch {k}"
        assert torch.equal(torch.as_tensor(np.asarray(b["image"])), torch.from_numpy(np.stack([image(i) for i in want]))), \
            f"batch {k}: images differ from the stored records"


# ---------------------------------------------------------------- in the worker processes

_SEEN: list[str] = []  # ZeroCopyCollateWarnings this worker process has shown


def _record_warnings(worker_id: int) -> None:
    """worker_init_fn: show every ZeroCopyCollateWarning (a fork inherits pytest's 'error'
    filter) and record it here, so the batches can report how many this worker got."""
    warnings.filterwarnings("always", category=ZeroCopyCollateWarning)
    shown = warnings.showwarning

    def record(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, ZeroCopyCollateWarning):
            _SEEN.append(str(message))
        else:
            shown(message, category, *args, **kwargs)

    warnings.showwarning = record


def _report(samples: Any, stacked: torch.Tensor) -> torch.Tensor:
    """(worker id, the worker's verdict, warnings it has shown, whether `stacked` is the batch
    buffer __getitems__ filled, i.e. no copy) from inside the worker."""
    info = torch.utils.data.get_worker_info()
    own = samples.tensors["image"].data_ptr() == stacked.data_ptr()
    return torch.tensor([info.id if info is not None else -1, zero_copy_collate_works(), len(_SEEN), own])


def _default_collate_reporting(samples: Any) -> dict[str, Any]:
    out = torch.utils.data.default_collate(samples)
    out["report"] = _report(samples, out["image"])
    return out


def _kvdata_collate_reporting(samples: Any) -> dict[str, Any]:
    out = kvdata.collate(samples)  # a dict (Batch: keeps its lease, if any)
    out["report"] = _report(samples, out["image"])
    return out


def _rows_reporting(samples: Any) -> tuple[list[Any], torch.Tensor]:
    """The rows themselves leave the worker (plain rows carry no lease in the fallback)."""
    return list(samples), _report(samples, samples[0]["image"])


def _as_batch(raw: Any) -> dict[str, Any]:
    if isinstance(raw, tuple):  # _rows_reporting
        rows, report = raw
        return {"image": torch.stack([r["image"] for r in rows]), "label": torch.stack([r["label"] for r in rows]),
                "name": [r["name"] for r in rows], "report": report}
    return dict(raw)


# ---------------------------------------------------------------- the installed torch passes

def test_the_self_check_passes_on_this_torch_and_default_collate_takes_the_batch_itself(
        dataset_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    check = ZeroCopyCheck()  # a fresh verdict: the self-check runs here (a warning would fail the test)
    assert check.works() and check.reason is None, check.reason
    assert zero_copy_collate_works()
    ds = kvdata.Dataset(dataset_path)
    items = ds.__getitems__([9, 2, 5])
    b = torch.utils.data.default_collate(items)
    assert b["label"].tolist() == [9, 2, 5]
    assert type(b["image"]) is torch.Tensor and b["image"].data_ptr() == items.tensors["image"].data_ptr()  # no copy
    # in workers: the worker path (row 0's storage asked for _new_shared) stacks into the ring buffer itself
    sampler = kvdata.ShardShuffleSampler(ds, seed=4, window=2)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2, collate_fn=_default_collate_reporting,
                        worker_init_fn=_record_warnings)
    batches = [dict(b) for b in loader]
    assert_exact(batches, sampler.indices(0).tolist())
    reports = torch.stack([b["report"] for b in batches]).tolist()
    assert {r[0] for r in reports} == {0, 1}
    assert all(r[1:] == [1, 0, 1] for r in reports), reports  # works, no warning, no copy


def test_the_self_check_catches_a_default_collate_that_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose collate_tensor_fn stacks into memory of its own (not the batch's): the
    self-check sees the copy, and the verdict is 'does not work', with its warning."""
    from torch.utils.data._utils import collate as torch_collate

    table = getattr(torch_collate, "default_collate_fn_map", None)
    if table is None or torch.Tensor not in table:
        pytest.skip("this torch has no default_collate_fn_map to stand in for another release's")
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setitem(table, torch.Tensor, lambda batch, **_: torch.stack([t.clone() for t in batch]))
    check = ZeroCopyCheck()
    with pytest.warns(ZeroCopyCollateWarning, match=rf"torch {re.escape(torch.__version__)} .*copied the batch"):
        assert not check.works()
    assert not check.works()  # the verdict is kept: no second check, no second warning


# ---------------------------------------------------------------- the forced fallback

def test_fallback_without_workers_gives_exact_batches_and_warns_once(dataset_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ds = kvdata.Dataset(dataset_path)
    monkeypatch.delenv(ENV, raising=False)
    assert zero_copy_collate_works()  # this process's verdict, so that setting the variable is a change
    monkeypatch.setenv(ENV, "off")
    sampler = kvdata.ShardShuffleSampler(ds, seed=7, window=2)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0)
    with pytest.warns(ZeroCopyCollateWarning) as got:
        epochs = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            epochs.append(list(loader))
    ours = [w for w in got if issubclass(w.category, ZeroCopyCollateWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    text = str(ours[0].message)
    assert f"torch {torch.__version__}" in text and "kvdata.collate" in text and "kvdata.Loader" in text
    assert f"{ENV}=off" in text
    for epoch, batches in enumerate(epochs):  # checked after both epochs: no batch was overwritten
        assert_exact(batches, sampler.indices(epoch).tolist())
    # the plain path: plain rows, which default_collate copies; kvdata.collate still copies nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        items = ds.__getitems__([4, 8, 1])
    assert all(type(s["image"]) is torch.Tensor for s in items)
    b = torch.utils.data.default_collate(items)
    assert b["label"].tolist() == [4, 8, 1] and b["image"].data_ptr() != items.tensors["image"].data_ptr()
    assert torch.equal(b["image"], torch.from_numpy(np.stack([image(i) for i in (4, 8, 1)])))
    fast = kvdata.collate(items)
    assert fast["image"].data_ptr() == items.tensors["image"].data_ptr() and torch.equal(fast["image"], b["image"])


@pytest.mark.parametrize(("context", "collate"), [("fork", _default_collate_reporting),
                                                  ("spawn", _default_collate_reporting),
                                                  ("fork", _kvdata_collate_reporting),
                                                  ("fork", _rows_reporting)])
def test_fallback_in_workers_gives_exact_batches_and_each_worker_warns_once(
        dataset_path: Path, monkeypatch: pytest.MonkeyPatch, context: str, collate: Callable[[Any], Any]) -> None:
    """Every worker checks for itself (a forked one too: its collate takes the worker path),
    fails, warns once, and hands out plain rows from buffers its ring disowned: batches kept by
    the loop (all of them, below) are never overwritten, whichever collate sent them."""
    monkeypatch.setenv(ENV, "off")
    ds = kvdata.Dataset(dataset_path)
    sampler = kvdata.ShardShuffleSampler(ds, seed=11, window=2)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2, multiprocessing_context=context,
                        collate_fn=collate, worker_init_fn=_record_warnings, persistent_workers=True)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append([_as_batch(raw) for raw in loader])
    reports = []
    for epoch, batches in enumerate(epochs):
        assert_exact(batches, sampler.indices(epoch).tolist())
        reports += torch.stack([b["report"] for b in batches]).tolist()
    assert {r[0] for r in reports} == {0, 1}
    # not zero-copy, exactly one warning in each worker (seen before its first collate, none after)
    assert all(r[1] == 0 and r[2] == 1 for r in reports), reports
    if collate is _default_collate_reporting:
        assert not any(r[3] for r in reports)  # default_collate copied the plain rows
    if collate is _kvdata_collate_reporting:
        assert all(r[3] for r in reports)  # kvdata.collate did not
    del epochs, loader
    gc.collect()


# ---------------------------------------------------------------- the ring's storage calls

def test_shared_storage_and_storage_refs(monkeypatch: pytest.MonkeyPatch) -> None:
    s = shared_storage(4096)
    assert s.nbytes() == 4096 and s.is_shared()
    owner = next(c for c in torch.UntypedStorage.__mro__ if "_new_shared" in c.__dict__)
    monkeypatch.delattr(owner, "_new_shared")  # a torch without the private constructor
    assert not hasattr(torch.UntypedStorage, "_new_shared")
    s2 = shared_storage(100)
    assert s2.nbytes() == 100 and s2.is_shared()
    t = torch.empty(0, dtype=torch.uint8).set_(s2, 0, (100,))  # type: ignore[call-overload]
    view = t[10:20]
    ref = StorageRef(t)
    del t, s2
    gc.collect()
    assert not ref.expired()  # a view still holds the memory
    del view
    gc.collect()
    assert ref.expired()
