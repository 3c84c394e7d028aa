"""Small helpers shared by the bench scripts."""

from __future__ import annotations

import os


def drop_caches() -> bool:
    """Drop the page cache (root only); False where that is not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
