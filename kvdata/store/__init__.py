"""The store layer: one dataset directory, read and written in place.

`Generation` (one committed manifest + its side-index), `Reader` (the read path),
`Writer` (the single writer), `Store` (the public facade over both), plus the
shard files, the index, rebuild and verify. Tiers and staging plug in through
the `ShardSource` protocol; this layer imports nothing above `kvdata.format`.
"""

from .facade import Store
from .generation import Generation, load_generation, read_manifest
from .reader import Reader
from .source import ShardSource

__all__ = ["Store", "Generation", "load_generation", "read_manifest", "Reader", "ShardSource"]
