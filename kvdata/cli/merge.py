"""`kvdata merge PARTS... DATASET`: join datasets written in parallel into one (kvdata.store.merge)."""

from __future__ import annotations

import click

from .._util.sizes import format_size
from .output import print_json


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(), metavar="PARTS... DATASET")
@click.option("--move", is_flag=True,
              help="Remove the parts' files once DATASET is committed (their shards live on in DATASET).")
@click.option("--seal", is_flag=True,
              help="Seal a part's open tail first (a commit of that part) instead of refusing it.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def merge(paths: tuple[str, ...], move: bool, seal: bool, as_json: bool) -> None:
    """Join the datasets PARTS (in this order) into the new DATASET without copying record bytes.

    Local paths: shards are hard-linked (copied and checked where links are refused). URLs of
    parts pushed to one s3:// or fsspec home (and DATASET there): the home copies the shard
    objects itself, the manifest is written last. The index is concatenated, and keys found in
    two parts are refused with nothing written. DATASET must be new (or an empty directory);
    it appears whole or not at all."""
    if len(paths) < 2:
        raise click.UsageError("name at least one part and the new DATASET")
    from ..sync.home_merge import merge as run_merge

    summary = run_merge(paths[:-1], paths[-1], move=move, seal=seal)
    if as_json:
        print_json(summary)
        return
    if "bytes_copied_at_home" in summary:
        done = "already merged, nothing to do" if summary["already_merged"] else (
            f"{format_size(summary['bytes_copied_at_home'])} copied at the home ({summary['objects_copied']} objects, "
            f"{summary['objects_skipped']} already there), {format_size(summary['bytes_downloaded'])} read")
        click.echo(f"merged {len(summary['parts'])} parts into {summary['dataset']}: {summary['samples']} samples, "
                   f"{summary['shards']} shards, {done} in {summary['seconds']:.2f} s")
        return
    copied = f", {format_size(summary['bytes_copied'])} copied (no hard links across filesystems)" \
        if summary["bytes_copied"] else ""
    click.echo(f"merged {len(summary['parts'])} parts into {summary['dataset']}: {summary['samples']} samples, "
               f"{summary['shards']} shards, {format_size(summary['bytes_linked'])} linked{copied} "
               f"in {summary['seconds']:.2f} s")
    for part, left in summary.get("left_in_parts", {}).items():
        click.echo(f"left in {part} (not part of its dataset, not removed): {', '.join(left)}", err=True)


COMMANDS: tuple[click.Command, ...] = (merge,)
