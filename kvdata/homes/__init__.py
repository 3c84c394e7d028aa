"""The homes layer: where a dataset's truth lives -- a local path, s3://bucket/prefix,
http(s)://, or any fsspec URL.

One small interface (base.Home: names relative to the dataset), chosen by URL scheme in
open_home (open.py); SDKs are imported only when a URL needs them. A remote home holds the same
layout as a local dataset, with sealed shards as `.mdb.zst` only. The local homes (a path; the
shard files a reader passes to kvdatad) are in local.py, the remote ones in s3_home.py,
http_home.py and fsspec_home.py. Homes know bytes and names (kvdata.format), not the store:
this layer sits beside kvdata.store, under the tiers that stage copies from it.
"""

from .base import Home, ObjectInfo, is_url
from .open import open_home

__all__ = ["Home", "ObjectInfo", "is_url", "open_home"]
