"""The tiers layer: where copies of sealed shards live and how they get there.

Homes (local, s3://, http(s)://), tier directories with budgets, the pure
next-use policy, verified fetching, the staging Engine, the index mirror of
remote datasets, push, and EngineSource (the in-process ShardSource).
"""

from ..format import Manifest, ShardEntry  # the types the daemon handles, through this layer

__all__ = ["Manifest", "ShardEntry"]
