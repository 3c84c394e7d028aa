"""The staging engine (engine.Engine): a facade over parts that each own their state.

counters.py     Counters: hits, misses, bytes, errors (each bump under their own lock)
known.py        KnownShards: the home and manifest entry of every shard a reader named
planner.py      Planner: the announced orders (ours, and other processes' published in the tiers),
                the planner thread, and the plan (policy.plan_tier) for each tier
keep_set.py     KeepSet: whole copy or record reads (policy.keep_for_next_pass), congestion
tier_stager.py  TierStager, one per tier: admission under the budget lock, eviction in policy order,
                the verified copy and its rename; Pins; private copies in memory
jobs.py         Jobs: the copies in flight, one per (tier, shard), on a pool of worker threads
engine.py       Engine: composes them; locate, stage, announce, wants_whole, maintenance, status
"""

from .engine import Engine

__all__ = ["Engine"]
