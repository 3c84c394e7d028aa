"""The daemon's state and request handling, without sockets.

`Service` builds the daemon's parts, each with explicit references to what it uses, and owns them:
the staging engine (kvdata.tiers.staging), the connected clients (clients.Clients), the datasets
open and for whom (datasets.Datasets), the shard files clients pass (passed.PassedDescriptors),
the request handlers (handlers.Handlers, which answer the requests messages.py decoded, following
docs/SECURITY.md) and the counters `kvdata status` shows.

Residency is never cached: the tier directories on disk are the truth, so a restarted
daemon serves what an earlier one staged.
"""

from __future__ import annotations

import time
from typing import Any

from kvdata.config import Config
from kvdata.tiers.staging import Engine

from .clients import Clients
from .datasets import Datasets, OpenDataset
from .handlers import Handlers, RequestCounts
from .messages import ReloadReply, Reply, Request
from .passed import MAX_HELD, PassedDescriptors
from .trust import INTERNAL, Peer, secure_tiers


class Service:
    """kvdatad without its socket: clients connect and disconnect, their decoded requests are
    handled (thread-safe: the socket loop runs blocking ones in a pool), the config is reloaded.
    `max_held_fds`: descriptors clients passed that the daemon keeps, over all connections."""

    def __init__(self, config: Config, max_held_fds: int = MAX_HELD) -> None:
        secure_tiers(config)
        self.config = config
        self.engine = Engine(config, verify_content=True, probe_open=True)  # (it never forks)
        self.started = time.time()
        self.counters = RequestCounts()
        self._clients = Clients()
        self._datasets = Datasets(config, self.engine)
        self._handlers = Handlers(config, self.engine, self._clients, self._datasets,
                                  PassedDescriptors(self._clients, max_held_fds), self.counters, self.started)

    def connect(self, cid: int, peer: Peer = INTERNAL) -> None:
        self._clients.connect(cid, peer)

    def disconnect(self, cid: int) -> None:
        """Socket closed = every claim of that client released, every descriptor it passed closed."""
        st = self._clients.disconnect(cid)
        if st is None:
            return
        for r in st.readers:
            self.engine.release(r)
        for home in st.passed.values():
            home.close()
        still = self._clients.keys_in_use()
        for key in st.using - still:  # nobody reads it now: its resident set is not kept any more
            self.engine.modes.deactivate(key)

    def handle(self, cid: int, req: Request) -> Reply:
        """The reply to a connection's request (see handlers.Handlers)."""
        return self._handlers.handle(cid, req)

    def status(self, cid: int | None = None) -> dict[str, Any]:
        """`kvdata status --json` as the connection `cid` may see it (None: the daemon itself, all)."""
        return self._handlers.status(cid).state

    def open_dataset(self, location: str, refresh: bool = False) -> OpenDataset:
        """A dataset the daemon reads itself, read again from its home if `refresh`."""
        return self._datasets.open_dataset(location, refresh)

    def local_datasets(self) -> list[str]:
        """Local datasets the daemon itself reads (watched for new generations)."""
        return self._datasets.local()

    def reload(self, config: Config) -> ReloadReply:
        """New tiers and budgets, keeping clients, datasets and announced orders."""
        secure_tiers(config)
        self.config = config
        self.engine.reconfigure(config)
        self._datasets.reconfigure(config)
        self._handlers.reconfigure(config)
        return ReloadReply(tuple(t.name for t in self.engine.tiers))

    def close(self) -> None:
        self.engine.close()
