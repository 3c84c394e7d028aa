"""bench/cluster_sim.py: the cluster simulation replays the real sampler and the real policy.

The rows, announced sequences and progress positions the simulation derives are compared with a
real ShardShuffleSampler (sample level); the node model's keep set with kvdata.tiers.policy's;
conservation, the warm-epoch traffic of the two orders and monotonicity in the budget are
checked on small clusters (seconds). The calibration comparison is tested on a fixture this
test makes from the simulation itself (labelled synthetic: it is not a measurement).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvdata.reader.sampler import ShardShuffleSampler
from kvdata.tiers import policy
from kvdata.tiers.staging.keep_set import KEEP_READING

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)   # (cluster_sim puts bench/ on sys.path for its siblings, as staging.py does)
    return mod


sim = _load("cluster_sim")
plan = sys.modules["_cluster_plan"]
node_mod = sys.modules["_cluster_node"]


class Shards:
    """What the sampler reads from a dataset (the shard of every sample), and what it tells a stager."""

    def __init__(self, shards: int, per_shard: int) -> None:
        self.sample_shards = np.repeat(np.arange(shards, dtype=np.int64), per_shard)
        self.announced: list[list[int]] = []
        self.positions: list[int] = []

    def __len__(self) -> int:
        return len(self.sample_shards)

    def announce(self, reader: str, seq: list, position: int = 0) -> None:
        self.announced.append(list(seq))
        self.positions.append(position)

    def progress(self, reader: str, position: int) -> None:
        self.positions.append(position)


LAYOUT = plan.Layout(shards=48, slots=20, nodes=4, per_node=2, window=4, seed=3, exchange=0.25)


def sampler_for(ds: Shards, sampler: str, rank: int) -> ShardShuffleSampler:
    return ShardShuffleSampler(ds, seed=LAYOUT.seed, window=LAYOUT.window, rank=rank, world_size=LAYOUT.world,
                               locality=sampler == "locality", exchange=LAYOUT.exchange, nodes=LAYOUT.nodes)


# ---------------------------------------------------------------- the real sampler

@pytest.mark.parametrize("sampler", ["global", "locality"])
def test_rows_are_what_shard_shuffle_sampler_yields(sampler: str) -> None:
    groups = LAYOUT.groups()
    for epoch in (0, 1, 4):
        rows = plan.epoch_rows(LAYOUT, groups, sampler, epoch, range(LAYOUT.world))
        for r in range(LAYOUT.world):
            s = sampler_for(Shards(LAYOUT.shards, LAYOUT.slots), sampler, r)
            s.set_epoch(epoch)
            assert list(s) == rows[r].tolist(), (sampler, epoch, r)


@pytest.mark.parametrize("sampler", ["global", "locality"])
def test_announced_sequence_and_progress_are_the_samplers(sampler: str) -> None:
    groups = LAYOUT.groups()
    rank = 5
    ds = Shards(LAYOUT.shards, LAYOUT.slots)
    s = sampler_for(ds, sampler, rank)
    s.set_epoch(2)
    n = len(list(s))
    this = plan.RankEpoch.of(LAYOUT, plan.epoch_rows(LAYOUT, groups, sampler, 2, [rank])[rank])
    nxt = plan.RankEpoch.of(LAYOUT, plan.epoch_rows(LAYOUT, groups, sampler, 3, [rank])[rank])
    assert ds.announced == [this.seq.tolist() + plan.announced_next(LAYOUT, groups, sampler, 2, rank, nxt).tolist()]
    # the sampler reports its position at every 32nd sample when it changes
    want = [this.position(0)]
    for c in range(0, n, 32):
        if this.position(c) != want[-1]:
            want.append(this.position(c))
    assert ds.positions == want


def test_blocks_are_the_windows_a_reader_reads_together() -> None:
    groups = LAYOUT.groups()
    for sampler in ("global", "locality"):
        rows = plan.epoch_rows(LAYOUT, groups, sampler, 1, range(LAYOUT.world))
        for row in rows.values():
            ep = plan.RankEpoch.of(LAYOUT, row)
            seen: list[int] = []
            for b in range(len(ep.block_start)):
                lo = int(ep.block_start[b])
                hi = int(ep.block_start[b + 1]) if b + 1 < len(ep.block_start) else len(row)
                inside = set(ep.shards[lo:hi].tolist())
                assert inside == set(ep.block_shards(b).tolist())          # its own shards, nothing else
                assert len(inside) <= LAYOUT.window                          # at most one window
                assert not inside & set(seen)                                # never come back to
                seen.extend(ep.block_shards(b).tolist())
                assert (ep.block_of[lo:hi] == b).all()
            assert seen == ep.seq.tolist()                                   # every shard in one block


# ---------------------------------------------------------------- conservation and the policy

def small(**kw) -> node_mod.Params:
    base = node_mod.Params(nodes=4, gpus=2, dataset_bytes=96 * 16e6, shard_bytes=16e6, sample_bytes=1e6,
                           tier_bytes=96 * 16e6, link_bps=10e9, gpu_rate=100.0, batch_size=4, num_workers=1,
                           prefixes=0, latency=0.01, conn_bps=100e6, part_bytes=4e6, workers=2, lookahead=4,
                           window=2, exchange=0.25, seed=1, epochs=4, slots=16, scale=1, detail=4, dt=0.05)
    return replace(base, **kw)


@pytest.mark.parametrize("sampler", ["global", "locality"])
def test_every_sample_read_once_per_epoch_across_nodes(sampler: str) -> None:
    p = small(epochs=2)
    layout = plan.Layout(p.sim_shards, p.sim_slots, p.nodes, p.gpus, p.window, p.seed, p.exchange)
    for e in range(2):
        rows = plan.epoch_rows(layout, layout.groups(), sampler, e, range(layout.world))
        every = np.sort(np.concatenate(list(rows.values())))
        assert (every == np.arange(p.sim_shards * p.sim_slots)).all()    # 96 x 16 slots over 8 ranks: no padding
    res = sim.simulate(p, sampler, "daemon")
    for ep in res["epochs"]:
        assert ep["samples"] == p.sim_shards * p.sim_slots * p.samples_per_slot
        # cold tiers, then warm: every slot was a hit or a record read
        assert ep["tier_fraction"] + ep["record_fraction"] == pytest.approx(1.0)
    assert res["epochs"][0]["s3_datasets"] >= 0.99          # cold: every shard came from S3 at least once


def test_locality_warm_epochs_fetch_about_exchange() -> None:
    res = sim.simulate(small(exchange=0.25, epochs=4), "locality", "daemon")
    warm = [e["s3_datasets"] for e in res["epochs"][1:]]
    assert all(0.15 <= w <= 0.4 for w in warm), warm           # the shards that moved (+ the next epoch's lookahead)
    assert res["epochs"][0]["s3_datasets"] >= 0.99


def test_global_warm_epochs_fetch_at_most_about_one_minus_the_budget() -> None:
    # tiers of half the dataset per node: they fill up with what the node read, then hit at least
    # about as often as they hold the dataset (more: the next epoch's shards are never evicted)
    b = 0.5
    res = sim.simulate(small(dataset_bytes=192 * 16e6, tier_bytes=b * 192 * 16e6, epochs=7), "global", "daemon")
    late = float(np.mean([e["s3_datasets"] for e in res["epochs"][4:]]))
    assert 1 - b - 0.25 <= late <= 1 - b + 0.05, late
    assert res["epochs"][0]["s3_datasets"] >= 0.99


def test_more_budget_fewer_bytes() -> None:
    warm = []
    for frac in (0.1, 0.2, 0.35, 0.6):
        res = sim.simulate(small(tier_bytes=frac * 96 * 16e6, epochs=3), "locality", "daemon")
        warm.append(sum(e["s3_bytes"] for e in res["epochs"][1:]))
    assert all(a >= b * 0.98 for a, b in zip(warm, warm[1:])), warm
    assert warm[0] > 1.5 * warm[-1]


def test_the_keep_set_is_policys() -> None:
    p = small(tier_bytes=0.1 * 96 * 16e6)
    layout = plan.Layout(p.sim_shards, p.sim_slots, p.nodes, p.gpus, p.window, p.seed, p.exchange)
    groups = layout.groups()
    rows0 = plan.epoch_rows(layout, groups, "locality", 0, [0, 1])
    rows1 = plan.epoch_rows(layout, groups, "locality", 1, [0, 1])
    n = node_mod.Node(p, "daemon", dict.fromkeys(range(p.sim_shards), int(p.shard_bytes)))
    n.start_epoch(0.0, [plan.RankEpoch.of(layout, rows0[r]) for r in (0, 1)],
                  [plan.RankEpoch.of(layout, rows1[r]).seq for r in (0, 1)])
    # as Engine.keep_set calls it: the boundary the sampler announces, what is resident and held
    demands = [policy.Demand(r.announced, 0, len(r.ep.seq)) for r in n.readers]
    assert [d.next_start for d in demands] == [r.next_start for r in n.readers]
    keep = policy.keep_for_next_pass(demands, n.sizes, int(p.tier_bytes), int(p.shard_bytes), resident={},
                                     held=set(), reading=KEEP_READING, admitted=None)
    assert keep is not None
    announced = {s for d in demands for s in d.sequence}
    assert set(np.flatnonzero(n.tiers[0].bypass).tolist()) == announced - keep


def test_the_daemon_caps_staging_at_its_workers_and_private_tiers_lose_locality() -> None:
    p = small(epochs=3, tier_bytes=0.5 * 96 * 16e6)
    daemon = sim.simulate(p, "locality", "daemon")["epochs"]
    private = sim.simulate(p, "locality", "private")["epochs"]
    assert sum(e["s3_bytes"] for e in private[1:]) > 1.5 * sum(e["s3_bytes"] for e in daemon[1:])
    cap = node_mod.Node(p, "daemon", {}).job_rate * p.workers
    assert max(e["node_stage_bps_peak"] for e in daemon) <= cap * 1.001


def test_s3_throttling_holds_the_request_rate() -> None:
    p = small(epochs=1, prefixes=1, get_limit=40.0, nodes=4, detail=4, tier_bytes=0.05 * 96 * 16e6)
    res = sim.simulate(p, "global", "daemon")["epochs"][0]
    assert res["gets_mean"] <= 40.0 * 1.05
    free = sim.simulate(replace(p, prefixes=0), "global", "daemon")["epochs"][0]
    assert free["gets_mean"] > 40.0 and res["epoch_s"] > free["epoch_s"]


# ---------------------------------------------------------------- calibration

def measured_fixture(tmp_path: Path, p: node_mod.Params, sims: dict, bytes_off: float, time_off: float) -> Path:
    """A SYNTHETIC measured-run file: the simulation's own figures, moved by the given
    fractions. It only exercises the comparison code; it is no measurement."""
    params = {"nodes": p.nodes, "ranks_per_node": p.gpus, "samples": int(p.sim_shards * p.samples_per_shard),
              "sample_bytes": p.sample_bytes, "shard_bytes": p.shard_bytes, "shards": p.sim_shards,
              "dataset_bytes": p.dataset_bytes, "tier_budget_bytes": p.tier_bytes, "link_rate_bps": p.link_bps,
              "rtt_ms": p.latency * 1e3, "epochs": p.epochs, "seed": p.seed, "exchange": p.exchange,
              "batch_size": p.batch_size, "num_workers": p.num_workers, "daemon": True}
    runs = [{"sampler": s, "epoch": e["epoch"] + 1, "s3_bytes": e["s3_bytes"] * (1 + bytes_off), "s3_requests": 0,
             "epoch_seconds": e["epoch_s"] * (1 + time_off), "per_node_staged_bytes": e["per_node_staged_bytes"],
             "samples_seen": e["samples"], "exact_once": True}
            for s, r in sims.items() for e in r["epochs"]]
    f = tmp_path / "synthetic-run.json"
    f.write_text(json.dumps({"synthetic": "made by test_cluster_sim from the simulation itself; not a measurement",
                             "params": params, "runs": runs}))
    return f


def test_calibration_compares_and_judges(tmp_path: Path) -> None:
    p = small(epochs=2, gpu_rate=100.0)
    data_p = sim.calibration_params({"params": {
        "nodes": 4, "ranks_per_node": 2, "samples": 96 * 16, "sample_bytes": 1e6, "shard_bytes": 16e6, "shards": 96,
        "dataset_bytes": 96 * 16e6, "tier_budget_bytes": p.tier_bytes, "link_rate_bps": 10e9, "rtt_ms": 10,
        "epochs": 2, "seed": 1, "exchange": 0.25, "batch_size": 4, "num_workers": 1}}, p)
    assert (data_p.nodes, data_p.gpus, data_p.sim_shards, data_p.sim_slots, data_p.detail, data_p.scale) == \
        (4, 2, 96, 16, 4, 1)
    sims = {s: sim.simulate(p, s, "daemon") for s in ("global", "locality")}
    for off, verdict in ((0.05, True), (-0.08, True), (0.3, False)):
        data = sim.load_measured(measured_fixture(tmp_path, p, sims, off, off))
        rows, ok = sim.compare(data, sims)
        assert ok is verdict and all(r["pass"] is verdict for r in rows)
        assert all(abs(r["bytes_error"] - (1 / (1 + off) - 1)) < 1e-9 for r in rows)
    data = sim.load_measured(measured_fixture(tmp_path, p, sims, 0.0, 0.4))   # bytes right, time off
    rows, ok = sim.compare(data, sims)
    assert not ok and all(abs(r["bytes_error"]) < 1e-9 and not r["pass"] for r in rows)


@pytest.mark.parametrize("mangle, message", [
    (lambda d: d["params"].pop("shards"), "params.shards is missing"),
    (lambda d: d["params"].update(nodes=0), "params.nodes is 0"),
    (lambda d: d["params"].update(exchange=2), "params.exchange is 2"),
    (lambda d: d["runs"][0].update(sampler="random"), "runs[0].sampler is 'random'"),
    (lambda d: d["runs"][0].update(epoch=9), "runs[0].epoch is 9"),
    (lambda d: d["runs"][0].update(epoch_seconds="fast"), "runs[0]: epoch_seconds is 'fast'"),
    (lambda d: d.pop("runs"), "needs an object with 'params'"),
    (lambda d: d["params"].update(daemon="yes"), "params.daemon is 'yes'"),
    (lambda d: d["params"].update(zst_dataset_bytes=-5), "params.zst_dataset_bytes is -5"),
])
def test_a_bad_measured_file_is_one_line_naming_the_key(tmp_path: Path, mangle, message) -> None:
    good = {"params": {"nodes": 2, "ranks_per_node": 1, "samples": 64, "sample_bytes": 1e6, "shard_bytes": 16e6,
                       "shards": 4, "dataset_bytes": 64e6, "tier_budget_bytes": 1e9, "link_rate_bps": 1e9,
                       "rtt_ms": 5, "epochs": 1, "seed": 0, "exchange": 0.1, "batch_size": 4, "num_workers": 0},
            "runs": [{"sampler": "global", "epoch": 1, "s3_bytes": 1.0, "epoch_seconds": 1.0}]}
    mangle(good)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(good))
    with pytest.raises(SystemExit) as ei:
        sim.main(["--calibrate", str(f), "--quiet"])
    text = str(ei.value)
    assert text.startswith("cluster_sim: error: ") and message in text and "\n" not in text
    f.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read it as JSON"):
        sim.main(["--calibrate", str(f), "--quiet"])


def test_simulating_part_of_the_shards_scales_back() -> None:
    # 1/2 of the shards and of the tiers: the same traffic per dataset, about the same epoch time
    # (averaged over 3 seeds: one layout's warm traffic alone varies by about 10% between seeds)
    def mean_epochs(scale: int) -> list[tuple[float, float]]:
        runs = [sim.simulate(small(dataset_bytes=192 * 16e6, tier_bytes=0.2 * 192 * 16e6, epochs=2, seed=seed,
                                   scale=scale), "locality", "daemon")["epochs"] for seed in range(3)]
        return [(float(np.mean([r[e]["s3_bytes"] for r in runs])), float(np.mean([r[e]["epoch_s"] for r in runs])))
                for e in range(2)]
    for (wb, ws), (hb, hs) in zip(mean_epochs(1), mean_epochs(2)):
        assert hb == pytest.approx(wb, rel=0.1)
        assert hs == pytest.approx(ws, rel=0.1)
