"""The hermetic environment: what kvdata reads from the environment, pointed into a temp dir.

Where kvdata looks (read these before changing the list):

- kvdata/config.py: $KVDATA_CONFIG, else $XDG_CONFIG_HOME/kvdata/kvdata.toml, else
  ~/.config/kvdata/kvdata.toml (HOME); with no file, one cache tier under
  $XDG_CACHE_HOME/kvdata, else ~/.cache/kvdata; "~" in tier and socket paths (HOME).
- kvdata/protocol.py: $KVDATA_SOCKET, else the config's [daemon] socket, else
  $XDG_RUNTIME_DIR/kvdata/kvdatad.sock, else /run/kvdata/kvdatad.sock. With
  XDG_RUNTIME_DIR set to an empty temp dir a daemon running on the machine is never found.
- kvdata/tiers/s3_home.py: $KVDATA_S3_ADDRESSING; boto3 reads AWS_* and ~/.aws.
- daemon/__main__.py: NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID (systemd); LISTEN_* too.

Subprocesses that tests start inherit os.environ (or build their env from it), so they
are isolated the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# pointed at directories of their own under the test's temp dir
DIRS = {"HOME": "home", "XDG_CONFIG_HOME": "config", "XDG_CACHE_HOME": "cache", "XDG_RUNTIME_DIR": "run"}
# removed: each would override the directories above or make a process act as a systemd service
UNSET = ("KVDATA_CONFIG", "KVDATA_SOCKET", "KVDATA_S3_ADDRESSING", "KVDATA_ZERO_COPY_COLLATE",
         "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


def isolate(mp: pytest.MonkeyPatch, root: Path) -> dict[str, Path]:
    """Point HOME and the XDG directories kvdata reads into `root`, unset the KVDATA_* and
    systemd variables; returns {variable: directory}. The directories exist (mode 0700)."""
    dirs = {var: root / name for var, name in DIRS.items()}
    for var, d in dirs.items():
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        mp.setenv(var, str(d))
    for var in UNSET:
        mp.delenv(var, raising=False)
    return dirs


def isolate_aws(mp: pytest.MonkeyPatch, root: Path) -> None:
    """No AWS setting of the developer's (profile, keys, endpoint, ~/.aws files, instance metadata)."""
    for var in [k for k in os.environ if k.startswith("AWS_")]:
        mp.delenv(var)
    mp.setenv("AWS_CONFIG_FILE", str(root / "aws-config"))
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(root / "aws-credentials"))
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
