"""`kvdata` behaves like a Unix tool (issue 27, item 7), run as the installed script.

- output into a pipe its reader closed (`kvdata ls X | head -1`, `kvdata get ... | head -c 10`,
  `--json` too) ends quietly with exit 0;
- `kvdata` alone prints its help on stdout and exits 0;
- `put` says what it wrote unless --quiet;
- read commands on a dataset an import is still building (its DEST.parts-PID beside it) say so;
- Ctrl-C ends an import at once with any worker count: exit 130, one line, the dataset as it
  was before (a new one not there at all), no parts directory or temp file left, no worker
  process left. The import runs with stderr on a pseudo-terminal, so its progress bar shows
  and the SIGINT is sent the way a terminal sends it: to the whole process group (os.killpg),
  once the bar has moved; repeated, at different moments, to catch the races.
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import kvdata

from helpers.cli import KVDATA, Cli

# ---------------------------------------------------------------- a closed pipe


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dataset of 6,000 small records (`ls` prints ~60 KB, `ls -l` and --json several times
    a pipe's buffer) and one of 2 MB ("big")."""
    ds = tmp_path_factory.mktemp("pipe") / "many.kv"
    with kvdata.open(ds, "a") as store:
        for i in range(6000):
            store.put(f"key/{i:06d}", b"x" * 8, label=i % 7)
        store.put("big", np.random.default_rng(0).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes())
        store.commit()
    return ds


def _shell(cmd: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`cmd` in bash; its exit status is kvdata's (PIPESTATUS[0]), not head's."""
    return subprocess.run(["bash", "-c", f"{cmd}; exit ${{PIPESTATUS[0]}}"], capture_output=True, text=True,
                          errors="backslashreplace", cwd=cwd, timeout=120)


@pytest.mark.parametrize("cmd, want", [
    ("ls {ds} | head -1", "key/000000\n"),
    ("ls -l {ds} | head -1", None),
    ("ls {ds} --json | head -c 10", None),
    ("get {ds} big | head -c 10", None),
    ("get {ds} key/000000 --json | head -c 1", "{"),
    ("info {ds} --json | head -c 1", "{"),
])
def test_a_closed_pipe_ends_quietly_with_exit_0(many: Path, cmd: str, want: str | None) -> None:
    r = _shell(f"'{KVDATA}' " + cmd.format(ds=many), many.parent)
    assert r.returncode == 0 and r.stderr == "", r
    assert r.stdout if want is None else r.stdout == want, r


def test_the_whole_output_still_comes_through_a_pipe(many: Path) -> None:
    r = _shell(f"'{KVDATA}' ls {many} | tail -1", many.parent)
    assert r.returncode == 0 and r.stdout == "big\n" and r.stderr == "", r


# ---------------------------------------------------------------- help, put


def test_kvdata_alone_prints_its_help_and_exits_0(cli: Cli) -> None:
    r = cli.ok()
    assert r.text.startswith("Usage: kvdata") and "Commands:" in r.text and "import" in r.text
    assert r.text == cli.ok("--help").text
    r = cli.ok("import")  # a group alone: its help too
    assert r.text.startswith("Usage: kvdata import") and "folder" in r.text


def test_put_says_what_it_wrote_unless_quiet(cli: Cli, tmp_path: Path) -> None:
    for name in ("a.bin", "b.bin", "c.bin"):
        (tmp_path / name).write_bytes(name.encode())
    ds = tmp_path / "data.kv"
    assert cli.ok("put", ds, tmp_path / "a.bin", tmp_path / "b.bin").text == f"put 2 records into {ds} (generation 1)\n"
    assert cli.ok("put", ds, tmp_path / "c.bin").text == f"put 1 record into {ds} (generation 2)\n"
    assert cli.ok("put", ds, "-", "--key", "d", input=b"dd").text == f"put 1 record into {ds} (generation 3)\n"
    assert cli.ok("put", "--quiet", ds, tmp_path / "a.bin").out == b""
    assert cli.ok("put", "-q", ds, tmp_path / "b.bin").out == b""
    assert cli.ok("put", ds, tmp_path / "c.bin", "--json").json() == {"dataset": str(ds), "put": 1, "generation": 6}
    assert cli.ok("ls", ds).lines() == ["a.bin", "b.bin", "c.bin", "d"]


# ---------------------------------------------------------------- a dataset being built


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_read_commands_on_a_dataset_being_built_say_so(cli: Cli, tmp_path: Path) -> None:
    ds = tmp_path / "new.kv"
    parts = tmp_path / f"new.kv.parts-{os.getpid()}"  # a running process (this one) builds it
    (parts / "p0").mkdir(parents=True)
    for args in (["info", ds], ["info", ds, "--json"], ["ls", ds], ["get", ds, "k"], ["verify", ds], ["rm", ds, "k"]):
        cli.fail(*args, names=[str(ds), "is being built by an import", f"process {os.getpid()}", str(parts)])
    parts.rename(tmp_path / f"new.kv.parts-{_dead_pid()}")  # what an import killed outright leaves
    line = cli.fail("info", ds, names=[str(ds), "was left by an import that was killed", "delete it"])
    assert "new.kv.parts-" in line
    (tmp_path / "other.kv.parts-1x").mkdir()  # not a parts directory of new.kv's
    for p in tmp_path.glob("new.kv.parts-*"):
        (p / "p0").rmdir()
        p.rmdir()
    cli.fail("info", ds, names=["no such dataset"])


# ---------------------------------------------------------------- Ctrl-C during an import


class Terminal:
    """A pseudo-terminal for a child's stderr (so its progress bar shows), read continuously
    so the child never blocks writing to it."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        self._out = bytearray()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="pty-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every slave end is closed
                return
            if not chunk:
                return
            with self._lock:
                self._out += chunk

    def text(self) -> str:
        with self._lock:
            return self._out.decode("utf-8", "replace")

    def close_slave(self) -> None:
        if self.slave >= 0:
            os.close(self.slave)
            self.slave = -1

    def close(self) -> None:
        self.close_slave()
        self._reader.join(timeout=10)
        os.close(self.master)


def _bar_at(text: str, at_least: int) -> bool:
    return any(int(done) >= at_least for done, _total in re.findall(r"(\d+)/(\d+)", text))


@pytest.fixture(scope="module")
def slow_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """src/a/<i>.png: 2,000 hard links of one flat 1024x1024 PNG -- a few KB on disk, a few ms
    each to decode -- so an import runs long enough to be interrupted at any moment."""
    src = tmp_path_factory.mktemp("slow") / "src"
    (src / "a").mkdir(parents=True)
    Image.new("RGB", (1024, 1024), (9, 99, 199)).save(src / "a" / "0.png")
    for i in range(1, 2000):
        os.link(src / "a" / "0.png", src / "a" / f"{i}.png")
    return src


@pytest.fixture(scope="module")
def small_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """src/a/x<i>.png: what the existing datasets are made of (same class, other keys)."""
    src = tmp_path_factory.mktemp("small") / "src"
    (src / "a").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (8, 8), (i, 2 * i, 3 * i)).save(src / "a" / f"x{i}.png")
    return src


def _tree_state(root: Path) -> dict[str, tuple[int | None, bytes | None]]:
    """Every file under root: its size (but the open tail's: an LMDB file keeps the pages a
    write that was rolled back grew it by), and the bytes of manifest.json."""
    out: dict[str, tuple[int | None, bytes | None]] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = (None if p.name.startswith("tail-") else p.stat().st_size,
                                             p.read_bytes() if p.name == "manifest.json" else None)
    return out


def _group_gone(pgid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _interrupt_import(cwd: Path, argv: list[str], at: int, delay: float,
                      check_info: Path | None = None) -> tuple[int, str, float]:
    """Run `kvdata import ...` with stderr on a pty in its own process group; once the bar
    counts `at` records, wait `delay` s and SIGINT the group. Returns (exit code, what the
    terminal showed, seconds from the signal to the exit)."""
    term = Terminal()
    p = subprocess.Popen([KVDATA, *argv], cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=term.slave, start_new_session=True,
                         # SIGINT at its default: a runner started in the background ignores it
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    term.close_slave()
    try:
        deadline = time.monotonic() + 60
        while not _bar_at(term.text(), at):
            assert p.poll() is None, f"the import ended before it could be interrupted: {term.text()!r}"
            assert time.monotonic() < deadline, term.text()
            time.sleep(0.01)
        if check_info is not None:  # meanwhile, a read command says the dataset is being built
            r = Cli(cwd).run("info", check_info)
            assert r.rc == 1 and "is being built by an import" in r.err and f"process {p.pid}" in r.err, str(r)
        time.sleep(delay)
        assert p.poll() is None, f"the import ended before it could be interrupted: {term.text()!r}"
        sent = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the import hung after SIGINT: {term.text()[-2000:]!r}") from None
        took = time.monotonic() - sent
        assert out == b"", out
        assert _group_gone(p.pid), "a worker process outlived the import"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if p.stdout is not None:
            p.stdout.close()
        term.close()
    return p.returncode, term.text(), took


def _messages(terminal: str) -> list[str]:
    """The lines the import printed besides its progress bar."""
    lines = re.split(r"[\r\n]+", terminal)
    return [s.strip() for s in lines if s.strip() and not re.search(r"\d+/\d+", s) and not s.strip().startswith("import")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers, repeats", [(0, 2), (1, 1), (2, 3)])
@pytest.mark.parametrize("into", ["new", "append", "overwrite"])
def test_ctrl_c_ends_an_import_at_once_leaving_the_dataset_as_it_was(
        tmp_path: Path, slow_images: Path, small_images: Path, cli: Cli, workers: int, repeats: int, into: str) -> None:
    ds = tmp_path / "ds"
    if into != "new":
        cli.ok("import", "folder", small_images, ds, "--decode", "rgb", "--resize", "4x4")
        keys = cli.ok("ls", ds).lines()  # (a first read makes the reader registry's lock file)
        before = _tree_state(ds)
    # small shards: the import seals some before it is interrupted, and those must go too
    argv = ["import", "folder", str(slow_images), "ds", "--decode", "rgb", "--resize", "32x32", "--shard-size", "64KB",
            "--workers", str(workers)]
    if into != "new":
        argv.append(f"--{into}")
    # at once, and later: after the first shards were sealed (about 20 records each)
    for attempt, (at, delay) in enumerate([(1, 0.0), (45, 0.15), (45, 0.4)][:repeats]):
        check = ds if into == "new" and workers == 2 and attempt == 0 else None  # parallel parts: being built
        rc, terminal, took = _interrupt_import(tmp_path, argv, at, delay, check_info=check)
        assert rc == 130, terminal
        assert _messages(terminal) == ["kvdata: interrupted"], terminal
        assert "Traceback" not in terminal
        assert took < 5, f"{took:.1f} s from SIGINT to exit"
        leftovers = sorted(n for n in os.listdir(tmp_path) if n not in ("ds",))
        assert leftovers == [], leftovers  # no DEST.parts-PID, no temp file beside it
        if into == "new":
            assert not ds.exists(), sorted(p.name for p in ds.iterdir())
        else:
            assert _tree_state(ds) == before, "the dataset changed"
            assert cli.ok("ls", ds).lines() == keys
            assert cli.ok("verify", ds, "--json").json()["ok"]
    if into != "new":  # and it still takes the import it refused to half-write
        summary = json.loads(cli.ok("import", "folder", small_images, ds, "--decode", "rgb", "--resize", "4x4",
                                    f"--{into}", "--json").text)
        assert summary["mode"] == into


@pytest.fixture(scope="module")
def slow_records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """The same slow images as a WebDataset tar and a Parquet file (1,500 records: big.*), and
    3 small ones of each (small.*) for the datasets that exist before."""
    import io
    import tarfile

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root = tmp_path_factory.mktemp("records")
    buf = io.BytesIO()
    Image.new("RGB", (1024, 1024), (9, 99, 199)).save(buf, "PNG")
    slow = buf.getvalue()
    small = []
    for i in range(3):
        b = io.BytesIO()
        Image.new("RGB", (8, 8), (i, i, i)).save(b, "PNG")
        small.append(b.getvalue())
    out: dict[str, tuple[Path, Path]] = {}
    tars = []
    for name, images in (("big", [slow] * 1500), ("small", small)):
        with tarfile.open(root / f"{name}.tar", "w") as tf:
            for i, data in enumerate(images):
                info = tarfile.TarInfo(f"{name}{i:05d}.png")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        pq.write_table(pa.table({"key": [f"{name}{i:05d}" for i in range(len(images))], "img": images}),
                       root / f"{name}.parquet")
        tars.append(root / f"{name}.tar")
    out["wds"] = (root / "big.tar", root / "small.tar")
    out["parquet"] = (root / "big.parquet", root / "small.parquet")
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["wds", "parquet"])
def test_ctrl_c_ends_a_record_import_too(tmp_path: Path, cli: Cli, slow_records: dict[str, tuple[Path, Path]],
                                         kind: str, workers: int) -> None:
    big, small = slow_records[kind]
    opts = ["--decode", "rgb", *(["--key", "key"] if kind == "parquet" else [])]
    ds = tmp_path / "ds"
    cli.ok("import", kind, small, ds, *opts)
    keys = cli.ok("ls", ds).lines()
    before = _tree_state(ds)
    argv = ["import", kind, str(big), "ds", *opts, "--overwrite", "--shard-size", "4MB", "--workers", str(workers)]
    rc, terminal, took = _interrupt_import(tmp_path, argv, at=45, delay=0.1)
    assert rc == 130 and _messages(terminal) == ["kvdata: interrupted"], terminal
    assert took < 5, f"{took:.1f} s from SIGINT to exit"
    assert _tree_state(ds) == before, "the dataset changed"
    assert cli.ok("ls", ds).lines() == keys
    assert sorted(os.listdir(tmp_path)) == ["ds"]


def _sleep_forever() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a worker stuck where SIGTERM does not end it
    while True:
        time.sleep(1)


def test_a_pool_that_will_not_terminate_does_not_hold_an_import_up() -> None:
    """Pool.terminate() can hang for good (a worker SIGTERMed while it sends a result keeps the
    result queue's lock, which the pool's task handler then waits for): end_pool gives it
    END_POOL_WAIT_S, then kills the workers and returns."""
    import multiprocessing

    from kvdata.importers import target

    release = threading.Event()
    proc = multiprocessing.get_context("fork").Process(target=_sleep_forever, daemon=True)
    proc.start()

    class StuckPool:
        _pool = [proc]

        def terminate(self) -> None:
            release.wait()

        def join(self) -> None:
            pass

    try:
        started = time.monotonic()
        target.end_pool(StuckPool())
        took = time.monotonic() - started
        assert target.END_POOL_WAIT_S <= took < target.END_POOL_WAIT_S + 3, took
        assert not proc.is_alive() and proc.exitcode == -signal.SIGKILL
    finally:
        release.set()
        if proc.is_alive():
            proc.kill()
        proc.join()
