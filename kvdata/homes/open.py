"""open_home: the Home for a path or URL, chosen by its scheme (STYLE 5: one small interface,
SDKs imported only when a URL needs them -- boto3 by s3_home, fsspec by fsspec_home).
"""

from __future__ import annotations

import os
import urllib.parse

from ..errors import NotADatasetError
from .base import Home
from .http_home import HTTPHome
from .local import LocalHome
from .s3_home import S3Home

__all__ = ["open_home"]


def open_home(location: str | os.PathLike[str]) -> Home:
    """The Home for a path or URL."""
    s = str(location)
    if s.startswith("s3://"):
        return S3Home(s)
    if s.startswith(("http://", "https://")):
        return HTTPHome(s)
    if s.startswith("file://"):
        return LocalHome(urllib.parse.urlparse(s).path)
    from .fsspec_home import FsspecHome, fsspec_scheme

    if fsspec_scheme(s) is not None:  # gs://, az://, hf://, memory://, ...: any fsspec filesystem
        return FsspecHome(s)
    if "://" in s:
        raise NotADatasetError(f"{s}: unsupported URL scheme; use a path, s3://, http(s):// or an fsspec URL")
    return LocalHome(s)
