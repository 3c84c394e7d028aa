"""`kvdata get/ls/rm/info/verify` on damaged index files and manifests: a non-zero exit with
exactly one `kvdata: error:` line (verify: BAD lines first), never a traceback. Fuzzed in
process (click's main, as the console script calls it), and a few cases through the real
script, with HOME, XDG_* and the working directory inside the temp root."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdata.format import record as rec

import fuzzlib as fl
from fuzzlib import fuzz_settings


@pytest.fixture(scope="module")
def ctx() -> Iterator[fl.Ctx]:
    with fl.context() as c:
        yield c


def test_fuzz_cli_on_damaged_index_and_manifest(ctx: fl.Ctx) -> None:
    @fuzz_settings(40)
    @given(st.randoms(use_true_random=False))
    def case(r: Any) -> None:
        fl.check("cli", fl.TARGETS["cli"].gen(r, ctx), ctx)
        ctx.sandbox.clean_work()
    case()


def _kvdata_script() -> str:
    beside = Path(sys.executable).parent / "kvdata"
    return str(beside) if beside.is_file() else "kvdata"


def _damaged_copies(ctx: fl.Ctx) -> dict[str, Path]:
    """Datasets whose index holds what the issue saw giving OverflowError/struct.error tracebacks."""
    out = {}
    ds = fl.fresh_copy(ctx, [])
    (p,) = (ds / "index").glob("records-*.bin")
    rows = np.fromfile(p, dtype=rec.RECORD_DTYPE)
    rows["offset"] = (1 << 64) - 2
    rows.tofile(p)
    out["offsets past 2**63"] = ds
    ds = fl.fresh_copy(ctx, [])
    (p,) = (ds / "index").glob("samples-*.bin")
    p.write_bytes(bytes(range(256)) * (p.stat().st_size // 256 + 1))
    out["garbage samples"] = ds
    ds = fl.fresh_copy(ctx, [])
    for k in (ds / "index").glob("keys-*.bin"):
        arr = np.fromfile(k, dtype="<u8")
        arr[len(arr) // 2:] = (1 << 64) - 1
        arr.tofile(k)
    out["key positions past the count"] = ds
    return out


@pytest.mark.parametrize("args", [["get", "{ds}", "k4"], ["ls", "{ds}", "-l"], ["rm", "{ds}", "k5"], ["info", "{ds}"]])
def test_cli_on_a_garbage_index_prints_one_error_line_not_a_traceback(ctx: fl.Ctx, args: list[str]) -> None:
    """The real console script, as a user runs it (issue 11: `get`/`ls`/`rm` gave OverflowError and
    struct.error tracebacks on a garbage index)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    for what, ds in _damaged_copies(ctx).items():
        argv = [a.format(ds=ds) for a in args]
        p = subprocess.run([_kvdata_script(), *argv], capture_output=True, text=True, cwd=ctx.sandbox.root / "cwd",
                           env=env, timeout=120)
        assert "Traceback" not in p.stderr, f"{what}: kvdata {' '.join(argv)}\n{p.stderr}"
        if p.returncode != 0:
            lines = p.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("kvdata: error:"), f"{what}: {p.stderr!r}"
        else:  # `info` reads no record; `ls` without the damaged rows may succeed
            assert args[0] in ("info", "ls"), f"{what}: kvdata {' '.join(argv)} succeeded: {p.stdout[:500]!r}"
    assert ctx.sandbox.escapes() == []


@pytest.mark.parametrize("args", [["get", "{ds}", "k4"], ["get", "{ds}", "k4", "--json"], ["ls", "{ds}", "--json"],
                                  ["rm", "{ds}", "k5"], ["verify", "{ds}"]])
def test_cli_in_process_on_offsets_past_2_63_exits_nonzero_with_one_line(ctx: fl.Ctx, args: list[str]) -> None:
    ds = _damaged_copies(ctx)["offsets past 2**63"]
    argv = [a.format(ds=ds) for a in args]
    r = fl.run_cli(argv)
    assert r.rc != 0, (argv, r)
    fl.check_cli_output(r, argv)
