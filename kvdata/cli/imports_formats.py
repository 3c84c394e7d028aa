"""`kvdata import wds|tfrecord`: record-format importers, attached to the `import` group.

Same conventions as imports.py: the importers are imported only when a command runs;
--workers, --json (the importer summary, plus "bad": records left out with --skip-bad),
a progress bar on a terminal, all-or-nothing. Records skipped with --skip-bad are also
named on stderr, one line each, so they are never silent.
"""

from __future__ import annotations

from typing import Any

import click

from .imports import _write_options, changes, existing_mode, import_group
from .output import print_json

_DECODE_HELP = "Decode image fields to raw HWC uint8 pixels (rgb or gray) so training never decodes; 'none' keeps bytes."


def _report(summary: dict[str, Any], as_json: bool) -> None:
    for bad in summary.get("bad", []):
        click.echo(f"kvdata: skipped {bad['key']!r}: {bad['where']}: {bad['error']}", err=True)
    if as_json:
        print_json(summary)
    else:
        click.echo(f"imported {summary['imported']} records into {summary['dataset']} ({changes(summary)}; "
                   f"{summary['classes']} classes, {summary['skipped']} skipped) in {summary['seconds']:.1f} s "
                   f"({summary['records_per_s']:.0f} records/s)")


def field_option(what: str, example: str) -> Any:
    """--field SRC=DST, repeatable: the one way every importer renames a source's fields."""
    return click.option("--field", "fields", multiple=True, metavar="SRC=DST",
                        help=f"Store {what} SRC as the field DST (DST '-': leave it out). Repeatable. By default "
                             f"images are the field 'image' and labels 'label' ({example}).")


def _record_options(f: Any) -> Any:
    f = click.option("--skip-bad", is_flag=True,
                     help="Leave out bad records (named on stderr and in --json) instead of failing the import.")(f)
    f = click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Processes that read and decode records (0 or 1: in-process). With --decode none "
                          "records are read in-process: handing bytes over from other processes is slower.")(f)
    f = click.option("--decode", type=click.Choice(["none", "rgb", "gray"]), default="none", show_default=True,
                     help=_DECODE_HELP)(f)
    return f


@import_group.command("wds")
@click.argument("src", nargs=-1, required=True, type=click.Path(exists=True))
@click.argument("dataset", type=click.Path())
@click.option("--max-member-size", default="256MB", show_default=True,
              help="Refuse tar members larger than this.")
@field_option("member extension", "--field seg.png=mask")
@_record_options
@_write_options
def import_wds(src: tuple[str, ...], dataset: str, max_member_size: str, decode: str, workers: int, skip_bad: bool,
               shard_size: str | None, compress: bool, append: bool, overwrite: bool, as_json: bool,
               fields: tuple[str, ...]) -> None:
    """WebDataset tar shards (files or directories of .tar): each key.ext group is one record, a field per ext
    (jpg/png/... members are the field 'image', cls the field 'label' and the label)."""
    from ..importers.wds import import_wds as run

    _report(run(list(src), dataset, decode=decode, workers=workers, skip_bad=skip_bad,
                max_member_size=max_member_size, shard_size=shard_size, compress=compress,
                existing=existing_mode(append, overwrite), fields=fields), as_json)


@import_group.command("tfrecord")
@click.argument("src", nargs=-1, required=True, type=click.Path(exists=True))
@click.argument("dataset", type=click.Path())
@click.option("--key", "key_feature", metavar="FEATURE",
              help="Feature holding each record's key (default: FILE/RECORD_NUMBER).")
@click.option("--max-record-size", default="256MB", show_default=True, help="Refuse records larger than this.")
@field_option("feature", "--field image/object/bbox=boxes")
@_record_options
@_write_options
def import_tfrecord(src: tuple[str, ...], dataset: str, key_feature: str | None, max_record_size: str, decode: str,
                    workers: int, skip_bad: bool, shard_size: str | None, compress: bool, append: bool,
                    overwrite: bool, as_json: bool, fields: tuple[str, ...]) -> None:
    """TFRecord files of tf.train.Example (no TensorFlow needed; CRCs checked): a field per feature
    (image/encoded is the field 'image', image/class/label the field 'label' and the label)."""
    from ..importers.tfrecord import import_tfrecord as run

    _report(run(list(src), dataset, decode=decode, key_feature=key_feature, workers=workers, skip_bad=skip_bad,
                max_record_size=max_record_size, shard_size=shard_size, compress=compress,
                existing=existing_mode(append, overwrite), fields=fields), as_json)
