"""Guards every test runs under (autouse), and where the shared pieces live.

Hermetic environment (`hermetic_env`, and `_hermetic_session` for module- and
session-scoped fixtures): HOME, XDG_CONFIG_HOME, XDG_CACHE_HOME and XDG_RUNTIME_DIR
point into fresh temp directories; KVDATA_CONFIG, KVDATA_SOCKET, KVDATA_S3_ADDRESSING
and the systemd variables (NOTIFY_SOCKET, WATCHDOG_*, LISTEN_*) are unset; AWS_* is
replaced by settings that read no file of the developer's. That covers every variable
kvdata/config.py and kvdata/protocol.py read (see helpers/env.py for the list), so no
developer config, cache tier or running kvdatad is ever picked up. Subprocesses inherit
os.environ (or build their env from it: helpers.cli.Cli, helpers.daemon.Kit), so they
are isolated too. A test that wants a config sets KVDATA_CONFIG itself (monkeypatch).

Thread leaks (`_no_thread_leaks`): a test fails (an error at teardown) if a non-daemon
thread that did not exist before it is still alive after it and its fixtures are torn
down, after a grace of THREAD_GRACE_S for threads that are finishing. Daemon threads are
ignored (they cannot keep the interpreter alive). A test whose leak is kvdata's, not
the test's, says so with @pytest.mark.allow_thread_leak("reason"); keep those rare.
The same fixture runs gc.collect() after each test, so garbage in reference cycles (an
exception holding a socket, ...) is finalized inside the test that made it; the objects
alive before the first test are frozen out of the collector (gc.freeze) to keep that cheap.

Warnings: `filterwarnings = ["error", ...]` in pyproject.toml's [tool.pytest.ini_options]
turns every warning raised while a test (or its fixtures) runs into a failure at the
line that raised it; a test that expects one uses pytest.warns or
@pytest.mark.filterwarnings. Chosen over a recorder fixture because the failure points
at the code that warned, it covers collection too, and pytest applies it per test
without extra code; known third-party noise would be listed in the ini as ignores, each
with its reason (none is needed today). Unraisable exceptions (e.g. a ResourceWarning from an unclosed file in
__del__) reach pytest as warnings, so they fail too. A test that must tolerate a known kvdata
leak would say so with @pytest.mark.filterwarnings("ignore:...:ResourceWarning") and a comment
naming the bug (none does today).

Timeouts: pytest-timeout with a default `timeout` in the ini (generous: this suite runs
on 2 shared cores); long tests carry @pytest.mark.timeout(N).

The fixtures themselves are in helpers/guards.py, loaded below as a plugin so that
tests/unit/test_guards.py can run them on purpose-built failing tests in a separate pytest.
Fixtures for the integration tests (cli, make_cli, kit, s3_server, nginx_home) are in
tests/integration/conftest.py; helper classes and functions in the `helpers` package
(tests/ is on sys.path: `pythonpath` in the ini).
"""

import re
from typing import Any

import pytest

pytest_plugins = ("helpers.guards",)


def pytest_sessionstart(session: object) -> None:
    """Byte-compile kvdata and daemon once, before any test starts a process.

    Hundreds of tests start Python processes that import kvdata (the CLI, kvdatad, spawned
    DataLoader workers, ranks). An editable install has no .pyc files, and where
    PYTHONDONTWRITEBYTECODE is set (this project's machines set it) the import system never
    writes them, so every one of those processes compiled ~100 modules again: `kvdata info`
    took 0.64 s, 0.45 s with __pycache__ present. compileall writes them whatever that
    variable says and skips what is up to date; the files are gitignored."""
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for package in ("kvdata", "daemon"):
        compileall.compile_dir(str(root / package), quiet=1)


# Test modules that import an optional package at the top: where it is not installed (the
# core-only, lowest-versions run of .ci/lowest-versions) the module is reported as skipped, naming
# the package, instead of as a collection error. Only these packages: any other missing module
# (a typo, a core dependency) stays an error.
OPTIONAL_PACKAGES = {"torch", "torchdata", "PIL", "boto3", "botocore", "moto", "pyarrow", "sklearn", "google",
                     "webdataset", "fsspec", "s3fs", "datasets", "lightning", "transformers", "accelerate"}


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    report = yield
    if report.failed and isinstance(collector, pytest.Module):
        found = re.search(r"ModuleNotFoundError: No module named '([A-Za-z0-9_]+)", str(report.longrepr))
        if found and found.group(1) in OPTIONAL_PACKAGES:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: needs {found.group(1)}, which is not installed")
    return report
