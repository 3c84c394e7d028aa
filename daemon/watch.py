"""watchdog observers: the config file and local homes' manifests. Handlers only enqueue."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from .state import Service

DEBOUNCE = 0.3


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

    def start(self) -> None:
        self._observer = Observer()
        if self.config_path is not None and self.config_path.parent.exists():
            self._observer.schedule(_Handler(self._event), str(self.config_path.parent), recursive=False)
        self._observer.daemon = True
        self._observer.start()
        self._poll = self.loop.call_later(1.0, self._sync_datasets)

    def _sync_datasets(self) -> None:
        """Watch every local home the daemon has opened (checked once a second)."""
        for loc, ds in list(self.service.datasets.items()):
            if loc not in self._watched and ds.home.local_path("") is not None and Path(loc).is_dir():
                self._observer.schedule(_Handler(self._event), loc, recursive=False)
                self._watched.add(loc)
                self._debounce(str(Path(loc) / "manifest.json"))  # a change before the watch existed
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
        self._pending[key] = self.loop.call_later(DEBOUNCE, lambda: self.loop.run_in_executor(None, fn))

    def stop(self) -> None:
        self._poll.cancel()
        for h in self._pending.values():
            h.cancel()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
