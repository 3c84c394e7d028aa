"""Work in a forked child that a test SIGKILLs in the middle (crash safety by a real kill).

A fork rather than a new interpreter: the child starts the work at once, so a kill `delay`
seconds after it said "go" lands inside the work itself, not in an interpreter's start-up.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from collections.abc import Callable


def run_forked(work: Callable[[], object], delay: float | None, *, until: Callable[[], bool] | None = None) -> float | None:
    """Run `work()` in a forked child. Without `delay`: wait for it and return how long it took
    (in the child). With `delay`: SIGKILL it that long after it started -- or, with `until`, as
    soon as until() is true (polled), `delay` at the latest -- and return None."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: work, report, and leave without running any of pytest's teardown
        code = 1
        try:
            os.close(r)
            os.write(w, b"g")
            t = time.perf_counter()
            work()
            os.write(w, struct.pack("<d", time.perf_counter() - t))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        assert os.read(r, 1) == b"g"
        if delay is None:
            took = struct.unpack("<d", os.read(r, 8))[0]
            assert os.waitpid(pid, 0)[1] == 0
            pid = 0
            return float(took)
        deadline = time.perf_counter() + delay
        if until is None:
            time.sleep(delay)
        else:
            while time.perf_counter() < deadline and not until():
                time.sleep(0.0002)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pid = 0
        return None
    finally:
        os.close(r)
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
