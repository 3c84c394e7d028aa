"""The README's training loops run as written (against a small train.kv in a temp dir)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import numpy as np
import pytest

import kvdata

README = Path(__file__).resolve().parents[2] / "README.md"


def section_code(title: str) -> list[str]:
    text = README.read_text()
    body = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)


# torchdata 0.11's StatefulDataLoader (the resume block) calls torch.set_vital, which torch 2.13 deprecates
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_the_training_loops_of_the_readme_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    with kvdata.open(tmp_path / "train.kv", "w", shard_size="8MB") as s:
        s.put_many((f"img{i:04d}", {"image": rng.integers(0, 256, (227, 227, 3), dtype=np.uint8), "label": i % 1000})
                   for i in range(300))
    blocks = section_code("Train with it")
    assert len(blocks) == 3
    has_torchdata = importlib.util.find_spec("torchdata") is not None   # the test extra has it
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        if "torchdata" in code and not has_torchdata:
            continue
        scope: dict = {"__name__": "readme"}
        exec(compile(code, str(README), "exec"), scope)  # noqa: S102 -- the README's own code
        loader = scope.get("loader")
        if loader is not None:
            loader.close()
    assert os.path.exists(tmp_path / "checkpoint.pt")
    assert os.path.exists(tmp_path / "checkpoint-dl.pt") or not has_torchdata


def test_the_coming_from_table_names_commands_that_exist() -> None:
    from click.testing import CliRunner

    from kvdata.cli import main as cli

    text = README.read_text()
    section = text.split("### Coming from another format\n", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    kinds = re.findall(r"`kvdata import (\w+) ", table)
    assert {"folder", "listfile", "caffe", "hf", "parquet", "wds", "tfrecord"} <= set(kinds)
    runner = CliRunner()
    for kind in kinds:
        r = runner.invoke(cli, ["import", kind, "--help"])
        assert r.exit_code == 0, (kind, r.output)
        for opt in re.findall(rf"`kvdata import {kind} [^`]*`", table)[0].split():
            if opt.startswith("--"):
                assert opt in r.output, (kind, opt)
    for fn in re.findall(r"`kvdata\.(\w+)\(", table):
        assert callable(getattr(kvdata, fn)), fn
