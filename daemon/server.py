"""The socket loop: the only daemon module that touches sockets.

One asyncio coroutine per client: a client that sends garbage gets an error reply,
one that never reads its replies stalls only itself (and is dropped when its
unread replies pass a limit), and blocking work (staging a shard a reader needs
now, mirroring a remote index) runs in a thread pool off the loop.
"""

from __future__ import annotations

import asyncio
import grp
import itertools
import logging
import os
import socket
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvdata.errors import BadRequest, KVDataError, ProtocolError
from kvdata.protocol import HEADER, MAX_FRAME, TYPES, decode_body, encode

from .state import Service

log = logging.getLogger("kvdatad")
MAX_CLIENTS = 1024
MAX_UNREAD = 8 << 20        # bytes of replies a client may leave unread before it is dropped
DRAIN_TIMEOUT = 30.0
BLOCKING = {"open", "need", "stage", "evict"}
PER_CLIENT_BLOCKING = 4     # a client's slow requests (a hung NFS home...) cannot take the whole pool


class Server:
    def __init__(self, service: Service, path: Path, group: str | None = None,
                 reload: Callable[[], dict[str, Any]] | None = None) -> None:
        self.service, self.path, self.group, self._reload = service, Path(path), group, reload
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="kvdatad-req")
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._limits: dict[int, asyncio.Semaphore] = {}

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o755 if self.group else 0o700)
        self._remove_stale_socket()
        old = os.umask(0o177 if not self.group else 0o117)
        try:
            self._server = await asyncio.start_unix_server(self._client, path=str(self.path), limit=1 << 16)
        finally:
            os.umask(old)
        if self.group:  # members of the group may connect; the socket's permissions decide who
            gid = grp.getgrnam(self.group).gr_gid
            os.chown(self.path, -1, gid)
            os.chmod(self.path, 0o660)
        else:
            os.chmod(self.path, 0o600)
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
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        cid = next(self._ids)
        if len(self.service.clients) >= MAX_CLIENTS:
            writer.close()
            return
        self.service.connect(cid)
        limit = asyncio.Semaphore(PER_CLIENT_BLOCKING)
        self._limits[cid] = limit
        try:
            while True:
                try:
                    head = await reader.readexactly(HEADER.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                (n,) = HEADER.unpack(head)
                if n > MAX_FRAME:  # cannot resynchronize after an oversized frame: answer, then hang up
                    self.service.bad_requests += 1
                    await self._send(writer, {"id": None, "ok": False, "code": "frame",
                                              "error": f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit"})
                    return
                try:
                    body = await reader.readexactly(n)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # truncated frame: the client went away
                reply = await self._dispatch(cid, body)
                if not await self._send(writer, reply):
                    return
        except asyncio.CancelledError:
            pass
        finally:
            self._limits.pop(cid, None)
            self.service.disconnect(cid)
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def _send(self, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> bool:
        try:
            writer.write(encode(reply))
        except ProtocolError as e:
            writer.write(encode({"id": reply.get("id"), "ok": False, "code": "frame", "error": str(e)}))
        if writer.transport.get_write_buffer_size() > MAX_UNREAD:
            log.warning("dropping a client that does not read its replies")
            return False
        try:
            await asyncio.wait_for(writer.drain(), DRAIN_TIMEOUT)
        except (TimeoutError, ConnectionError):
            return False
        return True

    async def _dispatch(self, cid: int, body: bytes) -> dict[str, Any]:
        self.service.requests += 1
        rid: Any = None
        try:
            msg = decode_body(body)
            rid = msg.get("id")
            if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
                rid = None
                raise BadRequest("id must be an integer")
            t = msg.get("t")
            if t not in TYPES:
                raise BadRequest(f"unknown message type {t!r}; known: {', '.join(TYPES)}")
            result = await self._handle(cid, t, msg)
            return {"id": rid, "ok": True, **result}
        except (BadRequest, ProtocolError, KVDataError) as e:
            self.service.bad_requests += 1
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            return {"id": rid, "ok": False, "code": type(e).__name__, "error": first_line}
        except Exception as e:  # never let one request take the daemon down
            log.exception("request failed")
            self.service.bad_requests += 1
            return {"id": rid, "ok": False, "code": "internal", "error": f"internal error: {e.__class__.__name__}: {e}"}

    async def _handle(self, cid: int, t: str, msg: dict[str, Any]) -> dict[str, Any]:
        svc = self.service
        loop = asyncio.get_running_loop()
        if t == "stage":
            async with self._limits.get(cid) or asyncio.Semaphore(1):
                result, futures = await loop.run_in_executor(self._pool, svc.stage, cid, msg)
            if msg.get("wait"):
                await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
                result["queued"] = 0
            return result
        if t == "reload":
            if self._reload is None:
                raise BadRequest("this daemon cannot reload")
            return await loop.run_in_executor(self._pool, self._reload)
        handler = getattr(svc, t)
        if t in BLOCKING:
            async with self._limits.get(cid) or asyncio.Semaphore(1):
                return await loop.run_in_executor(self._pool, handler, cid, msg)
        return handler(cid, msg)
