"""Fuzz the Caffe importer's decoders (kvdata/importers/caffe.py): random and mutated Datum
protobuf bytes (raw, float, encoded PNG/JPEG) through the parse path, and `import_caffe` /
`kvdata import caffe` of small LMDBs holding garbage keys and values. Only KVDataError may
escape, and nothing is written outside the temp root."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fuzzlib as fl
from fuzzlib import fuzz_settings

pytest.importorskip("google.protobuf")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def ctx() -> Iterator[fl.Ctx]:
    with fl.context() as c:
        yield c


def test_fuzz_caffe_datum_parse(ctx: fl.Ctx) -> None:
    @fuzz_settings(300)
    @given(st.one_of(st.tuples(st.binary(max_size=64), st.booleans()),
                     st.randoms(use_true_random=False).map(lambda r: fl.TARGETS["caffe_datum"].gen(r, ctx))))
    def case(c: tuple[bytes, bool]) -> None:
        fl.check("caffe_datum", c, ctx)
    case()


def test_fuzz_caffe_import_of_garbage_lmdbs(ctx: fl.Ctx) -> None:
    @fuzz_settings(25)
    @given(st.randoms(use_true_random=False))
    def case(r: Any) -> None:
        fl.check("caffe_import", fl.TARGETS["caffe_import"].gen(r, ctx), ctx)
        ctx.sandbox.clean_work()
    case()


def test_kvdata_import_caffe_of_garbage_values_prints_one_error_line(ctx: fl.Ctx) -> None:
    d = ctx.sandbox.case_dir()
    env = lmdb.open(str(d / "src"), map_size=1 << 22)
    with env.begin(write=True) as txn:
        txn.put(b"00000000_a.jpg", fl.mutate_bytes(random.Random(3), fl._datum_seeds(ctx)[0], 6))
        txn.put(b"00000001_b.jpg", b"\x0b" * 4000)
    env.close()
    script = Path(sys.executable).parent / "kvdata"
    p = subprocess.run([str(script) if script.is_file() else "kvdata", "import", "caffe", str(d / "src"), str(d / "ds")],
                       capture_output=True, text=True, cwd=ctx.sandbox.root / "cwd", timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvdata: error:") and str(d / "src") in lines[0], p.stderr
    assert not (d / "ds" / "manifest.json").exists()  # all or nothing
    assert ctx.sandbox.escapes() == []
