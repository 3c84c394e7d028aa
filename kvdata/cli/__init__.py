"""The `kvdata` command line: parsing and printing only; the work is in the library.

This module holds the `main` group and its error handling: every error kvdata
raises on purpose becomes one `kvdata: error: ...` line on stderr and a non-zero
exit code, never a traceback. Like any Unix tool: `kvdata` alone prints its help
(stdout, exit 0); output cut short by a reader that went away (`kvdata ls X | head`)
ends quietly with exit 0; Ctrl-C ends a command with one line and exit 130. The commands live in one module per group:
data.py (put/get/rm/ls/info/verify/reindex/seal), cache.py (stage/evict/status/
cache ls/push), imports.py (import folder|listfile|caffe, demo), merge.py and compact.py; output.py
prints for all of them. `--json` output is stable (documented in docs/CLI.md).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, NoReturn

import click

from ..errors import KVDataError
from . import cache, compact, data, doctor, imports, imports_arrow, imports_formats, merge  # noqa: F401 (imports_arrow, imports_formats: more `import` kinds)
from .output import error, fail

__all__ = ["main"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# click >= 8.2 raises this for a group run without a command (8.1 printed the help and exited 0)
_NO_ARGS: type[Exception] | None = getattr(click.exceptions, "NoArgsIsHelpError", None)


def _is_broken_pipe(e: BaseException) -> bool:
    return isinstance(e, BrokenPipeError) or (isinstance(e, OSError) and e.errno == errno.EPIPE)


def _pipe_closed() -> NoReturn:
    """stdout's reader went away (`kvdata ls X | head -1`): stop quietly with exit 0, stdout
    pointed at /dev/null so that flushing what is left at exit cannot fail again
    (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    sys.exit(0)


def _after_interrupt(e: BaseException) -> bool:
    """True when `e` was raised while a KeyboardInterrupt was being handled (cleanup that a
    Ctrl-C cut short failed in turn, e.g. a BufferError closing a map a frame still views):
    the user pressed Ctrl-C, and that is what to report."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _interrupted() -> NoReturn:
    """Ctrl-C: one line, exit 130 (what was being written is discarded by whoever wrote it)."""
    click.echo("kvdata: interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)


class KVDataGroup(click.Group):
    """A click group that turns kvdata, OS and usage errors into one-line messages."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
            sys.stdout.flush()  # a closed pipe shows here at the latest, not at exit
        except click.UsageError as e:
            if _NO_ARGS is not None and isinstance(e, _NO_ARGS) and e.ctx is not None:
                click.echo(e.ctx.get_help())  # `kvdata` (or `kvdata import`) alone: its help, exit 0
                sys.exit(0)
            hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            error(f"{e.format_message()}{hint}")  # bad option value, missing argument: one line, exit 2
            sys.exit(EXIT_USAGE)
        except click.ClickException as e:
            error(e.format_message())
            sys.exit(e.exit_code)
        except click.exceptions.Abort as e:
            if isinstance(e.__context__, KeyboardInterrupt):  # Ctrl-C outside a command (click's Abort)
                _interrupted()
            click.echo("kvdata: aborted", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            _interrupted()
        except OSError as e:
            if _is_broken_pipe(e):
                _pipe_closed()
            raise
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            _interrupted()
        except Exception as e:
            if _after_interrupt(e):
                _interrupted()
            if isinstance(e, KVDataError):
                fail(str(e))
            if isinstance(e, KeyError):
                fail(str(e.args[0]) if e.args else "key not found")
            if isinstance(e, OSError):
                if _is_broken_pipe(e):
                    _pipe_closed()
                where = f"{e.filename}: " if e.filename else ""
                fail(f"{where}{e.strerror or e}")
            raise


@click.group(cls=KVDataGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvdata")
def main() -> None:
    """kvdata: datasets as uncompressed LMDB shards with an O(1) memmap index."""


for _command in (*data.COMMANDS, *cache.COMMANDS, *imports.COMMANDS, *merge.COMMANDS, *compact.COMMANDS, *doctor.COMMANDS):
    main.add_command(_command)
