"""Any fsspec filesystem as a home (issue 15, item 2): push, open, stage into a tier and
record-granular reads on fsspec's in-memory filesystem, its local filesystem
(`fsspec+file://`) and s3fs against the real S3 server (`fsspec+s3://`), checked sample for
sample against the local dataset; `s3://` and `file://` keep their dedicated homes; pushes
through one S3 path read through the other; a merge at an s3fs home copies server-side;
kvdatad does not fetch fsspec homes (their readers stage in-process); hostile names and unknown
schemes refused."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.config import ConfigError, parse_config
from kvdata.errors import DaemonError, KVDataError, RemoteError
from kvdata.format import names, parse_manifest
from kvdata.homes import open_home
from kvdata.reader.open import open_dataset
from kvdata.sync.home_merge import merge_at_home
from kvdata.sync.push import push
from kvdata.tiers.records import RecordReader

from helpers.cli import Cli
from helpers.daemon import Kit
from helpers.servers import S3Server, tiers_config, write_toml

fsspec = pytest.importorskip("fsspec", reason="fsspec is not installed (pip install 'kvdata[fsspec]')")

N = 40
KINDS = ("memory", "file", "s3fs")


def sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8), "label": i % 7, "name": f"s{i}"}


def same(a: dict[str, Any], i: int) -> bool:
    b = sample(i)
    return np.array_equal(np.asarray(a["image"]), b["image"]) and int(a["label"]) == b["label"] and a["name"] == b["name"]


def write(path: Path, keys: range = range(N)) -> Path:
    with kvdata.open(path, "w", shard_size="64KB") as s:
        s.put_many((f"k{i:03d}", sample(i)) for i in keys)
    return path


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return write(tmp_path / "src.kv")


@pytest.fixture
def memory_url() -> Iterator[str]:
    url = f"memory://kvtest-{uuid.uuid4().hex[:8]}/ds.kv"
    yield url
    fs = fsspec.filesystem("memory")
    root = url.split("://", 1)[1].split("/", 1)[0]
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


def s3fs_url(s3: S3Server, what: str = "ds") -> str:
    """An fsspec+s3:// URL on the test server: s3fs finds the endpoint and credentials where
    boto3 does (the AWS_* settings the server fixture sets)."""
    return f"fsspec+s3://{s3.bucket}/fsspec-{what}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=KINDS)
def home_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh dataset URL on each kind of fsspec home."""
    kind = request.param
    if kind == "memory":
        yield request.getfixturevalue("memory_url")
    elif kind == "file":
        yield f"fsspec+file://{tmp_path / 'home' / 'ds.kv'}"
    else:
        pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")
        yield s3fs_url(request.getfixturevalue("s3_server"))


def objects(url: str) -> list[str]:
    """Every object name under a home URL (through the home's own filesystem)."""
    home = open_home(url)
    fs, root = home._fs, home._root  # type: ignore[attr-defined]
    return sorted(p[len(root) + 1:] for p in fs.find(root))


def test_push_then_read_every_sample_from_an_fsspec_home(local: Path, home_url: str, tmp_path: Path) -> None:
    summary = push(local, home_url, show=False)
    assert summary["shards_uploaded"] >= 3
    listed = objects(home_url)
    assert names.MANIFEST in listed and all(not n.rsplit("/", 1)[-1].startswith(".") for n in listed), listed
    home = open_home(home_url)
    assert type(home).__name__ == "FsspecHome"
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "64MB"))
    st = open_dataset(home_url, config=cfg, use_daemon=False)
    try:
        assert len(st) == N
        got = st.get_many(list(range(N)))
        assert all(same(v, i) for i, v in enumerate(got))
        assert same(st.get("k017"), 17)
    finally:
        st.close()


def test_record_granular_reads_from_an_fsspec_home(local: Path, home_url: str) -> None:
    push(local, home_url, show=False)
    home = open_home(home_url)
    assert type(home).__name__ == "FsspecHome" and home.record_reads
    entries = list(parse_manifest(home.read("manifest.json"), home_url).shards)
    assert len(entries) >= 3 and all(e.zst is not None and e.zst.seek_sha256 for e in entries)
    with kvdata.open(local) as ref:
        start = 0
        reader = RecordReader(home)
        assert all(reader.usable(e) for e in entries)
        for e in entries[:3]:
            slots = [0, e.records - 1]
            got = reader.read(e, slots)
            assert got is not None
            for s, v in zip(slots, got):
                assert same(ref._reader.decode_value(v, True), start + s)
            start += e.records
        assert reader.requests >= 3


@pytest.mark.parametrize("kind", ["file", "s3fs"])
def test_kvdata_stage_copies_every_shard_of_an_fsspec_home_into_a_tier(kind: str, local: Path, tmp_path: Path,
                                                                      request: pytest.FixtureRequest,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvdata stage` in its own process (memory:// lives in one process: not here)."""
    if kind == "s3fs":
        pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")
        url = s3fs_url(request.getfixturevalue("s3_server"))
    else:
        url = f"fsspec+file://{tmp_path / 'home' / 'ds.kv'}"
    push(local, url, show=False)
    monkeypatch.setenv("KVDATA_CONFIG", str(write_toml(tmp_path / "kvdata.toml", tmp_path / "tiers", ("ssd", "64MB"))))
    cli = Cli(tmp_path)
    r = cli.ok("stage", url, "--json").json()
    with kvdata.open(local) as ref:
        shas = {e.sha256 for e in ref.manifest.shards}
    assert r["shards"] == r["shards_staged"] == len(shas) and r["bytes_from_home"] > 0
    staged = {p.name for p in (tmp_path / "tiers" / "ssd").rglob("*.mdb")}
    assert {names.staged_name(s) for s in shas} <= staged
    assert cli.ok("verify", url).text.startswith("ok: ")
    assert cli.ok("get", url, "k007", "--field", "name").out == b"s7"


def test_file_and_s3_urls_keep_their_dedicated_homes(tmp_path: Path) -> None:
    assert type(open_home(f"file://{tmp_path}")).__name__ == "LocalHome"
    assert type(open_home("s3://bucket/ds")).__name__ == "S3Home"
    home = open_home(f"fsspec+file://{tmp_path}/ds")
    assert type(home).__name__ == "FsspecHome" and type(home._fs).__name__ == "LocalFileSystem"  # type: ignore[attr-defined]
    assert home.url == f"fsspec+file://{tmp_path}/ds" and home.where("manifest.json").startswith("fsspec+file://")


def test_s3fs_and_the_dedicated_s3_home_read_each_others_pushes(s3_server: S3Server, tmp_path: Path) -> None:
    """One layout: a dataset pushed through s3fs reads through boto3's s3:// home and back."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")
    a, b = write(tmp_path / "a.kv", range(0, 20)), write(tmp_path / "b.kv", range(20, 40))
    via_fsspec = s3fs_url(s3_server)
    via_boto = s3_server.url(f"boto-{uuid.uuid4().hex[:8]}")
    push(a, via_fsspec, show=False)
    push(b, via_boto, show=False)
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "64MB"))
    for url, first in ((via_fsspec.replace("fsspec+s3://", "s3://"), 0), (via_boto.replace("s3://", "fsspec+s3://"), 20)):
        st = open_dataset(url, config=cfg, use_daemon=False)
        try:
            assert all(same(v, first + i) for i, v in enumerate(st.get_many(list(range(20)))))
        finally:
            st.close()


def test_merge_at_an_s3fs_home_copies_on_the_server(s3_server: S3Server, tmp_path: Path) -> None:
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")
    parts = [write(tmp_path / f"p{i}.kv", range(i * 20, i * 20 + 20)) for i in range(2)]
    base = s3fs_url(s3_server, "merge")
    urls = [f"{base}.parts/node-{i}" for i in range(2)]
    for p, url in zip(parts, urls):
        push(p, url, show=False)
    mark = s3_server.log_size()
    summary = merge_at_home(urls, base, progress=False)
    requests = s3_server.requests_since(mark)
    assert summary["objects_copied"] == summary["shards"] > 0 and summary["samples"] == 2 * 20
    shard_gets = [r for r in requests if f'"GET /{s3_server.bucket}/' in r and "/shards/" in r]  # not LISTs
    assert not shard_gets, shard_gets  # no shard object came through the client
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "64MB"))
    st = open_dataset(base, config=cfg, use_daemon=False)
    try:
        assert all(same(v, i) for i, v in enumerate(st.get_many(list(range(40)))))
    finally:
        st.close()
    assert merge_at_home(urls, base, progress=False)["already_merged"]


def test_kvdatad_does_not_fetch_fsspec_homes_readers_stage_them_in_process(kit: Kit, local: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/SECURITY.md: allow_homes takes s3:// and http(s):// prefixes only; a reader of an
    fsspec home with a kvdatad running stages it itself, with its own credentials."""
    with pytest.raises(ConfigError, match="fsspec"):
        parse_config({"tiers": [{"name": "t", "path": str(tmp_path / "t"), "budget": "1MB"}],
                      "daemon": {"allow_homes": ["gs://bucket/datasets"]}})
    url = f"fsspec+file://{tmp_path / 'home' / 'ds.kv'}"
    push(local, url, show=False)
    d = kit.daemon()
    with pytest.raises(DaemonError):
        d.request("open", dataset=url)
    for k, v in kit.env().items():
        monkeypatch.setenv(k, v)
    own = tmp_path / "own.toml"  # the reader's own tiers, not the daemon's
    own.write_text(f'[[tiers]]\nname = "own"\npath = "{tmp_path / "own"}"\nbudget = "512MB"\n')
    monkeypatch.setenv("KVDATA_CONFIG", str(own))
    with kvdata.open(url) as s:
        assert type(s.engine).__name__ != "DaemonStager"
        assert all(same(v, i) for i, v in enumerate(s.get_many(list(range(N)))))
    assert d.status()["bytes_from_home"] == 0
    assert d.terminate() == 0


def test_hostile_names_and_unknown_schemes_are_refused(memory_url: str) -> None:
    home = open_home(memory_url)
    for bad in ("../other/manifest.json", "/etc/passwd", "a//b", "", "shards/\x00x", "a\\b", "./manifest.json"):
        with pytest.raises(RemoteError, match="refusing"):
            home.read_range(bad, 0, 10)
    with pytest.raises(RemoteError, match="does not exist"):
        home.size("manifest.json")
    with pytest.raises(KVDataError, match="fsspec cannot open|unsupported"):
        open_home("nosuchscheme-kv://bucket/ds.kv")
    with pytest.raises(KVDataError, match="fsspec cannot open|unsupported"):
        open_home("fsspec+nosuchscheme-kv://bucket/ds.kv")
