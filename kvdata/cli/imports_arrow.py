"""`kvdata import parquet` and `kvdata import hf`: Arrow data into a dataset.

Attached to the `import` group of imports.py; the importer (and pyarrow) is imported
only when a command runs.
"""

from __future__ import annotations

from typing import Any

import click

from .imports import _write_options, changes, existing_mode, import_group
from .imports_formats import field_option
from .output import print_json

MAX_BAD_SHOWN = 20  # bad records listed on stderr by the text report (--json lists them all)


def _arrow_options(f: Any) -> Any:
    """What both commands share: columns, key, label, images, workers, --skip-bad."""
    f = field_option("column", "the label column 'label', the one image column 'image'; the --key column is "
                     "the key, not also a field")(f)
    f = click.option("--skip-bad", is_flag=True,
                     help="Leave out records that cannot be imported (listed by key) instead of failing.")(f)
    f = click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Processes that decode images (0 or 1: in-process; none with --decode none).")(f)
    f = click.option("--decode", type=click.Choice(["none", "rgb", "gray"]), default="none", show_default=True,
                     help="Store image columns as raw pixels (HWC uint8); 'none' keeps the image bytes.")(f)
    f = click.option("--image", "images", multiple=True, metavar="COLUMN",
                     help="A binary column holding image files (HF Image features, {bytes, path} columns and "
                          "binary columns whose first value is an image are found by themselves). Repeatable.")(f)
    f = click.option("--columns", metavar="A,B,...", help="Keep only these columns as fields (default: all).")(f)
    f = click.option("--label", metavar="COLUMN",
                     help="Integer column for the label, stored as the field 'label' (default: the ClassLabel "
                          "column, else an integer column named 'label', if any).")(f)
    f = click.option("--key", metavar="COLUMN", help="Column whose values are the record keys (default: generated).")(f)
    return f


def _columns(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [c.strip() for c in value.split(",") if c.strip()]


def _report(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(summary)
        return
    for b in summary["bad"][:MAX_BAD_SHOWN]:
        click.echo(f"skipped {b['key'] or '(no key)'} ({b['where']}): {b['error']}", err=True)
    if summary["skipped"] > MAX_BAD_SHOWN:
        click.echo(f"... and {summary['skipped'] - MAX_BAD_SHOWN} more skipped (--json lists them)", err=True)
    split = f" (split {summary['split']})" if summary.get("split") else ""
    click.echo(f"imported {summary['imported']} records{split} into {summary['dataset']} ({changes(summary)}; "
               f"{summary['classes']} classes, {summary['skipped']} skipped) in {summary['seconds']:.1f} s")


@import_group.command("parquet")
@click.argument("src", nargs=-1, required=True, type=click.Path(exists=True))
@click.argument("dataset", type=click.Path())
@_arrow_options
@_write_options
def import_parquet(src: tuple[str, ...], dataset: str, key: str | None, label: str | None, columns: str | None,
                   images: tuple[str, ...], decode: str, workers: int, skip_bad: bool, shard_size: str | None,
                   compress: bool, append: bool, overwrite: bool, as_json: bool, fields: tuple[str, ...]) -> None:
    """Parquet files (or directories of *.parquet): one record per row, one field per column."""
    from ..importers.arrow import import_parquet as run

    _report(run(list(src), dataset, key=key, label=label, columns=_columns(columns), images=images, decode=decode,
                workers=workers, skip_bad=skip_bad, shard_size=shard_size, compress=compress,
                existing=existing_mode(append, overwrite), fields=fields), as_json)


@import_group.command("hf")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dataset", type=click.Path())
@click.option("--split", help="The split of a saved DatasetDict (or the files named for it in a folder).")
@_arrow_options
@_write_options
def import_hf(src: str, dataset: str, split: str | None, key: str | None, label: str | None, columns: str | None,
              images: tuple[str, ...], decode: str, workers: int, skip_bad: bool, shard_size: str | None,
              compress: bool, append: bool, overwrite: bool, as_json: bool, fields: tuple[str, ...]) -> None:
    """A Hugging Face dataset saved with save_to_disk, or a folder of its Parquet/Arrow files."""
    from ..importers.arrow import import_hf as run

    _report(run(src, dataset, split=split, key=key, label=label, columns=_columns(columns), images=images,
                decode=decode, workers=workers, skip_bad=skip_bad, shard_size=shard_size, compress=compress,
                existing=existing_mode(append, overwrite), fields=fields), as_json)
