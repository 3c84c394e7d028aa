"""HTTPHome: a read-only dataset home at an http(s):// URL, read by range GETs.

Its own module because it is one kind of home with its own machinery: a keep-alive connection
per thread (all closed together), bodies never read past a limit, servers that ignore Range.
kvdata.homes.open_home picks it for http:// and https:// URLs.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import urllib.parse

from ..errors import RemoteError
from .base import READ_LIMIT, Home


class HTTPHome(Home):
    """http(s):// read-only, through range GETs on one keep-alive connection per thread."""

    record_reads = True

    def __init__(self, url: str) -> None:
        u = urllib.parse.urlparse(url)
        if not u.hostname:
            raise RemoteError(f"{url}: not a valid HTTP URL")
        super().__init__(url.rstrip("/"))
        self._scheme, self._host, self._port = u.scheme, u.hostname, u.port
        self._base = u.path.rstrip("/")
        self._local = threading.local()
        self._open: set[http.client.HTTPConnection] = set()  # every thread's, so close() closes them all
        self._open_lock = threading.Lock()

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            if self._scheme == "https":
                c = http.client.HTTPSConnection(self._host, self._port, timeout=60, context=ssl.create_default_context())
            else:
                c = http.client.HTTPConnection(self._host, self._port, timeout=60)
            self._local.conn = c
            with self._open_lock:
                self._open.add(c)
        return c

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        self._local.conn = None
        with self._open_lock:
            self._open.discard(conn)

    def _request(self, method: str, name: str, headers: dict[str, str],
                 limit: int = READ_LIMIT) -> tuple[http.client.HTTPResponse, bytes, bool]:
        """(response, at most `limit` bytes of its body, whether more followed): a longer body
        is never read into memory (the connection is dropped with the rest unread)."""
        path = urllib.parse.quote(f"{self._base}/{name}")
        for attempt in range(3):
            conn = self._conn()
            try:
                conn.request(method, path, headers=headers)
                resp = conn.getresponse()
                body = resp.read(limit)
                more = not resp.isclosed() and bool(resp.read(1))
            except (http.client.HTTPException, OSError) as e:
                self._drop(conn)
                if attempt == 2:
                    raise RemoteError(f"{self.where(name)}: {e}") from None
                continue
            if more:  # the rest stays unread: this connection cannot be reused
                resp.close()
                self._drop(conn)
            return resp, body, more
        raise AssertionError("unreachable")

    def size(self, name: str) -> int:
        resp, _, _more = self._request("HEAD", name, {})
        if resp.status == 404:
            raise RemoteError(f"{self.where(name)} does not exist (HTTP 404)")
        length = resp.getheader("Content-Length")
        if resp.status != 200 or length is None or not length.isdigit():
            raise RemoteError(f"{self.where(name)}: HTTP {resp.status}")
        return int(length)

    def read_range(self, name: str, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        rng = f"bytes={start}-" if length < 0 else f"bytes={start}-{start + length - 1}"
        # a server that ignores Range answers the whole object: read only as far as needed
        resp, body, more = self._request("GET", name, {"Range": rng}, READ_LIMIT if length < 0 else start + length)
        if resp.status == 404:
            raise RemoteError(f"{self.where(name)} does not exist (HTTP 404)")
        if resp.status == 206:
            if more or (length >= 0 and len(body) > length):
                raise RemoteError(f"{self.where(name)}: answered more than the {length} bytes asked for")
            return body
        if resp.status == 200:  # server ignored Range
            if length < 0 and more:
                raise RemoteError(f"{self.where(name)} holds more than the {READ_LIMIT}-byte limit for one read")
            return body[start:] if length < 0 else body[start:start + length]
        raise RemoteError(f"{self.where(name)}: HTTP {resp.status}")

    def read(self, name: str, limit: int = READ_LIMIT) -> bytes:
        resp, body, more = self._request("GET", name, {"Range": f"bytes=0-{limit}"}, limit)
        if resp.status == 404:
            raise RemoteError(f"{self.where(name)} does not exist (HTTP 404)")
        if resp.status not in (200, 206):
            raise RemoteError(f"{self.where(name)}: HTTP {resp.status}")
        if more:
            raise RemoteError(f"{self.where(name)} holds more than the {limit}-byte limit for it; not read")
        return body

    def close(self) -> None:
        """Close every thread's connection (threads of a pool that staged from this home)."""
        with self._open_lock:
            conns, self._open = self._open, set()
        for c in conns:
            c.close()
        self._local = threading.local()
