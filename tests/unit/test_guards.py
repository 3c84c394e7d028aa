"""The guards every test runs under (tests/conftest.py, helpers/guards.py), checked on
purpose-built tests in a separate pytest run with this project's ini: a leaked thread,
a warning and a hang must fail; an exempted leak, an expected warning and a thread that
finishes in time must not; the environment seen by a test and its subprocesses is hermetic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.etree import ElementTree

import pytest

TESTS = Path(__file__).resolve().parents[1]
PYPROJECT = TESTS.parent / "pyproject.toml"

INNER = '''
import os, subprocess, sys, threading, time, warnings
import pytest

def _park(stop):
    stop.wait(30)

STOP = threading.Event()

def test_leaks_a_thread():
    threading.Thread(target=_park, args=(STOP,), name="left-running").start()

@pytest.mark.allow_thread_leak("a kvdata leak, reported")
def test_leaks_a_thread_exempted():
    threading.Thread(target=_park, args=(STOP,), name="exempted").start()

def test_daemon_thread_and_a_thread_that_finishes_in_the_grace_are_fine():
    threading.Thread(target=_park, args=(STOP,), daemon=True).start()
    threading.Thread(target=time.sleep, args=(0.5,)).start()

def test_warns():
    warnings.warn("something is deprecated", DeprecationWarning)

def test_expects_a_warning():
    with pytest.warns(UserWarning, match="expected"):
        warnings.warn("expected", UserWarning)

def test_unclosed_file():
    f = open(__file__)
    del f

@pytest.mark.timeout(1)
def test_hangs():
    time.sleep(30)

def test_environment_is_hermetic(hermetic_env):
    for var in ("KVDATA_CONFIG", "KVDATA_SOCKET", "NOTIFY_SOCKET", "AWS_PROFILE"):
        assert var not in os.environ, var
    for var in ("HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR"):
        assert os.environ[var] == str(hermetic_env[var]) and hermetic_env[var].is_dir()
    child = subprocess.run([sys.executable, "-c",
                            "import os; from kvdata.protocol import socket_path; from kvdata.config import config_path;"
                            "print(socket_path()); print(config_path()); print(os.environ.get('KVDATA_CONFIG'))"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert child == [str(hermetic_env["XDG_RUNTIME_DIR"] / "kvdata" / "kvdatad.sock"),
                     str(hermetic_env["XDG_CONFIG_HOME"] / "kvdata" / "kvdata.toml"), "None"]

def test_zz_release_the_parked_threads():
    STOP.set()
'''


@pytest.fixture(scope="module")
def inner_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """{test name: "passed" | "failed: <message>" | "error: <message>"} of one pytest run of
    INNER with this project's ini and guards, started from an environment through which a
    developer's settings would leak; "_output" is the run's output."""
    root = tmp_path_factory.mktemp("inner")
    (root / "test_inner.py").write_text(textwrap.dedent(INNER))
    report = root / "report.xml"
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath,
               KVDATA_CONFIG="/home/someone/.config/kvdata/kvdata.toml", KVDATA_SOCKET="/run/kvdata/kvdatad.sock",
               NOTIFY_SOCKET="/run/systemd/notify", AWS_PROFILE="prod")
    p = subprocess.run([sys.executable, "-m", "pytest", "-c", str(PYPROJECT), "--rootdir", str(root),
                        "-p", "helpers.guards", "-p", "no:cacheprovider", "-q", f"--junitxml={report}", "test_inner.py"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert report.exists(), p.stdout + p.stderr
    outcomes: dict[str, str] = {"_output": p.stdout + p.stderr}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        results = [f"{child.tag}: {child.get('message', '')}" for child in case if child.tag in ("failure", "error")]
        outcomes[case.get("name", "")] = "\n".join(results) or "passed"
    return outcomes


def outcome(run: dict[str, str], name: str) -> str:
    assert name in run, f"{name} did not run:\n{run['_output'][-3000:]}"
    return run[name]


def test_a_leaked_thread_fails_the_test_naming_it(inner_run: dict[str, str]) -> None:
    line = outcome(inner_run, "test_leaks_a_thread")
    assert line.startswith("error:") and "left-running" in line and "non-daemon" in line, line


def test_an_exempted_leak_passes(inner_run: dict[str, str]) -> None:
    assert outcome(inner_run, "test_leaks_a_thread_exempted") == "passed"


def test_daemon_threads_and_threads_finishing_in_the_grace_pass(inner_run: dict[str, str]) -> None:
    assert outcome(inner_run, "test_daemon_thread_and_a_thread_that_finishes_in_the_grace_are_fine") == "passed"


def test_a_warning_fails_the_test(inner_run: dict[str, str]) -> None:
    line = outcome(inner_run, "test_warns")
    assert line.startswith("failure:") and "something is deprecated" in line, line


def test_an_expected_warning_passes(inner_run: dict[str, str]) -> None:
    assert outcome(inner_run, "test_expects_a_warning") == "passed"


def test_an_unclosed_file_fails_the_test_that_left_it(inner_run: dict[str, str]) -> None:
    line = outcome(inner_run, "test_unclosed_file")
    assert line != "passed" and "ResourceWarning" in inner_run["_output"], line


def test_a_hang_is_cut_by_the_timeout(inner_run: dict[str, str]) -> None:
    line = outcome(inner_run, "test_hangs")
    assert line.startswith("failure:") and "Timeout" in line, line


def test_the_environment_of_a_test_and_its_subprocesses_is_hermetic(inner_run: dict[str, str]) -> None:
    assert outcome(inner_run, "test_environment_is_hermetic") == "passed", inner_run["_output"][-3000:]
