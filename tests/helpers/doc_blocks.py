"""Run the fenced code blocks of a Markdown file in order, as written (README.md, docs/RECIPES.md,
docs/DAEMON.md; tests/integration/test_readme.py).

How each block runs (its text is never edited):
- ```bash / ```sh: `bash` with `set -e`, PATH starting with the venv's bin (its `kvdata`, `kvdatad`
  and `python`). The bash blocks of a file are one shell session, as in a terminal: each starts in
  the directory and with the exported variables the previous bash block left (cd and export carry
  over). Every block runs in a session of its own; what it leaves running in the background (the
  README's `kvdatad ... &`) is stopped when the file is done (SIGTERM, then SIGKILL).
- ```python: the venv's python (sys.executable), a process of its own per block, in the shell
  session's current directory and environment. To keep the run fast, that process is forked from
  a python that has already imported what the file's python blocks import (tests/helpers/
  doc_zygote.py: torch's import alone is 3-5 s of CPU per block); it runs the block as a script
  (`__main__`, its own argv, cwd, environment, stdout/stderr and session) and is started again
  whenever the environment changed. KVDOC_FORK=0 runs each block as `python BLOCK.py` instead.
- ```toml: parsed by kvdata.config.parse_config, as `kvdatad --config` reads it.
- ```yaml: parsed by yaml.safe_load (a mapping).
- Any other language, or a block without one: the run fails naming it (a block must not go
  unchecked because nobody taught the harness its language).
A block fails the run when it exits non-zero (or does not parse); the failure names the file,
the line and the block, with the tail of its output.

Not run, each for the reason given here (and said in the file itself):
- README.md, "## Try it" and "## Run the tests": `pip install ...` lines. .ci/run installs the
  package from locks/test.txt and runs the "Run the tests" command itself (this harness runs
  inside it); `kvdata demo` is run by tests/integration/test_cli.py (`demo_run`).
- Blocks whose info string says `systemd` (```bash systemd): they need a systemd user session.
  A file with one must also run the same daemon without systemd (a run block with `kvdatad --config`).

The prelude (the only thing the harness does besides running blocks) is a fresh environment that
holds what the blocks name, made before the first block of a file:
- HOME is a new directory (the blocks' shell starts there, so `~/...` and relative paths land in
  it); XDG_CONFIG_HOME and XDG_CACHE_HOME are unset (the defaults under HOME apply), XDG_RUNTIME_DIR
  is a new directory, USER a name of this run's own (so `/dev/shm/...-$USER` is this run's, and
  removed after), KVDATA_CONFIG and KVDATA_SOCKET are unset.
- S3: moto's server on 127.0.0.1 (helpers.servers.running_s3_server) with a bucket named
  `bucket`; AWS_ENDPOINT_URL and test credentials point every block at it.
- HF_HUB_OFFLINE=1: nothing reaches the network (a Hugging Face recipe would else ask the hub).
- Data, per file (`prelude_readme`, `prelude_recipes`): real images bundled with scikit-learn
  (its two photos, its 8x8 digits) in the files and trees the blocks name.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
BUCKET = "bucket"  # the bucket the documents name (s3://bucket/...)

# (file, section title): why the pip-install block of that section is not run here
EXEMPT = {
    ("README.md", "Try it"): "pip install: .ci/run installs the package; `kvdata demo` runs in tests/integration/test_cli.py",
    ("README.md", "Run the tests"): "the test command itself: .ci/run runs it, and this harness runs inside it",
}
SHELLS = ("bash", "sh")


@dataclass
class Block:
    file: str
    line: int          # of the opening fence, 1-based
    lang: str
    info: list[str]    # the info string's words (the language first)
    section: str       # the title of the last heading above it
    text: str

    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.lang or 'no language'}, under '{self.section}')"


@dataclass
class Ran:
    block: Block
    seconds: float
    how: str           # "ran", "parsed", or "not run: <why>"
    output: str = ""   # what it printed (stdout and stderr)


@dataclass
class Session:
    """One file's run: its home, shell state (cwd, exported environment) and processes."""
    home: Path
    scratch: Path
    env: dict[str, str]
    cwd: Path
    groups: list[int] = field(default_factory=list)
    results: list[Ran] = field(default_factory=list)
    preload: list[str] = field(default_factory=list)   # what the python blocks import
    zygote: Zygote | None = None


class BlockFailed(AssertionError):
    pass


def extract(path: Path) -> list[Block]:
    """The fenced blocks (``` fences) of a Markdown file, in order."""
    blocks: list[Block] = []
    section = ""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(#{1,6}) (.*)$", line)
        if m:
            section = m.group(2).strip()
        if re.match(r"^\s+(```|~~~)|^~~~", line):
            raise BlockFailed(f"{path.name}:{i + 1}: an indented or ~~~ code fence; the harness runs top-level ``` "
                              "fences only (write it as one, so that it runs)")
        fence = re.match(r"^(`{3,})(.*)$", line)
        if fence:
            ticks, info = fence.group(1), fence.group(2).split()
            body: list[str] = []
            j = i + 1
            while j < len(lines) and not lines[j].startswith(ticks):
                body.append(lines[j])
                j += 1
            if j == len(lines):
                raise BlockFailed(f"{path.name}:{i + 1}: a code fence that is never closed")
            blocks.append(Block(path.name, i + 1, info[0] if info else "", info, section, "\n".join(body) + "\n"))
            i = j
        i += 1
    return blocks


def exemption(block: Block) -> str | None:
    """Why a block is not run, or None."""
    why = EXEMPT.get((block.file, block.section))
    if why is not None and block.text.lstrip().startswith("pip install"):
        return why
    if "systemd" in block.info[1:]:
        return "needs a systemd user session (the same kvdatad runs without systemd in another block)"
    return None


def check_exemptions(blocks: list[Block]) -> None:
    """Every exemption of EXEMPT for this file matches one block, and a systemd block has a run
    block with the same daemon beside it."""
    names = {b.file for b in blocks}
    for (file, section), _why in EXEMPT.items():
        if file in names:
            hits = [b for b in blocks if b.section == section and exemption(b) is not None]
            if len(hits) != 1:
                raise BlockFailed(f"{file}: the exempt pip-install block of '{section}' was not found once "
                                  f"(found {len(hits)}); fix EXEMPT in {__file__}")
    if any("systemd" in b.info[1:] for b in blocks):
        if not any(exemption(b) is None and b.lang in SHELLS and "kvdatad --config" in b.text for b in blocks):
            raise BlockFailed(f"{blocks[0].file}: a systemd block, but no block runs `kvdatad --config` without systemd")


# ------------------------------------------------------------------ the environment and data


def base_env(home: Path, run: Path, user: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVDATA_", "AWS_", "PYTEST_", "XDG_", "NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_"))}
    env.update(HOME=str(home), XDG_RUNTIME_DIR=str(run), USER=user, LOGNAME=user, HF_HUB_OFFLINE="1",
               PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}")
    env.pop("VIRTUAL_ENV", None)
    return env


def sklearn_file(*parts: str) -> Path:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise BlockFailed("the documents' data are scikit-learn's bundled images: pip install scikit-learn")
    return Path(spec.origin).parent.joinpath(*parts)


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits (uint8 0..255, labels), read from its bundled file
    (sklearn.datasets.load_digits without importing scikit-learn: 4 s saved per use)."""
    with gzip.open(sklearn_file("datasets", "data", "digits.csv.gz"), "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return (data[:, :-1].reshape(-1, 8, 8) * 255 / 16).astype(np.uint8), data[:, -1].astype(np.int64)


def prelude_readme(home: Path) -> None:
    """README.md: `cat.jpg` and `dog.jpg` (scikit-learn's two photos, real JPEGs) in the starting
    directory; `~/imagenet/train`, an ImageFolder tree of 100 digits as JPEGs in 10 class
    directories named like ImageNet's (with the `n01440764/n01440764_10026.JPEG` that
    `kvdata rm` names); `~/images` and `val.txt`, a Caffe list of 20 more."""
    from PIL import Image

    shutil.copy(sklearn_file("datasets", "images", "china.jpg"), home / "cat.jpg")
    shutil.copy(sklearn_file("datasets", "images", "flower.jpg"), home / "dog.jpg")
    images, labels = load_digits()
    for i in range(100):
        synset = f"n{1440764 + int(labels[i]):08d}"
        name = f"{synset}_{10026 if i == 0 else 20000 + i}.JPEG"
        (home / "imagenet" / "train" / synset).mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).convert("RGB").save(home / "imagenet" / "train" / synset / name)
    assert (home / "imagenet/train/n01440764/n01440764_10026.JPEG").exists()  # digit 0 is first
    lines = []
    for i in range(100, 120):
        (home / "images" / "val").mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).convert("RGB").save(home / "images" / "val" / f"{i}.jpg")
        lines.append(f"val/{i}.jpg {labels[i]}\n")
    (home / "val.txt").write_text("".join(lines))


def prelude_recipes(home: Path, env: dict[str, str]) -> None:
    """docs/RECIPES.md: s3://bucket/train.kv, scikit-learn's 1,797 digits as (8, 8, 3) uint8
    images with their labels (in 64 KB shards), pushed to the S3 server by `kvdata push`."""
    import kvdata

    images, labels = load_digits()
    local = home.parent / "digits.kv"
    kvdata.from_arrays(local, image=np.stack([images] * 3, axis=-1), label=labels, shard_size="64KB")
    subprocess.run([str(VENV_BIN / "kvdata"), "push", str(local), f"s3://{BUCKET}/train.kv"], check=True,
                   env=env, stdout=subprocess.DEVNULL)


PRELUDES: dict[str, Callable[[Path, dict[str, str]], None]] = {
    "README.md": lambda home, env: prelude_readme(home),
    "RECIPES.md": prelude_recipes,
}


# ------------------------------------------------------------------ running


BASH_WRAPPER = """\
__kvdoc_state=$1
__kvdoc_block=$2
shift 2
__kvdoc_save() {
  __kvdoc_rc=$?
  if [ "$__kvdoc_rc" = 0 ]; then env -0 > "$__kvdoc_state.env"; pwd > "$__kvdoc_state.cwd"; fi
  exit "$__kvdoc_rc"
}
trap __kvdoc_save EXIT
set -e
. "$__kvdoc_block"
"""
NOT_CARRIED = {"_", "SHLVL", "PWD", "OLDPWD"}


# ------------------------------------------------------------------ python blocks, forked

ZYGOTE = Path(__file__).with_name("doc_zygote.py")
# imported by what the blocks import, on first use: worth having before the fork too
ALSO_PRELOAD = {"torch": ["torch.optim", "torch._dynamo", "torch.utils.data"],
                "kvdata": ["kvdata.reader.dataset", "kvdata.reader.loader", "kvdata.reader.sampler"]}


def imports_of(blocks: list[Block]) -> list[str]:
    """The modules the python blocks import (at any depth of their code), in first-seen order."""
    names: list[str] = []
    for b in blocks:
        if b.lang != "python" or exemption(b) is not None:
            continue
        try:
            tree = ast.parse(b.text)
        except SyntaxError:
            continue  # the block fails on its own
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.append(node.module)
    for top, extra in ALSO_PRELOAD.items():
        if any(n == top or n.startswith(top + ".") for n in names):
            names += extra
    return list(dict.fromkeys(names))


def _read_line(fd: int, buf: bytearray, deadline: float) -> bytes | None:
    """One line from `fd` (None at the deadline); `buf` keeps what came after it."""
    import select

    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            raise BlockFailed("the forking python (tests/helpers/doc_zygote.py) exited")
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line


class Zygote:
    """tests/helpers/doc_zygote.py, started with one environment and its modules imported."""

    def __init__(self, env: dict[str, str], cwd: Path, modules: list[str], log: Path) -> None:
        """Starts it importing (in the background: the first start() waits until it is ready)."""
        self.env, self.log = dict(env), log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, str(ZYGOTE), *modules], cwd=cwd, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         start_new_session=True)
        self._buf = bytearray()
        self._ready = False

    def ready(self) -> None:
        if self._ready:
            return
        assert self.proc.stdout is not None
        if _read_line(self.proc.stdout.fileno(), self._buf, time.monotonic() + 300) != b"ready":
            self.close()
            raise BlockFailed(f"the forking python did not start:\n{self.log.read_text(errors='replace')[-3000:]}")
        self._ready = True

    def start(self, script: Path, cwd: Path, env: dict[str, str], log: Path) -> int:
        """Fork a child that runs `script`; its pid (also its process group: a session of its own)."""
        self.ready()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        req = {"script": str(script), "cwd": str(cwd), "env": env, "log": str(log)}
        self.proc.stdin.write(json.dumps(req).encode() + b"\n")
        self.proc.stdin.flush()
        line = _read_line(self.proc.stdout.fileno(), self._buf, time.monotonic() + 60)
        if line is None:
            raise BlockFailed("the forking python did not fork within 60 s")
        return int(json.loads(line)["pid"])

    def wait(self, timeout: float) -> int | None:
        """The exit status of the child started last (as a shell gives it), or None after `timeout`."""
        assert self.proc.stdout is not None
        line = _read_line(self.proc.stdout.fileno(), self._buf, time.monotonic() + timeout)
        return None if line is None else int(json.loads(line)["exit"])

    def run(self, s: Session, block: Block, script: Path, log: Path, timeout: float) -> int:
        pid = self.start(script, s.cwd, s.env, log)
        s.groups.append(pid)
        rc = self.wait(timeout)
        if rc is None:
            _stop_group(pid)
            self.wait(30)
            raise BlockFailed(f"{block.where()} did not finish within {timeout:.0f} s\n{_show(block, log)}")
        return rc

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            _stop_group(self.proc.pid)
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _run_python(s: Session, block: Block, script: Path, log: Path, timeout: float) -> None:
    if os.environ.get("KVDOC_FORK", "1") == "0":
        _run_process(s, block, [sys.executable, str(script)], log, timeout)
        return
    if s.zygote is not None and s.zygote.env != s.env:  # a bash block exported something: import afresh
        s.zygote.close()
        s.zygote = None
    if s.zygote is None:
        s.zygote = Zygote(s.env, s.cwd, s.preload, s.scratch / "zygote.log")
    rc = s.zygote.run(s, block, script, log, timeout)
    if rc != 0:
        raise BlockFailed(f"{block.where()} exited with {rc}\n{_show(block, log)}")


def _run_process(s: Session, block: Block, argv: list[str], log: Path, timeout: float) -> None:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=s.cwd, env=s.env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        s.groups.append(proc.pid)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc.pid)
            proc.wait()
            raise BlockFailed(f"{block.where()} did not finish within {timeout:.0f} s\n{_show(block, log)}") from None
    if rc != 0:
        raise BlockFailed(f"{block.where()} exited with {rc}\n{_show(block, log)}")


def _show(block: Block, log: Path) -> str:
    out = log.read_text(errors="replace")
    return f"--- block ---\n{block.text}--- output (last 4000 characters) ---\n{out[-4000:]}"


def run_block(s: Session, n: int, block: Block, timeout: float) -> Ran:
    started = time.monotonic()
    why = exemption(block)
    if why is not None:
        return Ran(block, 0.0, f"not run: {why}")
    stem = s.scratch / f"{n:02d}-{block.lang or 'plain'}"
    log = stem.with_suffix(".log")
    if block.lang in SHELLS:
        script = stem.with_suffix(".sh")
        script.write_text(block.text)
        wrapper = s.scratch / "wrapper.sh"
        wrapper.write_text(BASH_WRAPPER)
        _run_process(s, block, ["bash", str(wrapper), str(stem), str(script)], log, timeout)
        carried = stem.with_suffix(".env").read_bytes().split(b"\0")
        s.env = dict(e.decode().split("=", 1) for e in carried if b"=" in e)
        for k in NOT_CARRIED:
            s.env.pop(k, None)
        s.cwd = Path(stem.with_suffix(".cwd").read_text().strip())
        how = "ran"
    elif block.lang == "python":
        script = stem.with_suffix(".py")
        script.write_text(block.text)
        _run_python(s, block, script, log, timeout)
        how = "ran"
    elif block.lang == "toml":
        from kvdata.config import parse_config
        from kvdata.errors import KVDataError
        try:
            parse_config(tomllib.loads(block.text))
        except (tomllib.TOMLDecodeError, KVDataError) as e:
            raise BlockFailed(f"{block.where()}: kvdatad would refuse this config: {e}\n{block.text}") from None
        how = "parsed"
    elif block.lang == "yaml":
        import yaml
        try:
            doc = yaml.safe_load(block.text)
        except yaml.YAMLError as e:
            raise BlockFailed(f"{block.where()}: not YAML: {e}") from None
        if not isinstance(doc, dict):
            raise BlockFailed(f"{block.where()}: not a YAML mapping")
        how = "parsed"
    else:
        raise BlockFailed(f"{block.where()}: no way to run a block of language {block.lang!r}; "
                          f"teach {__file__} (or exempt it there, with the reason)")
    output = log.read_text(errors="replace") if log.exists() else ""
    return Ran(block, time.monotonic() - started, how, output)


def _stop_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)


@contextmanager
def session(file: str, s3: Any = None) -> Iterator[Session]:
    """A fresh home (short path: Unix socket names are at most 107 bytes) and its environment;
    at the end, every process group a block started is stopped and the files are removed."""
    top = Path(tempfile.mkdtemp(prefix="kvdoc-"))
    home, run, scratch = top / "home", top / "run", top / "blocks"
    for d in (home, run, scratch):
        d.mkdir(mode=0o700)
    user = f"kvdoc-{top.name.split('-', 1)[1]}"
    env = base_env(home, run, user)
    if s3 is not None:
        env.update(s3.env)
    s = Session(home, scratch, env, home)
    try:
        yield s
    finally:
        if s.zygote is not None:
            s.zygote.close()
        for pgid in s.groups:
            _stop_group(pgid)
        for shm in Path("/dev/shm").glob(f"*{user}*") if Path("/dev/shm").is_dir() else ():
            shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(top, ignore_errors=True)


def run_file(path: Path, s3: Any = None, timeout: float = 240.0) -> list[Ran]:
    """Run every block of `path` in order in one session (after the file's prelude)."""
    blocks = extract(path)
    check_exemptions(blocks)
    with session(path.name, s3) as s:
        s.preload = imports_of(blocks)
        if s.preload and os.environ.get("KVDOC_FORK", "1") != "0":  # it imports while the prelude and bash blocks run
            s.zygote = Zygote(s.env, s.cwd, s.preload, s.scratch / "zygote.log")
        prelude = PRELUDES.get(path.name)
        started = time.monotonic()
        if prelude is not None:
            prelude(s.home, s.env)
        s.results.append(Ran(Block(path.name, 0, "prelude", [], "", ""), time.monotonic() - started, "prelude"))
        for n, block in enumerate(blocks):
            s.results.append(run_block(s, n, block, timeout))
        return s.results


def report(results: list[Ran], outputs: bool = False) -> str:
    """One line per block (seconds, where, how); with `outputs`, what each printed."""
    total = sum(r.seconds for r in results)
    lines = []
    for r in results:
        lines.append(f"{r.seconds:6.1f} s  {r.block.file}:{r.block.line} {r.block.lang:<8} {r.how}")
        if outputs and r.output:
            lines += ["          | " + line for line in r.output.splitlines()]
    return "\n".join(lines + [f"{total:6.1f} s  in all"])


if __name__ == "__main__":  # a developer's run, outside pytest: python tests/helpers/doc_blocks.py [FILE.md...]
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.doc_blocks import report as _report  # the package's module: its PRELUDES, its Zygote
    from helpers.doc_blocks import run_file as _run_file
    from helpers.servers import running_s3_server

    with tempfile.TemporaryDirectory() as state, running_s3_server(Path(state)) as server:
        server.client().create_bucket(Bucket=BUCKET)
        for name in sys.argv[1:] or ["README.md", "docs/RECIPES.md", "docs/DAEMON.md"]:
            print(f"{name}:\n{_report(_run_file(ROOT / name, server), outputs=True)}", flush=True)
