"""Hostile settings and leftovers given to the record importers and to merge: each is refused
with one line naming it, and nothing the user owns is created or removed."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kvdata.errors import ConfigError

HUGE = 10**9


def _tar(path: Path) -> Path:
    with tarfile.open(path, "w") as t:
        data = b"hello"
        info = tarfile.TarInfo("a.txt")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("fmt", ["wds", "tfrecord", "parquet"])
def test_a_huge_worker_count_is_refused_before_any_process_starts(tmp_path: Path, fmt: str) -> None:
    """Before: `--workers 1000000000` forked until the machine ran out of processes (the import
    hung); now a ConfigError naming workers, nothing created."""
    from kvdata.importers import arrow, tfrecord, wds

    src = _tar(tmp_path / "a.tar")
    dst = tmp_path / "out"
    run = {"wds": wds.import_wds, "tfrecord": tfrecord.import_tfrecord, "parquet": arrow.import_parquet}[fmt]
    with pytest.raises(ConfigError, match="workers"):
        run([src] if fmt != "parquet" else src, dst, workers=HUGE)
    assert not dst.exists()


def test_cli_huge_workers_one_line(tmp_path: Path) -> None:
    src = _tar(tmp_path / "a.tar")
    p = subprocess.run([str(Path(sys.executable).parent / "kvdata"), "import", "wds", str(src), str(tmp_path / "o"),
                        "--workers", str(HUGE)], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "workers" in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_merge_keeps_a_staging_directory_it_did_not_make(tmp_path: Path) -> None:
    """Before: a user's directory named like merge's staging (`DEST/.kvdata-merge.tmp`) in an
    otherwise empty DEST was removed with everything in it; now the merge is refused naming
    the stranger file, and the file, the directory and DEST stay."""
    import kvdata
    from kvdata.errors import NotADatasetError
    from kvdata.store.merge import STAGING, merge

    part = tmp_path / "p0"
    with kvdata.open(part, "a") as s:
        s.put("k", b"x")
        s.seal()
        s.commit()
    dest = tmp_path / "dest"
    (dest / STAGING).mkdir(parents=True)
    (dest / STAGING / "mine.txt").write_text("precious")
    with pytest.raises(NotADatasetError, match="mine.txt"):
        merge([part], dest)
    assert (dest / STAGING / "mine.txt").read_text() == "precious"
    assert sorted(os.listdir(dest)) == [STAGING]


def test_merge_refuses_a_part_whose_shards_directory_is_a_symlink(tmp_path: Path) -> None:
    """Before: a part whose shards/ was a symlink to another directory was merged from there and,
    with --move, the files were deleted through the link, then the committed merge exited 1
    ("Not a directory"); now it is refused before anything is written, naming shards/."""
    import shutil

    import kvdata
    from kvdata.errors import CorruptDatasetError
    from kvdata.store.merge import merge

    for i in range(2):
        with kvdata.open(tmp_path / f"p{i}", "a") as s:
            s.put(f"k{i}", b"x")
            s.seal()
            s.commit()
    outside = tmp_path / "outside"
    shutil.move(str(tmp_path / "p1" / "shards"), str(outside))
    os.symlink(outside, tmp_path / "p1" / "shards")
    before = sorted(os.listdir(outside))
    with pytest.raises(CorruptDatasetError, match="shards"):
        merge([tmp_path / "p0", tmp_path / "p1"], tmp_path / "m", move=True)
    assert sorted(os.listdir(outside)) == before
    assert not (tmp_path / "m").exists() and (tmp_path / "p0" / "manifest.json").exists()


def test_parquet_with_very_many_columns_is_linear(tmp_path: Path) -> None:
    """Before: each column's name was looked up in the list of all names, so a file of 30,000
    columns took ~13 s to plan and 10^6 columns hours (a hostile file stalls the import); now
    sets: 30,000 columns import in about a second."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import time

    from kvdata.importers.arrow import import_parquet

    def seconds(n: int) -> float:
        src = tmp_path / f"wide{n}.parquet"
        pq.write_table(pa.table({"k": ["a", "b"], **{f"c{i}": [i, i] for i in range(n)}}), src)
        t0 = time.perf_counter()
        out = import_parquet([src], tmp_path / f"out{n}", key="k", progress=False)
        took = time.perf_counter() - t0
        assert out["imported"] == 2 and len(out["columns"]) == n and "k" not in out["columns"]  # k: only the key
        return took

    # a ratio, not a time: 10x the columns must cost well under the 100x a quadratic plan takes
    small, large = seconds(2_000), seconds(20_000)
    assert large < 30 * max(small, 0.05), f"2,000 columns {small:.2f} s, 20,000 columns {large:.2f} s"
