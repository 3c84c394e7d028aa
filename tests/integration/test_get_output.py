"""`kvdata get KEY -o OUT` writes OUT through a fresh temp file and a rename (issue 11,
"get -o OUT follows a symlink planted at its temp name").

The bug: the value was written to the predictable name `OUT.kvdata-tmp` with an ordinary
open, so a symlink planted there (by anyone who can write OUT's directory) had its
target overwritten. Now the temp name is random and created O_CREAT|O_EXCL|O_NOFOLLOW.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from helpers.cli import Cli

VALUE = bytes(range(256)) * 20


def dataset(cli: Cli, tmp_path: Path) -> Path:
    src = tmp_path / "value.bin"
    src.write_bytes(VALUE)
    ds = tmp_path / "ds"
    cli.ok("put", ds, src, "--key", "k")
    return ds


def test_get_output_never_follows_a_symlink_planted_at_its_temp_name(cli: Cli, tmp_path: Path) -> None:
    ds = dataset(cli, tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "value.bin"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = [out_dir / "value.bin.kvdata-tmp",      # the old temp name
               out_dir / ".value.bin.tmp",
               out_dir / "value.bin.tmp"]
    for p in planted:
        p.symlink_to(victim)
    cli.ok("get", ds, "k", "-o", out)
    assert out.read_bytes() == VALUE and not out.is_symlink()
    assert victim.read_bytes() == b"precious"
    assert all(p.is_symlink() and os.readlink(p) == str(victim) for p in planted)
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(["value.bin", *(p.name for p in planted)])


def test_get_output_replaces_a_symlink_at_out_and_never_writes_its_target(cli: Cli, tmp_path: Path) -> None:
    """Documented choice: OUT is replaced by rename, so a link at OUT becomes a regular file
    holding the value; the file it pointed to is left as it was."""
    ds = dataset(cli, tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out.bin"
    out.symlink_to(victim)
    cli.ok("get", ds, "k", "-o", out)
    assert not out.is_symlink() and out.read_bytes() == VALUE
    assert victim.read_bytes() == b"precious"


def test_get_output_is_a_normal_file_under_the_umask(cli: Cli, tmp_path: Path) -> None:
    ds = dataset(cli, tmp_path)
    out = tmp_path / "out.bin"
    out.write_bytes(b"old content that is longer than nothing")
    cli.ok("get", ds, "k", "-o", out, preexec_fn=lambda: os.umask(0o027))
    assert out.read_bytes() == VALUE
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "out.bin", "value.bin"]
