"""Ctrl-C held back while a short piece of work that must not stop halfway finishes.

A writer that gathers puts writes them later, in one go: a KeyboardInterrupt raised in the
middle would leave some of them written and the rest not, after every one of those puts had
returned. Python raises KeyboardInterrupt from its default SIGINT handler between any two
bytecodes; while `interrupts_deferred` is active that handler is replaced by one that only
notes the signal, and the KeyboardInterrupt is raised when the block ends -- the same Ctrl-C,
a few milliseconds later. Only Python's own default handler is replaced, on the signals that
have it (a handler the program installed, or SIG_IGN, is left alone), only in the main thread
(the only one that runs signal handlers), and it is put back before the block's end, whatever
happens.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_CATCHABLE = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold the signals whose handler raises KeyboardInterrupt (SIGINT's default, and any signal
    the program routed to it) that arrive inside the block; raise KeyboardInterrupt at the end
    (unless the block raised something else, which goes on as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    routed = [sig for sig in _CATCHABLE if signal.getsignal(sig) is signal.default_int_handler]
    held: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        held.append(signum)

    for sig in routed:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig in routed:
            signal.signal(sig, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt
