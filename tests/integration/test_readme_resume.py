"""The README's training loop ("## Train with it") resumes from its own checkpoints.

The block runs as written (its text taken from README.md, on the digits.kv the README's block
before it makes), in real processes forked for it (helpers.doc_blocks: the same way the document
harness runs python blocks). A small wrapper in this test, not in the README, records what every
step sees: kvdata.Loader's filling threads note each batch's sample indices and the loop's
iterator logs them (epoch, batch number in the epoch, indices) as the batch reaches the loop.

The chain: run 1 is SIGKILLed from outside in the middle of epoch 0 (after its step-10
checkpoint); run 2 resumes, and SIGKILLs itself right after the checkpoint that closes epoch 1
(an epoch boundary: the state saved is "epoch 2, batch 0"); run 3 resumes at epoch 2 and is
SIGKILLed as the last batch of epoch 2 reaches the loop (before the checkpoint that closes it);
run 4 resumes from the step-20 checkpoint of epoch 2 and finishes. What each killed run did after
its last checkpoint is lost (so is its model's progress) and done again by the next run; keeping
each run's steps up to the checkpoint it left, the steps of all runs are exactly those of an
uninterrupted run: every epoch, every sample once, in the sampler's order for that epoch.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the README's training loop needs torch (pip install -e '.[test]')")
pytest.importorskip("sklearn", reason="the README's digits.kv needs scikit-learn (pip install -e '.[test]')")

import kvdata  # noqa: E402 -- after the skips

from helpers import doc_blocks  # noqa: E402

README = doc_blocks.ROOT / "README.md"
BATCH, EPOCHS = 64, 3

WRAPPER = r'''\
"""Runs the README block named by KVDOC_BLOCK, logging each step (test_readme_resume.py)."""
import os
import runpy
import signal
import time

from kvdata.reader import loader as loader_mod

LOG = os.open(os.environ["KVDOC_STEPS"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
KILL = os.environ.get("KVDOC_KILL", "").split()   # "boundary E" | "last-batch E N" | ""
SLOW = int(os.environ.get("KVDOC_SLOW_AFTER", "0"))  # from that many steps on, 0.2 s a step: a kill from outside lands
finished = []                                     # epochs whose iteration ran to its end

real_fill = loader_mod.Loader._fill
real_iter = loader_mod.Loader.__iter__
real_replace = os.replace


def fill(self, store, slot, idx):
    batch = real_fill(self, store, slot, idx)
    batch["__indices__"] = [int(i) for i in idx]
    return batch


def iterate(self):
    for batch in real_iter(self):
        idx = batch.pop("__indices__")
        os.write(LOG, f"{self.epoch} {self._consumed} {' '.join(map(str, idx))}\n".encode())
        if KILL[:1] == ["last-batch"] and [self.epoch, self._consumed] == [int(KILL[1]), int(KILL[2])]:
            os.kill(os.getpid(), signal.SIGKILL)
        if SLOW and self._consumed >= SLOW:
            time.sleep(0.2)
        yield batch
    finished.append(self.epoch)


def replace(src, dst, **kw):
    real_replace(src, dst, **kw)
    if str(dst).endswith("checkpoint.pt"):
        os.write(LOG, b"saved\n")
        if KILL[:1] == ["boundary"] and finished and finished[-1] == int(KILL[1]):
            os.kill(os.getpid(), signal.SIGKILL)   # right after the checkpoint that closes that epoch


loader_mod.Loader._fill = fill
loader_mod.Loader.__iter__ = iterate
os.replace = replace
runpy.run_path(os.environ["KVDOC_BLOCK"], run_name="__main__")
'''


def readme_blocks() -> tuple[str, str]:
    """The README's block that makes digits.kv and its training loop."""
    blocks = [b for b in doc_blocks.extract(README) if b.section == "Train with it" and b.lang == "python"]
    make = [b.text for b in blocks if "digits.kv" in b.text and "from_arrays" in b.text]
    train = [b.text for b in blocks if "checkpoint.pt" in b.text and "kvdata.Loader" in b.text]
    assert len(make) == 1 and len(train) == 1, "README: the digits block and the training loop moved"
    return make[0], train[0]


Step = tuple[int, int, tuple[int, ...]]


def logged(log: Path) -> int:
    """Steps a running run has logged so far (whole lines only)."""
    data = log.read_bytes() if log.exists() else b""
    return data.count(b"\n") - data.count(b"saved\n")


def steps(log: Path) -> list[Step]:
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        if line != "saved":
            e, n, *idx = line.split()
            out.append((int(e), int(n), tuple(int(i) for i in idx)))
    return out


def checkpoint(home: Path) -> dict[str, Any]:
    return torch.load(home / "checkpoint.pt", weights_only=False)["loader"]


def kept(run: list[Step], state: dict[str, Any]) -> list[Step]:
    """The steps of a killed run that its checkpoint holds (the rest is done again)."""
    at = (state["epoch"], state["batches"])
    return [s for s in run if (s[0], s[1]) <= at]


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[doc_blocks.Session, doc_blocks.Zygote, Path]]:
    make, train = readme_blocks()
    with doc_blocks.session("README.md") as s:
        (s.scratch / "make.py").write_text(make)
        (s.scratch / "train.py").write_text(train)
        (s.scratch / "wrapper.py").write_text(WRAPPER)
        z = doc_blocks.Zygote(s.env, s.cwd, doc_blocks.imports_of(
            [doc_blocks.Block("README.md", 0, "python", ["python"], "", make + train)]), s.scratch / "zygote.log")
        s.zygote = z
        pid = z.start(s.scratch / "make.py", s.cwd, s.env, s.scratch / "make.log")
        s.groups.append(pid)
        assert z.wait(120) == 0, (s.scratch / "make.log").read_text()
        yield s, z, s.scratch


def run(lab: tuple[doc_blocks.Session, doc_blocks.Zygote, Path], n: int, kill: str = "",
        kill_after_steps: int | None = None) -> tuple[int, list[Step], str]:
    """Run the README's loop once (through the wrapper); its exit status, steps and output.
    kill_after_steps: SIGKILL it from here once it has logged that many steps (from then on the
    wrapper takes 0.2 s a step, so that the kill lands in the same epoch however busy the machine)."""
    s, z, scratch = lab
    log, out = scratch / f"steps-{n}.log", scratch / f"run-{n}.log"
    env = {**s.env, "KVDOC_BLOCK": str(scratch / "train.py"), "KVDOC_STEPS": str(log), "KVDOC_KILL": kill,
           "KVDOC_SLOW_AFTER": str(kill_after_steps or 0)}
    pid = z.start(scratch / "wrapper.py", s.cwd, env, out)
    s.groups.append(pid)
    if kill_after_steps is not None:
        deadline = time.monotonic() + 120
        while logged(log) < kill_after_steps and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
    rc = z.wait(180)
    assert rc is not None, f"run {n} did not end\n{out.read_text()}"
    return rc, steps(log), out.read_text()


@pytest.mark.timeout(300)
def test_the_readme_loop_resumes_after_sigkill_mid_epoch_and_at_an_epoch_boundary(lab: Any) -> None:
    s, _z, _scratch = lab
    home = s.home
    ds = kvdata.Dataset(home / "digits.kv")
    sampler = kvdata.ShardShuffleSampler(ds, seed=0)   # as the README: the order of an uninterrupted run
    n = len(ds)
    per_epoch = -(-n // BATCH)
    expected = [(e, k + 1, tuple(int(i) for i in sampler.indices(e)[k * BATCH:(k + 1) * BATCH]))
                for e in range(EPOCHS) for k in range(per_epoch)]
    ds.store.close()

    # 1: killed from outside in the middle of epoch 0, after its step-10 checkpoint
    rc, run1, _ = run(lab, 1, kill_after_steps=12)
    assert rc == 128 + signal.SIGKILL
    state1 = checkpoint(home)
    assert state1["epoch"] == 0 and 10 <= state1["batches"] < per_epoch, state1   # a mid-epoch checkpoint
    done = kept(run1, state1)

    # 2: resumes there; killed right after the checkpoint that closes epoch 1
    rc, run2, out2 = run(lab, 2, kill="boundary 1")
    assert rc == 128 + signal.SIGKILL, out2
    assert run2[0] == (0, state1["batches"] + 1, expected[state1["batches"]][2])   # the next batch, not the first
    state2 = checkpoint(home)
    assert (state2["epoch"], state2["batches"]) == (2, 0), state2                     # "epoch 1 done", unambiguous
    assert "epoch 0: accuracy" in out2 and "epoch 1: accuracy" in out2
    done += kept(run2, state2)

    # 3: resumes at epoch 2 (epoch 1 is not read again); killed as its last batch reaches the loop
    rc, run3, out3 = run(lab, 3, kill=f"last-batch 2 {per_epoch}")
    assert rc == 128 + signal.SIGKILL, out3
    assert run3[0][:2] == (2, 1)
    state3 = checkpoint(home)
    assert state3["epoch"] == 2 and 0 < state3["batches"] < per_epoch, state3
    done += kept(run3, state3)

    # 4: resumes from epoch 2's last mid-epoch checkpoint and finishes
    rc, run4, out4 = run(lab, 4)
    assert rc == 0, out4
    assert "epoch 2: accuracy" in out4
    state4 = checkpoint(home)
    assert (state4["epoch"], state4["batches"]) == (EPOCHS, 0), state4
    done += run4

    assert done == expected   # every epoch: every sample once, none lost, none repeated, in order
    for e in range(EPOCHS):
        seen = [i for step in done if step[0] == e for i in step[2]]
        assert sorted(seen) == list(range(n))

    # a finished run, started again, has nothing left to do
    rc, run5, out5 = run(lab, 5)
    assert rc == 0 and run5 == [] and "accuracy" not in out5, out5


# ------------------------------------------------------------------ the Loader's state, in process


def test_a_loader_state_after_a_whole_epoch_is_the_next_epochs_start(tmp_path: Path) -> None:
    import numpy as np

    kvdata.from_arrays(tmp_path / "d.kv", x=np.arange(100), shard_size="1KB")
    ds = kvdata.Dataset(tmp_path / "d.kv")

    def loader() -> kvdata.Loader:
        return kvdata.Loader(ds, 32, sampler=kvdata.ShardShuffleSampler(ds, seed=3), threads=1)

    a = loader()
    a.set_epoch(0)
    assert a.state_dict()["epoch"] == 0 and a.state_dict()["batches"] == 0
    for _ in a:
        pass
    assert a.state_dict() == {"epoch": 1, "batches": 0, "batch_size": 32}
    b = loader()
    b.load_state_dict(a.state_dict())
    assert b.epoch == 1
    b.set_epoch(b.epoch)
    got = [int(i) for batch in b for i in batch["x"]]
    assert got == [int(i) for i in kvdata.ShardShuffleSampler(ds, seed=3).indices(1)]   # epoch 1, whole

    # taken when the epoch's last (short) batch has reached the loop, before the loop ends:
    # it loads, and the epoch has nothing left
    c = loader()
    c.set_epoch(4)
    it = iter(c)
    for _ in range(4):
        next(it)
    state = c.state_dict()
    it.close()
    assert (state["epoch"], state["batches"]) == (4, 4)
    d = loader()
    d.load_state_dict(state)
    d.set_epoch(4)
    assert list(d) == []
    assert d.state_dict()["epoch"] == 5
    ds.store.close()
