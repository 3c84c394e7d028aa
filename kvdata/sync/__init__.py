"""The sync layer: a whole dataset against its home, above the tier mechanics.

mirror.py brings a remote dataset's manifest and index down (the verified local copy a reader of
a URL opens), push.py sends a local dataset up, and home_merge.py (kvdata.merge) joins parts
pushed to one home there, or hands local parts to kvdata.store.merge. What a reader stages of a
dataset's shards is the tiers' business (kvdata.tiers), the homes' bytes kvdata.homes'.
"""
