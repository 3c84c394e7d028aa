"""kvdatad: the cache daemon. Loads the config, logs to stderr (journald), handles signals,
talks to systemd (sd_notify READY/STOPPING/WATCHDOG), serves the socket and metrics.

    kvdatad --config FILE [--socket PATH] [--metrics-port N]

SIGTERM/SIGINT: stop accepting, abandon queued staging, let in-flight copies finish
or abort them cleanly (temp files never get real names), exit 0.
SIGHUP or an edit of the config file: reload tiers and budgets, keeping clients.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from kvdata.config import Config, load_config
from kvdata.errors import KVDataError
from kvdata.protocol import socket_path

from .messages import ReloadReply
from .metrics import MetricsServer
from .server import Server
from .state import Service
from .trust import raise_fd_limit, secure_tiers
from .watch import Watcher

log = logging.getLogger("kvdatad")
SHUTDOWN_WAIT = 5.0


def sd_notify(state: str) -> bool:
    """One datagram to $NOTIFY_SOCKET (systemd's protocol); False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("sd_notify failed: %s", e)
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvdatad", description="kvdata cache daemon: one staged copy for every job on this box")
    p.add_argument("--config", help="TOML config with [[tiers]] (default: $KVDATA_CONFIG or ~/.config/kvdata/kvdata.toml)")
    p.add_argument("--socket", help="Unix socket path (default: [daemon] socket, else $XDG_RUNTIME_DIR/kvdata/kvdatad.sock "
                                     "or /run/kvdata/kvdatad.sock)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


class Daemon:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.config_path = Path(args.config).expanduser() if args.config else None
        self.config: Config = load_config(self.config_path)
        for line in secure_tiers(self.config):
            log.warning("tier directory made private: %s", line)
        nofile = raise_fd_limit()
        # passed descriptors the daemon may hold, leaving room for connections, tiers and pools
        max_held = max(64, min(4096, (nofile - self.config.daemon.max_connections - 256) // 2))
        self.service = Service(self.config, max_held_fds=max_held)
        self.sock = Path(args.socket) if args.socket else socket_path(self.config.daemon.socket, env={
            k: v for k, v in os.environ.items() if k != "KVDATA_SOCKET"})
        self.server = Server(self.service, self.sock, self.config.daemon.group, reload=self.reload,
                             all_users=self.config.daemon.all_users)
        port = args.metrics_port if args.metrics_port is not None else self.config.daemon.metrics_port
        self.metrics = MetricsServer(self.service, port) if port else None
        self.stop_event: asyncio.Event | None = None
        self.watcher: Watcher | None = None

    def reload(self) -> ReloadReply:
        try:
            cfg = load_config(self.config_path)
        except KVDataError as e:
            log.error("reload refused: %s", e)
            raise
        result = self.service.reload(cfg)
        self.config = cfg
        log.info("reloaded config: tiers %s", ", ".join(result.tiers))
        sd_notify("STATUS=reloaded config")
        return result

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        # handlers first: a client may connect (and a supervisor send SIGTERM) the moment the
        # socket listens, before the watcher has started
        loop.add_signal_handler(signal.SIGTERM, self.stop_event.set)
        loop.add_signal_handler(signal.SIGINT, self.stop_event.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.run_in_executor(None, self._safe_reload))
        await self.server.start()
        if self.metrics is not None:
            self.metrics.start()
        self.watcher = Watcher(loop, self.config_path, self._on_config_change, self._on_dataset_change,
                               self.service)
        self.watcher.start()
        sd_notify(f"READY=1\nSTATUS=listening on {self.sock}\nMAINPID={os.getpid()}")
        pinger = asyncio.create_task(self._watchdog_pings())
        await self.stop_event.wait()
        sd_notify("STOPPING=1\nSTATUS=stopping")
        log.info("stopping")
        pinger.cancel()
        # Abort staging first: stopping the watcher can take seconds while its observer drains a
        # burst of events (reading 1,500 shard files of a watched home is one), and staging must
        # not go on meanwhile. A copy stuck in a slow read is abandoned after a bound (its temp
        # file never gets a real name and is removed at the next start), so SIGTERM always exits.
        closer = threading.Thread(target=self.service.engine.close, kwargs={"abort": True}, daemon=True)
        closer.start()
        await self.server.stop()  # the socket goes first: clients learn at once
        self.watcher.stop()
        if self.metrics is not None:
            self.metrics.stop()
        closer.join(timeout=SHUTDOWN_WAIT)
        if closer.is_alive():
            log.warning("staging did not stop within %.0f s; exiting anyway", SHUTDOWN_WAIT)
        return 0

    def _safe_reload(self) -> None:
        try:
            self.reload()
        except KVDataError:
            pass

    def _on_config_change(self) -> None:
        self._safe_reload()

    def _on_dataset_change(self, location: str) -> None:
        try:
            ds = self.service.open_dataset(location, refresh=True)
            log.info("dataset %s changed at home: now generation %s", location, ds.manifest.generation)
        except KVDataError as e:
            log.warning("dataset %s changed at home but cannot be read: %s", location, e)

    async def _watchdog_pings(self) -> None:
        usec = os.environ.get("WATCHDOG_USEC")
        if not usec or not usec.isdigit():
            return
        pid = os.environ.get("WATCHDOG_PID")
        if pid and pid.isdigit() and int(pid) != os.getpid():
            return
        interval = max(int(usec) / 2e6, 0.05)
        while True:
            sd_notify("WATCHDOG=1")
            await asyncio.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.umask(0o077)  # everything the daemon creates (tiers, copies, mirrors) is its own alone
    logging.basicConfig(stream=sys.stderr, level=args.log_level, format="kvdatad[%(process)d] %(levelname)s %(message)s")
    try:
        daemon = Daemon(args)
    except KVDataError as e:
        log.error("%s", e)
        return 1
    try:
        rc = asyncio.run(daemon.run())
    except KVDataError as e:
        log.error("%s", e)
        rc = 1
    # Staging was aborted and the socket removed; a request thread stuck on a hung home
    # (NFS, a FIFO) must not keep the process alive past SIGTERM.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
