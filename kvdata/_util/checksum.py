"""The records' crc32, as fast as this machine computes it.

Every record carries a crc32 (zlib's polynomial) of its bytes, computed on every put and checked
by `verify` and by record reads from a home. zlib's crc32 runs at about 5-6 GB/s, which is 27 us
of a 151 KB image's ~240 us write; ISA-L's (python-isal, the same function with carry-less
multiplication) runs at 80+ GB/s. Both give the same values; zlib is the fallback where isal has
no wheel.
"""

from __future__ import annotations

from collections.abc import Callable

crc32: Callable[..., int]  # crc32(data, value=0): zlib's signature
try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # pragma: no cover - platforms without an isal wheel
    from zlib import crc32 as _zlib_crc32

    crc32 = _zlib_crc32
else:
    crc32 = _isal_crc32

__all__ = ["crc32"]
