"""ShardShuffleSampler under real torch.distributed: 2 processes, gloo, file rendezvous.

Each rank builds the sampler WITHOUT rank/world_size (they must come from the process
group), runs 2 epochs, resumes epoch 1 from a mid-epoch state_dict, reads epoch 1 through
a DataLoader, and all_gathers what it saw; rank 0 writes the gathered results for the test.
This file is also the worker script: `python test_distributed.py DATASET INITFILE RANK OUT`.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import kvdata

WORLD, SEED, WINDOW, STOP_AT = 2, 3, 8, 137
PER_SHARD, FULL_SHARDS, EXTRA = 25, 40, 3
N = PER_SHARD * FULL_SHARDS + EXTRA          # 1003, odd: rank 1 gets one wrap-around pad
DEADLINE_S = 60


def build(path: Path) -> Path:
    with kvdata.open(path, "w", shard_size="64KB") as s:
        s.put_many((f"k{i:05d}", {"x": np.full(600, i, dtype=np.int32), "i": i}) for i in range(N))
        s.seal()
    return path


# ---------------------------------------------------------------- the worker (one rank)

def worker(dataset: str, init_file: str, rank: int, out: str) -> None:
    import torch.distributed as dist
    import torch.utils.data

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    try:
        ds = kvdata.Dataset(dataset)

        def sampler() -> kvdata.ShardShuffleSampler:
            return kvdata.ShardShuffleSampler(ds, seed=SEED)      # rank/world from the process group

        s = sampler()
        res: dict = {"rank": s.rank, "world_size": s.world_size, "dist_rank": dist.get_rank(),
                     "len": len(s), "epochs": [], "shard_orders": []}
        for e in (0, 1):
            res["shard_orders"].append(s.shard_order(e).tolist())   # planned ahead, as the stager does
            s.set_epoch(e)
            res["epochs"].append(list(s))

        # stop mid-epoch 1, checkpoint (as JSON), restart with a fresh sampler
        a = sampler()
        a.set_epoch(1)
        head = list(itertools.islice(iter(a), STOP_AT))
        state = json.loads(json.dumps(a.state_dict()))
        b = sampler()
        b.load_state_dict(state)
        b.set_epoch(1)
        res["state"] = state
        res["resumed_head"], res["resumed_rest"] = head, list(b)
        # the usual checkpoint: only rank 0 saves; every rank loads rank 0's state
        shared = [state]
        dist.broadcast_object_list(shared, src=0)
        c = sampler()
        c.load_state_dict(shared[0])
        res["resumed_from_rank0"] = list(c)

        # epoch 1 through a DataLoader: the samples read are the sampler's indices
        dl = torch.utils.data.DataLoader(ds, sampler=s, batch_size=8, num_workers=0, collate_fn=kvdata.collate)
        s.set_epoch(1)
        read, content_ok = [], True
        for batch in dl:
            content_ok &= bool((batch["x"] == batch["i"][:, None].to(batch["x"].dtype)).all())
            read += batch["i"].tolist()
        res["read"], res["content_ok"] = read, content_ok

        gathered: list = [None] * WORLD
        dist.all_gather_object(gathered, res)
        if rank == 0:
            tmp = out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(gathered, f)
            os.rename(tmp, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the test

def run_job(dataset: Path, tmp: Path) -> list[dict]:
    init_file, out = tmp / "rendezvous", tmp / "gathered.json"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(dataset), str(init_file), str(r), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(WORLD)]
    deadline = time.monotonic() + DEADLINE_S
    errors = []
    try:
        for r, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {r} still running after {DEADLINE_S}s: a hang") from None
            if p.returncode != 0:
                errors.append(f"rank {r} exited {p.returncode}:\n{err.decode(errors='replace')[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not errors, "\n".join(errors)
    return json.loads(out.read_text())


def test_two_gloo_ranks(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="needs torch (pip install 'kvdata[torch]')")
    from kvdata.order import blocked as om
    from kvdata.reader.sampler import ShardShuffleSampler

    dataset = build(tmp_path / "ds.kv")
    got = run_job(dataset, tmp_path)
    ds = kvdata.Dataset(dataset)
    shards = np.asarray(ds.sample_shards)
    groups = om.group_by_shard(shards)
    per = (N + 1) // 2

    assert [g["rank"] for g in got] == [g["dist_rank"] for g in got] == [0, 1]
    assert all(g["world_size"] == WORLD and g["len"] == per for g in got)

    for e in (0, 1):
        r0, r1 = got[0]["epochs"][e], got[1]["epochs"][e]
        assert len(r0) == len(r1) == per                                  # equal shares
        full = om.epoch_order(groups, SEED, e, WINDOW).tolist()
        assert r0 + r1 == full + full[:1]                                  # contiguous slices + wrap pad
        assert set(r0) & set(r1) == {full[0]} and r1[-1] == full[0]        # disjoint apart from the pad
        assert len(set(r0)) == len(set(r1)) == per                         # no repeats within a rank
        assert set(r0) | set(r1) == set(range(N))                          # every sample
        # deterministic: the same as a single process with explicit rank/world_size
        for r in range(WORLD):
            ref = ShardShuffleSampler(ds, seed=SEED, rank=r, world_size=WORLD)
            ref.set_epoch(e)
            assert got[r]["epochs"][e] == list(ref)
            # the stager's plan is the order this rank first reads its shards
            assert got[r]["shard_orders"][e] == list(dict.fromkeys(shards[got[r]["epochs"][e]].tolist()))
        # the ranks read mostly different shards: they share only the window at the cut and the pad's shard
        assert len(set(shards[r0].tolist()) & set(shards[r1].tolist())) <= WINDOW + 1
    assert got[0]["epochs"][0] != got[0]["epochs"][1]

    for g in got:
        assert g["state"]["epoch"] == 1 and g["state"]["position"] == STOP_AT
        assert g["state"]["rank"] == g["rank"] and g["state"]["world_size"] == WORLD
        assert g["resumed_rest"] == g["epochs"][1][STOP_AT:]                # identical remainder
        assert g["resumed_head"] + g["resumed_rest"] == g["epochs"][1]
        assert g["resumed_from_rank0"] == g["epochs"][1][STOP_AT:]
        assert g["read"] == g["epochs"][1] and g["content_ok"]             # DataLoader read those samples


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
