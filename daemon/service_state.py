"""What the parts of the daemon's Service share (kvdata_daemon.state): the records of an open
dataset and of a connection, and ServiceState -- Service's attributes declared once (Service.__init__
sets them) with the client lookup every part uses. The parts (datasets.Datasets,
passed.PassedDescriptors) are mixins over ServiceState, so neither imports the other.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdata.config import Config
from kvdata.errors import BadRequest
from kvdata.tiers import Manifest, ShardEntry
from kvdata.tiers.homes import Home, PassedFiles
from kvdata.tiers.staging import Engine

from .trust import Peer

INTERNAL = Peer(0, 0, 0, True)


@dataclass
class OpenDataset:
    location: str
    home: Home
    root: Path
    manifest: Manifest
    owner: int | None = None          # uid whose passed manifest this is; None: read by the daemon itself
    users: set[int] = field(default_factory=set)  # uids that opened it (status shows it to these)
    staged_all: bool = False  # `kvdata stage` asked for it: keep new generations staged too
    key: str = ""             # the engine's key for its shard list (policy.dataset_key): mode, resident set


@dataclass
class ClientState:
    id: int
    peer: Peer = INTERNAL
    pid: int | None = None
    readers: set[str] = field(default_factory=set)
    stall_seconds: float = 0.0
    passed: OrderedDict[str, PassedFiles] = field(default_factory=OrderedDict)  # dataset key -> descriptors
    using: set[str] = field(default_factory=set)  # engine keys of the datasets this client read


class ServiceState:
    """The attributes of Service its parts share (set by Service.__init__), the client lookup
    they all use, and the methods one part calls that another defines (declared, not defined, here)."""

    config: Config
    engine: Engine
    _lock: threading.RLock
    datasets: dict[str, OpenDataset]
    clients: dict[int, ClientState]
    max_held_fds: int  # descriptors clients passed that the daemon keeps, over all connections
    _proofs: OrderedDict[tuple[int, int], tuple[int, int, int, str, str]]

    # defined by datasets.Datasets, called by passed.PassedDescriptors
    _entry: Callable[[OpenDataset, Any], ShardEntry]

    def _client(self, cid: int | None) -> ClientState:
        with self._lock:
            st = self.clients.get(cid) if cid is not None else None
        if st is None:
            if cid is None:
                return ClientState(0)
            raise BadRequest("this connection is closing")
        return st
