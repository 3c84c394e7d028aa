"""What every importer shares: the summary it returns."""

from __future__ import annotations

import os
import time
from typing import Any


def summary(dataset: str | os.PathLike[str], imported: int, skipped: int, classes: int,
            started: float) -> dict[str, Any]:
    """The importer's result (what `kvdata import --json` prints)."""
    return {"dataset": str(dataset), "imported": imported, "skipped": skipped, "classes": classes,
            "seconds": round(time.perf_counter() - started, 3)}
