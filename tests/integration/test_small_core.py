"""`pip install kvdata` with no extras: the core commands work, and a command that needs an
extra names it in one line (issue 26, "a small core").

These tests need an environment that lacks every optional package, so they run in the
core-only venv of `.ci/lowest-versions` (the core dependencies at their lowest allowed
versions, plus pytest), and skip elsewhere with that reason. `.ci/run` runs that step on every
submission, so they are never skipped in CI.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvdata

from helpers.cli import Cli

OPTIONAL = ["torch", "PIL", "boto3", "pyarrow", "google.protobuf", "sklearn", "fsspec"]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package (google) is missing
        return False


pytestmark = pytest.mark.skipif(
    any(_installed(n) for n in OPTIONAL),
    reason="needs a venv without the optional packages (run by .ci/lowest-versions): "
           + ", ".join(n for n in OPTIONAL if _installed(n)) + " installed here")


def _tree(root: Path) -> dict[str, bytes]:
    """An ImageFolder-like tree of files (contents need not decode: --decode none stores bytes)."""
    out = {}
    for name in ["cat", "dog"]:
        (root / name).mkdir(parents=True)
        for i in range(3):
            data = f"{name}-{i}".encode() * (i + 1)
            (root / name / f"{i}.png").write_bytes(data)
            out[f"{name}/{i}.png"] = data
    return out


def test_the_core_commands_work_without_any_extra(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"alpha")
    (tmp_path / "b.bin").write_bytes(b"beta" * 1000)
    ds = tmp_path / "data.kv"
    assert cli.run("put", ds, tmp_path / "a.bin", tmp_path / "b.bin", "--label", "3").rc == 0
    assert cli.ok("get", ds, "a.bin").out == b"alpha"
    assert cli.ok("get", ds, "b.bin").out == b"beta" * 1000
    assert cli.ok("ls", ds).out.decode().split() == ["a.bin", "b.bin"]
    assert cli.ok("info", ds, "--json").json()["samples"] == 2
    cli.ok("verify", ds)

    files = _tree(tmp_path / "tree")
    imported = tmp_path / "imported.kv"
    summary = cli.ok("import", "folder", tmp_path / "tree", imported, "--decode", "none", "--json").json()
    assert summary["imported"] == len(files)
    cli.ok("verify", imported)
    with kvdata.open(imported) as store:
        assert {k: bytes(store[k]["image"]) for k in files} == files


def test_python_api_without_torch_reads_and_writes(tmp_path: Path) -> None:
    import numpy as np

    ds = tmp_path / "arrays.kv"
    kvdata.from_arrays(ds, data=np.arange(40, dtype=np.uint8).reshape(10, 4), label=np.arange(10))
    with kvdata.open(ds) as store:
        batch = store.get_batch([3, 1])
        assert batch["data"].tolist() == [[12, 13, 14, 15], [4, 5, 6, 7]]
        assert batch["label"].tolist() == [3, 1]


@pytest.mark.parametrize(("argv", "extra"), [
    (["import", "folder", "{tree}", "{out}", "--decode", "rgb"], "kvdata[images]"),
    (["push", "{ds}", "s3://bucket/data.kv"], "kvdata[s3]"),
    (["import", "parquet", "{parquet}", "{out}"], "kvdata[parquet]"),
    (["import", "hf", "{tree}", "{out}"], "kvdata[hf]"),
    (["import", "caffe", "{tree}", "{out}"], "kvdata[caffe]"),
    (["import", "tfrecord", "{tfrecord}", "{out}"], "kvdata[tfrecord]"),
    (["demo"], "kvdata[demo]"),
])
def test_a_command_that_needs_an_extra_names_it_in_one_line(cli: Cli, tmp_path: Path, argv: list[str],
                                                           extra: str) -> None:
    _tree(tmp_path / "tree")
    ds = tmp_path / "data.kv"
    (tmp_path / "a.bin").write_bytes(b"alpha")
    assert cli.run("put", ds, tmp_path / "a.bin").rc == 0
    (tmp_path / "x.parquet").write_bytes(b"PAR1" + bytes(16) + b"PAR1")
    (tmp_path / "x.tfrecord").write_bytes(b"")
    names = {"tree": tmp_path / "tree", "out": tmp_path / "out.kv", "ds": ds,
             "parquet": tmp_path / "x.parquet", "tfrecord": tmp_path / "x.tfrecord"}
    line = cli.fail(*[a.format(**names) for a in argv])
    assert extra in line.replace("'", ""), line
    assert not (tmp_path / "out.kv").exists()


def test_a_torch_name_without_torch_names_the_extra() -> None:
    code = ("import kvdata\n"
            "try:\n    kvdata.Dataset\nexcept ModuleNotFoundError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "kvdata[torch]" in out.replace("'", ""), out


def test_import_kvdata_loads_no_optional_package() -> None:
    code = "import sys, json, kvdata, kvdata.cli; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert not [m for m in loaded if m.split(".")[0] in {"torch", "PIL", "boto3", "pyarrow", "sklearn"}]
