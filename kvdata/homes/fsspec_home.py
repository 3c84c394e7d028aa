"""Any fsspec filesystem as a dataset home: gs://, az://, abfs://, hf://, memory://, ... .

S3 and HTTP(S) keep their dedicated homes (kvdata.homes.s3_home: boto3's connection pool;
kvdata.homes.http_home: ranged GETs, one keep-alive connection per thread), which are faster
than going through fsspec; every other scheme fsspec knows is served here, with fsspec's own
ranged reads (`cat_file(path, start, end)`), so staging, record-granular reads and
`kvdata push` work the same way on it. fsspec is an optional extra (`pip install
'kvdata[fsspec]'`, plus the scheme's own package: gcsfs, adlfs, huggingface_hub, ...);
credentials come from where that package looks for them, never from the URL.

To go through fsspec for a scheme that has a dedicated home, prefix it with `fsspec+`:
`fsspec+s3://bucket/ds.kv` is served by s3fs (its own options: endpoint, requester-pays,
anonymous access, ... from fsspec's configuration, e.g. FSSPEC_S3_ENDPOINT_URL, or the AWS
settings), `fsspec+file:///data/ds.kv` by fsspec's local filesystem. The prefix is part of the
home's URL (it names a different way to the same objects), never passed to fsspec.

Names are the dataset's own relative paths; anything else (absolute, '..', empty parts, NUL,
backslashes) is refused before it reaches the filesystem, so a hostile manifest cannot make
a reader touch another object of the bucket. On a filesystem whose writes are visible while
they happen (fsspec's local one), an upload or copy is written under a hidden temp name and
moved into place, so a partial object never has a real name; object stores publish a PUT or a
copy whole.
"""

from __future__ import annotations

import posixpath
import secrets
from pathlib import Path
from typing import Any

from ..errors import KVDataError, RemoteError
from ..format import names
from ..format.codec import file_sha256
from .base import Home, ObjectInfo

#: schemes that have a dedicated home (or are local paths): routed through fsspec only with FSSPEC_PREFIX
DEDICATED = frozenset({"s3", "s3a", "http", "https", "file", "local"})
FSSPEC_PREFIX = "fsspec+"


def fsspec_scheme(location: str) -> str | None:
    """The URL's scheme when it is one for this home (not a dedicated one, or one asked for
    with the `fsspec+` prefix), else None."""
    if "://" not in location:
        return None
    scheme = location.split("://", 1)[0].lower()
    if scheme.startswith(FSSPEC_PREFIX):
        return scheme[len(FSSPEC_PREFIX):] or None
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
        super().__init__(url.rstrip("/"))
        target = self.url[len(FSSPEC_PREFIX):] if self.url.lower().startswith(FSSPEC_PREFIX) else self.url
        try:
            self._fs, root = fsspec.core.url_to_fs(target)
        except (ImportError, ValueError) as e:  # unknown scheme, or its package is not installed
            raise KVDataError(f"{url}: fsspec cannot open this URL ({e}); install the package for its "
                              "scheme (gcsfs for gs://, adlfs for az://, huggingface_hub for hf://)") from None
        self._root = str(root).rstrip("/")
        self._in_place_writes = bool(getattr(self._fs, "local_file", False))  # see the module doc

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

    def info(self, name: str) -> ObjectInfo | None:
        """The object's size (fsspec records no sha256), or None if there is no such object."""
        try:
            got = self._fs.info(self._path(name))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise RemoteError(f"{self.where(name)}: {e}") from None
        if got.get("type") not in (None, "file"):
            raise RemoteError(f"{self.where(name)} is not a file")
        return ObjectInfo(int(got["size"]))

    def can_copy_from(self, src: Home) -> bool:
        """Another home on the same filesystem (same fsspec class and options)."""
        return isinstance(src, FsspecHome) and (src._fs is self._fs or (
            type(src._fs) is type(self._fs) and src._fs.storage_options == self._fs.storage_options))

    def copy_from(self, src: Home, src_name: str, name: str, info: ObjectInfo, sha256: str) -> None:
        """The filesystem's own copy (`cp_file`: a server-side copy on object stores); refused
        with a clear error where the filesystem has none."""
        if not isinstance(src, FsspecHome) or not self.can_copy_from(src):
            super().copy_from(src, src_name, name, info, sha256)
            return
        source = src._path(src_name)

        def copy(dest: str) -> None:
            try:
                self._fs.cp_file(source, dest)
            except NotImplementedError:
                raise KVDataError(f"{self.url}: fsspec's {type(self._fs).__name__} cannot copy objects in place; "
                                  "merge local copies of the parts and push the result") from None

        self._write(name, copy, "copy")

    def put_file(self, name: str, path: Path, sha256: str | None = None) -> None:
        if sha256 is not None:
            self.check_upload(name, path, sha256, file_sha256(path)[1])
        self._write(name, lambda dest: self._fs.put_file(str(path), dest), "upload")

    def _write(self, name: str, write: Any, what: str) -> None:
        """`write(dest)` to the object `name`: straight there on an object store; under a hidden
        temp name, then moved into place, where writes are visible while they happen."""
        dest = self._path(name)
        parent = posixpath.dirname(dest)
        tmp = posixpath.join(parent, names.temp_name(posixpath.basename(dest), secrets.token_hex(8))) \
            if self._in_place_writes else dest
        try:
            if parent:
                self._fs.makedirs(parent, exist_ok=True)
            write(tmp)
            if tmp != dest:
                self._fs.mv(tmp, dest)
        except (OSError, ValueError) as e:
            if tmp != dest:
                try:
                    self._fs.rm_file(tmp)
                except (OSError, ValueError):
                    pass
            raise RemoteError(f"{self.where(name)}: {what} failed ({e})") from None

    def close(self) -> None:
        pass
