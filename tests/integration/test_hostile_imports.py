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
