"""Any fsspec filesystem as a home (issue 15, item 2): push, open, stage and record-granular
reads on fsspec's in-memory filesystem, checked sample for sample against the local dataset;
hostile names and unknown schemes refused."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.errors import KVDataError, RemoteError
from kvdata.reader.open import open_dataset
from kvdata.tiers.push import push

from helpers.servers import tiers_config

fsspec = pytest.importorskip("fsspec", reason="fsspec is not installed (pip install 'kvdata[fsspec]')")

N = 40


def sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8), "label": i % 7, "name": f"s{i}"}


@pytest.fixture
def local(tmp_path: Path) -> Path:
    p = tmp_path / "src.kv"
    with kvdata.open(p, "w", shard_size="64KB") as s:
        s.put_many((f"k{i:03d}", sample(i)) for i in range(N))
    return p


@pytest.fixture
def memory_url() -> Any:
    url = f"memory://kvtest-{uuid.uuid4().hex[:8]}/ds.kv"
    yield url
    fs = fsspec.filesystem("memory")
    root = url.split("://", 1)[1].split("/", 1)[0]
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


def same(a: dict[str, Any], i: int) -> bool:
    b = sample(i)
    return np.array_equal(np.asarray(a["image"]), b["image"]) and int(a["label"]) == b["label"] and a["name"] == b["name"]


def test_push_then_read_every_sample_from_an_fsspec_home(local: Path, memory_url: str, tmp_path: Path) -> None:
    summary = push(local, memory_url, show=False)
    assert summary
    fs = fsspec.filesystem("memory")
    assert fs.exists(memory_url.split("://", 1)[1] + "/manifest.json")
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "64MB"))
    st = open_dataset(memory_url, config=cfg, use_daemon=False)
    try:
        assert len(st) == N
        got = st.get_many(list(range(N)))
        assert all(same(v, i) for i, v in enumerate(got))
        assert same(st.get("k017"), 17)
    finally:
        st.close()


def test_record_granular_reads_from_an_fsspec_home(local: Path, memory_url: str) -> None:
    from kvdata.tiers.homes import open_home
    from kvdata.tiers.records import RecordReader

    push(local, memory_url, show=False)
    home = open_home(memory_url)
    assert type(home).__name__ == "FsspecHome" and home.record_reads
    from kvdata.format import parse_manifest

    entries = list(parse_manifest(home.read("manifest.json"), memory_url).shards)
    assert len(entries) >= 3 and all(e.zst is not None and e.zst.seek_sha256 for e in entries)
    with kvdata.open(local) as ref:
        start = 0
        reader = RecordReader(home)
        for e in entries[:3]:
            slots = [0, e.records - 1]
            got = reader.read(e, slots)
            assert got is not None
            for s, v in zip(slots, got):
                assert same(ref._reader.decode_value(v, True), start + s)
            start += e.records
        assert reader.requests >= 3


def test_hostile_names_and_unknown_schemes_are_refused(memory_url: str) -> None:
    from kvdata.tiers.homes import open_home

    home = open_home(memory_url)
    for bad in ("../other/manifest.json", "/etc/passwd", "a//b", "", "shards/\x00x", "a\\b", "./manifest.json"):
        with pytest.raises(RemoteError, match="refusing"):
            home.read_range(bad, 0, 10)
    with pytest.raises(RemoteError, match="does not exist"):
        home.size("manifest.json")
    with pytest.raises(KVDataError, match="fsspec cannot open|unsupported"):
        open_home("nosuchscheme-kv://bucket/ds.kv")
