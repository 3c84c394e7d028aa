"""`kvdata import folder|listfile|caffe` and `kvdata demo`: commands that build datasets.

The importers (and through them Pillow and protobuf) are imported only when a
command runs, so importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from .._util.sizes import parse_size
from ..errors import ConfigError
from .output import print_json

F = TypeVar("F", bound=Callable[..., Any])


def _check_size(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Validate --shard-size up front, naming the option as the user typed it."""
    if value is not None:
        try:
            parse_size(value, "--shard-size")
        except ConfigError as e:
            raise click.BadParameter(str(e).split(": ", 1)[-1]) from None
    return value


def _parse_resize(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        w, h = (int(x) for x in value.lower().split("x"))
        if w <= 0 or h <= 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--resize {value!r}: write WIDTHxHEIGHT, e.g. 256x256") from None
    return w, h


def _image_options(f: F) -> F:
    """How images are decoded and in what order they are written (folder and listfile)."""
    f = click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Processes that read and decode images (0: in-process); into a new dataset, each "
                          "also writes a part and the parts are merged (kvdata merge).")(f)
    f = click.option("--seed", type=int, default=0, show_default=True, help="Seed of the shuffled write order.")(f)
    f = click.option("--shuffle/--no-shuffle", default=True, show_default=True,
                     help="Write records in a seeded random order, so every shard mixes classes.")(f)
    f = click.option("--resize", metavar="WxH", help="Resize decoded images to WIDTHxHEIGHT.")(f)
    f = click.option("--decode", type=click.Choice(["none", "rgb", "gray"]), default="none", show_default=True,
                     help="Store raw pixels (HWC uint8) so training never decodes; 'none' keeps file bytes.")(f)
    return f


def _existing(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    """--append and --overwrite exclude each other (checked once both are parsed)."""
    if value:
        other = "overwrite" if param.name == "append" else "append"
        if ctx.params.get(other):
            raise click.UsageError("--append and --overwrite exclude each other; pass one", ctx=ctx)
    return value


def existing_mode(append: bool, overwrite: bool) -> str:
    """The importers' `existing` setting for --append / --overwrite."""
    return "append" if append else "overwrite" if overwrite else "refuse"


def _write_options(f: F) -> F:
    """How the dataset is written and what is printed (every importer)."""
    f = click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")(f)
    f = click.option("--overwrite", is_flag=True, callback=_existing,
                     help="DATASET exists: replace its contents with the source's (one commit; keys it held that "
                          "the source lacks are removed).")(f)
    f = click.option("--append", is_flag=True, callback=_existing,
                     help="DATASET exists: add only the keys it lacks (keys it has are kept as they are); records "
                          "must have the fields its records have.")(f)
    f = click.option("--compress/--no-compress", default=False, show_default=True,
                     help="Write each shard's .mdb.zst cold copy when it is sealed (otherwise `kvdata push` "
                          "makes them when it uploads).")(f)
    f = click.option("--shard-size", callback=_check_size,
                     help="Seal shards at this size (default: 256MB for a new dataset, else the dataset's own).")(f)
    return f


def changes(summary: dict[str, Any]) -> str:
    """What an import did to the dataset's keys, for the text report: "3 added, 0 overwritten" and,
    where there were any, the keys an append kept and an overwrite removed."""
    text = f"{summary['added']} added, {summary['overwritten']} overwritten"
    if summary.get("kept"):
        text += f", {summary['kept']} already there kept"
    if summary.get("removed"):
        text += f", {summary['removed']} removed"
    return text


def _report(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(summary)
    else:
        click.echo(f"imported {summary['imported']} images into {summary['dataset']} ({changes(summary)}; "
                   f"{summary['classes']} classes, {summary['skipped']} files skipped) in {summary['seconds']:.1f} s")


@click.group("import")
def import_group() -> None:
    """Build a dataset from a folder of images, a list file, a Caffe LMDB, Parquet, HF, WebDataset or TFRecord.

    Into a DATASET that exists, pass --append (add only new keys) or --overwrite (replace its
    contents). Ctrl-C stops an import with DATASET as it was (exit 130)."""


@import_group.command("folder")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dataset", type=click.Path())
@_image_options
@_write_options
def import_folder(src: str, dataset: str, decode: str, resize: str | None, shuffle: bool, seed: int,
                  workers: int, shard_size: str | None, compress: bool, append: bool, overwrite: bool,
                  as_json: bool) -> None:
    """One record per image under SRC; label = parent directory (ImageFolder layout)."""
    from ..importers.folder import import_folder as run

    _report(run(src, dataset, decode=decode, resize=_parse_resize(resize), shuffle=shuffle, seed=seed,
                workers=workers, shard_size=shard_size, compress=compress,
                existing=existing_mode(append, overwrite)), as_json)


@import_group.command("listfile")
@click.argument("listfile", type=click.Path(exists=True, dir_okay=False))
@click.argument("dataset", type=click.Path())
@click.option("--root", required=True, type=click.Path(exists=True, file_okay=False),
              help="Directory the list's relative paths start from.")
@_image_options
@_write_options
def import_listfile(listfile: str, dataset: str, root: str, decode: str, resize: str | None, shuffle: bool,
                    seed: int, workers: int, shard_size: str | None, compress: bool, append: bool, overwrite: bool,
                    as_json: bool) -> None:
    """Caffe convert_imageset list: one `relative/path label` per line."""
    from ..importers.folder import import_listfile as run

    _report(run(listfile, dataset, root=root, decode=decode, resize=_parse_resize(resize), shuffle=shuffle,
                seed=seed, workers=workers, shard_size=shard_size, compress=compress,
                existing=existing_mode(append, overwrite)), as_json)


@import_group.command("caffe")
@click.argument("src_lmdb", metavar="SRC_LMDB", type=click.Path(exists=True))
@click.argument("dataset", type=click.Path())
@click.option("--keep-encoded", is_flag=True, help="Store encoded records' JPEG/PNG bytes as is (field 'encoded').")
@_write_options
def import_caffe(src_lmdb: str, dataset: str, keep_encoded: bool, shard_size: str | None, compress: bool,
                 append: bool, overwrite: bool, as_json: bool) -> None:
    """Caffe LMDB of Datum records (convert_imageset): keys, order and labels kept; images HWC."""
    from ..importers.caffe import import_caffe as run

    _report(run(src_lmdb, dataset, keep_encoded=keep_encoded, shard_size=shard_size,
                compress=compress, existing=existing_mode(append, overwrite)), as_json)


@click.command()
@click.option("--dir", "workdir", type=click.Path(file_okay=False), help="Where to build (default: a temp dir).")
@click.option("--keep", is_flag=True, help="Keep the datasets instead of deleting them.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def demo(workdir: str | None, keep: bool, as_json: bool) -> None:
    """Build small datasets from real images bundled with scikit-learn and read them back fast."""
    from ..demo import run_demo

    run_demo(workdir, keep=keep, as_json=as_json)  # run_demo prints its own table or JSON


COMMANDS: tuple[click.Command, ...] = (import_group, demo)
