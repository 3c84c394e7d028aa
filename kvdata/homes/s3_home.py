"""S3Home: a dataset's home at s3://bucket/prefix on any S3-compatible endpoint (boto3, imported
only when such a URL is opened).

Its own module because it is the largest kind of home: recorded sha256s as object metadata,
server-side copies between buckets (CopyObject, or UploadPartCopy ranges past 5 GiB) and
uploads through boto3's transfer manager. kvdata.homes.open_home picks it for s3:// URLs.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .._util.digest import is_sha256
from ..errors import KVDataError, RemoteError
from ..format.codec import file_sha256
from .base import PART_SIZE, READ_LIMIT, Home, ObjectInfo

S3_SHA256_META = "sha256"             # an S3 object's recorded sha256: the header x-amz-meta-sha256
MAX_COPY_OBJECT = 5 << 30             # S3's CopyObject limit; larger objects are copied part by part
COPY_PART = 512 << 20                 # the size of each UploadPartCopy of a larger object
COPY_PARTS_IN_FLIGHT = 8


class S3Home(Home):
    """s3://bucket/prefix on any S3-compatible endpoint; endpoint and credentials come
    from the standard AWS environment variables and config files (AWS_ENDPOINT_URL too)."""

    record_reads = True

    writable = True

    def __init__(self, url: str, max_connections: int = 32) -> None:
        u = urllib.parse.urlparse(url)
        super().__init__(url.rstrip("/"))
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
            data = body.read(None if length < 0 else length + 1)
        finally:
            body.close()
        if length >= 0 and len(data) > length:
            raise RemoteError(f"{self.where(name)}: answered more than the {length} bytes asked for")
        return data

    def read(self, name: str, limit: int = READ_LIMIT) -> bytes:
        body = self._call(self._client.get_object, name, Range=f"bytes=0-{limit}")["Body"]
        try:
            data = body.read(limit + 1)
        finally:
            body.close()
        if len(data) > limit:
            raise RemoteError(f"{self.where(name)} holds more than the {limit}-byte limit for it")
        return data

    def sha256(self, name: str) -> str | None:
        """The sha256 push recorded as the object's metadata (x-amz-meta-sha256), read with
        one HEAD; None for a missing object or one without (or with a malformed) record.
        An S3 object's bytes and metadata are replaced together, so the record cannot go stale."""
        try:
            got = self.info(name)
        except RemoteError:
            return None
        return got.sha256 if got is not None else None

    def info(self, name: str) -> ObjectInfo | None:
        """Size, recorded sha256 and ETag from one HEAD; None for a missing object."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchKey", "NotFound"):
                return None
            raise RemoteError(f"{self.where(name)}: {code or e}") from None
        except BotoCoreError as e:
            raise RemoteError(f"{self.where(name)}: {e}") from None
        value = (head.get("Metadata") or {}).get(S3_SHA256_META)
        return ObjectInfo(int(head["ContentLength"]), value if is_sha256(value) else None, head.get("ETag"))

    def can_copy_from(self, src: Home) -> bool:
        """Any s3:// home: this process reaches every bucket through one endpoint and one set of
        credentials (the AWS settings), so the server copies between them."""
        return isinstance(src, S3Home)

    def copy_from(self, src: Home, src_name: str, name: str, info: ObjectInfo, sha256: str, *,
                  multipart_over: int = MAX_COPY_OBJECT, part_size: int = COPY_PART) -> None:
        """A server-side copy: CopyObject up to `multipart_over` bytes (S3's limit is 5 GiB), else
        a multipart upload of UploadPartCopy ranges; the copy's metadata records `sha256`. The
        source is pinned to the version `info` describes (CopySourceIfMatch its ETag), so what is
        copied is what was checked. No byte of the object passes through this process."""
        if not isinstance(src, S3Home):
            super().copy_from(src, src_name, name, info, sha256)
            return
        source = {"Bucket": src.bucket, "Key": src._key(src_name)}
        pin = {"CopySourceIfMatch": info.tag} if info.tag else {}
        meta = {S3_SHA256_META: sha256}
        if info.size <= multipart_over:
            self._call(self._client.copy_object, name, CopySource=source, MetadataDirective="REPLACE", Metadata=meta,
                       **pin)
            return
        upload = self._call(self._client.create_multipart_upload, name, Metadata=meta)["UploadId"]
        try:
            def part(n: int) -> dict[str, Any]:
                start = (n - 1) * part_size
                end = min(start + part_size, info.size) - 1
                r = self._call(self._client.upload_part_copy, name, UploadId=upload, PartNumber=n, CopySource=source,
                               CopySourceRange=f"bytes={start}-{end}", **pin)
                return {"PartNumber": n, "ETag": r["CopyPartResult"]["ETag"]}

            with ThreadPoolExecutor(COPY_PARTS_IN_FLIGHT, thread_name_prefix="kvdata-copy") as pool:
                parts = list(pool.map(part, range(1, -(-info.size // part_size) + 1)))
            self._call(self._client.complete_multipart_upload, name, UploadId=upload, MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(name), UploadId=upload)
            except Exception:  # the upload was completed, or the store is unreachable: S3 expires it
                pass
            raise

    def put_file(self, name: str, path: Path, sha256: str | None = None) -> None:
        from boto3.s3.transfer import TransferConfig
        from botocore.exceptions import BotoCoreError, ClientError

        extra: dict[str, Any] = {}
        if sha256 is not None:
            self.check_upload(name, path, sha256, file_sha256(path)[1])
            extra["Metadata"] = {S3_SHA256_META: sha256}
        try:
            self._client.upload_file(str(path), self.bucket, self._key(name), ExtraArgs=extra,
                                     Config=TransferConfig(multipart_chunksize=PART_SIZE, max_concurrency=8))
        except (ClientError, BotoCoreError, OSError) as e:
            raise RemoteError(f"{self.where(name)}: upload failed ({e})") from None
