"""What every importer shares: the summary it returns, the field names it writes, and how it
records classes.

One rule for every importer (docs/CLI.md, "Field names and classes"): a record's image is the
field `image` (its file bytes, or HWC uint8 pixels with decode="rgb"/"gray") and its label the
int field `label`, also the index label; other fields keep their source names, and `fields`
(`--field SRC=DST`, repeatable) renames any source name (DST "-" leaves it out). The dataset's
classes are the source's class names where it has them (folder directories, an HF ClassLabel),
else "0".."max label" (numbered_classes), so `kvdata info` shows the count the summary printed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError

IMAGE_FIELD = "image"
LABEL_FIELD = "label"
DROP = "-"  # --field SRC=- leaves SRC out
# Labels above this get no numbered class names (ids, not classes): the dataset then has none.
MAX_NUMBERED_CLASSES = 1 << 16


def numbered_classes(labels: Iterable[int]) -> list[str]:
    """Class names for labels that came without names: "0", "1", ... up to the largest label,
    so that classes[label] is the label's name. None ([]) with no labels, a negative label, or a
    largest label of MAX_NUMBERED_CLASSES or more."""
    top = -1
    for lb in labels:
        if lb < 0:
            return []
        top = max(top, int(lb))
    if top < 0 or top >= MAX_NUMBERED_CLASSES:
        return []
    return [str(i) for i in range(top + 1)]


def parse_fields(pairs: Sequence[str] | Mapping[str, str] | None) -> dict[str, str]:
    """`--field SRC=DST` options (or a dict) as {source name: field name}; DST "-" drops SRC."""
    if not pairs:
        return {}
    if isinstance(pairs, Mapping):
        items = [(str(k), str(v)) for k, v in pairs.items()]
    else:
        items = []
        for p in pairs:
            src, eq, dst = p.partition("=")
            if not eq or not src or not dst:
                raise ConfigError(f"--field {p!r}: write SRC=DST (e.g. --field jpg=image, or SRC=- to leave it out)")
            items.append((src, dst))
    out: dict[str, str] = {}
    for src, dst in items:
        if src in out and out[src] != dst:
            raise ConfigError(f"--field: {src!r} is mapped twice ({out[src]!r} and {dst!r}); map it once")
        out[src] = dst
    return out


def rename(value: dict[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """`value` with its fields renamed by `names` (DROP: left out); raises ValueError naming two
    source fields that would land on one name."""
    if not names:
        return value
    out: dict[str, Any] = {}
    came: dict[str, str] = {}
    for k, v in value.items():
        dst = names.get(k, k)
        if dst == DROP:
            continue
        if dst in came:
            raise ValueError(f"fields {came[dst]!r} and {k!r} would both be {dst!r}; map one elsewhere with "
                             f"--field {k}=NAME (or --field {k}=- to leave it out)")
        came[dst] = k
        out[dst] = v
    return out


def summary(dataset: str | os.PathLike[str], imported: int, skipped: int, classes: int,
            started: float, writers: int = 1, counts: dict[str, Any] | None = None) -> dict[str, Any]:
    """The importer's result (what `kvdata import --json` prints). `classes`: the classes the
    dataset has after the import (what `kvdata info` shows). `writers`: the processes that
    wrote records (1 unless the folder importer wrote parts in parallel), so every importer's
    --json has the same keys and a script can tell which path an import took. `counts`
    (target.Target.counts): "mode" (new, append or overwrite) and how many keys were "added",
    "overwritten", "kept" (an append left them as they were) and "removed" (an overwrite's
    source lacked them); without it, every record imported made a new dataset."""
    out = {"dataset": str(dataset), "imported": imported, "skipped": skipped, "classes": classes,
           "seconds": round(time.perf_counter() - started, 3), "writers": writers}
    out.update(counts if counts is not None else
               {"mode": "new", "added": imported, "overwritten": 0, "kept": 0, "removed": 0})
    return out
