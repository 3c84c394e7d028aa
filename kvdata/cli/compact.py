"""`kvdata compact DATASET`: rewrite shards holding dead records, merge small ones (kvdata.store.compact)."""

from __future__ import annotations

import click

from .._util.sizes import format_size
from .output import print_json


@click.command()
@click.argument("dataset", type=click.Path())
@click.option("--dry-run", is_flag=True, help="Only say what would be rewritten and reclaimed; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def compact(dataset: str, dry_run: bool, as_json: bool) -> None:
    """Rewrite DATASET's shards that hold overwritten or deleted records and merge its small
    shards into shards near the shard size, as one atomic commit; report the bytes reclaimed.

    Record values are copied as they are (each one's crc32 checked); full, fully live shards
    are kept as hard links. Readers that have the dataset open keep reading their generation:
    its old files stay until they close, and the next compact or commit removes them."""
    from ..store.compact import compact as run_compact

    s = run_compact(dataset, dry_run=dry_run)
    if as_json:
        print_json(s.to_json())
        return
    if not s.compacted and not dry_run:
        freed = f"; removed {format_size(s.bytes_reclaimed)} of older generations" if s.bytes_reclaimed else ""
        click.echo(f"nothing to compact in {s.dataset}: {s.shards_before} shards, no dead records, no small shards "
                   f"to merge{freed}")
    elif dry_run:
        click.echo(f"would compact {s.dataset}: {s.shards_before} shards -> {s.shards_after} ({s.shards_kept} kept, "
                   f"{s.shards_rewritten} rewritten into {s.shards_written}), {s.records_rewritten} records copied, "
                   f"{s.records_dropped} dead records dropped; {format_size(s.bytes_before)} -> "
                   f"~{format_size(s.bytes_after)}, ~{format_size(s.bytes_reclaimed)} reclaimed")
    else:
        rate = s.bytes_copied / s.seconds / 1e6 if s.seconds > 0 else 0.0
        click.echo(f"compacted {s.dataset} (generation {s.generation_before} -> {s.generation_after}): "
                   f"{s.shards_before} shards -> {s.shards_after} ({s.shards_kept} kept, {s.shards_rewritten} "
                   f"rewritten into {s.shards_written}), {s.records_rewritten} records copied, {s.records_dropped} "
                   f"dead records dropped; {format_size(s.bytes_before)} -> {format_size(s.bytes_after)}, "
                   f"{format_size(s.bytes_reclaimed)} reclaimed in {s.seconds:.2f} s ({rate:.0f} MB/s copied)")
    if s.files_kept_for_readers:
        click.echo(f"kept for readers: {len(s.files_kept_for_readers)} files ({format_size(s.bytes_kept_for_readers)}) "
                   "of a replaced generation that open readers use; the next compact or commit removes them once "
                   "they close")


COMMANDS: tuple[click.Command, ...] = (compact,)
