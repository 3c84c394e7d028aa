"""Small helpers shared by the daemon and server tests."""

from __future__ import annotations

import socket
import time
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll cond() until it returns something truthy; fail naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout:.1f} s (last: {last!r})")
