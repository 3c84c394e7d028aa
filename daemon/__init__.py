"""kvdatad, the kvdata cache daemon (installed as the package `kvdata_daemon`).

It runs kvdata's staging engine for every job on a box: one verified copy of
each shard, staged ahead of the orders readers announce, shared by all of them.
Readers and the CLI talk to it through kvdata.protocol.
"""
