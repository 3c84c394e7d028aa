"""The one rule for a sha256 named by text: 64 lowercase hex digits."""

from __future__ import annotations

import re

_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_sha256(value: object) -> bool:
    """Whether `value` is a sha256 hex digest (what names staged copies and checksums)."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None
