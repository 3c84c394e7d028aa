"""Bad input and damaged datasets, through the real `kvdata` script.

Every case must exit non-zero with exactly one `kvdata: error:` line on stderr
(verify: `BAD ...` lines, then that one line) that names the file, key or
setting at fault, never a traceback, and must leave a sound dataset as it was:
a separate `kvdata verify` passes and the committed keys read back byte for byte.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvdata
from kvdata.errors import InvalidValueError

from helpers.cli import Cli

READ_COMMANDS = ["get", "ls", "info", "verify"]


def _write(path: Path, n: int, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def _read_args(cmd: str, ds: Path, key: str = "a.bin") -> list[str | Path]:
    return [cmd, ds, key] if cmd == "get" else [cmd, ds]


def _contents(ds: Path) -> dict[str, bytes]:
    with kvdata.open(ds) as store:
        return {k: bytes(store[k]) for k in store.keys()}


def _generation(ds: Path) -> int:
    with kvdata.open(ds) as store:
        return store.generation


def _assert_intact(cli: Cli, ds: Path, want: dict[str, bytes], generation: int | None = None) -> None:
    """`kvdata verify` passes, the keys are exactly `want` (in order) and read back with their bytes."""
    cli.ok("verify", ds)
    assert _contents(ds) == want
    if generation is not None:
        assert _generation(ds) == generation


@pytest.fixture
def small(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A dataset of 2 small records committed in the tail (256MB shards), written with the Python API."""
    ds = tmp_path / "ds"
    want = {n: _write(tmp_path / "in" / n, 1000 + i, i) for i, n in enumerate(["a.bin", "b.bin"])}
    with kvdata.open(ds, "a") as store:
        for k, v in want.items():
            store.put(k, v)
    return ds, want


@pytest.fixture
def sharded(cli: Cli, tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """64KB shards and 5 x 30 KB files: sealed shards 000000 (a, b) and 000001 (c, d), e in the tail."""
    ds = tmp_path / "ds"
    names = ["a.bin", "b.bin", "c.bin", "d.bin", "e.bin"]
    want = {n: _write(tmp_path / "in" / n, 30_000, i) for i, n in enumerate(names)}
    cli.ok("put", ds, *(tmp_path / "in" / n for n in names), "--shard-size", "64KB")
    with kvdata.open(ds) as store:
        assert len(store.manifest["shards"]) == 2
        assert store.shard_of(range(5)).tolist() == [0, 0, 1, 1, 2]
    return ds, want


# ---------------------------------------------------------------- 1. not a dataset


@pytest.mark.parametrize("cmd", READ_COMMANDS)
@pytest.mark.parametrize("kind", ["missing", "other-dir", "file"])
def test_path_that_is_not_a_dataset(cli: Cli, tmp_path: Path, cmd: str, kind: str) -> None:
    path = tmp_path / "not-a-dataset"
    if kind == "other-dir":
        path.mkdir()
        (path / "notes.txt").write_text("mine")
        (path / "sub").mkdir()
    elif kind == "file":
        path.write_text("a file")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    line = cli.fail(*_read_args(cmd, path), names=[str(path)])
    assert ("no such dataset" if kind == "missing" else "not a kvdata dataset") in line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing created or changed


@pytest.mark.parametrize("cmd", ["put", "reindex"])
def test_writing_into_a_directory_that_is_not_a_dataset(cli: Cli, tmp_path: Path, cmd: str) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    _write(tmp_path / "a.bin", 10, 0)
    args = ["put", other, tmp_path / "a.bin"] if cmd == "put" else ["reindex", other]
    line = cli.fail(*args, names=[str(other)])
    assert "not a kvdata dataset" in line
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------- 2. newer format version


def _set_version(ds: Path, version: int) -> bytes:
    m = json.loads((ds / "manifest.json").read_text())
    m["version"] = version
    data = json.dumps(m, indent=1).encode()
    (ds / "manifest.json").write_bytes(data)
    return data


def test_manifest_of_a_newer_format_version_says_upgrade(cli: Cli, tmp_path: Path,
                                                         small: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = small
    gen = _generation(ds)
    edited = _set_version(ds, 99)
    _write(tmp_path / "new.bin", 10, 9)
    for args in [_read_args(c, ds) for c in READ_COMMANDS] + [["put", ds, tmp_path / "new.bin"], ["rm", ds, "a.bin"]]:
        line = cli.fail(*args, names=[str(ds / "manifest.json"), "version 99"])
        assert "upgrade kvdata" in line
    assert (ds / "manifest.json").read_bytes() == edited  # nobody rewrote it
    _set_version(ds, 1)
    _assert_intact(cli, ds, want, gen)


def test_reindex_refuses_a_newer_format_version(cli: Cli, small: tuple[Path, dict[str, bytes]]) -> None:
    ds, _want = small
    edited = _set_version(ds, 99)
    cli.fail("reindex", ds, names=[str(ds), "upgrade"])
    assert (ds / "manifest.json").read_bytes() == edited


# ---------------------------------------------------------------- 3. truncated manifest, corrupt index


def test_truncated_manifest_suggests_reindex_which_repairs_it(cli: Cli, sharded: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = sharded
    data = (ds / "manifest.json").read_bytes()
    (ds / "manifest.json").write_bytes(data[:len(data) // 2])
    for cmd in READ_COMMANDS:
        line = cli.fail(*_read_args(cmd, ds), names=[str(ds / "manifest.json"), "kvdata reindex"])
        assert "truncated or corrupt" in line
    assert cli.ok("reindex", ds).text.startswith("reindexed 5 samples from 2 sealed shards")
    _assert_intact(cli, ds, want)


def test_corrupt_index_suggests_reindex_which_repairs_it(cli: Cli, sharded: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = sharded
    gen = _generation(ds)
    (samples,) = (ds / "index").glob("samples-*.bin")
    with open(samples, "r+b") as f:
        f.truncate(5)
    for cmd in ("get", "verify"):
        cli.fail(*_read_args(cmd, ds), names=[samples.name, "truncated", "kvdata reindex"])
    cli.ok("reindex", ds)
    _assert_intact(cli, ds, want)
    assert _generation(ds) == gen + 1


# ---------------------------------------------------------------- 4. missing shard


def test_missing_shard_is_named_by_get_and_verify(cli: Cli, sharded: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = sharded
    shard = ds / "shards" / "000000.mdb"
    saved = shard.read_bytes()
    shard.unlink()
    cli.fail("get", ds, "a.bin", names=[f"{shard} is missing"])
    bad = cli.verify_fails(ds, names=["000000.mdb"])
    assert "BAD shard 000000.mdb: missing" in bad
    assert cli.ok("get", ds, "c.bin").out == want["c.bin"]  # other shards still read
    assert cli.ok("get", ds, "e.bin").out == want["e.bin"]
    shard.write_bytes(saved)  # restored: the failed commands changed nothing else
    _assert_intact(cli, ds, want)


# ---------------------------------------------------------------- 5. flipped byte


def test_flipped_byte_in_a_shard_is_named_by_verify(cli: Cli, sharded: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = sharded
    with kvdata.open(ds) as store:
        i = store.find("b.bin")
        shard = int(store.shard_of([i])[0])
        row = int(store._index.base[shard]) + int(store._index.samples["slot"][i])
        off = int(store._index.records["offset"][row]) + 200
        name = store.manifest["shards"][shard]["name"]
    path = ds / "shards" / name
    with open(path, "r+b") as f:
        f.seek(off)
        old = f.read(1)
        f.seek(off)
        f.write(bytes([old[0] ^ 0xFF]))
    bad = cli.verify_fails(ds, names=[name, "'b.bin'"])
    assert any("'b.bin'" in line and name in line and "crc32" in line for line in bad)
    r = cli.run("verify", ds, "--json")
    assert r.rc == 1
    report = r.json()
    assert report["ok"] is False
    assert [(b["key"], b["shard"]) for b in report["bad_records"]] == [("b.bin", name)]
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(old)
    _assert_intact(cli, ds, want)


# ---------------------------------------------------------------- 6. bad keys


def test_empty_key_writes_nothing(cli: Cli, tmp_path: Path, small: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = small
    gen = _generation(ds)
    line = cli.fail("put", ds, "-", "--key", "", input=b"data")
    assert "empty key" in line
    _assert_intact(cli, ds, want, gen)
    new = tmp_path / "new"
    cli.fail("put", new, "-", "--key", "", input=b"data")
    assert not new.exists()


def test_non_utf8_file_name_writes_nothing(cli: Cli, tmp_path: Path, small: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = small
    gen = _generation(ds)
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.bin").write_bytes(b"good")
    bad = os.fsencode(src) + b"/bad\xff.bin"
    fd = os.open(bad, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"bad")
    os.close(fd)
    for args in (["put", ds, bad], ["put", ds, src], ["put", ds, src / "good.bin", bad]):
        cli.fail(*args, names=["key 'bad", "ff.bin'", "not valid UTF-8", "--key"])
    _assert_intact(cli, ds, want, gen)  # not even good.bin
    cli.ok("put", ds, bad, "--key", "renamed.bin")  # what the message suggests
    assert _contents(ds) == {**want, "renamed.bin": b"bad"}


# ---------------------------------------------------------------- 7. record larger than a shard


def test_record_larger_than_the_shard_size(cli: Cli, tmp_path: Path, sharded: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = sharded
    gen = _generation(ds)
    big = tmp_path / "big.bin"
    _write(big, 100_000, 7)
    _write(tmp_path / "ok.bin", 100, 8)
    for args in (["put", ds, big], ["put", ds, tmp_path / "ok.bin", big]):
        line = cli.fail(*args, names=["'big.bin'", "use a larger --shard-size"])
    assert "64000" in line
    _assert_intact(cli, ds, want, gen)


def test_retry_with_a_larger_shard_size_as_advised(cli: Cli, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    data = _write(big, 100_000, 7)
    ds = tmp_path / "new"
    cli.fail("put", ds, big, "--shard-size", "64KB", names=["use a larger --shard-size"])
    cli.ok("put", ds, big, "--shard-size", "1MB")
    assert _contents(ds) == {"big.bin": data}


# ---------------------------------------------------------------- 8. object dtype (Python API)


def test_object_dtype_array_is_refused_and_nothing_is_committed(cli: Cli, small: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = small
    gen = _generation(ds)
    with pytest.raises(InvalidValueError) as info:
        with kvdata.open(ds, "a") as store:
            store.put("first", b"pending, never committed")
            store.put("k", {"x": np.array([object()])})
    msg = str(info.value)
    assert "'k'" in msg and "'x'" in msg and "object" in msg
    assert len(msg.splitlines()) == 1
    _assert_intact(cli, ds, want, gen)
    with kvdata.open(ds, "a") as store:  # the writer lock was released
        store.put("k", {"x": np.arange(3)})
    assert _generation(ds) == gen + 1


# ---------------------------------------------------------------- 9. full disk during commit

_CHILD = r"""
import os, resource, signal, sys
import kvdata
from kvdata.errors import CommitError

limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = kvdata.open(sys.argv[1], "a")
try:
    for i in range(2):
        store.put(f"new{i}", os.urandom(3_000_000))
    store.commit()
except CommitError as e:
    print(e)
    sys.exit(3)
finally:
    store.close()
print("committed")
"""


def _disk_limit(ds: Path) -> int:
    """A file-size limit a bit above the dataset: its files fit, a few more MB do not."""
    return sum(f.stat().st_size for f in ds.rglob("*") if f.is_file()) + 256 * 1024


def _limited(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


def test_full_disk_during_commit_keeps_the_previous_generation(cli: Cli, tmp_path: Path,
                                                               small: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = small
    gen = _generation(ds)
    p = subprocess.run([sys.executable, "-c", _CHILD, str(ds), str(_disk_limit(ds))], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    assert str(ds) in p.stdout and "commit failed" in p.stdout and f"unchanged at generation {gen}" in p.stdout
    _assert_intact(cli, ds, want, gen)
    # with room again the same writes succeed
    _write(tmp_path / "more.bin", 3_000_000, 5)
    cli.ok("put", ds, tmp_path / "more.bin")
    assert _generation(ds) == gen + 1
    cli.ok("verify", ds)


def _cli_put_on_a_full_disk(cli: Cli, tmp_path: Path, ds: Path) -> str:
    files = [tmp_path / f"big{i}.bin" for i in range(2)]
    for i, f in enumerate(files):
        _write(f, 3_000_000, 20 + i)
    return cli.fail("put", ds, *files, preexec_fn=_limited(_disk_limit(ds)), names=[str(ds), "commit failed"])


def test_cli_put_on_a_full_disk(cli: Cli, tmp_path: Path, small: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = small
    gen = _generation(ds)
    line = _cli_put_on_a_full_disk(cli, tmp_path, ds)
    assert f"unchanged at generation {gen}" in line and "free space" in line
    _assert_intact(cli, ds, want, gen)


def test_cli_put_on_a_full_disk_says_the_disk_is_full(cli: Cli, tmp_path: Path,
                                                      small: tuple[Path, dict[str, bytes]]) -> None:
    ds, _want = small
    line = _cli_put_on_a_full_disk(cli, tmp_path, ds)
    assert "disk" in line.split(str(ds), 1)[1]  # (the test's own tmp path says "disk")


# ---------------------------------------------------------------- 10. a second writer


def test_second_writer_fails_at_once(cli: Cli, tmp_path: Path, small: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = small
    data = _write(tmp_path / "c.bin", 500, 3)
    writer = kvdata.open(ds, "a")
    try:
        t = time.monotonic()
        cli.fail("put", ds, tmp_path / "c.bin", names=[str(ds), "another process", f"pid {os.getpid()}"])
        assert time.monotonic() - t < 5
        cli.fail("rm", ds, "a.bin", names=[str(ds), "another process"])
        assert cli.ok("ls", ds).lines() == list(want)  # readers are not blocked
    finally:
        writer.close()
    cli.ok("put", ds, tmp_path / "c.bin")
    _assert_intact(cli, ds, {**want, "c.bin": data})


# ---------------------------------------------------------------- 11. bad option values


def test_bad_shard_size(cli: Cli, tmp_path: Path, small: tuple[Path, dict[str, bytes]]) -> None:
    ds, want = small
    gen = _generation(ds)
    _write(tmp_path / "c.bin", 10, 3)
    new = tmp_path / "new"
    for value in ("abc", "0"):
        cli.fail("put", new, tmp_path / "c.bin", "--shard-size", value, names=["--shard-size", repr(value)])
    assert not new.exists()
    cli.fail("put", ds, tmp_path / "c.bin", "--shard-size", "abc", names=["--shard-size", "'abc'"])
    cli.fail("import", "folder", tmp_path / "in", tmp_path / "imp", "--shard-size", "abc", names=["--shard-size", "'abc'"])
    assert not (tmp_path / "imp").exists()
    _assert_intact(cli, ds, want, gen)


def test_import_bad_shard_size_names_the_option(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    cli.fail("import", "folder", tmp_path / "images", tmp_path / "ds", "--shard-size", "abc", names=["--shard-size"])


def test_bad_resize(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "images" / "cat"
    src.mkdir(parents=True)
    (src / "0.png").write_bytes(b"not read before the options are checked")
    ds = tmp_path / "ds"
    for value in ("10", "0x5", "axb"):
        cli.fail("import", "folder", src.parent, ds, "--decode", "rgb", "--resize", value,
                 names=["--resize", repr(value), "WIDTHxHEIGHT"])
    assert not ds.exists()


def test_click_usage_errors_name_the_option(cli: Cli, tmp_path: Path) -> None:
    """Errors click itself detects (bad option values, missing files) are one line too, exit 2."""
    ds = tmp_path / "ds"
    for args, named in ([["put", ds, "-", "--label", "x"], "--label"],
                        [["put", ds, tmp_path / "missing.bin"], "missing.bin"],
                        [["ls", ds, "--limit", "-1"], "--limit"]):
        r = cli.run(*args)
        assert r.rc == 2, str(r)
        assert len(r.err.splitlines()) == 1 and r.err.startswith("kvdata: error:") and named in r.err, str(r)
    assert not ds.exists()
