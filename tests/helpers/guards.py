"""The autouse guards of tests/conftest.py (its docstring explains them): a hermetic
environment, no leaked non-daemon threads, garbage collected inside the test that made it.
Loaded as a plugin (`pytest_plugins` in tests/conftest.py; `-p helpers.guards` elsewhere)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .env import isolate, isolate_aws

THREAD_GRACE_S = 2.0


# ------------------------------------------------------------------ hermetic environment


@pytest.fixture(scope="session", autouse=True)
def _hermetic_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The isolated environment for session- and module-scoped fixtures (set up before any
    function-scoped fixture); each test then gets fresh directories from `hermetic_env`."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("session-env")
        isolate(mp, root)
        isolate_aws(mp, root)
        yield


@pytest.fixture(autouse=True)
def hermetic_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """{variable: directory} of this test's HOME and XDG_* directories (empty, its own)."""
    # beside tmp_path, not in it: some tests assert that nothing appears under tmp_path
    return isolate(monkeypatch, tmp_path_factory.mktemp("env"))


# ------------------------------------------------------------------ thread leaks


@pytest.fixture(scope="session", autouse=True)
def _gc_frozen_baseline() -> Iterator[None]:
    """Everything alive once collection is done (modules, items) moves to the permanent
    generation, so the per-test gc.collect() below costs microseconds, not 0.1 s."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _no_thread_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    # Garbage in reference cycles (an exception holding a socket, ...) is finalized now, so a
    # ResourceWarning from its __del__ fails this test, not whichever test the GC next runs in.
    gc.collect()
    deadline = time.monotonic() + THREAD_GRACE_S
    leaked = []
    for t in threading.enumerate():
        if t in before or t.daemon or t is threading.current_thread():
            continue
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            leaked.append(t)
    if not leaked:
        return
    allowed = request.node.get_closest_marker("allow_thread_leak")
    if allowed is not None:
        if not (allowed.args and isinstance(allowed.args[0], str) and allowed.args[0]):
            pytest.fail("@pytest.mark.allow_thread_leak needs a reason", pytrace=False)
        return
    names = ", ".join(sorted(f"{t.name!r}" for t in leaked))
    pytest.fail(f"{len(leaked)} non-daemon thread(s) still running {THREAD_GRACE_S:.0f} s after the test: {names}; "
                "close what the test opened (store, engine, loader)", pytrace=False)
