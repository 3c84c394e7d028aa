"""What every `kvdata` command prints goes through here: JSON, error lines, sizes, progress bars.

`--json` output is stable (documented in docs/CLI.md): one JSON document on stdout,
keys sorted, one-space indent, values JSON cannot hold written as strings.
An error is one `kvdata: error: ...` line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click

from .._util.progress import progress
from .._util.sizes import format_size

__all__ = ["EXIT_ERROR", "ERROR_PREFIX", "print_json", "error", "fail", "format_size", "progress"]

EXIT_ERROR = 1
ERROR_PREFIX = "kvdata: error:"


def print_json(obj: Any) -> None:
    """Print a command's `--json` result."""
    click.echo(json.dumps(obj, indent=1, sort_keys=True, default=str))


def error(message: str) -> None:
    """Print `kvdata: error: MESSAGE` on stderr."""
    click.echo(f"{ERROR_PREFIX} {message}", err=True)


def fail(message: str) -> NoReturn:
    """Print the first line of `message` as the error line and exit with EXIT_ERROR."""
    error(message.splitlines()[0] if message else "failed")
    sys.exit(EXIT_ERROR)
