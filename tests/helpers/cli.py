"""The real `kvdata` console script in a subprocess (fixtures `cli` and `make_cli` in
tests/integration/conftest.py).

Running the installed script (not CliRunner, not `python -m`) means exit codes,
stderr and TTY detection are what a user's shell sees: stdout and stderr are
pipes here, so progress bars must stay silent. The script inherits os.environ,
which the autouse fixture in tests/conftest.py keeps hermetic.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Arg = str | bytes | os.PathLike[str]


def _find_kvdata() -> str:
    beside = Path(sys.executable).parent / "kvdata"
    if beside.is_file():
        return str(beside)
    found = shutil.which("kvdata")
    if found is None:
        raise RuntimeError("the `kvdata` console script is not installed; run `pip install -e .`")
    return found


KVDATA = _find_kvdata()
ERROR_PREFIX = "kvdata: error:"


@dataclass
class Result:
    """What one run of the CLI produced."""

    args: tuple[str | bytes, ...]
    rc: int
    out: bytes
    err: str

    @property
    def text(self) -> str:
        return self.out.decode("utf-8")

    def json(self) -> Any:
        return json.loads(self.text)

    def lines(self) -> list[str]:
        return self.text.splitlines()

    def __str__(self) -> str:
        argv = " ".join(os.fsdecode(a) for a in self.args)
        return f"kvdata {argv} -> rc={self.rc}\nstdout: {self.out[:2000]!r}\nstderr: {self.err!r}"


class Cli:
    """Runs `kvdata ...` with pipes for stdin/stdout/stderr, from a working directory."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd

    def run(self, *args: Arg, input: bytes | None = None,
            preexec_fn: Callable[[], None] | None = None, timeout: float = 120) -> Result:
        argv = tuple(os.fspath(a) for a in args)
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        p = subprocess.run([KVDATA, *argv], input=b"" if input is None else input, capture_output=True,
                           cwd=self.cwd, env=env, preexec_fn=preexec_fn, timeout=timeout)
        r = Result(argv, p.returncode, p.stdout, p.stderr.decode("utf-8", "backslashreplace"))
        assert "Traceback" not in r.err and b"Traceback" not in r.out, str(r)
        return r

    def ok(self, *args: Arg, quiet: bool = True, **kw: Any) -> Result:
        """Run and require success; `quiet`: stderr must be empty (no progress bar off a TTY)."""
        r = self.run(*args, **kw)
        assert r.rc == 0, str(r)
        if quiet:
            assert r.err == "", str(r)
        return r

    def fail(self, *args: Arg, names: Iterable[str] = (), **kw: Any) -> str:
        """Run and require a non-zero exit with exactly one `kvdata: error:` line that names
        every string in `names`; return that line."""
        r = self.run(*args, **kw)
        assert r.rc != 0, str(r)
        lines = r.err.splitlines()
        assert len(lines) == 1 and r.err.endswith("\n"), str(r)
        assert lines[0].startswith(ERROR_PREFIX), str(r)
        for n in names:
            assert n in lines[0], f"{n!r} not named in: {lines[0]}"
        return lines[0]

    def verify_fails(self, dataset: str | os.PathLike[str], names: Iterable[str] = ()) -> list[str]:
        """`kvdata verify` must exit 1 with BAD lines, then one error line; `names` must each
        appear in some BAD line. Returns the BAD lines."""
        r = self.run("verify", dataset)
        assert r.rc == 1, str(r)
        lines = r.err.splitlines()
        assert len(lines) >= 2, str(r)
        assert all(line.startswith("BAD") for line in lines[:-1]), str(r)
        assert lines[-1].startswith(ERROR_PREFIX) and os.fspath(dataset) in lines[-1], str(r)
        for n in names:
            assert any(n in line for line in lines[:-1]), f"{n!r} not named in: {lines[:-1]}"
        return lines[:-1]
