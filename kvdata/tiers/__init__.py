"""The tiers layer: where copies of sealed shards live and how they get there.

Tier directories with budgets, the pure next-use policy, verified fetching from a home
(kvdata.homes), record-granular reads, the staging Engine, and EngineSource (the in-process
ShardSource).
"""
