"""Prometheus text exposition of the daemon's status on 127.0.0.1 (no extra dependency)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .state import Service


def render(st: dict[str, Any]) -> str:
    """Status dict -> Prometheus text format 0.0.4."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP kvdata_{name} {help_}")
        lines.append(f"# TYPE kvdata_{name} {kind}")
        for labels, value in samples:
            lines.append(f"kvdata_{name}{labels} {value}")

    tiers = st["tiers"]
    metric("tier_used_bytes", "gauge", "Bytes of staged shards in the tier.",
           [(f'{{tier="{t["name"]}"}}', t["used"]) for t in tiers])
    metric("tier_budget_bytes", "gauge", "Byte budget of the tier.", [(f'{{tier="{t["name"]}"}}', t["budget"]) for t in tiers])
    metric("tier_shards", "gauge", "Staged shards in the tier.", [(f'{{tier="{t["name"]}"}}', t["shards"]) for t in tiers])
    metric("tier_ok", "gauge", "1 if the tier directory is usable.",
           [(f'{{tier="{t["name"]}"}}', 0 if t.get("problem") else 1) for t in tiers])
    metric("hits_total", "counter", "Shard lookups served from a tier.", [("", st["hits"])])
    metric("misses_total", "counter", "Shard lookups that had to stage first.", [("", st["misses"])])
    metric("hit_ratio", "gauge", "hits / lookups.", [("", st["hit_rate"] if st["hit_rate"] is not None else 0)])
    metric("shards_staged_total", "counter", "Shards staged.", [("", st["shards_staged"])])
    metric("bytes_staged_total", "counter", "Uncompressed bytes staged.", [("", st["bytes_staged"])])
    metric("bytes_from_home_total", "counter", "Bytes read from homes.", [("", st["bytes_from_home"])])
    metric("evictions_total", "counter", "Staged copies evicted.", [("", st["evictions"])])
    metric("queue_depth", "gauge", "Staging jobs queued or running.", [("", st["queue_depth"])])
    metric("stall_seconds_total", "counter", "Seconds readers waited for a shard to be staged.", [("", st["stall_seconds"])])
    metric("reader_stall_seconds", "gauge", "Stall seconds reported by connected readers.", [("", st["reader_stall_seconds"])])
    metric("connected_clients", "gauge", "Clients connected to the socket.", [("", st["connected_clients"])])
    metric("requests_total", "counter", "Requests handled.", [("", st["requests"])])
    metric("bad_requests_total", "counter", "Requests refused.", [("", st["bad_requests"])])
    return "\n".join(lines) + "\n"


class MetricsServer:
    def __init__(self, service: Service, port: int) -> None:
        svc = service

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = render(svc.status()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvdatad-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
