"""`kvdata push` decides what to upload by content hash, never by size (issue 11, "push
compares content hashes, not sizes").

The bug: push skipped any object whose size matched, so a shard rewritten with the same
size but other bytes was never uploaded and the home stayed unstageable. Here a home (a
local directory, and moto's S3 server on 127.0.0.1) is made to hold same-size objects
with other bytes, pushed to again, then staged and read back; uploads are counted by
wrapping the homes' `put_file`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvdata
from kvdata.errors import ChecksumMismatchError
from kvdata.homes import open_home
from kvdata.homes.local import SHA256_XATTR, LocalHome
from kvdata.homes.s3_home import S3Home
from kvdata.sync.push import push

from helpers.servers import S3Server, tiers_config

N_KEYS = 40          # 4 sealed shards of 10 records at 64 KB
VALUE_BYTES = 6000


@dataclass
class Version:
    path: Path
    values: dict[str, bytes]
    shards: list[Any]        # the manifest's ShardEntry list

    def zst(self, i: int) -> tuple[str, Path, str, int]:
        """(name at the home, local file, sha256, size) of shard i's compressed copy."""
        z = self.shards[i].zst
        return f"shards/{z.name}", self.path / "shards" / z.name, z.sha256, z.bytes


def build(path: Path, seed: int) -> Version:
    rng = np.random.default_rng(seed)
    values = {f"k{i:03d}": rng.integers(0, 256, VALUE_BYTES, dtype=np.uint8).tobytes() for i in range(N_KEYS)}
    with kvdata.open(path, "w", shard_size="64KB", compress=True) as s:  # cold copies at seal
        s.put_many((k, v, i % 3) for i, (k, v) in enumerate(values.items()))
        s.seal()
    with kvdata.open(path) as s:
        shards = list(s.manifest.shards)
    assert len(shards) >= 2 and all(e.zst is not None for e in shards)
    return Version(path, values, shards)


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Version, Version]:
    """Two datasets with the same keys, layout and shard names, and other bytes."""
    root = tmp_path_factory.mktemp("versions")
    v1, v2 = build(root / "v1.kv", 1), build(root / "v2.kv", 2)
    assert [e.zst.name for e in v1.shards] == [e.zst.name for e in v2.shards]
    assert all(a.zst.sha256 != b.zst.sha256 for a, b in zip(v1.shards, v2.shards))
    return v1, v2


@pytest.fixture
def uploads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names passed to every home's put_file, in order."""
    seen: list[str] = []
    for cls in (LocalHome, S3Home):
        def spy(self: Any, name: str, path: Path, sha256: str | None = None, *, _orig: Any = cls.put_file) -> None:
            seen.append(name)
            _orig(self, name, path, sha256=sha256)
        monkeypatch.setattr(cls, "put_file", spy)
    return seen


def read_back(url: str, tmp_path: Path) -> dict[str, bytes]:
    """Every record of the home, staged into a fresh tier."""
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "8MB"))
    with kvdata.open(url, config=cfg) as st:
        return {k: bytes(st[k]) for k in st.keys()}


def xattrs_supported(path: Path) -> bool:
    try:
        os.getxattr(path, SHA256_XATTR)
    except OSError as e:
        return e.errno != errno.ENOTSUP
    return True


def stale_bytes(old: bytes, size: int) -> bytes:
    """The old version's bytes, cut or repeated to exactly `size`."""
    return (old * (size // len(old) + 1))[:size]


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_push_reuploads_a_shard_rewritten_with_the_same_size(kind: str, versions: tuple[Version, Version],
                                                            s3_server: S3Server, uploads: list[str],
                                                            tmp_path: Path) -> None:
    v1, v2 = versions
    url = s3_server.url(f"same-size-{tmp_path.name}") if kind == "s3" else str(tmp_path / "home")
    push(v1.path, url, show=False)
    # The home now holds, under every shard name, v1's bytes at exactly v2's size: a size
    # comparison takes each for v2's shard. Half carry a sha256 record of what they hold (as
    # a push of other bytes leaves it), half were rewritten behind the home's back.
    home = open_home(url)
    try:
        for i in range(len(v2.shards)):
            name, _local, _sha, size = v2.zst(i)
            data = stale_bytes(v1.zst(i)[1].read_bytes(), size)
            if kind == "s3":
                meta = {"sha256": hashlib.sha256(data).hexdigest()} if i % 2 else {}
                s3_server.client().put_object(Bucket=s3_server.bucket, Key=f"{home.prefix}/{name}",
                                              Body=data, Metadata=meta)
            elif i % 2:
                staged = tmp_path / "stale.zst"
                staged.write_bytes(data)
                home.put_file(name, staged)           # records its own (other) sha256
            else:
                with open(Path(url) / name, "r+b") as f:   # in place: same inode, old record kept
                    f.truncate(0)
                    f.write(data)
            assert home.size(name) == size and home.sha256(name) != v2.zst(i)[2]
    finally:
        home.close()
    uploads.clear()

    summary = push(v2.path, url, show=False)
    shard_names = [v2.zst(i)[0] for i in range(len(v2.shards))]
    assert (summary["shards_uploaded"], summary["shards_skipped"]) == (len(shard_names), 0), summary
    assert [n for n in uploads if n.startswith("shards/")] == shard_names
    assert uploads[-1] == "manifest.json"          # still last
    assert read_back(url, tmp_path) == v2.values

    uploads.clear()
    again = push(v2.path, url, show=False)          # nothing changed: only the manifest goes up
    assert (again["shards_uploaded"], again["shards_skipped"]) == (0, len(shard_names)), again
    n_index = summary["index_uploaded"] + summary["index_skipped"]
    assert n_index > 0 and (again["index_uploaded"], again["index_skipped"]) == (0, n_index), again
    assert uploads == ["manifest.json"]


def test_push_reuploads_an_s3_object_without_sha256_metadata(versions: tuple[Version, Version], s3_server: S3Server,
                                                             uploads: list[str], tmp_path: Path) -> None:
    _v1, v2 = versions
    prefix = f"no-meta-{tmp_path.name}"
    url = s3_server.url(prefix)
    push(v2.path, url, show=False)
    client = s3_server.client()
    name, local, sha, _size = v2.zst(1)
    head = client.head_object(Bucket=s3_server.bucket, Key=f"{prefix}/{name}")
    assert head["Metadata"] == {"sha256": sha}      # x-amz-meta-sha256, recorded at upload
    # the right bytes, but nothing vouches for them (an upload by another tool)
    client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{name}", Body=local.read_bytes())
    assert client.head_object(Bucket=s3_server.bucket, Key=f"{prefix}/{name}")["Metadata"] == {}
    # a malformed record vouches for nothing either
    name3, local3, sha3, _ = v2.zst(3)
    client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{name3}", Body=local3.read_bytes(),
                      Metadata={"sha256": sha3.upper()})
    uploads.clear()

    summary = push(v2.path, url, show=False)
    assert uploads == [name, name3, "manifest.json"]
    assert (summary["shards_uploaded"], summary["shards_skipped"]) == (2, len(v2.shards) - 2)
    assert client.head_object(Bucket=s3_server.bucket, Key=f"{prefix}/{name}")["Metadata"] == {"sha256": sha}
    assert read_back(url, tmp_path) == v2.values


def test_push_to_a_local_home_rehashes_a_file_rewritten_in_place(versions: tuple[Version, Version],
                                                                 uploads: list[str], tmp_path: Path) -> None:
    """A local home's recorded sha256 is trusted only while the file is provably unchanged:
    a same-size rewrite right after the push (same timestamp tick, old record kept) is caught,
    a file without a record is hashed, and one that hashes right is left alone."""
    _v1, v2 = versions
    home = tmp_path / "home"
    push(v2.path, home, show=False)
    name0, _local0, sha0, _ = v2.zst(0)
    name1, _local1, sha1, size1 = v2.zst(1)
    with open(home / name1, "r+b") as f:             # same size, other bytes, record left behind
        data = bytearray(f.read())
        data[size1 // 2] ^= 0xFF
        f.seek(0)
        f.write(data)
    try:
        os.removexattr(home / name0, SHA256_XATTR)   # right bytes, no record: hashed, not uploaded
    except OSError as e:
        assert e.errno in (errno.ENOTSUP, errno.ENODATA), e
    uploads.clear()

    summary = push(v2.path, home, show=False)
    assert uploads == [name1, "manifest.json"]
    assert (summary["shards_uploaded"], summary["shards_skipped"]) == (1, len(v2.shards) - 1)
    assert hashlib.sha256((home / name1).read_bytes()).hexdigest() == sha1
    if xattrs_supported(home / name0):
        assert os.getxattr(home / name0, SHA256_XATTR).split()[0].decode() == sha0   # recorded again
    assert read_back(str(home), tmp_path) == v2.values


def test_push_never_follows_a_symlink_planted_at_a_temp_name(versions: tuple[Version, Version],
                                                             tmp_path: Path) -> None:
    """The old upload wrote through `<name>.tmp` with shutil.copyfile: a symlink there got
    the shard's bytes written into its target."""
    _v1, v2 = versions
    home = tmp_path / "home"
    (home / "shards").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = []
    for i in range(len(v2.shards)):
        name = v2.zst(i)[0]
        link = home / (name + ".tmp")
        link.symlink_to(victim)
        planted.append(link)
    (home / "manifest.json.tmp").symlink_to(victim)
    planted.append(home / "manifest.json.tmp")

    push(v2.path, home, show=False)
    assert victim.read_bytes() == b"precious"
    assert all(p.is_symlink() and os.readlink(p) == str(victim) for p in planted)
    leftovers = [p.name for p in (home / "shards").iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]
    assert leftovers == []
    assert read_back(str(home), tmp_path) == v2.values


def test_push_refuses_a_local_shard_that_does_not_match_its_manifest(versions: tuple[Version, Version],
                                                                     tmp_path: Path) -> None:
    """Every upload is checked against the sha256 it is recorded under: a push never
    publishes (or vouches for) bytes the manifest does not describe."""
    _v1, v2 = versions
    src = tmp_path / "src.kv"
    shutil.copytree(v2.path, src, ignore=shutil.ignore_patterns("*-lock", ".lock"))
    name, _local, sha, size = v2.zst(2)
    with open(src / name, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    home = tmp_path / "home"
    with pytest.raises(ChecksumMismatchError, match=sha):
        push(src, home, show=False)
    assert not (home / "manifest.json").exists()
    assert not (home / name).exists()
    assert [p.name for p in (home / "shards").iterdir() if p.name.endswith(".tmp")] == []
