"""Locality-aware sampling: ShardShuffleSampler(locality=True) and kvdata.order.locality's orders.

Nodes and ranks are simulated with the rank/world_size/nodes arguments (a rank's node is
rank // ranks per node, torchrun's layout); one test runs two real gloo ranks that find their
nodes from torch.distributed and LOCAL_WORLD_SIZE.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdata.order import blocked, locality
from kvdata.reader.sampler import ShardShuffleSampler, _node_identity


class Shards:
    """The one thing the sampler reads from a dataset: the shard of every sample."""

    def __init__(self, counts: list[int] | np.ndarray) -> None:
        self.sample_shards = np.repeat(np.arange(len(counts), dtype=np.uint32), counts)

    def __len__(self) -> int:
        return len(self.sample_shards)


EVEN = Shards([24] * 40)            # 960 samples: divides by 8, 4 and 6 ranks
UNEVEN = Shards(np.random.default_rng(5).integers(5, 40, size=37))


def samplers(ds, nodes: int, per_node: int, **kw) -> list[ShardShuffleSampler]:
    world = nodes * per_node
    return [ShardShuffleSampler(ds, rank=r, world_size=world, nodes=nodes, locality=True, **kw) for r in range(world)]


def run_epoch(ss: list[ShardShuffleSampler], e: int) -> list[list[int]]:
    for s in ss:
        s.set_epoch(e)
    return [list(s) for s in ss]


def node_shards(ds, shares: list[list[int]], nodes: int) -> list[set[int]]:
    per_node = len(shares) // nodes
    return [set(ds.sample_shards[list(itertools.chain(*shares[j * per_node:(j + 1) * per_node]))].tolist())
            for j in range(nodes)]


# ---------------------------------------------------------------- coverage and equal lengths

@pytest.mark.parametrize("exchange", [0.0, 0.1, 0.3, 1.0])
def test_every_sample_once_per_epoch_4_nodes_x_2_ranks(exchange) -> None:
    ss = samplers(EVEN, 4, 2, seed=3, window=4, exchange=exchange)
    assert [s.node for s in ss] == [0, 0, 1, 1, 2, 2, 3, 3]
    for e in range(4):
        shares = run_epoch(ss, e)
        assert all(len(x) == len(ss[0]) == 120 for x in shares)
        assert sorted(itertools.chain(*shares)) == list(range(960))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("nodes,per_node", [(4, 2), (3, 2), (5, 1), (2, 3)])
def test_uneven_dataset_equal_len_and_at_most_padding(nodes, per_node, drop_last) -> None:
    n, world = len(UNEVEN), nodes * per_node
    ss = samplers(UNEVEN, nodes, per_node, seed=1, exchange=0.2, drop_last=drop_last)
    for e in range(3):
        shares = run_epoch(ss, e)
        per = blocked.samples_per_rank(n, world, drop_last)
        assert all(len(x) == len(s) == per for x, s in zip(shares, ss))
        flat = list(itertools.chain(*shares))
        if drop_last:
            assert len(set(flat)) == len(flat) and n - len(flat) < world
        else:
            assert set(flat) == set(range(n)) and len(flat) - n < world


def test_a_node_reads_its_own_shards() -> None:
    """Each node's ranks read the node's part of the shards (apart from the few samples that
    even out the nodes' counts), and the parts of the nodes are disjoint."""
    ds = Shards([30] * 256)
    ss = samplers(ds, 4, 2, seed=0, exchange=0.1)
    g = blocked.group_by_shard(ds.sample_shards)
    for e in range(3):
        shares = run_epoch(ss, e)
        part = locality.node_of_shards(g, 0, e, 4, 0.1)
        for j in range(4):
            mine = np.concatenate([shares[2 * j], shares[2 * j + 1]])
            own = part[ds.sample_shards[mine]] == j
            assert own.mean() >= 0.9, (e, j, own.mean())
        sizes = np.bincount(part, minlength=4)                   # about equal parts: within 6 shards of 64
        assert sizes.sum() == 256 and np.abs(sizes - 64).max() <= 6, sizes


def test_nodes_1_is_the_default_order() -> None:
    for world, drop_last in [(1, False), (3, False), (3, True)]:
        for r in range(world):
            a = ShardShuffleSampler(UNEVEN, seed=4, window=4, rank=r, world_size=world, drop_last=drop_last)
            b = ShardShuffleSampler(UNEVEN, seed=4, window=4, rank=r, world_size=world, drop_last=drop_last,
                                    locality=True, nodes=1)
            for e in (0, 1):
                assert np.array_equal(a.indices(e), b.indices(e))


# ---------------------------------------------------------------- determinism

def test_deterministic_from_the_seed() -> None:
    a, b = samplers(EVEN, 4, 2, seed=7), samplers(EVEN, 4, 2, seed=7)
    assert run_epoch(a, 2) == run_epoch(b, 2)
    assert run_epoch(b, 1) == run_epoch(a, 1)                 # any epoch, in any order
    assert run_epoch(a, 1) != run_epoch(a, 2)
    assert run_epoch(samplers(EVEN, 4, 2, seed=8), 1) != run_epoch(a, 1)
    # a rank computes its share alone, and gets the row every other rank planned for it
    lone = ShardShuffleSampler(EVEN, seed=7, rank=5, world_size=8, nodes=4, locality=True)
    assert list(epoch_of(lone, 2)) == run_epoch(a, 2)[5]


def epoch_of(s: ShardShuffleSampler, e: int) -> list[int]:
    s.set_epoch(e)
    return list(s)


# ---------------------------------------------------------------- stability and mixing

@pytest.mark.parametrize("nodes", [2, 4, 16])
@pytest.mark.parametrize("exchange", [0.0, 0.05, 0.1, 0.3])
def test_a_node_keeps_all_but_about_exchange_of_its_shards(nodes, exchange) -> None:
    g = blocked.group_by_shard(np.repeat(np.arange(800), 10))
    parts = [locality.node_of_shards(g, 9, e, nodes, exchange) for e in range(30)]
    moved = []
    for a, b in zip(parts, parts[1:]):
        for j in range(nodes):
            mine = a == j
            moved.append(float((b[mine] != j).mean()))
    mean = float(np.mean(moved))
    if exchange == 0:
        assert max(moved) == 0.0
    else:
        assert 0.85 * exchange <= mean <= 1.15 * exchange, (mean, exchange)
    # balanced by sample count: every node within a few shards of its share
    for p in parts:
        assert np.abs(np.bincount(p, minlength=nodes) - 800 / nodes).max() <= 3 + 800 / nodes * 0.08


def test_the_sampler_moves_about_exchange_of_a_nodes_shards() -> None:
    """Measured on what the ranks read: the shards a node's ranks read in one epoch and the next."""
    ds = Shards([20] * 200)
    for exchange in (0.1, 0.3):
        ss = samplers(ds, 4, 2, seed=2, exchange=exchange, window=4)
        sets = [node_shards(ds, run_epoch(ss, e), 4) for e in range(12)]
        new = [len(b[j] - a[j]) / len(b[j]) for a, b in zip(sets, sets[1:]) for j in range(4)]
        assert 0.7 * exchange <= float(np.mean(new)) <= 1.3 * exchange + 0.03, (exchange, np.mean(new))
    glob = [ShardShuffleSampler(ds, seed=2, rank=r, world_size=8) for r in range(8)]
    sets = [node_shards(ds, run_epoch(glob, e), 4) for e in range(4)]
    new = [len(b[j] - a[j]) / len(b[j]) for a, b in zip(sets, sets[1:]) for j in range(4)]
    assert float(np.mean(new)) > 0.6                          # the global order: most shards are new


@pytest.mark.parametrize("exchange,epochs", [(0.1, 500), (0.3, 300), (1.0, 150)])
def test_every_pair_of_shards_meets_on_a_node(exchange, epochs) -> None:
    k, nodes = 40, 4
    g = blocked.group_by_shard(np.repeat(np.arange(k), 5))
    met = np.zeros((k, k), dtype=bool)
    first_all = None
    cache = locality.SlotCache(g.counts, 1, exchange)                   # replays one epoch per call, not e
    for e in range(epochs):
        p = locality.node_of_shards(g, 1, e, nodes, exchange, cache=cache)
        met |= p[:, None] == p[None, :]
        if first_all is None and met.all():
            first_all = e
    assert met.all(), f"{int((~met).sum()) // 2} pairs never met in {epochs} epochs"
    assert first_all is not None and first_all < epochs
    # exchange=0: the partition never changes, so shards of different nodes never meet
    p0 = [locality.node_of_shards(g, 1, e, nodes, 0.0) for e in range(5)]
    assert all(np.array_equal(p0[0], p) for p in p0)


# ---------------------------------------------------------------- balance in whole shards (issue 14: traffic ~ exchange)

def layout_counts(nodes: int, per_node: int, sizes: str, seed: int = 0) -> np.ndarray:
    k = nodes * per_node
    return np.full(k, 12) if sizes == "equal" else np.random.default_rng(seed).integers(6, 19, size=k)


GRID = [(nodes, per_node, sizes) for nodes in (2, 4, 8, 16) for per_node in (16, 64) for sizes in ("equal", "unequal")]


def node_reads(counts: np.ndarray, nodes: int, per_node_ranks: int, exchange: float, epochs: int,
               seed: int = 0) -> list[list[dict[int, int]]]:
    """For each epoch and node: {shard: samples of it the node's ranks read}, from locality_shares."""
    g = blocked.group_by_shard(np.repeat(np.arange(len(counts)), counts))
    shard_of = np.repeat(np.arange(len(counts)), counts)
    cache = locality.SlotCache(g.counts, seed, exchange)
    out = []
    for e in range(epochs):
        shares = locality.locality_shares(g, seed, e, nodes, nodes * per_node_ranks, exchange, window=4, cache=cache)
        per = []
        for j in range(nodes):
            samples = np.unique(shares[j * per_node_ranks:(j + 1) * per_node_ranks])     # padding repeats some
            ids, n = np.unique(shard_of[samples], return_counts=True)
            per.append(dict(zip(ids.tolist(), n.tolist())))
        out.append(per)
    return out


@pytest.mark.parametrize("nodes,per_node,sizes", GRID)
def test_new_shards_per_epoch_are_about_exchange(nodes, per_node, sizes) -> None:
    """Of the shards a node reads in epoch e + 1, about `exchange` are new to it (its tier
    fetches those): the nodes are evened out in whole shards, so no node reads the tail of
    another's order (before: 0.18 at 4 nodes x 16 shards, 0.24 at 8 x 16 unequal)."""
    reads = node_reads(layout_counts(nodes, per_node, sizes), nodes, 2, 0.1, 14)
    new = [len(b[j].keys() - a[j].keys()) / len(b[j]) for a, b in zip(reads, reads[1:]) for j in range(nodes)]
    assert 0.07 <= float(np.mean(new)) <= 0.125, (nodes, per_node, sizes, np.mean(new))


@pytest.mark.parametrize("nodes,per_node,sizes", GRID)
def test_at_most_one_split_shard_per_pair_of_neighbours(nodes, per_node, sizes) -> None:
    """A shard read by two nodes is read by two neighbours j, j + 1 and no other shard is shared
    by that pair, so a node reads parts of at most two shards; when the nodes' shares are whole
    shards (equal shards, 12 a shard here) no shard is split at all."""
    counts = layout_counts(nodes, per_node, sizes)
    for per in node_reads(counts, nodes, 2, 0.1, 6):
        shared: dict[int, list[int]] = {}
        for j, got in enumerate(per):
            for s, n in got.items():
                if n < counts[s]:
                    shared.setdefault(s, []).append(j)
        pairs = [tuple(js) for js in shared.values()]
        assert all(len(p) == 2 and p[1] == p[0] + 1 for p in pairs), pairs
        assert len(set(pairs)) == len(pairs) <= nodes - 1
        if sizes == "equal":
            assert not pairs


def test_node_counts_differ_by_at_most_one() -> None:
    """The cuts are even: every node's order has n // nodes or n // nodes + 1 samples, also over
    what a resume leaves (keep), so ranks get equal counts with padding from their own node."""
    g = blocked.group_by_shard(UNEVEN.sample_shards)
    n = g.num_samples
    keep = np.random.default_rng(1).random(n) < 0.6
    for nodes, e, k in itertools.product((2, 3, 5), (0, 3), (None, keep)):
        order, bounds = locality.locality_node_orders(g, 2, e, nodes, 0.2, window=3, keep=k)
        left = n if k is None else int(k.sum())
        assert sorted(order.tolist()) == (list(range(n)) if k is None else np.flatnonzero(k).tolist())
        assert set(np.diff(bounds).tolist()) <= {left // nodes, left // nodes + 1}


def test_padding_repeats_the_nodes_own_samples() -> None:
    ds = Shards([7] * 9)                                         # 63 samples on 4 nodes x 2 ranks: 8 a rank
    g = blocked.group_by_shard(ds.sample_shards)
    order, bounds = locality.locality_node_orders(g, 3, 1, 4, 0.1, window=2)
    shares = locality.locality_shares(g, 3, 1, 4, 8, 0.1, window=2)
    assert shares.shape == (8, 8)
    for j in range(4):
        mine = shares[2 * j:2 * j + 2].ravel()
        own = order[bounds[j]:bounds[j + 1]]
        assert set(mine.tolist()) == set(own.tolist())            # padding included: nothing of another node
        assert mine[:len(own)].tolist() == own.tolist()


def test_slot_cache_is_the_replay_from_scratch() -> None:
    counts = layout_counts(4, 16, "unequal")
    cache = locality.SlotCache(counts, 5, 0.1)
    for e in [0, 1, 2, 7, 3, 30, 30, 31, 0]:                      # forwards, back, the same epoch again
        for nodes in (2, 4):
            assert np.array_equal(cache.slots(e, nodes), locality.shard_slots(counts, 5, e, nodes, 0.1))
    g = blocked.group_by_shard(np.repeat(np.arange(len(counts)), counts))
    with pytest.raises(ValueError, match="SlotCache"):
        locality.locality_shares(g, 6, 0, 4, 4, 0.1, cache=cache)       # another seed
    with pytest.raises(ValueError, match="epoch"):
        cache.slots(-1, 4)


def test_slots_keep_every_cut_inside_its_split_shard() -> None:
    """The row's invariant, epoch after epoch: node j's whole shards end at or before its cut, and
    the split shard of j and j + 1 (if any) covers it."""
    for sizes in ("equal", "unequal"):
        counts = layout_counts(8, 16, sizes, seed=3)
        cache = locality.SlotCache(counts, 3, 0.3)
        cuts = locality.node_cuts(int(counts.sum()), 8)
        for e in range(40):
            slot = cache.slots(e, 8)
            per_slot = np.bincount(slot, weights=counts, minlength=15).astype(np.int64)
            through = np.cumsum(per_slot)[0:-1:2]
            assert ((through <= cuts) & (cuts <= through + per_slot[1::2])).all(), (sizes, e)
            assert np.bincount(slot, minlength=15)[1::2].max() <= 1


# ---------------------------------------------------------------- resume

def resumed(ds, state: dict, nodes: int, per_node: int, **kw) -> list[list[int]]:
    """Every rank of a (possibly different) world loads rank 0's checkpoint (via JSON) and reads on."""
    out = []
    for s in samplers(ds, nodes, per_node, **kw):
        s.load_state_dict(json.loads(json.dumps(state)))
        s.set_epoch(state["epoch"])
        out.append(list(s))
    return out


def test_resume_same_world_is_exact() -> None:
    kw = dict(seed=9, window=4, exchange=0.2)
    ref = run_epoch(samplers(UNEVEN, 4, 2, **kw), 1)
    ss = samplers(UNEVEN, 4, 2, **kw)
    for s in ss:
        s.set_epoch(1)
    its = [iter(s) for s in ss]
    heads = [list(itertools.islice(it, 37)) for it in its]
    state = ss[0].state_dict()
    assert state["position"] == 37 and state["history"] == [] and state["nodes"] == 4
    rest = resumed(UNEVEN, state, 4, 2, **kw)
    assert [h + r for h, r in zip(heads, rest)] == ref
    t = samplers(UNEVEN, 4, 2, **kw)[3]
    t.load_state_dict(state)
    assert t.state_dict()["position"] == 37
    assert list(t) == ref[3][37:] and list(t) == ref[3]        # then the epoch again, from its start
    assert epoch_of(t, 2) == run_epoch(samplers(UNEVEN, 4, 2, **kw), 2)[3]


def consumed_after(shares: list[list[int]], pos: int) -> list[int]:
    return list(itertools.chain(*(x[:pos] for x in shares)))


@pytest.mark.parametrize("pos", [0, 1, 50, 119, 120])
def test_resume_4x2_onto_2x2_visits_the_rest_once(pos) -> None:
    kw = dict(seed=5, window=4, exchange=0.1)
    old = samplers(EVEN, 4, 2, **kw)
    shares = run_epoch(old, 2)
    old[0].set_epoch(2)
    state = old[0].state_dict(consumed=pos)
    done = consumed_after(shares, pos)
    rest = resumed(EVEN, state, 2, 2, **kw)
    assert len({len(x) for x in rest}) == 1                    # equal per rank
    flat = list(itertools.chain(*rest))
    assert not set(flat) & set(done)
    assert sorted(flat + done) == list(range(960))             # 960 - 8 pos divides by 4: no padding
    # the new nodes read their own part of the shards (the new world's partition)
    part = locality.node_of_shards(blocked.group_by_shard(EVEN.sample_shards), 5, 2, 2, 0.1)
    for j in range(2):
        mine = rest[2 * j] + rest[2 * j + 1]
        if pos <= 50:                                            # (not when a few samples are left)
            assert (part[EVEN.sample_shards[mine]] == j).mean() >= 0.9


def test_resume_2x2_onto_3x2_and_a_chain_of_worlds() -> None:
    kw = dict(seed=6, window=4, exchange=0.3)
    old = samplers(EVEN, 2, 2, **kw)
    shares = run_epoch(old, 1)
    old[0].set_epoch(1)
    state = old[0].state_dict(consumed=70)
    done = consumed_after(shares, 70)
    mid = resumed(EVEN, state, 3, 2, **kw)
    flat = list(itertools.chain(*mid))
    remaining = set(range(960)) - set(done)
    assert len({len(x) for x in mid}) == 1
    assert set(flat) == remaining and len(flat) - len(remaining) < 6   # plus wrap-around padding only
    assert len(remaining) == 680 and len(flat) == 684                  # 6 x 114: 4 padded

    # 3x2 checkpoints 40 samples into its part, then the job goes on with 4x2 (3 worlds in one epoch)
    ss = samplers(EVEN, 3, 2, **kw)
    for s in ss:
        s.load_state_dict(json.loads(json.dumps(state)))
    heads = [list(itertools.islice(iter(s), 40)) for s in ss]
    assert heads == [x[:40] for x in mid]
    state2 = ss[0].state_dict()
    assert state2["history"] == [[2, 4, 70]] and state2["position"] == 40 and state2["nodes"] == 3
    assert len(json.dumps(state2)) < 600                              # small, whatever the dataset
    done2 = set(done) | set(itertools.chain(*heads))
    last = resumed(EVEN, state2, 4, 2, **kw)
    flat = list(itertools.chain(*last))
    assert len({len(x) for x in last}) == 1
    assert set(flat) == set(range(960)) - done2 and len(flat) - len(set(range(960)) - done2) < 8
    # the next epoch is whole again, on the new world
    s = samplers(EVEN, 4, 2, **kw)[0]
    s.load_state_dict(state2)
    s.set_epoch(2)
    assert list(s) == run_epoch(samplers(EVEN, 4, 2, **kw), 2)[0]


def test_state_is_checked() -> None:
    loc = ShardShuffleSampler(EVEN, seed=1, rank=0, world_size=4, nodes=2, locality=True)
    plain = ShardShuffleSampler(EVEN, seed=1, rank=0, world_size=4)
    assert "locality" not in plain.state_dict()                         # the default's state is as before
    with pytest.raises(ValueError, match="locality"):
        plain.load_state_dict(loc.state_dict())
    with pytest.raises(ValueError, match="locality"):
        loc.load_state_dict(plain.state_dict())
    other = ShardShuffleSampler(EVEN, seed=1, rank=0, world_size=4, nodes=2, locality=True, exchange=0.5)
    with pytest.raises(ValueError, match="exchange"):
        other.load_state_dict(loc.state_dict())
    for bad, word in [({"position": 10_000}, "position"), ({"history": [[3, 4, 0]]}, "history"),
                      ({"history": "x"}, "history")]:
        with pytest.raises(ValueError, match=word):
            loc.load_state_dict({**loc.state_dict(), **bad})
    with pytest.raises(ValueError, match="world_size"):                # the default still rejects another world
        ShardShuffleSampler(EVEN, seed=1, rank=0, world_size=2).load_state_dict(plain.state_dict())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of nodes"):
        ShardShuffleSampler(EVEN, rank=0, world_size=6, nodes=4, locality=True)
    with pytest.raises(ValueError, match="node 2"):
        ShardShuffleSampler(EVEN, rank=0, world_size=4, nodes=2, node=2, locality=True)
    with pytest.raises(ValueError, match="exchange"):
        ShardShuffleSampler(EVEN, rank=0, world_size=4, nodes=2, exchange=1.5, locality=True)
    with pytest.raises(ValueError, match="nodes"):
        locality.node_of_shards(blocked.group_by_shard(EVEN.sample_shards), 0, 0, 0, 0.1)


def test_node_identity() -> None:
    assert _node_identity(5, 8, 4, None, False) == (4, 2, 5)
    assert _node_identity(5, 8, None, None, False) == (1, 0, 5)          # no torch.distributed: one node
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "2", "1"
    try:
        assert _node_identity(5, 8, None, None, True) == (4, 2, 5)       # torchrun: 8 // 2 nodes
        assert _node_identity(5, 8, None, 0, True) == (4, 0, 1)          # node given: LOCAL_RANK inside it
        assert _node_identity(5, 8, None, None, False) == (1, 0, 5)      # the variable alone is not trusted
    finally:
        del os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]


def test_node_identity_from_torch_distributed(tmp_path: Path) -> None:
    """Two real gloo ranks, one per "node" (LOCAL_WORLD_SIZE=1, as torchrun sets on 2 nodes x 1
    process): each finds nodes=2 and its node, and together they read every sample once."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        import numpy as np
        import torch.distributed as dist
        from kvdata.reader.sampler import ShardShuffleSampler

        class Shards:
            sample_shards = np.repeat(np.arange(20, dtype=np.uint32), 10)
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
        s = ShardShuffleSampler(Shards(), seed=3, locality=True)
        out = {"nodes": s.nodes, "node": s.node, "idx": list(s)}
        dist.destroy_process_group()
        print(json.dumps(out))
    """))
    env = {**os.environ, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "rdzv")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    got = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert [(g["nodes"], g["node"]) for g in got] == [(2, 0), (2, 1)]
    assert sorted(got[0]["idx"] + got[1]["idx"]) == list(range(200))
    ref = samplers(Shards([10] * 20), 2, 1, seed=3)
    assert [g["idx"] for g in got] == run_epoch(ref, 0)


# ---------------------------------------------------------------- the staging engine

def test_announces_the_nodes_shards_this_epoch_and_next() -> None:
    class Listening(Shards):
        def __init__(self) -> None:
            super().__init__([20] * 32)
            self.announced: list = []
            self.progress_calls = 0

        def announce(self, reader: str, seq: list, position: int = 0) -> None:
            self.announced.append(seq)

        def progress(self, reader: str, position: int) -> None:
            self.progress_calls += 1

    ds = Listening()
    s = ShardShuffleSampler(ds, seed=2, window=2, rank=2, world_size=4, nodes=2, locality=True)
    got = list(s)
    this = list(dict.fromkeys(ds.sample_shards[got].tolist()))
    nxt = s.shard_order(1).tolist()
    assert ds.announced == [this + nxt] and ds.progress_calls > 0
    part0, part1 = (locality.node_of_shards(blocked.group_by_shard(ds.sample_shards), 2, e, 2, 0.1) for e in (0, 1))
    assert np.mean(part0[this] == 1) >= 0.9 and np.mean(part1[nxt] == 1) >= 0.9   # node 1's shards


# ---------------------------------------------------------------- planning speed

def test_plans_10m_samples_quickly(capsys: pytest.CaptureFixture[str]) -> None:
    n = 10_000_000
    g = blocked.group_by_shard(np.repeat(np.arange(1000, dtype=np.uint32), n // 1000))
    locality.locality_shares(g, 0, 0, 2, 2, 0.1)         # warm up numpy
    t0 = time.perf_counter()
    shares = locality.locality_shares(g, 0, 7, 16, 128, 0.1, window=8)
    dt = time.perf_counter() - t0
    assert shares.shape == (128, n // 128) and shares.dtype == np.int32
    assert (np.bincount(shares.ravel(), minlength=n) == 1).all()
    with capsys.disabled():
        print(f"\n[locality plan 10M samples / 1000 shards, 16 nodes x 8 ranks] {dt:.2f}s")
    assert dt < 2.0


# ---------------------------------------------------------------- any layout, any worlds

@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 30), min_size=0, max_size=30), seed=st.integers(0, 2**32),
       epoch=st.integers(0, 500), exchange=st.sampled_from([0.0, 0.1, 0.3, 1.0]),
       worlds=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3), st.floats(0, 1)), min_size=1, max_size=3),
       drop_last=st.booleans())
def test_locality_shares_cover_the_rest_of_the_epoch_once(counts, seed, epoch, exchange, worlds, drop_last) -> None:
    """A chain of worlds in one epoch, each reading part of its share: together they read every
    sample at most once apart from the padding, and without drop_last every sample."""
    g = blocked.group_by_shard(np.repeat(np.arange(len(counts)), counts))
    n = g.num_samples
    history: list[tuple[int, int, int]] = []
    read: list[int] = []
    for i, (nodes, per_node, frac) in enumerate(worlds):
        world = nodes * per_node
        shares = locality.locality_shares(g, seed, epoch, nodes, world, exchange, window=3, drop_last=drop_last,
                                          history=tuple(history))
        left = n - len(set(read))
        assert shares.shape == (world, blocked.samples_per_rank(left, world, drop_last))
        flat = shares.ravel().tolist()
        assert not set(flat) & set(read)                                   # nothing read twice
        if drop_last:
            assert len(set(flat)) == len(flat) and left - len(flat) < world
        else:
            assert set(flat) | set(read) == set(range(n)) and len(flat) - left < world
        last = i == len(worlds) - 1
        pos = shares.shape[1] if last else int(frac * shares.shape[1])
        read += shares[:, :pos].ravel().tolist()
        history.append((nodes, world, pos))
    if not drop_last:
        assert set(read) == set(range(n))


def test_empty_and_tiny_datasets() -> None:
    for counts in ([], [1], [2, 1]):
        ds = Shards(counts)
        n = len(ds)
        ss = samplers(ds, 3, 2, seed=0)
        shares = run_epoch(ss, 0)
        assert all(len(x) == blocked.samples_per_rank(n, 6, False) for x in shares)
        assert set(itertools.chain(*shares)) == set(range(n))


def test_a_real_dataset_through_dataloaders(tmp_path: Path) -> None:
    """2 nodes x 2 ranks read a real kvdata dataset through DataLoaders: every record once per
    epoch, the record read is the one the index names; shuffle=False too."""
    import torch.utils.data

    import kvdata

    path = tmp_path / "ds.kv"
    with kvdata.open(path, "w") as w:
        for j in range(20):
            w.put_many((f"k{10 * j + i:04d}", {"x": np.full(8, 10 * j + i, dtype=np.int32), "i": 10 * j + i})
                       for i in range(10))
            w.seal()
            w.commit()
    ds = kvdata.Dataset(path)
    assert np.bincount(np.asarray(ds.sample_shards)).tolist() == [10] * 20
    for shuffle in (True, False):
        ss = samplers(ds, 2, 2, seed=4, window=2, shuffle=shuffle)
        for e in (0, 1):
            got = []
            for s in ss:
                s.set_epoch(e)
                dl = torch.utils.data.DataLoader(ds, sampler=s, batch_size=8, collate_fn=kvdata.collate)
                mine = []
                for batch in dl:
                    assert (batch["x"] == batch["i"][:, None].to(batch["x"].dtype)).all()
                    mine += batch["i"].tolist()
                assert mine == list(s) and len(mine) == len(s) == 50
                got += mine
            assert sorted(got) == list(range(200))
