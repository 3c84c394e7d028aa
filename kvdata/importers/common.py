"""What every importer shares: the summary it returns."""

from __future__ import annotations

import os
import time
from typing import Any


def summary(dataset: str | os.PathLike[str], imported: int, skipped: int, classes: int,
            started: float, writers: int = 1, counts: dict[str, Any] | None = None) -> dict[str, Any]:
    """The importer's result (what `kvdata import --json` prints). `writers`: the processes that
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
