"""Any fsspec filesystem as a dataset home: gs://, az://, abfs://, hf://, memory://, ... .

S3 and HTTP(S) keep their dedicated homes (kvdata.tiers.homes: boto3's connection pool and
ranged GETs, one keep-alive connection per thread), which are faster than going through
fsspec; every other scheme fsspec knows is served here, with fsspec's own ranged reads
(`cat_file(path, start, end)`), so staging, record-granular reads and `kvdata push` work the
same way on it. fsspec is an optional extra (`pip install 'kvdata[fsspec]'`, plus the
scheme's own package: gcsfs, adlfs, huggingface_hub, ...); credentials come from where
that package looks for them, never from the URL.

Names are the dataset's own relative paths; anything else (absolute, '..', empty parts, NUL,
backslashes) is refused before it reaches the filesystem, so a hostile manifest cannot make
a reader touch another object of the bucket.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from ..errors import KVDataError, RemoteError
from ..format.codec import file_sha256
from .home_base import Home

#: schemes that have a dedicated home (or are local paths): never routed through fsspec
DEDICATED = frozenset({"s3", "s3a", "http", "https", "file", "local"})


def fsspec_scheme(location: str) -> str | None:
    """The URL's scheme when it is one for this home (not a dedicated one), else None."""
    if "://" not in location:
        return None
    scheme = location.split("://", 1)[0].lower()
    return None if scheme in DEDICATED or not scheme else scheme


class FsspecHome(Home):
    """A dataset at `scheme://path` on an fsspec filesystem."""

    record_reads = True   # remote: read record by record from its framed cold copies
    writable = True

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError:
            raise KVDataError(f"{url}: this home needs fsspec (and the package for its scheme): "
                              "pip install 'kvdata[fsspec]'") from None
        self.url = url.rstrip("/")
        try:
            self._fs, root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as e:  # unknown scheme, or its package is not installed
            raise KVDataError(f"{url}: fsspec cannot open this URL ({e}); install the package for its "
                              "scheme (gcsfs for gs://, adlfs for az://, huggingface_hub for hf://)") from None
        self._root = str(root).rstrip("/")

    def _path(self, name: str) -> str:
        if not isinstance(name, str) or not name or "\x00" in name or "\\" in name or name.startswith("/"):
            raise RemoteError(f"{self.url}: refusing the object name {name!r}")
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise RemoteError(f"{self.url}: refusing the object name {name!r}")
        return posixpath.join(self._root, name) if self._root else name

    def _call(self, name: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except FileNotFoundError:
            raise RemoteError(f"{self.where(name)} does not exist") from None
        except (OSError, ValueError) as e:
            raise RemoteError(f"{self.where(name)}: {e}") from None

    def size(self, name: str) -> int:
        info = self._call(name, self._fs.info, self._path(name))
        if info.get("type") not in (None, "file"):
            raise RemoteError(f"{self.where(name)} is not a file")
        return int(info["size"])

    def read_range(self, name: str, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        end = None if length < 0 else start + length
        data = self._call(name, self._fs.cat_file, self._path(name), start=start, end=end)
        if length >= 0 and len(data) > length:
            raise RemoteError(f"{self.where(name)}: answered more than the {length} bytes asked for")
        return bytes(data)

    def put_file(self, name: str, path: Path, sha256: str | None = None) -> None:
        if sha256 is not None:
            self.check_upload(name, path, sha256, file_sha256(path)[1])
        dest = self._path(name)
        parent = posixpath.dirname(dest)
        try:
            if parent:
                self._fs.makedirs(parent, exist_ok=True)
            self._fs.put_file(str(path), dest)
        except (OSError, ValueError) as e:
            raise RemoteError(f"{self.where(name)}: upload failed ({e})") from None

    def close(self) -> None:
        pass
