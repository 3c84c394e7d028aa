"""Fuzz a real dataset's index/ files and shards (kvdata/store/index.py, kvdata/store/reader.py):
damaged, truncated, garbage, missing, replaced-by-a-directory and symlinked files, then every
read entry point (kvdata.open, get_many, find, keys, describe, record_info, metas, verify).
Only KVDataError may escape, and nothing is written outside the temp root."""

from __future__ import annotations

import json
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

import kvdata
from kvdata.errors import CorruptDatasetError, KVDataError
from kvdata.format import record as rec
from kvdata.store import index as ix
from kvdata.store.verify import verify_store

import fuzzlib as fl
from fuzzlib import fuzz_settings


@pytest.fixture(scope="module")
def ctx() -> Iterator[fl.Ctx]:
    with fl.context() as c:
        yield c


def test_fuzz_index_files(ctx: fl.Ctx) -> None:
    @fuzz_settings(120)
    @given(st.randoms(use_true_random=False))
    def case(r: Any) -> None:
        fl.check("index_files", fl.TARGETS["index_files"].gen(r, ctx), ctx)
        ctx.sandbox.clean_work()
    case()


def test_fuzz_shards_and_tails(ctx: fl.Ctx) -> None:
    @fuzz_settings(100)
    @given(st.randoms(use_true_random=False))
    def case(r: Any) -> None:
        fl.check("shard_records", fl.TARGETS["shard_records"].gen(r, ctx), ctx)
        ctx.sandbox.clean_work()
    case()


# ---------------------------------------------------------------- regressions, one per bug


def _records_file(ds: Path) -> Path:
    (p,) = (ds / "index").glob("records-*.bin")
    return p


def _set_record_row(ds: Path, row: int, field: str, value: int) -> None:
    p = _records_file(ds)
    rows = np.fromfile(p, dtype=rec.RECORD_DTYPE)
    rows[field][row] = value
    rows.tofile(p)


def _sealed_fields_row(ctx: fl.Ctx) -> tuple[int, int]:
    """(sample position, records row) of a fields record in a sealed shard."""
    with kvdata.open(ctx.dataset) as s:
        idx = s.reader().gen.index
        for p in range(len(s)):
            shard, slot, row = idx.resolve(np.array([p]))
            if row[0] >= 0 and int(idx.records["head_kind"][row[0]]) >> rec.KIND_SHIFT == rec.KIND_FIELDS:
                return p, int(row[0])
    raise AssertionError("no sealed fields record")


@pytest.mark.parametrize("value", [(1 << 64) - 2, 1 << 63, (1 << 63) + 5])
def test_index_record_offset_past_2_63_is_corrupt_not_overflowerror(ctx: fl.Ctx, value: int) -> None:
    """The bounds check added the offset as int64, which wrapped negative and passed."""
    ds = fl.fresh_copy(ctx, [])
    pos, row = _sealed_fields_row(ctx)
    _set_record_row(ds, row, "offset", value)
    with kvdata.open(ds) as s:
        for call in (lambda: s.get_many([pos]), lambda: s.get_batch([pos]), lambda: s[pos],
                     lambda: s.record_info(pos), lambda: s.metas([pos])):
            with pytest.raises(CorruptDatasetError, match="kvdata reindex"):
                call()


@pytest.mark.parametrize("head_kind", [0, 19, rec.KIND_TOMBSTONE << rec.KIND_SHIFT | 24, 7 << rec.KIND_SHIFT | 24])
def test_index_row_with_a_short_head_or_a_non_sample_kind_is_corrupt_not_struct_error(ctx: fl.Ctx, head_kind: int) -> None:
    ds = fl.fresh_copy(ctx, [])
    pos, row = _sealed_fields_row(ctx)
    _set_record_row(ds, row, "head_kind", head_kind)
    with kvdata.open(ds) as s, pytest.raises(CorruptDatasetError, match="is damaged"):
        s.get_many([pos])


def test_index_row_pointing_into_another_records_payload_is_corrupt_not_garbage(ctx: fl.Ctx) -> None:
    ds = fl.fresh_copy(ctx, [])
    pos, row = _sealed_fields_row(ctx)
    with kvdata.open(ds) as s:
        off = int(s.reader().gen.index.records["offset"][row])
    _set_record_row(ds, row, "offset", off + 8)
    with kvdata.open(ds) as s, pytest.raises(CorruptDatasetError, match="does not match the side-index"):
        s.get_many([pos])


def _keys_file(ds: Path) -> Path:
    return sorted((ds / "index").glob("keys-*.bin"))[0]


@pytest.mark.parametrize("position", [12345, 1 << 63, (1 << 64) - 1])
def test_key_run_position_past_the_count_is_corrupt_not_indexerror_or_overflowerror(ctx: fl.Ctx, position: int) -> None:
    """find() skipped such positions, but all_key_hashes (rewrites, verify) raised IndexError, wrapped
    2**64-1 to -1 (overwriting the last sample's hash), and candidates_many (put) raised OverflowError."""
    ds = fl.fresh_copy(ctx, [])
    p = _keys_file(ds)
    arr = np.fromfile(p, dtype="<u8")
    n = len(arr) // 2
    arr[n:] = position  # every position of the run
    arr.tofile(p)
    with kvdata.open(ds) as s:
        idx = s.reader().gen.index
        with pytest.raises(CorruptDatasetError, match="past the"):
            ix.all_key_hashes(idx)
        with pytest.raises(CorruptDatasetError, match="past the"):
            idx.candidates_many(idx.runs[0].hashes[:3].copy())
        with pytest.raises(CorruptDatasetError, match="past the"):
            s.find("k0")
        report = verify_store(s)
        assert not report["ok"] and any("past the" in x for x in report["index_problems"])


def test_manifest_counting_samples_without_a_samples_file_is_corrupt_not_indexerror(ctx: fl.Ctx) -> None:
    ds = fl.fresh_copy(ctx, [])
    m = fl.pristine_manifest(ctx)
    (ds / "manifest.json").write_text(json.dumps(dict(m, index=dict(m["index"], samples=None))))
    with pytest.raises(CorruptDatasetError, match="names no index file"):
        kvdata.open(ds)


def test_manifest_whose_shard_record_counts_overflow_int64_is_corrupt_not_indexerror(tmp_path: Path) -> None:
    """65,536 shards of 2**48 records each summed (np.cumsum, int64) to 0 == records_count, so the
    index took garbage bases and get() raised IndexError; the totals are compared as Python ints now."""
    from kvdata.format.manifest import IndexFiles, Manifest, ShardEntry, TailEntry

    shards = tuple(ShardEntry(i, f"{i:06d}.mdb", 1 << 48, 4096, "0" * 64) for i in range(1 << 16))
    m = Manifest(generation=1, count=0, shard_size=1 << 20, compress=False, shards=shards,
                 tail=TailEntry(1 << 16, f"tail-{1 << 16:06d}.mdb", 0), index=IndexFiles(records_count=0))
    with pytest.raises(CorruptDatasetError, match="rows but the shards hold"):
        ix.Index(tmp_path, m)


@pytest.mark.parametrize("kind", ["symlink-loop", "dir"])
def test_index_file_that_is_a_symlink_loop_or_a_directory_is_corrupt_not_oserror(ctx: fl.Ctx, kind: str) -> None:
    ds = fl.fresh_copy(ctx, [fl.Damage(str(_records_file(ctx.dataset).relative_to(ctx.dataset)), kind)])
    with pytest.raises(CorruptDatasetError, match="kvdata reindex"):
        kvdata.open(ds)


@pytest.mark.parametrize("kind", ["symlink-loop", "dir"])
def test_sealed_shard_that_is_a_symlink_loop_or_a_directory_is_corrupt_not_oserror(ctx: fl.Ctx, kind: str) -> None:
    shard = sorted((ctx.dataset / "shards").glob("0*.mdb"))[0]
    ds = fl.fresh_copy(ctx, [fl.Damage(f"shards/{shard.name}", kind)])
    with kvdata.open(ds) as s:
        with pytest.raises(CorruptDatasetError, match=shard.name):
            s.get_many([0])
        report = verify_store(s)
    assert not report["ok"]  # a loop does not exist() (reported missing); a directory is not a regular file
    assert {"shard": shard.name, "problem": "missing" if kind == "symlink-loop" else "not a regular file"} \
        in report["bad_shards"]


def _tail(ds: Path) -> Path:
    (p,) = (ds / "shards").glob("tail-*.mdb")
    return p


def test_truncated_tail_is_corrupt_not_sigbus(ctx: fl.Ctx) -> None:
    """LMDB maps the file whole: reading a page past a truncated tail's end killed the process
    with SIGBUS (run in a child, so a regression cannot take pytest down)."""
    ds = fl.fresh_copy(ctx, [])
    tail = _tail(ds)
    os.truncate(tail, tail.stat().st_size - 4096)
    code = ("import sys, kvdata\n"
            "from kvdata.errors import CorruptDatasetError\n"
            "from kvdata.store.verify import verify_store\n"
            "s = kvdata.open(sys.argv[1])\n"
            "try:\n    s.get_many([len(s) - 1])\n    print('read')\n"
            "except CorruptDatasetError as e:\n    print('corrupt:', e)\n"
            "r = verify_store(s)\nprint('verify ok' if r['ok'] else 'verify bad:', r['bad_shards'])\n")
    p = subprocess.run([sys.executable, "-c", code, str(ds)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "corrupt:" in p.stdout and "is truncated" in p.stdout and "verify bad:" in p.stdout, p.stdout


def test_tail_that_is_not_lmdb_is_corrupt_not_lmdb_error(ctx: fl.Ctx) -> None:
    ds = fl.fresh_copy(ctx, [])
    _tail(ds).write_bytes(b"\x00" * 8192)
    with kvdata.open(ds) as s:
        with pytest.raises(CorruptDatasetError, match="LMDB cannot read it"):
            s.get_many([len(s) - 1])
        with pytest.raises(CorruptDatasetError, match="LMDB cannot read it"):
            list(s.keys())
        report = verify_store(s)
    assert not report["ok"] and report["bad_shards"][0]["shard"] == _tail(ds).name


def test_tail_that_is_a_symlink_is_refused_and_nothing_is_written_beside_its_target(ctx: fl.Ctx) -> None:
    """LMDB opened the link's target and created `<target>-lock` beside it, outside the dataset."""
    ds = fl.fresh_copy(ctx, [fl.Damage(str(_tail(ctx.dataset).relative_to(ctx.dataset)), "symlink-out")])
    with kvdata.open(ds) as s, pytest.raises(CorruptDatasetError, match="symbolic link"):
        s.get_many([len(s) - 1])
    assert ctx.sandbox.escapes() == []


def test_tail_lock_file_that_is_a_symlink_is_refused_and_its_target_left_alone(ctx: fl.Ctx) -> None:
    """LMDB opened `<tail>-lock` through a planted link and wrote its reader table into the target."""
    lock = _tail(ctx.dataset).name + "-lock"
    ds = fl.fresh_copy(ctx, [fl.Damage(f"shards/{lock}", "symlink-out")])
    before = (ctx.sandbox.parent / "bystander.txt").read_bytes()
    with kvdata.open(ds) as s:
        with pytest.raises(CorruptDatasetError, match="symbolic link"):
            s.get_many([len(s) - 1])
        assert not verify_store(s)["ok"]
    assert (ctx.sandbox.parent / "bystander.txt").read_bytes() == before
    assert ctx.sandbox.escapes() == []


@pytest.mark.parametrize("name", ["records", "samples", "keys"])
def test_writer_never_writes_index_rows_through_a_planted_symlink(ctx: fl.Ctx, name: str) -> None:
    """Appends wrote rows in place with open(O_WRONLY | O_CREAT), following a link planted at an
    index file's name into a file outside the dataset; now the link is refused (ELOOP: the commit
    fails and the dataset is unchanged) or the commit writes new files, never the link's target."""
    ds = fl.fresh_copy(ctx, [])
    (real,) = [p for p in sorted((ds / "index").glob(f"{name}-*.bin"))][:1]
    victim = ctx.sandbox.parent / f"victim-{real.name}"
    victim.write_bytes(real.read_bytes())
    real.unlink()
    real.symlink_to(victim)
    ctx.sandbox.snapshot()
    before = victim.read_bytes()
    try:
        with kvdata.open(ds, "a") as w:
            w.put("new-a", b"x" * 100)
            w.seal()
            w.put("new-b", b"y")
            w.commit()
    except KVDataError:
        pass
    assert victim.read_bytes() == before
    assert ctx.sandbox.escapes() == []


def test_fuzz_index_writer_in_forked_workers(tmp_path: Path) -> None:
    """The `index_writer` target (a writer appending, deleting, sealing and committing on damaged
    index files, tails and planted links) through bench/fuzz.py, whose cases run in forked
    workers: a crash inside LMDB is reported as a failure instead of killing the test session.
    The seed is fixed so a failure reproduces; the 100,000-case runs are bench/fuzz.py's job."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "fuzz.py"
    out = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, str(bench), "--only", "index_writer", "--cases", "400", "--jobs", "1",
                        "--seed", "7", "--json", str(out)], capture_output=True, text=True, timeout=240,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 failures and 0 files written outside the temp root: met" in r.stdout


def test_writer_on_a_tail_whose_pages_were_rewritten_is_corrupt_not_sigbus(tmp_path: Path) -> None:
    """bench/fuzz.py index_writer case 1673: a tail whose LMDB page contents were overwritten in
    place. LMDB trusts its own pages, so appending followed a node offset past the end of the file
    and the writer died of SIGBUS; the writer now walks the tail's tree first (check_tail_pages)
    and refuses with one CorruptDatasetError. Run in a child process: a regression must fail this
    test, not kill the session."""
    script = f"""
import random, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import fuzzlib as fl, kvdata
from kvdata.errors import CorruptDatasetError
with fl.context() as ctx:
    ds = fl.fresh_copy(ctx, fl.TARGETS["index_writer"].gen(random.Random("0:index_writer:1673"), ctx))
    try:
        with kvdata.open(ds, "a") as w:
            w.put("fuzz-new", b"x" * 100)
    except CorruptDatasetError as e:
        print("REFUSED", e)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert "REFUSED" in r.stdout and "LMDB pages are damaged" in r.stdout, r.stdout + r.stderr[-2000:]
