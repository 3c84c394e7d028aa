"""The documents run as written: every fenced block of README.md, docs/RECIPES.md and
docs/DAEMON.md, in order, each file in a fresh home (tests/helpers/doc_blocks.py says how each
language runs, the prelude of data and servers, and the few blocks not run, with why).
Resuming the README's training loop after SIGKILL: tests/integration/test_readme_resume.py."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvdata

from helpers import doc_blocks
from helpers.servers import S3Server, running_s3_server

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server with the bucket the documents name (s3://bucket/...)."""
    with running_s3_server(tmp_path_factory.mktemp("moto")) as server:
        server.client().create_bucket(Bucket=doc_blocks.BUCKET)
        yield server


# what the blocks import or the prelude uses, beyond the core (all in the test extra); the core-only
# run of .ci/lowest-versions has none of them
NEEDS = {"README.md": ["torch", "torchdata", "sklearn", "PIL", "moto", "boto3"],
         "docs/RECIPES.md": ["torch", "lightning", "transformers", "accelerate", "moto", "boto3"],
         "docs/DAEMON.md": ["yaml"]}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("doc", ["README.md", "docs/RECIPES.md", "docs/DAEMON.md"])
def test_every_block_runs_as_written(doc: str, request: pytest.FixtureRequest,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    for package in NEEDS[doc]:
        pytest.importorskip(package, reason=f"{doc}'s blocks need {package} (pip install -e '.[test]')")
    s3 = request.getfixturevalue("s3") if "moto" in NEEDS[doc] else None
    results = doc_blocks.run_file(ROOT / doc, s3)
    with capsys.disabled():
        print(f"\n{doc}:\n{doc_blocks.report(results)}")
    ran = [r for r in results if r.how in ("ran", "parsed")]
    assert ran, f"{doc}: no block ran"
    if doc == "README.md":
        learns(results)


def learns(results: list[doc_blocks.Ran]) -> None:
    """README "Train with it": the loop prints its accuracy per epoch, rising to what the text says."""
    [out] = [r.output for r in results if "checkpoint.pt" in r.block.text and "kvdata.Loader" in r.block.text]
    accuracy = [float(a) for a in re.findall(r"^epoch \d+: accuracy ([0-9.]+)% on 1797 samples$", out, re.M)]
    assert len(accuracy) == 3 and accuracy[0] < accuracy[1] < accuracy[2] and accuracy[2] > 85, out
    text = README.read_text()
    promised = re.findall(r"`epoch \d: (?:accuracy )?([0-9.]+)%`", text)
    assert [float(a) for a in promised] == pytest.approx(accuracy, abs=3), (promised, accuracy)


def test_the_harness_fails_on_a_failing_block_and_an_unknown_language(tmp_path: Path) -> None:
    cases = {
        "exit.md": "# T\n\n```bash\necho one\nfalse\necho never\n```\n",
        "python.md": "# T\n\n```python\nraise SystemExit(3)\n```\n",
        "toml.md": "# T\n\n```toml\n[[tiers]]\nname = 'x'\n```\n",
        "lang.md": "# T\n\n```console\n$ kvdata ls\n```\n",
        "bare.md": "# T\n\n```\nkvdata ls\n```\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(doc_blocks.BlockFailed):
            doc_blocks.run_file(tmp_path / name)
    # a systemd block alone (no foreground kvdatad beside it) is refused too
    (tmp_path / "systemd.md").write_text("# T\n\n```bash systemd\nsystemd-run --user kvdatad\n```\n")
    with pytest.raises(doc_blocks.BlockFailed, match="without systemd"):
        doc_blocks.run_file(tmp_path / "systemd.md")


def test_blocks_of_a_file_share_the_shell_state_and_stop_what_they_leave_running(tmp_path: Path) -> None:
    pid_file = tmp_path / "sleeper.pid"
    (tmp_path / "ok.md").write_text(
        f"# T\n\n```bash\nmkdir sub && cd sub\nexport GREETING=hello\nsleep 300 &\necho $! > {pid_file}\n```\n\n"
        "```bash\ntest \"$GREETING\" = hello && test \"$(basename \"$PWD\")\" = sub\n```\n\n"
        "```python\nimport os\nassert os.environ['GREETING'] == 'hello' and os.getcwd().endswith('sub')\n"
        "assert os.environ['HOME'] == os.path.dirname(os.getcwd())\n```\n")
    results = doc_blocks.run_file(tmp_path / "ok.md")
    assert [r.how for r in results] == ["prelude", "ran", "ran", "ran"]
    with pytest.raises(ProcessLookupError):   # the background sleep was stopped with its block's group
        os.kill(int(pid_file.read_text()), 0)


def test_the_zero_copy_claims_of_use_it(tmp_path: Path) -> None:
    """README "Use it": sealed records give read-only views (bytes: read-only memoryviews), tail
    records writable copies, get_batch new arrays; a "w" writer's close seals a dataset of 64 KiB."""
    with kvdata.open(tmp_path / "images.kv", "w") as st:
        for i in range(2):
            st.put(f"img/{i}", {"image": np.full((227, 227, 3), i, np.uint8), "label": i})
    with kvdata.open(tmp_path / "images.kv", "a") as st:
        st.put("img/2", {"image": np.full((227, 227, 3), 2, np.uint8), "label": 2})
    with kvdata.open(tmp_path / "images.kv") as st:
        assert st.manifest.tail.records == 1
        sealed, tail = st[0]["image"], st[2]["image"]
        assert not sealed.flags.writeable and not sealed.flags.owndata
        assert tail.flags.writeable
        assert st.get("img/0", copy=True)["image"].flags.writeable
        assert st.get_batch([0, 2])["image"].flags.writeable
    with kvdata.open(tmp_path / "files.kv", "w") as st:
        st.put("a", bytes(70_000))
    with kvdata.open(tmp_path / "files.kv") as st:
        view = st["a"]
        assert isinstance(view, memoryview) and view.readonly


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
