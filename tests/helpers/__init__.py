"""Helper classes and functions for kvdata's tests (fixtures live in the conftest.py files;
the autouse guards in `guards`, a plugin tests/conftest.py loads).

tests/ is on sys.path while pytest runs (`pythonpath` in pyproject.toml's pytest section),
so test modules import these as `from helpers.daemon import ...`.

- common:  free ports, polling with a deadline
- env:     the hermetic environment every test (and every subprocess it starts) runs in
- guards:  the autouse fixtures of tests/conftest.py (a pytest plugin)
- cli:     the installed `kvdata` script run in a subprocess (Cli, Result)
- daemon:  kvdatad as a subprocess (Kit, Daemon), raw protocol sockets, the reader subprocess
- servers: moto's S3 server and nginx as local homes, tier configs and datasets for them
- forked:  work in a forked child that a test SIGKILLs in the middle (crash safety)
"""
