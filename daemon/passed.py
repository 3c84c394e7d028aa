"""The shard files clients pass to kvdatad (PassedDescriptors): a request's files held within
bounds (per dataset and connection, and over all connections), the proof an unprivileged peer
holds a shard's content before it gets a copy, and a request's files closed once its staging
jobs end (docs/SECURITY.md).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

from kvdata.errors import BadRequest, NotAllowed, RemoteError
from kvdata.format import ShardEntry
from kvdata.homes import Home
from kvdata.homes.local import PassedFiles
from kvdata.protocol import SHARD_KINDS
from kvdata.tiers.fetch import content_matches

from .clients import Clients
from .datasets import OpenDataset
from .messages import Passed, ShardFile

HELD_PER_DATASET = 32    # descriptors of one dataset a connection's requests leave with the daemon (LRU)
PROOFS = 65536           # file identities remembered as holding a shard's content
MAX_HELD = 4096          # descriptors clients passed that the daemon keeps, over all connections (by default)


class PassedDescriptors:
    """The files `clients`' requests passed: at most `max_held` kept over all connections."""

    def __init__(self, clients: Clients, max_held: int = MAX_HELD) -> None:
        self._clients = clients
        self._max_held = max_held
        self._lock = threading.Lock()
        self._proofs: OrderedDict[tuple[int, int], tuple[int, int, int, str, str]] = OrderedDict()

    def hold(self, home: PassedFiles, entry: ShardEntry, fd: int, kind: str | None) -> None:
        """Keep a shard file a client passed (checked by PassedFiles.add), within the bounds."""
        if kind is None or kind not in SHARD_KINDS or (kind == "zst" and entry.zst is None):
            os.close(fd)
            raise BadRequest(f"kind must be one of {', '.join(SHARD_KINDS)} (zst only for a shard with a .zst copy)")
        if self._clients.held_files() >= self._max_held:
            os.close(fd)
            raise NotAllowed("kvdatad holds as many passed files as it may; the reader stages this shard itself")
        size = entry.bytes if kind == "mdb" else entry.zst.bytes  # type: ignore[union-attr]
        try:
            home.add(entry.sha256, fd, kind, size)
        except RemoteError as e:
            raise BadRequest(f"shard {entry.id} of {home.url}: {e}") from None
        home.drop_oldest(HELD_PER_DATASET)

    def take_files(self, ds: OpenDataset, home: Home, ahead: tuple[ShardFile, ...] | None,
                   fds: Passed) -> list[ShardEntry]:
        """The shard files a request passed as `ahead`, one descriptor each, held in `home` if the
        dataset is read from passed files there (else not needed: closed after the reply); their entries."""
        if ahead is None or not isinstance(home, PassedFiles):
            return []
        out = []
        for item in ahead:
            e = ds.entry(item.shard)
            self.hold(home, e, fds.take(), item.kind)
            out.append(e)
        return out

    def prove(self, home: PassedFiles, entry: ShardEntry) -> None:
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
