"""`kvdata doctor` (kvdata/cli/doctor.py over kvdata/reader/doctor.py): the installed script in a
subprocess, on a dataset written by kvdata, with tiers from a config in tmp_path and, for a
remote home, nginx serving a pushed copy. The hidden --quick option shrinks every measurement
(a few MB, 0.3 s of reading) so each run takes about a second; the numbers then mean little,
but every field must still be there and positive, and the verdict must follow from them.
`diagnose` (which part limits a rate) is also checked on made-up measurements, where the
right answer is known.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.doctor.diagnose import diagnose, parse_rate
from kvdata.errors import InvalidValueError

from helpers.cli import Cli
from helpers.daemon import Kit
from helpers.servers import NginxHome, publish_http


def make_dataset(path: Path, n: int = 600) -> Path:
    with kvdata.open(path, "w", shard_size="256KB") as s:
        s.put_many((f"k{i:05d}", {"image": np.full((24, 24, 3), i % 251, np.uint8), "label": i % 10})
                   for i in range(n))
    return path


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A dataset, and a config with two tiers: one that exists, one that staging would create."""
    ds = make_dataset(tmp_path / "ds.kv")
    (tmp_path / "tiers" / "ram").mkdir(parents=True)
    cfg = tmp_path / "kvdata.toml"
    cfg.write_text(f'[[tiers]]\nname = "ram"\npath = "{tmp_path / "tiers" / "ram"}"\nbudget = "1MB"\n'
                   f'[[tiers]]\nname = "ssd"\npath = "{tmp_path / "tiers" / "ssd"}"\nbudget = "2MB"\n')
    monkeypatch.setenv("KVDATA_CONFIG", str(cfg))
    monkeypatch.setenv("KVDATA_SOCKET", str(tmp_path / "no-daemon.sock"))
    return {"ds": ds, "root": tmp_path}


def test_json_has_every_measurement(cli: Cli, env: dict[str, Path]) -> None:
    r = cli.run("doctor", env["ds"], "--json", "--quick")
    assert r.rc == 0, str(r)
    rep = r.json()
    assert rep["memcpy"]["bytes_per_s"] > 0 and rep["memcpy"]["bytes"] > 0
    assert [t["name"] for t in rep["tiers"]] == ["ram", "ssd"]
    for t in rep["tiers"]:
        assert t["ok"] is True, t
        assert t["read_bytes_per_s"] > 0 and t["write_bytes_per_s"] > 0 and isinstance(t["direct"], bool)
        assert t["budget"] in (1_000_000, 2_000_000)
    assert rep["tiers"][1]["measured_at"] == str(env["root"] / "tiers")
    ds = rep["dataset"]
    assert ds["samples"] == 600 and ds["shards"] > 1 and ds["bytes"] > 0 and ds["bytes_per_sample"] > 0
    assert ds["remote"] is False and ds["via"] == "tiers" and ds["in_place"] is False
    home = rep["home"]
    assert home["bytes_per_s"] > 0 and home["latency_s"] >= 0 and home["remote"] is False
    assert rep["reader"]["samples_per_s"] > 0 and rep["reader"]["samples"] > 0
    assert "verdict" not in rep
    # the probe files are gone (the reader's engine made the tiers' own directories)
    left = [name for _d, _s, files in os.walk(env["root"] / "tiers") for name in files if "doctor" in name]
    assert left == []


def test_need_that_fits_says_ok_and_exits_0(cli: Cli, env: dict[str, Path]) -> None:
    r = cli.run("doctor", env["ds"], "--need", "1/s", "--quick")
    assert r.rc == 0, str(r)
    last = r.lines()[-1]
    assert last.startswith("OK: 1 samples/s") and "fits" in last, last
    for word in ("memcpy", "tier ram", "tier ssd", "dataset", "home", "reader"):
        assert any(line.startswith(word) for line in r.lines()), (word, r.text)


def test_need_that_starves_names_the_limit_and_exits_1(cli: Cli, env: dict[str, Path]) -> None:
    j = cli.run("doctor", env["ds"], "--need", "1e12/s", "--quick", "--json")
    assert j.rc == 1, str(j)
    v = j.json()["verdict"]
    assert v["ok"] is False and v["need"] == 1e12
    caps = {p["name"]: p["samples_per_s"] for p in v["parts"]}
    links = {k: c for k, c in caps.items() if k != "the reader (one thread)"}  # what no thread count lifts
    assert v["limit"] == min(links, key=links.__getitem__) and all(c < 1e12 for c in caps.values())
    assert {"memcpy", "the reader (one thread)"} <= set(caps)
    assert v["text"].startswith("STARVES: ") and f"more than {v['limit']} gives" in v["text"] and "Fix: " in v["text"]


@pytest.mark.parametrize("bad", ["abc", "0"])  # more shapes: test_parse_rate_refuses_what_is_not_a_rate
def test_bad_need_is_one_usage_line(cli: Cli, env: dict[str, Path], bad: str) -> None:
    r = cli.run("doctor", env["ds"], "--need", bad, "--quick")
    assert r.rc == 2, str(r)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvdata: error: Invalid value for '--need'"), r.err
    assert r.out == b""


def test_need_without_a_dataset_and_a_missing_dataset(cli: Cli, env: dict[str, Path]) -> None:
    r = cli.run("doctor", "--need", "100", "--quick")
    assert r.rc == 2 and "--need needs a DATASET" in r.err, str(r)
    r = cli.run("doctor", env["root"] / "nope.kv", "--quick")
    assert r.rc == 1 and len(r.err.strip().splitlines()) == 1 and "nope.kv" in r.err, str(r)


def test_without_a_dataset_measures_the_box(cli: Cli, env: dict[str, Path]) -> None:
    r = cli.run("doctor", "--json", "--quick")
    assert r.rc == 0, str(r)
    rep = r.json()
    assert rep["memcpy"]["bytes_per_s"] > 0 and len(rep["tiers"]) == 2 and "dataset" not in rep
    assert all(t["ok"] and t["read_bytes_per_s"] > 0 for t in rep["tiers"])
    # a diagnosis changes nothing: no tier directory made, no probe file left
    assert os.listdir(env["root"] / "tiers") == ["ram"] and os.listdir(env["root"] / "tiers" / "ram") == []


def test_remote_home_latency_and_bandwidth(cli: Cli, env: dict[str, Path], nginx_home: NginxHome) -> None:
    url = publish_http(env["ds"], nginx_home, "doctor-ds", env["root"] / "scratch")
    r = cli.run("doctor", url, "--json", "--quick", "--need", "1")
    assert r.rc == 0, str(r)
    rep = r.json()
    home = rep["home"]
    assert home["remote"] is True and home["object"].endswith(".mdb.zst")
    assert home["latency_s"] > 0 and home["bytes_per_s"] > 0 and home["expansion"] > 0
    assert home["sample_bytes_per_s"] == pytest.approx(home["bytes_per_s"] * home["expansion"])
    assert rep["dataset"]["remote"] is True and rep["dataset"]["samples"] == 600 and rep["dataset"]["via"] == "tiers"
    assert rep["reader"]["samples_per_s"] > 0
    assert rep["verdict"]["ok"] is True


# ---------------------------------------------------------------- the verdict, on known numbers


def report(*, mem: float = 10e9, tier: float = 2e9, home: float = 100e6, reader: float = 1e6,
           budget: int = 50 * 10**9, total: int = 100 * 10**9, samples: int = 10**6, remote: bool = True) -> dict[str, Any]:
    return {"memcpy": {"bytes_per_s": mem},
            "tiers": [{"name": "ram", "ok": True, "budget": budget, "read_bytes_per_s": tier, "direct": False}],
            "dataset": {"bytes": total, "samples": samples, "remote": remote, "in_place": False},
            "home": {"sample_bytes_per_s": home, "remote": remote},
            "reader": {"samples_per_s": reader, "batch": 256}}


def test_diagnose_names_the_home_link_and_the_budget_that_fixes_it() -> None:
    # 100 KB/sample; half the dataset from a 100 MB/s home: 2,000 samples/s
    v = diagnose(report(), need=5000)
    assert not v.ok and v.limit == "the home link"
    assert "a tier budget of 100.0 GB" in v.text and "ShardShuffleSampler" in v.text and "bandwidth" in v.text
    assert next(p for p in v.parts if p.name == "the home link").samples_per_s == pytest.approx(2000)
    assert diagnose(report(), need=1500).ok


def test_diagnose_the_tier_memcpy_and_the_reader() -> None:
    v = diagnose(report(budget=10**12, tier=200e6), need=5000)  # the tier holds it all: 2,000/s from it
    assert not v.ok and v.limit == "tier ram" and all(p.name != "the home link" for p in v.parts)
    v = diagnose(report(budget=10**12, mem=100e6), need=5000)
    assert not v.ok and v.limit == "memcpy"
    v = diagnose(report(budget=10**12, reader=3000), need=5000, cpus=4)
    assert not v.ok and v.limit == "the reader (one thread)" and "kvdata.Loader(threads=2)" in v.text
    v = diagnose(report(budget=10**12, reader=300), need=5000, cpus=4)
    assert not v.ok and "17 threads" in v.text and "4 cores" in v.text
    # a link below the need is named even when one thread is slower still: threads cannot lift it
    v = diagnose(report(budget=10**12, mem=100e6, reader=500), need=5000, cpus=4)
    assert not v.ok and v.limit == "memcpy"
    assert diagnose(report(budget=10**12), need=5000).ok


def test_a_tier_smaller_than_a_shard_is_the_diagnosis(cli: Cli, env: dict[str, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = env["root"] / "tiny.toml"
    cfg.write_text(f'[[tiers]]\nname = "ram"\npath = "{env["root"] / "tiers" / "ram"}"\nbudget = 1000\n')
    monkeypatch.setenv("KVDATA_CONFIG", str(cfg))
    r = cli.run("doctor", env["ds"], "--need", "1", "--quick", "--json")
    assert r.rc == 1, str(r)
    v = r.json()["verdict"]
    assert v["ok"] is False and v["limit"] == "configuration" and "raise it" in v["text"], v


@pytest.mark.parametrize(("text", "rate"), [("20000", 20000), ("20000/s", 20000), ("20k/s", 20000),
                                            ("1.5M/s", 1.5e6), ("1e6/s", 1e6), (" 300 / s ", 300)])
def test_parse_rate(text: str, rate: float) -> None:
    assert parse_rate(text) == rate


def test_parse_rate_refuses_what_is_not_a_rate() -> None:
    for bad in ("k/s", "20 MB/s", "nan", "inf", "-1", "", "20000/min", "1e999"):
        with pytest.raises(InvalidValueError, match="samples per second"):
            parse_rate(bad)


def test_through_kvdatad(kit: Kit) -> None:
    """With kvdatad up, the reader measured is the one a job gets: shards through the daemon."""
    ds = make_dataset(kit.root / "ds.kv", n=200)
    kit.daemon()
    r = kit.kvdata("doctor", str(ds), "--json", "--quick", "--need", "1")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["dataset"]["via"] == "kvdatad" and rep["reader"]["samples_per_s"] > 0
    assert [t["name"] for t in rep["tiers"]] == ["ram", "ssd"] and rep["verdict"]["ok"] is True
