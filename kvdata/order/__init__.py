"""Epoch orders (numpy only), shared by the sampler and the stager: a pure function of (seed, epoch).

blocked.py: the seeded, shard-blocked order of one epoch and its split across ranks;
locality.py: the locality-aware order for many nodes, built on it. Import the functions from
those modules; this package re-exports nothing.
"""
