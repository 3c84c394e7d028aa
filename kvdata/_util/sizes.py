"""Parsing and printing byte sizes ("256MB", "1GiB", 4096)."""

from __future__ import annotations

import re

from ..errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, setting: str = "size") -> int:
    """Bytes from an int or a string such as "256MB" (SI) or "256MiB" (binary)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{setting}: expected a size like 256MB or 1GiB (a string) or a whole number of bytes, "
                          f"got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{setting}: must be positive, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"{setting}: cannot read {value!r}; write a size like 256MB, 64MiB or 1048576")
    exact = float(m.group(1)) * _UNITS[unit]
    if exact != int(exact) and _UNITS[unit] == 1:
        raise ConfigError(f"{setting}: {value!r} is not a whole number of bytes; write e.g. 1.5MB or 1536")
    n = int(exact)
    if n <= 0:
        raise ConfigError(f"{setting}: must be positive, got {value!r}")
    return n


def format_size(n: int | float) -> str:
    """Human-readable binary size, e.g. 1.5 GiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
