"""Descriptors clients pass to kvdatad (a part of kvdata_daemon.state.Service): one request's
descriptors (Passed), a client's shard files held within bounds, the `ahead` files a request
passes, the proof an unprivileged peer holds a shard's content before it gets a copy, and a
request's files closed once its staging jobs end (docs/SECURITY.md).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvdata.errors import BadRequest, NotAllowed, RemoteError
from kvdata.protocol import MAX_FDS, SHARD_KINDS, close_fds
from kvdata.tiers import ShardEntry
from kvdata.tiers.fetch import content_matches
from kvdata.tiers.homes import Home, PassedFiles

from .service_state import OpenDataset, ServiceState

HELD_PER_DATASET = 32    # descriptors of one dataset a connection's requests leave with the daemon (LRU)
PROOFS = 65536           # file identities remembered as holding a shard's content


class Passed:
    """The descriptors that came with one request: a handler takes what it keeps, the
    server closes whatever is left after the reply."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = list(fds)

    def __len__(self) -> int:
        return len(self._fds)

    def take(self) -> int:
        return self._fds.pop(0)

    def close(self) -> None:
        close_fds(self._fds)
        self._fds = []


class PassedDescriptors(ServiceState):
    """Service's handling of the shard files clients pass."""

    def _hold(self, cid: int | None, home: PassedFiles, entry: ShardEntry, fd: int, kind: Any) -> None:
        """Keep a shard file a client passed (checked by PassedFiles.add), within the bounds."""
        if kind not in SHARD_KINDS or (kind == "zst" and entry.zst is None):
            os.close(fd)
            raise BadRequest(f"kind must be one of {', '.join(SHARD_KINDS)} (zst only for a shard with a .zst copy)")
        if self._held_total() >= self.max_held_fds:
            os.close(fd)
            raise NotAllowed("kvdatad holds as many passed files as it may; the reader stages this shard itself")
        size = entry.bytes if kind == "mdb" else entry.zst.bytes  # type: ignore[union-attr]
        try:
            home.add(entry.sha256, fd, kind, size)
        except RemoteError as e:
            raise BadRequest(f"shard {entry.id} of {home.url}: {e}") from None
        home.drop_oldest(HELD_PER_DATASET)

    def _held_total(self) -> int:
        with self._lock:
            homes = [h for c in self.clients.values() for h in c.passed.values()]
        return sum(len(h) for h in homes)

    def _take_files(self, cid: int | None, ds: OpenDataset, home: Home, msg: dict[str, Any],
                    field_name: str = "ahead") -> list[ShardEntry]:
        """Shard files passed as `ahead` [[id, kind], ...] with one descriptor each; the entries."""
        items = msg.get(field_name)
        passed: Passed = msg["_fds"]
        if items is None:
            return []
        if not isinstance(items, list) or len(items) != len(passed) or len(items) > MAX_FDS:
            raise BadRequest(f"{field_name} must be a list of [shard id, kind] pairs, one per descriptor passed")
        if not isinstance(home, PassedFiles):
            return []  # a peer the daemon reads paths for: its descriptors are not needed (closed after the reply)
        out = []
        for item in items:
            if not isinstance(item, list) or len(item) != 2:
                raise BadRequest(f"{field_name} must be a list of [shard id, kind] pairs")
            e = self._entry(ds, item[0])
            self._hold(cid, home, e, passed.take(), item[1])
            out.append(e)
        return out

    def _prove(self, home: PassedFiles, entry: ShardEntry) -> None:
        """An unprivileged peer gets a copy only of content it holds: the copy was made from
        its own passed file, or that file hashes to the shard's sha256 (remembered by the
        file's identity, so a dataset's next epoch costs nothing)."""
        got = home.open_passed(entry.sha256)
        if got is None:
            raise NotAllowed(f"shard {entry.id} of {home.url}: pass the shard's file with the request")
        fd, kind = got
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
            sig = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, kind, entry.sha256)
            with self._lock:
                known = self._proofs.get(ident) == sig
            if not known and entry.sha256 not in home.proven and not content_matches(fd, kind, entry):
                raise NotAllowed(f"shard {entry.id} of {home.url}: the file passed does not hold the content its "
                                 "manifest names; nothing was served")
            with self._lock:
                self._proofs[ident] = sig
                self._proofs.move_to_end(ident)
                while len(self._proofs) > PROOFS:
                    self._proofs.popitem(last=False)
        finally:
            os.close(fd)


def close_when_done(home: PassedFiles, futures: list[Future[Path]]) -> None:
    """Close a request's descriptors once every staging job that may read them has ended."""
    left = [len(futures)]
    lock = threading.Lock()

    def done(_f: Future[Path]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            home.close()

    if not futures:
        home.close()
    for f in futures:
        f.add_done_callback(done)
