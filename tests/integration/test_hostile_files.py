"""Files planted or damaged in a dataset directory: the writer and the readers refuse them with
one line instead of following a link, dying of SIGBUS or leaking a library error.

Each test is named after what main did (found by tests/fuzz and bench/fuzz.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvdata
from kvdata.errors import CorruptDatasetError, InvalidValueError

from helpers.cli import Cli


def _tail(ds: Path) -> Path:
    return ds / "shards" / json.loads((ds / "manifest.json").read_text())["tail"]["name"]


def _small(ds: Path) -> None:
    with kvdata.open(ds, "w") as s:
        for i in range(20):
            s.put(f"k{i}", bytes([i]) * 500)


def test_writer_refuses_a_tail_that_is_a_symlink_and_never_writes_through_it(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    _small(ds)
    tail = _tail(ds)
    victim = tmp_path / "victim.mdb"
    victim.write_bytes(tail.read_bytes())
    before = victim.read_bytes()
    tail.unlink()
    tail.symlink_to(victim)
    with pytest.raises(CorruptDatasetError, match="symbolic link"):
        kvdata.open(ds, "a")
    assert victim.read_bytes() == before
    assert not (tmp_path / "victim.mdb-lock").exists()


def test_writer_refuses_a_tail_lock_file_that_is_a_symlink(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    _small(ds)
    lock = _tail(ds).with_name(_tail(ds).name + "-lock")
    lock.unlink(missing_ok=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    lock.symlink_to(victim)
    with pytest.raises(CorruptDatasetError, match="symbolic link"):
        kvdata.open(ds, "a")
    assert victim.read_bytes() == b"precious"


def test_writer_on_a_truncated_tail_raises_instead_of_sigbus(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    _small(ds)
    tail = _tail(ds)
    size = tail.stat().st_size
    # in a child: a SIGBUS would kill the test process itself
    code = f"""
import kvdata, sys, os
os.truncate({str(tail)!r}, {size // 2})
try:
    kvdata.open({str(ds)!r}, "a")
except kvdata.KVDataError as e:
    print("ERR", e); sys.exit(3)
print("opened"); sys.exit(0)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "truncated" in r.stdout and str(tail) in r.stdout


def test_manifest_with_non_canonical_shard_name_is_refused(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "w", shard_size="64KB") as s:
        for i in range(40):
            s.put(f"k{i}", bytes([i]) * 3000)
        s.seal()
    m = json.loads((ds / "manifest.json").read_text())
    good = m["shards"][0]["name"]
    for bad in ("0" + good, good.replace("0", "\u0660", 1)):  # 7 digits; an Arabic-Indic zero matched by \d
        m["shards"][0]["name"] = bad
        (ds / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(CorruptDatasetError, match="shards"):
            kvdata.open(ds)


def test_get_batch_on_mixed_records_is_a_clear_error_not_typeerror(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "w") as s:
        s.put("raw", b"bytes")
        s.put("img", {"x": np.arange(3)})
        s.put("other", {"y": 1})
    s = kvdata.open(ds)
    with pytest.raises(InvalidValueError, match="mixes raw-bytes"):
        s.get_batch([0, 1])
    with pytest.raises(InvalidValueError, match="field 'x'"):
        s.get_batch([1, 2], fields=["x"])
    assert isinstance(s.get_batch([1])["x"], np.ndarray)


def test_cli_on_a_tail_symlink_prints_one_line(tmp_path: Path, cli: Cli) -> None:
    ds = tmp_path / "ds"
    _small(ds)
    tail = _tail(ds)
    victim = tmp_path / "victim.mdb"
    os.replace(tail, victim)
    tail.symlink_to(victim)
    cli.fail("get", ds, "k1", names=[tail.name, "symbolic link"])
    cli.fail("put", ds, "-", "--key", "new", input=b"v", names=[tail.name, "symbolic link"])
    assert not (tmp_path / "victim.mdb-lock").exists()
