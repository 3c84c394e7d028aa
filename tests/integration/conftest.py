"""Fixtures shared by the integration tests; the classes and functions behind them are in
tests/helpers (cli, daemon, servers). Test modules get these fixtures by name, never by
importing them from each other.

- cli / make_cli:       the installed `kvdata` script in a subprocess (helpers.cli.Cli)
- kit:                  a kvdatad work directory and the processes a test starts (helpers.daemon.Kit)
- s3_server:            moto's S3 server on 127.0.0.1 for the module (helpers.servers.S3Server)
- nginx_home:           nginx on 127.0.0.1 serving a temp directory, for the module
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers.cli import Cli
from helpers.daemon import Kit
from helpers.servers import NginxHome, S3Server, running_nginx, running_s3_server


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path)


@pytest.fixture(scope="session")
def make_cli() -> Callable[[Path], Cli]:
    """A Cli for another working directory (for module-scoped fixtures, which cannot use `cli`)."""
    return Cli


@pytest.fixture
def kit() -> Iterator[Kit]:
    """Two tiers, a config and a socket path in a short directory under /tmp (Unix socket
    paths are limited to 108 bytes); every process started through it is killed after."""
    k = Kit(Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp")))
    try:
        yield k
    finally:
        k.cleanup()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 with one bucket; the AWS environment is set for the module's tests."""
    with running_s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="module")
def nginx_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxHome]:
    """nginx serving a temp www directory on a free loopback port (skipped without nginx, except on CI)."""
    with running_nginx(tmp_path_factory.mktemp("nginx")) as home:
        yield home
