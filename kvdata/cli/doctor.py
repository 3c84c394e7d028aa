"""`kvdata doctor [DATASET] [--need RATE] [--json]`: what this box can feed a job, measured
(the work is kvdata.doctor: diagnose and measure; this module parses and prints).

Exit status: 0 when the measurements ran (and with --need, the rate fits); 1 when --need
would starve, the dataset cannot be read with this config (say, a tier smaller than a shard),
or another error; 2 for a bad option value (a --need that is not a rate).
"""

from __future__ import annotations

import sys

import click

from ..errors import InvalidValueError
from .output import print_json


def _need(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """--need as samples/s, checked before anything is measured."""
    if value is None:
        return None
    from ..doctor.diagnose import parse_rate

    try:
        return parse_rate(value)
    except InvalidValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command()
@click.argument("dataset", required=False)
@click.option("--need", callback=_need, metavar="RATE",
              help="Samples/s the job consumes (20000, 20000/s or 20k/s): say whether it would starve, "
                   "which part limits it and what would fix it. Needs DATASET. Exit 1 if it would starve.")
@click.option("--json", "as_json", is_flag=True, help="Print every measurement as JSON.")
@click.option("--quick", is_flag=True, hidden=True, help="Tiny sizes (tests): the numbers mean little.")
def doctor(dataset: str | None, need: float | None, as_json: bool, quick: bool) -> None:
    """Measure memcpy, each tier's read bandwidth and, with DATASET, its home's latency and
    bandwidth and the samples/s the reader gets; with --need, whether that rate would starve.
    Takes about 10 s."""
    from ..doctor.diagnose import run_doctor, text_report
    from ..doctor.measure import FULL, QUICK

    if need is not None and dataset is None:
        raise click.UsageError("--need needs a DATASET: its bytes per sample turn the rate into bandwidth")
    on_tty = not as_json and sys.stderr.isatty()

    def say(what: str) -> None:
        if on_tty:
            click.echo(f"\rmeasuring {what} ...\x1b[K", err=True, nl=False)

    report = run_doctor(dataset, need, QUICK if quick else FULL, say=say)
    if on_tty:
        click.echo("\r\x1b[K", err=True, nl=False)
    if as_json:
        print_json(report)
    else:
        for line in text_report(report):
            click.echo(line)
    verdict = report.get("verdict")
    if (verdict is not None and not verdict["ok"]) or (report.get("dataset") or {}).get("error"):
        sys.exit(1)


COMMANDS = [doctor]
