"""Progress reporting: a bar on a terminal, silence in scripts and pipes."""

from __future__ import annotations

import sys
from typing import Any, Protocol


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...
    def close(self) -> None: ...


class NullProgress:
    """What library code gets by default: no output at all."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BarProgress:
    """A click progress bar on stderr."""

    def __init__(self, total: int | None, label: str) -> None:
        import click

        self._bar: Any = click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True)
        self._bar.__enter__()

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.__exit__(None, None, None)

    def __enter__(self) -> BarProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress(total: int | None, label: str, enabled: bool | None = None) -> NullProgress | BarProgress:
    """A bar when `enabled` (default: stderr is a terminal), else a silent stand-in."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    return BarProgress(total, label) if enabled else NullProgress()
