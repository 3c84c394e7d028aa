"""The socket loop: the only daemon module that touches sockets.

One asyncio coroutine per connection, over the raw socket (recvmsg/sendmsg: frames carry
file descriptors as SCM_RIGHTS, see kvdata.protocol). Bounded and non-blocking, so one
client can slow only itself (docs/SECURITY.md):

- connections: at most `max_connections`, and `max_connections_per_uid` per uid
  (SO_PEERCRED); an excess connection gets one error frame and is closed;
- frames: the length is checked before the body is read (MAX_FRAME), a started frame
  must arrive within FRAME_TIMEOUT, decoding runs under msgpack limits, descriptors are
  bounded per frame and per connection;
- work: everything that touches a home or a disk runs in a thread pool, at most
  PER_CLIENT_BLOCKING requests per connection and PER_UID_BLOCKING per uid at a time,
  each answered within `request_timeout` (a stuck thread keeps its uid's slot until it
  returns, so a uid cannot pile up stuck threads); `status` has its own small pool;
- replies: a client that does not read them stalls only its own coroutine, and is
  dropped after DRAIN_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import grp
import itertools
import logging
import os
import socket
import stat
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvdata.errors import BadRequest, KVDataError, NotAllowed, ProtocolError
from kvdata.protocol import HEADER, MAX_FDS, MAX_FRAME, TYPES, close_fds, decode_body, encode, recv_with_fds

from .messages import (
    HelloRequest,
    Passed,
    ProgressRequest,
    ReleaseRequest,
    ReloadRequest,
    Reply,
    Request,
    StageReply,
    StageRequest,
    StatusRequest,
    decode,
)
from .state import Service
from .trust import Peer, peer_of

log = logging.getLogger("kvdatad")
DRAIN_TIMEOUT = 30.0
FRAME_TIMEOUT = 30.0        # seconds a client may take to send the rest of a frame it started
STATUS_TIMEOUT = 10.0
ON_LOOP = (HelloRequest, ReleaseRequest)   # no disk, no home: answered on the loop (and a progress passing no files)
PER_CLIENT_BLOCKING = 4     # a client's slow requests (a hung NFS home...) cannot take the whole pool
PER_UID_BLOCKING = 8        # ... nor a uid's many connections
POOL_THREADS = 32
QUEUED_FDS = 2 * MAX_FDS    # descriptors received ahead of the frames that claim them
RECV_SIZE = 1 << 16


class RequestTimeout(KVDataError):
    """A request took longer than [daemon] request_timeout; its thread finishes on its own."""


class Conn:
    """One client socket, non-blocking, read with recvmsg (descriptors queue in `fds`)."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        sock.setblocking(False)
        self.sock, self.loop = sock, loop
        self.buf = bytearray()
        self.fds: list[int] = []

    async def _ready(self, write: bool) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        fd = self.sock.fileno()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        (self.loop.add_writer if write else self.loop.add_reader)(fd, wake)
        try:
            await fut
        finally:
            (self.loop.remove_writer if write else self.loop.remove_reader)(fd)

    async def fill(self) -> bool:
        """Read what is there (waiting for it); False at end of stream."""
        while True:
            try:
                data = recv_with_fds(self.sock, RECV_SIZE, self.fds)
            except (BlockingIOError, InterruptedError):
                await self._ready(False)
                continue
            except OSError:
                return False
            if len(self.fds) > QUEUED_FDS:
                raise ProtocolError(f"more than {QUEUED_FDS} descriptors arrived ahead of the frames that claim them")
            if not data:
                return False
            self.buf += data
            return True

    async def read_exact(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not await self.fill():
                return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def send(self, data: bytes, fds: list[int] | None = None) -> None:
        view = memoryview(data)
        pending = list(fds or ())
        while view:
            try:
                if pending:
                    sent = socket.send_fds(self.sock, [view], pending)
                    pending = []
                else:
                    sent = self.sock.send(view)
                view = view[sent:]
            except (BlockingIOError, InterruptedError):
                await self._ready(True)

    def close(self) -> None:
        close_fds(self.fds)
        self.fds = []
        try:
            self.sock.close()
        except OSError:
            pass


class Server:
    def __init__(self, service: Service, path: Path, group: str | None = None,
                 reload: Callable[[], Reply] | None = None, all_users: bool = False) -> None:
        self.service, self.path, self.group, self._reload = service, Path(path), group, reload
        self.all_users = all_users
        self._pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="kvdatad-req")
        self._status_pool = ThreadPoolExecutor(2, thread_name_prefix="kvdatad-status")
        self._ids = itertools.count(1)
        self._lsock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._limits: dict[int, asyncio.Semaphore] = {}
        self._uid_limits: dict[int, asyncio.Semaphore] = {}
        self._per_uid: Counter[int] = Counter()
        self._refused_logged = 0.0
        self.refused = 0

    # ------------------------------------------------------------ listening

    async def start(self) -> None:
        shared = bool(self.group) or self.all_users
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(parents=True, exist_ok=True)
            os.chmod(parent, 0o755 if shared else 0o700)
        self._remove_stale_socket()
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            lsock.bind(str(self.path))
        except OSError:
            lsock.close()
            raise
        finally:
            os.umask(old)
        lsock.listen(1024)
        lsock.setblocking(False)
        self._lsock = lsock
        if self.group:  # members of the group may connect; the socket's permissions decide who
            gid = grp.getgrnam(self.group).gr_gid
            os.chown(self.path, -1, gid)
            os.chmod(self.path, 0o660)
        elif self.all_users:
            os.chmod(self.path, 0o666)
        else:
            os.chmod(self.path, 0o600)
        self._accepting = asyncio.create_task(self._accept_loop())
        log.info("listening on %s", self.path)

    def _remove_stale_socket(self) -> None:
        if not self.path.exists() and not self.path.is_symlink():
            return
        if self.path.is_symlink() or not stat.S_ISSOCK(self.path.lstat().st_mode):
            raise KVDataError(f"{self.path} exists and is not a socket; remove it or pass another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            self.path.unlink()  # nobody listens: a previous daemon died
            return
        finally:
            probe.close()
        raise KVDataError(f"another kvdatad already listens on {self.path}; stop it or pass --socket")

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._lsock is not None:
            self._lsock.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._status_pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._lsock is not None
        while True:
            try:
                sock, _addr = await loop.sock_accept(self._lsock)
            except OSError as e:  # EMFILE/ENFILE/ENOBUFS: back off instead of spinning
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._log_refusal(f"cannot accept connections: {e.strerror}")
                    await asyncio.sleep(0.1)
                    continue
                raise
            peer = self._admit(sock)
            if peer is None:
                continue
            task = asyncio.create_task(self._client(Conn(sock, loop), peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _admit(self, sock: socket.socket) -> Peer | None:
        """The peer, or None after one error frame if it is over a connection limit."""
        try:
            peer = peer_of(sock)
        except OSError:
            sock.close()
            return None
        cfg = self.service.config.daemon
        why = None
        if sum(self._per_uid.values()) >= cfg.max_connections:
            why = f"kvdatad has {cfg.max_connections} connections, the most it accepts (max_connections)"
        elif self._per_uid[peer.uid] >= cfg.max_connections_per_uid:
            why = (f"uid {peer.uid} has {cfg.max_connections_per_uid} connections to kvdatad, the most it accepts "
                   "(max_connections_per_uid); close some")
        if why is None:
            self._per_uid[peer.uid] += 1
            return peer
        self.refused += 1
        self._log_refusal(why)
        try:
            sock.setblocking(False)
            sock.send(encode({"id": None, "ok": False, "code": "busy", "error": why}))
        except OSError:
            pass
        sock.close()
        return None

    def _log_refusal(self, why: str) -> None:
        now = time.monotonic()
        if now - self._refused_logged > 5.0:
            self._refused_logged = now
            log.warning("refusing connections: %s (%d refused so far)", why, self.refused)

    # ------------------------------------------------------------ one connection

    async def _client(self, conn: Conn, peer: Peer) -> None:
        cid = next(self._ids)
        self.service.connect(cid, peer)
        self._limits[cid] = asyncio.Semaphore(PER_CLIENT_BLOCKING)
        try:
            while True:
                head = await conn.read_exact(HEADER.size)
                if head is None:
                    return
                (n,) = HEADER.unpack(head)
                if n > MAX_FRAME:  # refused from its header: the body is never read (nor can it be skipped)
                    self.service.counters.bad_requests += 1
                    await asyncio.wait_for(conn.send(encode({
                        "id": None, "ok": False, "code": "frame",
                        "error": f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit"})), DRAIN_TIMEOUT)
                    return
                body = await asyncio.wait_for(conn.read_exact(n), FRAME_TIMEOUT)
                if body is None:
                    return  # truncated frame: the client went away
                reply, fds = await self._dispatch(cid, peer, body, conn)
                try:
                    data = encode(reply)
                except ProtocolError as e:
                    close_fds(fds)
                    fds = []
                    data = encode({"id": reply.get("id"), "ok": False, "code": "frame", "error": str(e)})
                try:
                    await asyncio.wait_for(conn.send(data, fds), DRAIN_TIMEOUT)
                finally:
                    close_fds(fds)  # the client has its own copies now (or never will)
        except (asyncio.CancelledError, TimeoutError, ProtocolError, ConnectionError):
            pass
        except OSError as e:
            log.debug("connection %d: %s", cid, e)
        finally:
            self._limits.pop(cid, None)
            self._per_uid[peer.uid] -= 1
            if self._per_uid[peer.uid] <= 0:
                del self._per_uid[peer.uid]
            self.service.disconnect(cid)
            conn.close()

    async def _dispatch(self, cid: int, peer: Peer, body: bytes, conn: Conn) -> tuple[dict[str, Any], list[int]]:
        self.service.counters.requests += 1
        rid: Any = None
        passed = Passed([])
        try:
            try:
                msg = decode_body(body)
            except ProtocolError:
                close_fds(conn.fds)  # whatever came with a frame we cannot read is not kept
                conn.fds = []
                raise
            rid = msg.get("id")
            if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
                rid = None
                raise BadRequest("id must be an integer")
            nfds = msg.get("fds", 0)
            if not isinstance(nfds, int) or isinstance(nfds, bool) or not 0 <= nfds <= MAX_FDS:
                raise BadRequest(f"fds must be the number of descriptors passed, at most {MAX_FDS}")
            if nfds > len(conn.fds):
                close_fds(conn.fds)
                conn.fds = []
                raise BadRequest(f"the frame says {nfds} descriptors came with it; fewer did")
            passed = Passed(conn.fds[:nfds])
            del conn.fds[:nfds]
            t = msg.get("t")
            if t not in TYPES:
                raise BadRequest(f"unknown message type {t!r}; known: {', '.join(TYPES)}")
            reply = await self._handle(cid, peer, decode(t, msg, passed, peer.privileged))
            return {"id": rid, "ok": True, **reply.wire()}, reply.descriptors()
        except (BadRequest, ProtocolError, KVDataError) as e:
            self.service.counters.bad_requests += 1
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            return {"id": rid, "ok": False, "code": type(e).__name__, "error": first_line}, []
        except Exception as e:  # never let one request take the daemon down
            log.exception("request failed")
            self.service.counters.bad_requests += 1
            return {"id": rid, "ok": False, "code": "internal", "error": f"internal error: {e.__class__.__name__}: {e}"}, []
        finally:
            passed.close()

    async def _handle(self, cid: int, peer: Peer, req: Request) -> Reply:
        svc = self.service
        if isinstance(req, ON_LOOP) or (isinstance(req, ProgressRequest) and req.prefetch is None):
            return svc.handle(cid, req)
        if isinstance(req, StatusRequest):
            async with self._limits.get(cid) or asyncio.Semaphore(1):
                loop = asyncio.get_running_loop()
                return await self._bounded(loop.run_in_executor(self._status_pool, svc.handle, cid, req),
                                           STATUS_TIMEOUT)
        if isinstance(req, ReloadRequest):
            if self._reload is None:
                raise BadRequest("this daemon cannot reload")
            if not peer.privileged:
                raise NotAllowed("only root or kvdatad's own user may reload it (or send SIGHUP)")
            return await self._blocking(cid, peer, self._reload)
        reply: Reply = await self._blocking(cid, peer, svc.handle, cid, req)
        if isinstance(req, StageRequest) and req.wait and isinstance(reply, StageReply):
            await asyncio.gather(*(asyncio.wrap_future(f) for f in reply.jobs))
            reply = dataclasses.replace(reply, queued=0)
        return reply

    async def _blocking(self, cid: int, peer: Peer, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in the pool, within the connection's and the uid's share of it, answered
        within request_timeout (the thread keeps both slots until it really returns)."""
        mine = self._limits.get(cid) or asyncio.Semaphore(1)
        uid_sem = self._uid_limits.setdefault(peer.uid, asyncio.Semaphore(PER_UID_BLOCKING))
        await mine.acquire()
        try:
            await uid_sem.acquire()
        except BaseException:
            mine.release()
            raise
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(self._pool, fn, *args)
        except BaseException:
            uid_sem.release()
            mine.release()
            raise

        def done(_f: asyncio.Future[Any]) -> None:
            uid_sem.release()
            mine.release()

        fut.add_done_callback(done)
        return await self._bounded(fut, self.service.config.daemon.request_timeout)

    @staticmethod
    async def _bounded(fut: asyncio.Future[Any], timeout: float) -> Any:
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            fut.add_done_callback(_close_late_reply)
            raise RequestTimeout(f"the request took more than {timeout:.0f} s (a slow home or disk); "
                                 "it goes on without this reply") from None


def _close_late_reply(fut: asyncio.Future[Any]) -> None:
    """A reply nobody waits for any more may hold descriptors: close them."""
    if fut.cancelled() or fut.exception() is not None:
        return
    result = fut.result()
    if isinstance(result, Reply):
        close_fds(result.descriptors())
