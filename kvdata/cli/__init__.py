"""The `kvdata` command line: parsing and printing only; the work is in the library.

This module holds the `main` group and its error handling: every error kvdata
raises on purpose becomes one `kvdata: error: ...` line on stderr and a non-zero
exit code, never a traceback. The commands live in one module per group:
data.py (put/get/rm/ls/info/verify/reindex/seal), cache.py (stage/evict/status/
cache ls/push), imports.py (import folder|listfile|caffe, demo), merge.py and compact.py; output.py
prints for all of them. `--json` output is stable (documented in docs/CLI.md).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from ..errors import KVDataError
from . import cache, compact, data, doctor, imports, imports_arrow, imports_formats, merge  # noqa: F401 (imports_arrow, imports_formats: more `import` kinds)
from .output import error, fail

__all__ = ["main"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class KVDataGroup(click.Group):
    """A click group that turns kvdata, OS and usage errors into one-line messages."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.UsageError as e:  # bad option value, missing argument: one line, exit 2
            hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            error(f"{e.format_message()}{hint}")
            sys.exit(EXIT_USAGE)
        except click.ClickException as e:
            error(e.format_message())
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("kvdata: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KVDataError as e:
            fail(str(e))
        except KeyError as e:
            fail(str(e.args[0]) if e.args else "key not found")
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            fail(f"{where}{e.strerror or e}")
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)


@click.group(cls=KVDataGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvdata")
def main() -> None:
    """kvdata: datasets as uncompressed LMDB shards with an O(1) memmap index."""


for _command in (*data.COMMANDS, *cache.COMMANDS, *imports.COMMANDS, *merge.COMMANDS, *compact.COMMANDS, *doctor.COMMANDS):
    main.add_command(_command)
