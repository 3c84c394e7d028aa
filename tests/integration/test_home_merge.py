"""`kvdata merge URL... URL` (kvdata.sync.home_merge, issue 14 item 3): parts pushed under their
own prefixes of the real S3 server (moto) are published as one dataset at the home by one merge
that moves no record byte through the client (the server's log shows no GET of a shard), and read
back -- through kvdata.Dataset, `kvdata verify`, record for record -- exactly like a local merge of
the same parts. Refused with nothing written: duplicate keys, hostile part manifests and index
files, an object at the destination with other bytes. A merge SIGKILLed at any moment leaves no
manifest at the destination and runs again to completion."""

from __future__ import annotations

import hashlib
import json
import struct
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.errors import CorruptDatasetError, InvalidKeyError, KVDataError, NotADatasetError, ReadOnlyError
from kvdata.format import names
from kvdata.homes import open_home
from kvdata.homes.s3_home import S3Home
from kvdata.reader.open import verify
from kvdata.sync.home_merge import merge, merge_at_home
from kvdata.sync.push import push

from helpers.cli import Cli
from helpers.forked import run_forked
from helpers.parts import CLASSES, records, same, write_part
from helpers.servers import S3Server, write_toml

SIZES = (300, 1, 250)


@pytest.fixture(scope="module")
def local_parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three sealed local parts; the first and the last with overwrites and deletes (tombstones)."""
    d = tmp_path_factory.mktemp("parts")
    out = []
    for i, n in enumerate(SIZES):
        p = d / f"p{i}.kv"
        write_part(p, records(i, n), deletes={0: 20, 2: 10}.get(i, 0))
        out.append(p)
    return out


@pytest.fixture(scope="module")
def pushed(local_parts: list[Path], s3_server: S3Server) -> list[str]:
    """The parts, each pushed by its "node" under its own prefix."""
    urls = [s3_server.url(f"ds.parts/node-{i}") for i in range(len(local_parts))]
    for p, url in zip(local_parts, urls):
        push(p, url, show=False)
    return urls


@pytest.fixture(scope="module")
def local_merged(local_parts: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "merged.kv"
    kvdata.merge(local_parts, out)
    return out


@pytest.fixture
def reader_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDATA_CONFIG", str(write_toml(tmp_path / "kvdata.toml", tmp_path / "tiers",
                                                       ("ssd", "64MB"))))


def fresh(s3: S3Server, what: str) -> str:
    return s3.url(f"{what}-{uuid.uuid4().hex[:8]}")


def objects(s3: S3Server, url: str) -> set[str]:
    """The names (under the URL's prefix) of every object there."""
    prefix = url.split("/", 3)[3] + "/"
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix)
    return {o["Key"][len(prefix):] for page in pages for o in page.get("Contents", [])}


def clone(s3: S3Server, src: str, edit: Callable[[dict[str, Any]], None] | None = None,
          files: dict[str, bytes] | None = None) -> str:
    """A copy of a pushed part under a new prefix (objects copied with their metadata), its
    manifest changed by `edit` and some objects replaced by `files` (as a hostile home would)."""
    dst = fresh(s3, "hostile")
    client = s3.client()
    sp, dp = src.split("/", 3)[3], dst.split("/", 3)[3]
    for name in objects(s3, src):
        client.copy_object(Bucket=s3.bucket, Key=f"{dp}/{name}", CopySource={"Bucket": s3.bucket, "Key": f"{sp}/{name}"})
    for name, data in (files or {}).items():
        s3.put_bytes(dp, name, data)
    if edit is not None:
        m = json.loads(s3.get_bytes(dp, names.MANIFEST))
        edit(m)
        s3.put_bytes(dp, names.MANIFEST, json.dumps(m).encode())
    return dst


# ---------------------------------------------------------------- the merge


def test_parts_merged_at_the_home_read_like_a_local_merge(pushed: list[str], local_merged: Path, s3_server: S3Server,
                                                          reader_config: None) -> None:
    dest = fresh(s3_server, "ds")
    mark = s3_server.log_size()
    summary = merge_at_home(pushed, dest, progress=False)
    requests = s3_server.requests_since(mark)
    with kvdata.open(local_merged) as ref:
        want = ref.manifest
    assert summary["samples"] == sum(SIZES) == want.count and summary["shards"] == len(want.shards)
    assert summary["objects_copied"] == len(want.shards) and summary["objects_skipped"] == 0
    assert summary["bytes_copied_at_home"] == sum(e.zst.bytes for e in open_home_manifest(dest).shards)
    # no record byte went through the client: each merged shard object was copied by the server;
    # shard objects were read only for the keys of the last part's deletes (seek table + frames)
    shard_gets = [r for r in requests if '"GET ' in r and "/shards/" in r]
    assert all(f"/{pushed[2].split('/', 3)[3]}/shards/" in r and '" 206 ' in r for r in shard_gets), shard_gets
    zst_bytes = sum(e.zst.bytes for e in open_home_manifest(pushed[2]).shards)
    assert 0 < summary["bytes_read_for_keys"] < zst_bytes / 4
    dest_key = dest.split("/", 3)[3]
    copied = [r for r in requests if '"PUT ' in r and f"/{dest_key}/shards/" in r]
    assert len(copied) == len(want.shards)
    assert [r for r in requests if f"/{dest_key}/" in r and '"PUT ' in r][-1].count(names.MANIFEST) == 1  # last

    got = open_home_manifest(dest)
    assert [(e.name, e.bytes, e.sha256, e.records) for e in got.shards] == \
        [(e.name, e.bytes, e.sha256, e.records) for e in want.shards]
    assert got.classes == tuple(CLASSES) and got.index_sha256 and got.tail.records == 0

    with kvdata.open(local_merged) as ref, kvdata.open(dest) as m:
        assert len(m) == len(ref) and list(m.keys()) == list(ref.keys())
        assert (m.labels == ref.labels).all() and m.fields == ref.fields and m.classes == CLASSES
        for i in range(len(ref)):
            assert same(m[i], ref[i]), i
        for k in ("part0/00000", "part1/00000", "part2/00249", "part0/00011"):
            assert m.find(k) == ref.find(k) and same(m[k], ref[k])
        assert "part2/00001-gone" not in m and m.find("nope") is None
    ds = kvdata.Dataset(dest)
    try:
        assert len(ds) == sum(SIZES)
        with kvdata.open(local_merged) as ref:
            for i in range(len(ds)):
                assert same(ds[i], ref.get_one(i)), i
    finally:
        ds.store.close()
    assert verify(dest, progress=False, use_daemon=False)["ok"]

    again = merge_at_home(pushed, dest, progress=False)  # a re-run of a finished merge changes nothing
    assert again["already_merged"] and again["objects_copied"] == 0


def open_home_manifest(url: str) -> Any:
    from kvdata.format import parse_manifest

    home = open_home(url)
    try:
        return parse_manifest(home.read(names.MANIFEST), url)
    finally:
        home.close()


def test_cli_merge_of_urls(pushed: list[str], local_parts: list[Path], s3_server: S3Server, tmp_path: Path,
                           reader_config: None) -> None:
    cli = Cli(tmp_path)
    dest = fresh(s3_server, "ds")
    r = cli.ok("merge", *pushed, dest, "--json").json()
    assert {"dataset", "parts", "generation", "samples", "shards", "bytes", "objects_copied", "objects_skipped",
            "bytes_copied_at_home", "index_uploaded", "bytes_downloaded", "already_merged", "seconds"} <= r.keys()
    assert r["samples"] == sum(SIZES) and r["parts"] == pushed and r["dataset"] == dest and not r["already_merged"]
    assert cli.ok("verify", dest).text.startswith("ok: ")
    assert "already merged, nothing to do" in cli.ok("merge", *pushed, dest).text
    text = cli.ok("merge", *pushed, fresh(s3_server, "ds")).text
    assert f"merged 3 parts into s3://{s3_server.bucket}/ds-" in text and "copied at the home" in text

    cli.fail("merge", local_parts[0], pushed[1], fresh(s3_server, "ds"), names=[str(local_parts[0]), "kvdata push"])
    cli.fail("merge", *pushed, fresh(s3_server, "ds"), "--move", names=["--move"])
    cli.fail("merge", *pushed, "http://127.0.0.1:9/ds", names=["read-only"])
    cli.fail("merge", *pushed, pushed[0] + "/inside", names=["overlaps", pushed[0]])
    cli.fail("merge", *pushed, s3_server.url("x/../ds.parts/node-0"), names=["'..'"])
    cli.fail("merge", *pushed, f"file://{tmp_path / 'out'}", names=["local path", "fsspec+file://"])
    assert not (tmp_path / "out").exists()
    with pytest.raises(ReadOnlyError):
        merge(pushed, "https://127.0.0.1:9/ds")
    with pytest.raises(KVDataError, match="given twice"):
        merge([pushed[0], pushed[0] + "/"], fresh(s3_server, "ds"))
    with pytest.raises(KVDataError, match="no/such/part.* does not exist"):
        merge([pushed[0], s3_server.url("no/such/part")], fresh(s3_server, "ds"))


def test_duplicate_keys_across_parts_are_named_and_nothing_is_written(pushed: list[str], s3_server: S3Server,
                                                                      tmp_path: Path) -> None:
    dup = tmp_path / "dup.kv"
    write_part(dup, [("z/only-here", b"z", None), ("part2/00007", b"again", None), ("part0/00011", b"again", None)])
    dup_url = s3_server.url("ds.parts/dup")
    push(dup, dup_url, show=False)
    dest = fresh(s3_server, "ds")
    with pytest.raises(InvalidKeyError) as e:
        merge_at_home([*pushed, dup_url], dest, progress=False)
    msg = str(e.value)
    assert "'part2/00007'" in msg and "'part0/00011'" in msg and dup_url in msg and pushed[2] in msg
    assert "nothing was written" in msg and objects(s3_server, dest) == set()
    line = Cli(tmp_path).fail("merge", *pushed, dup_url, dest, names=["duplicate", "part2/00007", dup_url])
    assert "nothing was written" in line and objects(s3_server, dest) == set()


# ---------------------------------------------------------------- hostile parts


def _rewrite_samples(s3: S3Server, part: str) -> tuple[Callable[[dict[str, Any]], None], dict[str, bytes]]:
    """A samples file whose first sample points at a shard the part does not have, with the
    manifest's checksum updated to match (a home that lies consistently)."""
    m = json.loads(s3.get_bytes(part.split("/", 3)[3], names.MANIFEST))
    name = m["index"]["samples"]
    data = bytearray(s3.get_bytes(part.split("/", 3)[3], f"{names.INDEX_DIR}/{name}"))
    struct.pack_into("<I", data, 0, 999)
    digest = hashlib.sha256(bytes(data)).hexdigest()

    def edit(man: dict[str, Any]) -> None:
        man["index_sha256"][name] = digest

    return edit, {f"{names.INDEX_DIR}/{name}": bytes(data)}


def test_hostile_part_manifests_and_indexes_are_refused_before_anything_is_written(
        pushed: list[str], s3_server: S3Server) -> None:
    def shard0(f: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        return lambda m: f(m["shards"][0])

    cases: list[tuple[str, str, type[Exception]]] = []

    def add(match: str, err: type[Exception], edit: Callable[[dict[str, Any]], None] | None = None,
            files: dict[str, bytes] | None = None) -> None:
        cases.append((clone(s3_server, pushed[1], edit, files), match, err))

    add("bad field", CorruptDatasetError, shard0(lambda s: s.update(name="../../escape.mdb")))
    add("bad field", CorruptDatasetError, shard0(lambda s: s["zst"].update(name="../other/000000.mdb.zst")))
    add("bad field", CorruptDatasetError, lambda m: m["index"].update(samples="../samples-00000001.bin"))
    add("its part's manifest says", CorruptDatasetError, shard0(lambda s: s["zst"].update(bytes=s["zst"]["bytes"] + 1)))
    add("was uploaded with sha256", CorruptDatasetError, shard0(lambda s: s["zst"].update(sha256="0" * 64)))
    add("does not match its checksum", CorruptDatasetError,
        lambda m: m["index_sha256"].update({k: "0" * 64 for k in m["index_sha256"]}))
    add("no sha256", CorruptDatasetError, lambda m: m.pop("index_sha256"))
    add("open tail", CorruptDatasetError, lambda m: m["tail"].update(records=3))
    add("shorter than", CorruptDatasetError, lambda m: m.update(count=m["count"] + 1000))
    add("not a record of it", CorruptDatasetError, *_rewrite_samples(s3_server, pushed[1]))
    for part, match, err in cases:
        dest = fresh(s3_server, "ds")
        with pytest.raises(err, match=match):
            merge_at_home([part], dest, progress=False)
        assert objects(s3_server, dest) == set(), (part, match)


def test_an_object_at_the_destination_is_never_overwritten_with_other_bytes(pushed: list[str],
                                                                           s3_server: S3Server) -> None:
    dest = fresh(s3_server, "ds")
    key = dest.split("/", 3)[3]
    s3_server.put_bytes(key, f"{names.SHARDS_DIR}/000001.mdb.zst", b"someone else's bytes")
    with pytest.raises(KVDataError, match="000001.mdb.zst exists with other bytes.*nothing was written"):
        merge_at_home(pushed, dest, progress=False)
    assert objects(s3_server, dest) == {f"{names.SHARDS_DIR}/000001.mdb.zst"}
    s3_server.put_bytes(key, names.MANIFEST, b"{}")  # a dataset (or anything) under the manifest's name: refused
    with pytest.raises(NotADatasetError, match="already a dataset"):
        merge_at_home(pushed, dest, progress=False)


def test_large_objects_are_copied_part_by_part(pushed: list[str], s3_server: S3Server, reader_config: None) -> None:
    """UploadPartCopy: every object as a multipart copy (S3 does so above 5 GiB); a merged
    dataset reads, and an 11 MiB object copied in 5 MiB ranges is the same bytes and record."""
    dest = fresh(s3_server, "ds")
    merge_at_home(pushed, dest, progress=False, copy_options={"multipart_over": 0})
    assert verify(dest, progress=False, use_daemon=False)["ok"]
    data = np.random.default_rng(0).bytes(11 << 20)
    key = fresh(s3_server, "big").split("/", 3)[3]
    s3_server.put_bytes(key, "src", data)
    home = S3Home(s3_server.url(key))
    try:
        info = home.info("src")
        assert info is not None and info.size == len(data)
        home.copy_from(home, "src", "dst", info, "ab" * 32, multipart_over=1, part_size=5 << 20)
        assert s3_server.get_bytes(key, "dst") == data and home.sha256("dst") == "ab" * 32
    finally:
        home.close()


# ---------------------------------------------------------------- fsspec homes


def test_parts_at_an_fsspec_home_merge_with_its_own_copy(local_parts: list[Path], pushed: list[str],
                                                        local_merged: Path, reader_config: None) -> None:
    fsspec = pytest.importorskip("fsspec", reason="fsspec is not installed (pip install 'kvdata[fsspec]')")
    root = f"memory://kvmerge-{uuid.uuid4().hex[:8]}"
    try:
        urls = [f"{root}/ds.parts/node-{i}" for i in range(len(local_parts))]
        for p, url in zip(local_parts, urls):
            push(p, url, show=False)
        summary = merge_at_home(urls, f"{root}/ds", progress=False)
        assert summary["objects_copied"] == summary["shards"] > 0
        with kvdata.open(local_merged) as ref, kvdata.open(f"{root}/ds") as m:
            assert list(m.keys()) == list(ref.keys()) and all(same(m[i], ref[i]) for i in range(len(ref)))
        again = merge_at_home(urls, f"{root}/ds", progress=False)
        assert again["already_merged"]
        with pytest.raises(KVDataError, match="not at the same home"):
            merge_at_home([urls[0], pushed[1]], f"{root}/ds2", progress=False)
        with pytest.raises(KVDataError, match="not at the same home"):
            merge_at_home(urls, pushed[0].rsplit("/", 2)[0] + "/from-memory", progress=False)
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(root.split("://", 1)[1]):
            fs.rm(root.split("://", 1)[1], recursive=True)


# ---------------------------------------------------------------- SIGKILL during a merge

KILLS = 4


def _fork_merge(parts: list[str], dest: str, delay: float | None) -> float | None:
    """Merge in a forked child; with `delay`, SIGKILL it that long after it starts merging,
    else return how long the merge took."""
    return run_forked(lambda: merge_at_home(parts, dest, progress=False), delay)


@pytest.mark.timeout(180)
def test_sigkill_during_a_merge_at_the_home_then_run_again(pushed: list[str], s3_server: S3Server,
                                                          reader_config: None) -> None:
    took = _fork_merge(pushed, fresh(s3_server, "timing"), None)
    assert took is not None
    seen = {"no manifest": 0, "complete": 0}
    for i in range(KILLS):
        dest = fresh(s3_server, f"kill{i}")
        _fork_merge(pushed, dest, took * (i + 0.5) / KILLS)
        left = objects(s3_server, dest)
        if names.MANIFEST in left:  # the manifest is last: every object it names is there
            seen["complete"] += 1
            m = open_home_manifest(dest)
            assert {f"{names.SHARDS_DIR}/{e.zst.name}" for e in m.shards} <= left
        else:
            seen["no manifest"] += 1
            again = merge_at_home(pushed, dest, progress=False)  # run again: completes, skipping what is there
            assert not again["already_merged"] and again["samples"] == sum(SIZES)
            assert again["objects_skipped"] == sum(1 for k in left if k.startswith(f"{names.SHARDS_DIR}/")) + \
                sum(1 for k in left if k.startswith(f"{names.INDEX_DIR}/"))
        with kvdata.open(dest) as m:
            assert len(m) == sum(SIZES)
    assert verify(dest, progress=False, use_daemon=False)["ok"]
    assert seen["no manifest"] >= 1, seen
    print(f"\nmerge at the home took {took * 1000:.0f} ms; outcomes of {KILLS} kills: {json.dumps(seen)}")
