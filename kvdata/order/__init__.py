"""Epoch orders (numpy only), shared by the sampler and the stager: a pure function of (seed, epoch).

blocked.py: the seeded, shard-blocked order of one epoch and its split across ranks;
locality.py: the locality-aware order for many nodes, built on it. The names below were the
module kvdata.order's before it became this package, and stay importable from it.
"""

from .blocked import (
    ShardGroups,
    epoch_order,
    first_use_order,
    group_by_shard,
    index_dtype,
    planned_shard_sequence,
    rank_share,
    samples_per_rank,
    shard_permutation,
)
from .locality import (
    SlotCache,
    balance_nodes,
    exchange_rate,
    locality_node_orders,
    locality_shares,
    node_cuts,
    node_of_shards,
    shard_slots,
)

__all__ = ["ShardGroups", "SlotCache", "balance_nodes", "epoch_order", "exchange_rate", "first_use_order",
           "group_by_shard", "index_dtype", "locality_node_orders", "locality_shares", "node_cuts", "node_of_shards",
           "planned_shard_sequence", "rank_share", "samples_per_rank", "shard_permutation", "shard_slots"]
