"""Homes: where a dataset's truth lives -- a local path, s3://bucket/prefix, or http(s)://.

One small interface, chosen by URL scheme; SDKs are imported only when a URL needs
them (boto3 for s3://, the standard library for HTTP). A remote home holds the
same layout as a local dataset, with sealed shards as `.mdb.zst` only.
"""

from __future__ import annotations

import http.client
import os
import shutil
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import KVDataError, NotADatasetError, ReadOnlyError, RemoteError

PART_SIZE = 8 << 20


def is_url(path: str | os.PathLike[str]) -> bool:
    return isinstance(path, str) and ("://" in path)


class Home:
    """A dataset's home. Names are relative paths inside the dataset ("manifest.json",
    "index/samples-1.bin", "shards/000000.mdb.zst")."""

    url: str
    writable = False

    def local_path(self, name: str) -> Path | None:
        """A path that can be read in place, or None for remote homes."""
        return None

    def size(self, name: str) -> int:
        raise NotImplementedError

    def read_range(self, name: str, start: int, length: int) -> bytes:
        raise NotImplementedError

    def read(self, name: str) -> bytes:
        return self.read_range(name, 0, -1)

    def put_file(self, name: str, path: Path) -> None:
        raise ReadOnlyError(f"{self.url} is read-only; push to a local path or s3://")

    def where(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def parts(self, name: str, size: int, pool: ThreadPoolExecutor, part_size: int = PART_SIZE,
              in_flight: int = 8) -> Iterator[bytes]:
        """The object's bytes in order, fetched as concurrent ranged parts (bounded memory)."""
        starts = list(range(0, size, part_size))
        pending: list[Future[bytes]] = []
        nxt = 0
        while nxt < len(starts) or pending:
            while nxt < len(starts) and len(pending) < in_flight:
                a = starts[nxt]
                pending.append(pool.submit(self.read_range, name, a, min(part_size, size - a)))
                nxt += 1
            yield pending.pop(0).result()

    def close(self) -> None:
        pass


class LocalHome(Home):
    writable = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = Path(path)
        self.url = str(self.root)

    def local_path(self, name: str) -> Path | None:
        return self.root / name

    def size(self, name: str) -> int:
        try:
            return os.path.getsize(self.root / name)
        except FileNotFoundError:
            raise RemoteError(f"{self.root / name} is missing at the home") from None

    def read_range(self, name: str, start: int, length: int) -> bytes:
        try:
            with open(self.root / name, "rb") as f:
                f.seek(start)
                return f.read() if length < 0 else f.read(length)
        except FileNotFoundError:
            raise RemoteError(f"{self.root / name} is missing at the home") from None

    def put_file(self, name: str, path: Path) -> None:
        dest = self.root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copyfile(path, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)


class S3Home(Home):
    """s3://bucket/prefix on any S3-compatible endpoint; endpoint and credentials come
    from the standard AWS environment variables and config files (AWS_ENDPOINT_URL too)."""

    writable = True

    def __init__(self, url: str, max_connections: int = 32) -> None:
        u = urllib.parse.urlparse(url)
        self.url = url.rstrip("/")
        self.bucket = u.netloc
        self.prefix = u.path.strip("/")
        if not self.bucket:
            raise RemoteError(f"{url}: an S3 URL needs a bucket, e.g. s3://bucket/data.kv")
        try:
            import boto3
            from botocore.config import Config as BotoConfig
        except ImportError:
            raise KVDataError(f"{url}: s3:// homes need boto3: pip install 'kvdata[s3]'") from None
        cfg = BotoConfig(max_pool_connections=max_connections, retries={"max_attempts": 5, "mode": "standard"},
                         s3={"addressing_style": os.environ.get("KVDATA_S3_ADDRESSING", "auto")})
        self._client = boto3.session.Session().client("s3", config=cfg)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, fn: Callable[..., Any], name: str, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, Key=self._key(name), **kw)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchKey", "NotFound"):
                raise RemoteError(f"{self.where(name)} does not exist") from None
            raise RemoteError(f"{self.where(name)}: {code or e}") from None
        except BotoCoreError as e:
            raise RemoteError(f"{self.where(name)}: {e}") from None

    def size(self, name: str) -> int:
        return int(self._call(self._client.head_object, name)["ContentLength"])

    def read_range(self, name: str, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        rng = f"bytes={start}-" if length < 0 else f"bytes={start}-{start + length - 1}"
        body = self._call(self._client.get_object, name, Range=rng)["Body"]
        try:
            return body.read()
        finally:
            body.close()

    def put_file(self, name: str, path: Path) -> None:
        from boto3.s3.transfer import TransferConfig
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.upload_file(str(path), self.bucket, self._key(name),
                                     Config=TransferConfig(multipart_chunksize=PART_SIZE, max_concurrency=8))
        except (ClientError, BotoCoreError, OSError) as e:
            raise RemoteError(f"{self.where(name)}: upload failed ({e})") from None


class HTTPHome(Home):
    """http(s):// read-only, through range GETs on one keep-alive connection per thread."""

    def __init__(self, url: str) -> None:
        u = urllib.parse.urlparse(url)
        if not u.hostname:
            raise RemoteError(f"{url}: not a valid HTTP URL")
        self.url = url.rstrip("/")
        self._scheme, self._host, self._port = u.scheme, u.hostname, u.port
        self._base = u.path.rstrip("/")
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            if self._scheme == "https":
                c = http.client.HTTPSConnection(self._host, self._port, timeout=60, context=ssl.create_default_context())
            else:
                c = http.client.HTTPConnection(self._host, self._port, timeout=60)
            self._local.conn = c
        return c

    def _request(self, method: str, name: str, headers: dict[str, str]) -> tuple[http.client.HTTPResponse, bytes]:
        path = urllib.parse.quote(f"{self._base}/{name}")
        for attempt in range(3):
            conn = self._conn()
            try:
                conn.request(method, path, headers=headers)
                resp = conn.getresponse()
                body = resp.read()
                return resp, body
            except (http.client.HTTPException, OSError) as e:
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise RemoteError(f"{self.where(name)}: {e}") from None
        raise AssertionError("unreachable")

    def size(self, name: str) -> int:
        resp, _ = self._request("HEAD", name, {})
        if resp.status == 404:
            raise RemoteError(f"{self.where(name)} does not exist (HTTP 404)")
        length = resp.getheader("Content-Length")
        if resp.status != 200 or length is None or not length.isdigit():
            raise RemoteError(f"{self.where(name)}: HTTP {resp.status}")
        return int(length)

    def read_range(self, name: str, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        rng = f"bytes={start}-" if length < 0 else f"bytes={start}-{start + length - 1}"
        resp, body = self._request("GET", name, {"Range": rng})
        if resp.status == 404:
            raise RemoteError(f"{self.where(name)} does not exist (HTTP 404)")
        if resp.status == 206:
            return body
        if resp.status == 200:  # server ignored Range
            return body[start:] if length < 0 else body[start:start + length]
        raise RemoteError(f"{self.where(name)}: HTTP {resp.status}")

    def close(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()


def open_home(location: str | os.PathLike[str]) -> Home:
    """The Home for a path or URL."""
    s = str(location)
    if s.startswith("s3://"):
        return S3Home(s)
    if s.startswith(("http://", "https://")):
        return HTTPHome(s)
    if s.startswith("file://"):
        return LocalHome(urllib.parse.urlparse(s).path)
    if "://" in s:
        raise NotADatasetError(f"{s}: unsupported URL scheme; use a path, s3://, http:// or https://")
    return LocalHome(s)
