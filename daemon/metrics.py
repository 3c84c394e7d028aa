"""Prometheus text exposition (format 0.0.4) of the daemon's status on 127.0.0.1, with no
extra dependency.

Every metric family is declared once in METRICS (name, type, labels, help) so the exposition,
docs/DAEMON.md's table and daemon/grafana-dashboard.json's test agree on one list. Names follow
Prometheus' conventions (`promtool check metrics` passes; tests/integration/test_metrics.py runs
it): a `kvdata_` prefix, base units as suffixes (`_bytes`, `_seconds`), `_total` on counters and
only on counters, `_info` for the build. Labels are bounded: a tier's configured name, and a
dataset's engine key (16 hex digits, the `key` of `kvdata status --json`), never a path or URL:
the endpoint is readable by every local user, and paths are other users' business
(docs/SECURITY.md). Label values and help text are escaped anyway.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvdata.tiers import policy

from .state import Service

__all__ = ["METRICS", "Metric", "MetricsServer", "escape_label", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # "counter" | "gauge"
    help: str
    labels: tuple[str, ...] = ()


METRICS: tuple[Metric, ...] = (
    Metric("kvdata_build_info", "gauge", "Always 1; the running kvdatad's version as a label.", ("version",)),
    Metric("kvdata_start_time_seconds", "gauge", "When kvdatad started, in seconds since the Unix epoch."),
    Metric("kvdata_tier_budget_bytes", "gauge", "Byte budget of the tier.", ("tier",)),
    Metric("kvdata_tier_used_bytes", "gauge",
           "Bytes the tier holds: staged copies, temp files in flight and remote datasets' indexes.", ("tier",)),
    Metric("kvdata_tier_metadata_bytes", "gauge", "Bytes of remote datasets' manifests and indexes kept in the tier.",
           ("tier",)),
    Metric("kvdata_tier_shards", "gauge", "Staged shard copies in the tier.", ("tier",)),
    Metric("kvdata_tier_up", "gauge", "1 if the tier directory is usable, 0 if it failed (see kvdata status).",
           ("tier",)),
    Metric("kvdata_hits_total", "counter", "Shard lookups served from a staged copy in a tier."),
    Metric("kvdata_misses_total", "counter", "Shard lookups with no copy in a tier (staged, or read elsewhere)."),
    Metric("kvdata_random_misses_total", "counter",
           "Shards of random-order datasets outside their resident sets, served without being kept."),
    Metric("kvdata_home_reads_total", "counter", "Shards read in place from a local home instead of a tier."),
    Metric("kvdata_private_copies_total", "counter", "Shards no tier had room for, copied into a reader's memory."),
    Metric("kvdata_staged_shards_total", "counter", "Shard copies staged into tiers."),
    Metric("kvdata_staged_bytes_total", "counter", "Uncompressed bytes of the shard copies staged into tiers."),
    Metric("kvdata_home_read_bytes_total", "counter", "Bytes read from homes (compressed where the home has .zst)."),
    Metric("kvdata_evictions_total", "counter", "Staged copies evicted to make room."),
    Metric("kvdata_staging_in_flight", "gauge", "Staging jobs queued or running."),
    Metric("kvdata_staging_queued", "gauge", "Staging jobs waiting for a free staging worker."),
    Metric("kvdata_staging_workers", "gauge", "Staging worker threads."),
    Metric("kvdata_staging_wait_seconds_total", "counter",
           "Seconds kvdatad's handlers waited for a shard a reader needed to be staged."),
    Metric("kvdata_reader_stall_seconds_total", "counter",
           "Seconds readers reported waiting for shards, over every client since start."),
    Metric("kvdata_clients_connected", "gauge", "Clients connected to the socket."),
    Metric("kvdata_readers_connected", "gauge", "Readers (sampler streams) of the connected clients."),
    Metric("kvdata_requests_total", "counter", "Requests handled."),
    Metric("kvdata_bad_requests_total", "counter", "Requests refused as malformed or not allowed."),
    Metric("kvdata_errors_total", "counter", "Staging and planning errors (the last ones: kvdata status)."),
    Metric("kvdata_dataset_bytes", "gauge", "Bytes of the shards of a dataset being read.", ("dataset",)),
    Metric("kvdata_dataset_random_order", "gauge",
           "1 if a dataset is read in random (unannounced) order, 0 if shard-aware.", ("dataset",)),
    Metric("kvdata_dataset_resident_budget_bytes", "gauge",
           "Bytes of the tiers a random-order dataset's resident set may take.", ("dataset",)),
    Metric("kvdata_dataset_resident_bytes", "gauge", "Bytes of a random-order dataset's resident set.", ("dataset",)),
    Metric("kvdata_dataset_resident_shards", "gauge", "Shards in a random-order dataset's resident set.", ("dataset",)),
    Metric("kvdata_dataset_resident_staged_shards", "gauge",
           "Shards of a random-order dataset's resident set that have a staged copy.", ("dataset",)),
)


def escape_label(value: str) -> str:
    """A label value as the text format wants it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _value(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _samples(st: dict[str, Any], started: float | None, version: str) -> dict[str, list[tuple[tuple[str, ...], float]]]:
    """{metric name: [(label values, value)]} from a Service.status() dict."""
    out: dict[str, list[tuple[tuple[str, ...], float]]] = {m.name: [] for m in METRICS}

    def one(name: str, value: Any, labels: tuple[str, ...] = ()) -> None:
        if value is not None:
            out[name].append((labels, value))

    one("kvdata_build_info", 1, (version,))
    one("kvdata_start_time_seconds", started if started is not None else time.time() - st.get("uptime_seconds", 0))
    for t in st["tiers"]:
        name = (str(t["name"]),)
        one("kvdata_tier_budget_bytes", t["budget"], name)
        one("kvdata_tier_used_bytes", t["used"], name)
        one("kvdata_tier_metadata_bytes", t.get("metadata", 0), name)
        one("kvdata_tier_shards", t["shards"], name)
        one("kvdata_tier_up", 0 if t.get("problem") else 1, name)
    for metric, key in (("kvdata_hits_total", "hits"), ("kvdata_misses_total", "misses"),
                        ("kvdata_random_misses_total", "random_misses"), ("kvdata_home_reads_total", "home_reads"),
                        ("kvdata_private_copies_total", "private_copies"),
                        ("kvdata_staged_shards_total", "shards_staged"), ("kvdata_staged_bytes_total", "bytes_staged"),
                        ("kvdata_home_read_bytes_total", "bytes_from_home"), ("kvdata_evictions_total", "evictions"),
                        ("kvdata_staging_in_flight", "in_flight"), ("kvdata_staging_workers", "workers"),
                        ("kvdata_staging_wait_seconds_total", "stall_seconds"),
                        ("kvdata_reader_stall_seconds_total", "reader_stall_seconds_total"),
                        ("kvdata_clients_connected", "connected_clients"), ("kvdata_requests_total", "requests"),
                        ("kvdata_bad_requests_total", "bad_requests"), ("kvdata_errors_total", "error_count")):
        one(metric, st.get(key))
    if st.get("workers") is not None:  # a job beyond the workers' count waits in the pool's queue
        one("kvdata_staging_queued", max(0, int(st["in_flight"]) - int(st["workers"])))
    one("kvdata_readers_connected", sum(int(c.get("readers", 0)) for c in st.get("clients", [])))
    seen: set[str] = set()
    for d in st.get("datasets", []):
        key = d.get("key")
        if not key or key in seen:  # one dataset opened by two names (a path and a URL): one series
            continue
        seen.add(key)
        label = (str(key),)
        one("kvdata_dataset_bytes", d.get("bytes"), label)
        if d.get("mode") is None:  # opened, not being read now
            continue
        random = d["mode"] == policy.RANDOM
        one("kvdata_dataset_random_order", 1 if random else 0, label)
        if random:
            one("kvdata_dataset_resident_budget_bytes", d.get("resident_budget"), label)
            one("kvdata_dataset_resident_bytes", d.get("resident_bytes"), label)
            one("kvdata_dataset_resident_shards", d.get("resident_shards"), label)
            one("kvdata_dataset_resident_staged_shards", d.get("resident_staged"), label)
    return out


def render(st: dict[str, Any], started: float | None = None, version: str | None = None) -> str:
    """Service.status() dict -> Prometheus text format 0.0.4: every family of METRICS with its
    HELP and TYPE, even one with no samples now (so dashboards and alerts find the name)."""
    if version is None:
        version = _version()
    samples = _samples(st, started, version)
    lines: list[str] = []
    for m in METRICS:
        lines.append(f"# HELP {m.name} {_escape_help(m.help)}")
        lines.append(f"# TYPE {m.name} {m.kind}")
        for values, v in samples[m.name]:
            labels = ",".join(f'{k}="{escape_label(x)}"' for k, x in zip(m.labels, values))
            lines.append(f"{m.name}{{{labels}}} {_value(v)}" if labels else f"{m.name} {_value(v)}")
    return "\n".join(lines) + "\n"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvdata")
    except PackageNotFoundError:
        return "unknown"


class MetricsServer:
    """GET /metrics (or /) on 127.0.0.1:PORT, in a thread of its own; anything else is a 404."""

    def __init__(self, service: Service, port: int) -> None:
        svc = service
        version = _version()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = render(svc.status(), started=svc.started, version=version).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
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
