"""Where an import writes: what it does with a dataset that already exists, and Ctrl-C.

Existing datasets (`existing`, the CLI's --append / --overwrite). Importing into a path that
already holds a dataset is never silent:
- "refuse" (the default): the import stops with one line naming the dataset and both options,
  before anything is read or written;
- "append": only keys the dataset lacks are written ("added"); a key it already holds is
  skipped and left exactly as it is ("kept"), so appending a folder that grew adds only its new
  files. A key deleted with `kvdata rm` is not in the dataset: it comes back only if the source
  holds it (and is then counted as added). Every record written must have fields the
  dataset's records already have, with the same kind (bytes, str, int, float, bool, or an
  array of the same dtype and number of dimensions): else one line says which field differs,
  before that record is written, and nothing is committed;
- "overwrite": the dataset's contents are replaced by the source's, in one commit: every
  record it held is deleted, the source's are written (a key it held is "overwritten", a new
  one "added", one the source lacks "removed"), and its fields, classes and sample order are
  those of the new import alone. The old records' bytes stay in their shards until
  `kvdata compact` reclaims them.
Either way the import is one commit at the end: until then readers see the dataset as it was.

Ctrl-C. An import is interrupted with nothing committed: the writer discards its writes (a
dataset it created is removed again), worker processes are ended, and the KeyboardInterrupt
goes on to the caller (the CLI exits 130). Worker processes ignore SIGINT themselves
(start_pool: the terminal sends it to the whole process group), so only the parent decides,
and a worker never dies holding one of the pool's locks or half a message -- which is what
hung `Pool.terminate()` before. Once the import's commit begins (`Target.commit`,
`commit_begins`) it is too late to stop it: a Ctrl-C from then on is dropped and the import
completes and returns its summary, so an interrupted import (exit 130) always means nothing
changed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .._util.interrupts import interrupts_deferred
from ..errors import ConfigError
from ..format import names
from ..reader.open import open_dataset
from ..store import Store
from .common import numbered_classes

EXISTING = ("refuse", "append", "overwrite")
F = TypeVar("F", bound=Callable[..., Any])


# ---------------------------------------------------------------- existing datasets

def check_existing(existing: Any) -> str:
    """The `existing` setting, checked before anything is read."""
    if existing not in EXISTING:
        raise ConfigError(f"existing: must be 'refuse', 'append' or 'overwrite', not {existing!r}")
    return str(existing)


def dataset_exists(dest: str | os.PathLike[str]) -> bool:
    """True when the local path `dest` already holds a dataset (a manifest, or shards); a URL
    never does (writers refuse it anyway)."""
    path = Path(dest)
    return (path / names.MANIFEST).exists() or (path / names.SHARDS_DIR).is_dir()


def exists_message(dest: str | os.PathLike[str], records: int | None = None) -> str:
    held = "" if records is None else f" ({records} record{'' if records == 1 else 's'})"
    return (f"{dest} already holds a dataset{held}; pass --append to add only the keys it lacks, "
            "or --overwrite to replace its contents (Python: existing='append' or 'overwrite')")


def refuse_existing(dest: str | os.PathLike[str], existing: str) -> None:
    """Before a source is scanned: refuse a destination that holds a dataset unless told what to do."""
    if check_existing(existing) == "refuse" and dataset_exists(dest):
        raise ConfigError(exists_message(dest))


def _kind(v: Any) -> tuple[Any, ...]:
    """What a field value is stored as: ("array", dtype, ndim), ("bytes",), ("int",) ..."""
    if isinstance(v, np.generic):
        v = np.asarray(v)
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.ndim)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return ("bytes",)
    if isinstance(v, str):
        return ("str",)
    if v is None:
        return ("none",)
    if isinstance(v, bool):
        return ("bool",)
    if isinstance(v, int):
        return ("int",)
    if isinstance(v, float):
        return ("float",)
    return (type(v).__name__,)


def _spec_kind(spec: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The kind of a manifest field spec (None: mixed, anything goes)."""
    t = spec.get("type")
    if t == "mixed":
        return None
    if t == "array":
        shape = spec.get("shape")
        return ("array", spec.get("dtype"), None if shape is None else len(shape))
    return ("int",) if t == "uint" else (t,)


def _describe(kind: tuple[Any, ...] | None) -> str:
    if kind is None:
        return "mixed"
    if kind[0] == "array":
        dims = "" if kind[2] is None else f" {kind[2]}-d"
        return f"{kind[1]} array{dims}"
    return str(kind[0])


def _fields_text(kinds: Mapping[str, tuple[Any, ...] | None]) -> str:
    return ", ".join(f"{name}: {_describe(k)}" for name, k in kinds.items()) or "none"


# ---------------------------------------------------------------- the target

class Target:
    """An import's dataset open for writing, and what `existing` says to do with what it holds.

    The importer asks `wants(key)` before it reads or decodes a record (append skips keys the
    dataset holds), writes with `put`, and ends with `commit`; `counts()` goes into the summary."""

    def __init__(self, store: Store, dest: str | os.PathLike[str], existing: str) -> None:
        self.store = store
        self.dest = dest
        existed = store.generation > 0 or len(store) > 0
        if existed and existing == "refuse":  # made between refuse_existing and the open
            raise ConfigError(exists_message(dest, len(store)))
        self.mode = existing if existed else "new"
        self.added = self.overwritten = self.kept = 0
        self.old_keys: set[str] = set()
        self._fields: dict[str, tuple[Any, ...] | None] | None = None
        self._ok_layouts: set[tuple[Any, ...]] = set()
        if self.mode == "overwrite":
            self.old_keys = set(store.keys())
            for key in sorted(self.old_keys):
                store.delete(key)
            store.set_classes([])
            _forget_fields(store)
        elif self.mode == "append" and len(store):
            self._fields = {name: _spec_kind(spec) for name, spec in store.fields.items()}

    def wants(self, key: str) -> bool:
        """False (and counted as kept) for a key an append leaves as it is."""
        if self.mode == "append" and key in self.store:
            self.kept += 1
            return False
        return True

    def put(self, key: str, value: Any, label: int | None = None) -> None:
        if self._fields is not None:
            self._check_fields(key, value)
        if key in self.old_keys:
            self.overwritten += 1
        else:
            self.added += 1
        self.store.put(key, value, label=label)

    def _check_fields(self, key: str, value: Any) -> None:
        """Refuse a record whose fields the dataset's records do not have (append)."""
        assert self._fields is not None
        if not isinstance(value, Mapping):
            return
        kinds = {name: _kind(v) for name, v in value.items()}
        layout = tuple(kinds.items())
        if layout in self._ok_layouts:
            return
        for name, kind in kinds.items():
            if name not in self._fields:
                break
            have = self._fields[name]
            if have is None:
                continue
            if have[0] == "array" and kind[0] == "array" and have[1] == kind[1] and have[2] in (None, kind[2]):
                continue
            if have != kind:
                break
        else:
            self._ok_layouts.add(layout)
            return
        raise ConfigError(f"cannot append {key!r} to {self.dest}: its fields ({_fields_text(kinds)}) do not match "
                          f"the dataset's ({_fields_text(self._fields)}); import with the options the dataset was "
                          "made with, into a new dataset, or pass --overwrite to replace it")

    def set_classes(self, classes: Sequence[str], what: str) -> None:
        """The dataset's class names; an append refuses classes other than the ones it has."""
        old = self.store.classes
        if self.mode == "append" and old and list(old) != list(classes):
            raise ConfigError(f"{self.dest} already has classes {old[:5]}{'...' if len(old) > 5 else ''} that differ "
                              f"from {what}; import into a new dataset or pass --overwrite")
        self.store.set_classes(classes)

    def number_classes(self, labels: Iterable[int]) -> int:
        """Record classes for labels that came without names, the one way every importer does
        (kvdata.importers.common.numbered_classes): "0".."max" unless the dataset's class names
        already cover every label. Returns the number of classes the dataset then has (what the
        import's summary reports, and `kvdata info` shows)."""
        old = list(self.store.classes)
        names = numbered_classes(labels)
        if len(names) > len(old) and (not old or old == names[:len(old)]):
            self.store.set_classes(names)  # longer numbered names (an append's new labels) replace shorter
            return len(names)
        return len(old)

    def commit(self) -> int:
        """Seal and commit: the import's point of no return (commit_begins)."""
        commit_begins()
        if self.added or self.overwritten or self.old_keys:  # (an append that added nothing changes nothing)
            self.store.seal()  # a finished import is read by memory-map offset and can be staged
        return self.store.commit()

    def counts(self) -> dict[str, Any]:
        """What the summary says about the dataset's keys."""
        return {"mode": self.mode, "added": self.added, "overwritten": self.overwritten, "kept": self.kept,
                "removed": len(self.old_keys) - self.overwritten}


def _forget_fields(store: Store) -> None:
    """An overwrite's manifest lists only the fields of the records it writes, not the deleted
    ones' (a Loader takes the fields it batches from there). The store has no call for that yet,
    so the writer's schema is emptied here; every put adds its own fields back."""
    writer = store._w()
    writer.schema = {}


@contextlib.contextmanager
def open_target(dest: str | os.PathLike[str], existing: str, *, shard_size: int | str | None,
                compress: bool) -> Iterator[Target]:
    """`dest` opened for one import (mode "a"): committed only by Target.commit; any error or
    Ctrl-C before that discards every write (and removes a dataset the import created)."""
    with open_dataset(dest, "a", shard_size=shard_size, compress=compress) as store:
        try:
            yield Target(store, dest, existing)
        except BaseException:
            _discard(store)
            raise


def _discard(store: Store) -> None:
    """Return an existing dataset's files to its last commit before the writer closes without
    committing: the shards this import sealed and the tails it started are removed.
    (Writer.close(commit=False) leaves them to the next writer's recovery, which cannot tell
    them from someone else's and moves them into lost+found/; a dataset the import created is
    removed whole by close.) The store has no call for that yet, so this is the writer's own
    recovery, which removes only files that writer wrote."""
    try:
        writer = store._w()
        if writer.m.generation > 0:
            writer._fail()
    except Exception:  # noqa: BLE001 -- the import's own error is the one to report
        pass


# ---------------------------------------------------------------- Ctrl-C

_sessions: list[Any] = []  # the SIGINT handler before each import now running in the main thread


def _dropped(_signum: int, _frame: Any) -> None:
    """SIGINT once an import's commit has begun: too late to stop it, so it is dropped."""


@contextlib.contextmanager
def _session() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    _sessions.append(before)
    try:
        yield
    finally:
        _sessions.pop()
        if signal.getsignal(signal.SIGINT) is not before:
            signal.signal(signal.SIGINT, before)


def import_entry(fn: F) -> F:
    """Decorates an importer's public entry point: the SIGINT handler it had is put back when
    the import returns or raises (commit_begins may have replaced it)."""
    import functools

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _session():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def commit_begins() -> None:
    """From here on the import completes: Ctrl-C (Python's default handler) is dropped until
    the entry point returns. Outside an import_entry call it changes nothing."""
    if _sessions and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _dropped)


def _init_worker(initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
    """A pool worker's first act: ignore SIGINT (the parent handles Ctrl-C), then the pool's own initializer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer(*initargs)


def start_pool(ctx: Any, workers: int, initializer: Callable[..., None] | None = None,
               initargs: tuple[Any, ...] = ()) -> Any:
    """`ctx.Pool(workers)` whose processes ignore SIGINT. A Ctrl-C while they start is held
    (a forked worker inherits the holding handler until it ignores SIGINT), then raised with
    the pool ended."""
    pool = None
    try:
        with interrupts_deferred():
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=(initializer, initargs))
    except BaseException:
        if pool is not None:
            end_pool(pool)
        raise
    return pool


END_POOL_WAIT_S = 3.0  # how long ending a pool may take before its processes are killed


def end_pool(pool: Any) -> None:
    """Terminate a pool and wait for its processes -- but not forever. `Pool.terminate()` can
    hang for good: a worker it SIGTERMs while the worker sends a result holds the result
    queue's lock, which the pool's task-handler thread may still need (and terminate joins
    that thread). So it runs on a thread of its own; if it has not finished in
    END_POOL_WAIT_S, the workers are killed and the import goes on ending (the stuck thread
    is a daemon: it never holds the process up)."""
    done = threading.Event()

    def run() -> None:
        try:
            pool.terminate()
            pool.join()
        finally:
            done.set()

    threading.Thread(target=run, name="kvdata-end-pool", daemon=True).start()
    if not done.wait(END_POOL_WAIT_S):
        for proc in list(getattr(pool, "_pool", ())):  # (the pool's worker processes)
            with contextlib.suppress(Exception):
                proc.kill()
                proc.join(1.0)


__all__ = ["EXISTING", "Target", "open_target", "check_existing", "refuse_existing", "dataset_exists",
           "exists_message", "import_entry", "commit_begins", "start_pool", "end_pool"]
