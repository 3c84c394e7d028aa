"""watchdog observers: the config file and local homes' manifests. Handlers only enqueue."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from .state import Service

DEBOUNCE = 0.3


STOP_WAIT = 1.0  # seconds stop() waits for the observer thread
# Only what can change a config or a manifest: with every event, a watched home that jobs read
# from (open/access/close-nowrite of each shard) keeps the observer busy for nothing.
EVENTS = [FileCreatedEvent, FileModifiedEvent, FileMovedEvent, FileClosedEvent]
# watchdog's inotify emitter logs this at ERROR when it reads one more event after stop() began
# (Observer.stop deactivates the emitter while its thread is in a read): a race inside watchdog,
# harmless at shutdown -- that event is dropped, as every later one is.
_STOPPED_EMITTER = "queue_events() called when the thread is inactive"


class _QuietStoppedEmitter(logging.Filter):
    """Demotes watchdog's 'called when the thread is inactive' (a clean stop, above) to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and _STOPPED_EMITTER in str(record.msg):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_QUIET = _QuietStoppedEmitter()
for _name in ("watchdog.observers.inotify", "watchdog.observers.inotify_buffer"):
    logging.getLogger(_name).addFilter(_QUIET)


def _schedule(observer: Any, handler: FileSystemEventHandler, path: str) -> None:
    try:  # watchdog >= 4 narrows the inotify mask to these events
        observer.schedule(handler, path, recursive=False, event_filter=EVENTS)
    except TypeError:  # watchdog 3: every event (the handler ignores the others)
        observer.schedule(handler, path, recursive=False)


class _Handler(FileSystemEventHandler):
    def __init__(self, on_path: Callable[[str], None]) -> None:
        self._on_path = on_path

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type not in ("created", "modified", "moved", "closed"):  # not opens/reads
            return
        for p in (getattr(event, "src_path", None), getattr(event, "dest_path", None)):
            if p:
                self._on_path(os.fsdecode(p))


class Watcher:
    """Reloads config on edit; refreshes a local dataset when its manifest.json is replaced
    (a new generation), so the daemon stages the new shards. Staged copies are named by
    checksum, so a rewritten dataset is never served a stale copy either way."""

    def __init__(self, loop: asyncio.AbstractEventLoop, config_path: Path | None, on_config: Callable[[], None],
                 on_dataset: Callable[[str], None], service: Service) -> None:
        self.loop, self.config_path, self.on_config, self.on_dataset = loop, config_path, on_config, on_dataset
        self.service = service
        self._observer: Any = None
        self._watched: set[str] = set()
        self._pending: dict[str, asyncio.TimerHandle] = {}
        self._lock = threading.Lock()
        self._stopped = False
        # its own threads: a home that hangs must not hold up asyncio.run's exit (default executor)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvdatad-watch")

    def start(self) -> None:
        self._observer = Observer()
        if self.config_path is not None and self.config_path.parent.exists():
            _schedule(self._observer, _Handler(self._event), str(self.config_path.parent))
        self._observer.daemon = True
        self._observer.start()
        self._poll = self.loop.call_later(1.0, self._sync_datasets)

    def _sync_datasets(self) -> None:
        """Watch every local home the daemon reads itself (checked once a second, off the loop:
        a hung home must not stall it). Datasets read from passed descriptors are not watched."""
        fut = self.loop.run_in_executor(self._pool, self._new_watches)
        fut.add_done_callback(self._watched_now)

    def _new_watches(self) -> list[str]:
        added = []
        for loc in self.service.local_datasets():
            with self._lock:  # never a new watch on an observer that stop() is stopping
                if self._stopped:
                    break
                if loc not in self._watched and Path(loc).is_dir():
                    _schedule(self._observer, _Handler(self._event), loc)
                    self._watched.add(loc)
                    added.append(loc)
        return added

    def _watched_now(self, fut: asyncio.Future[list[str]]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            for loc in fut.result():
                self._debounce(str(Path(loc) / "manifest.json"))  # a change before the watch existed
        if not self._stopped:
            self._poll = self.loop.call_later(1.0, self._sync_datasets)

    def _event(self, path: str) -> None:  # watchdog thread: only hand over to the loop
        self.loop.call_soon_threadsafe(self._debounce, path)

    def _debounce(self, path: str) -> None:
        p = Path(path)
        if self.config_path is not None and p == self.config_path:
            key, fn = "config", self.on_config
        elif p.name == "manifest.json" and str(p.parent) in self._watched:
            key, fn = str(p.parent), functools.partial(self.on_dataset, str(p.parent))
        else:
            return
        old = self._pending.pop(key, None)
        if old is not None:
            old.cancel()
        self._pending[key] = self.loop.call_later(DEBOUNCE, lambda: self.loop.run_in_executor(self._pool, fn))

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._poll.cancel()
        for h in self._pending.values():
            h.cancel()
        if self._observer is not None:
            self._observer.stop()
            # its threads are daemon threads: a shutdown waits a moment for them, not for a
            # backlog of events to drain
            self._observer.join(timeout=STOP_WAIT)
        self._pool.shutdown(wait=False, cancel_futures=True)
