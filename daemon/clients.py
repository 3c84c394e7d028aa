"""The connections kvdatad serves (Clients): each client's peer, its readers, the stall it reported,
the datasets it read and the shard files its requests left with the daemon (per dataset, for the
PASSED_DATASETS it used last). Thread-safe: handlers run in a pool.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvdata.errors import BadRequest
from kvdata.homes.local import PassedFiles

from .trust import INTERNAL, Peer

PASSED_DATASETS = 4      # datasets per connection with descriptors held


@dataclass
class ClientState:
    id: int
    peer: Peer = INTERNAL
    pid: int | None = None
    readers: set[str] = field(default_factory=set)  # engine keys of its readers ("cid:name")
    stall_seconds: float = 0.0
    passed: OrderedDict[str, PassedFiles] = field(default_factory=OrderedDict)  # dataset key -> descriptors
    using: set[str] = field(default_factory=set)  # engine keys of the datasets this client read


class Clients:
    """The connected clients by connection id, and the stall of those that have gone."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._by_id: dict[int, ClientState] = {}
        self._gone_stall_seconds = 0.0  # stall reported by clients that have gone (a counter with the live ones)

    def connect(self, cid: int, peer: Peer) -> None:
        with self._lock:
            self._by_id[cid] = ClientState(cid, peer, peer.pid or None)

    def disconnect(self, cid: int) -> ClientState | None:
        """The client gone (its record, for the caller to release what it held), if it was connected."""
        with self._lock:
            st = self._by_id.pop(cid, None)
            if st is not None:
                self._gone_stall_seconds += st.stall_seconds
        return st

    def get(self, cid: int | None) -> ClientState:
        """A connected client's record (None: the daemon itself, privileged); BadRequest once it has gone."""
        with self._lock:
            st = self._by_id.get(cid) if cid is not None else None
        if st is None:
            if cid is None:
                return ClientState(0)
            raise BadRequest("this connection is closing")
        return st

    def said_pid(self, cid: int, pid: int | None) -> None:
        """The pid a client's hello gave, kept if the kernel named none (another pid namespace)."""
        st = self.get(cid)
        with self._lock:
            if st.pid is None and pid is not None:
                st.pid = pid

    def add_reader(self, cid: int, reader: str) -> None:
        with self._lock:
            self.get(cid).readers.add(reader)

    def drop_reader(self, cid: int, reader: str) -> None:
        with self._lock:
            self.get(cid).readers.discard(reader)

    def reported_stall(self, cid: int, seconds: float) -> None:
        """A client's stall only grows (it reports its total): keeps the sum a counter."""
        with self._lock:
            c = self.get(cid)
            c.stall_seconds = max(c.stall_seconds, seconds)

    def reads(self, st: ClientState, key: str) -> None:
        """The client reads the dataset of engine key `key`."""
        with self._lock:
            st.using.add(key)

    def keys_in_use(self) -> set[str]:
        """The engine keys of the datasets some connected client reads."""
        with self._lock:
            return {k for c in self._by_id.values() for k in c.using}

    def passed_home(self, st: ClientState, key: str, location: str) -> PassedFiles:
        """The files this client passed for the dataset of `key` (the least recent of more than
        PASSED_DATASETS closed)."""
        with self._lock:
            home = st.passed.get(key)
            if home is None:
                home = st.passed[key] = PassedFiles(location)
                while len(st.passed) > PASSED_DATASETS:
                    _k, old = st.passed.popitem(last=False)
                    old.close()
            st.passed.move_to_end(key)
            return home

    def held_files(self) -> int:
        """Descriptors the connected clients' requests left with the daemon."""
        with self._lock:
            homes = [h for c in self._by_id.values() for h in c.passed.values()]
        return sum(len(h) for h in homes)

    def shown_to(self, peer: Peer) -> tuple[list[dict[str, Any]], float]:
        """(the clients `peer` may see, as `status` lists them; the stall every client reported since start)."""
        with self._lock:
            rows: list[dict[str, Any]] = [
                {"id": c.id, "pid": c.pid, "uid": c.peer.uid, "readers": len(c.readers), "stall_seconds": c.stall_seconds}
                for c in self._by_id.values() if peer.privileged or c.peer.uid == peer.uid]
            total = self._gone_stall_seconds + sum(c.stall_seconds for c in self._by_id.values())
        return rows, total
