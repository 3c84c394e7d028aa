"""Store: the public object of one dataset, a thin facade over a Reader and (mode a/w) a Writer.

Reads see one committed generation (the one loaded at open or by the last
commit/refresh), so a reader never observes half a commit. Open one with
`kvdata.open(path_or_url, mode)`; this class reads shards in place unless it is
given a ShardSource.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ClosedError, ReadOnlyError
from ..format import Manifest, names
from . import inspection
from .generation import Generation, load_generation, load_pinned, read_manifest
from .pins import ReaderPin
from .reader import Reader
from .source import ShardSource
from .stacking import ArrayAlloc
from .writer import Writer

ITER_CHUNK = 256


class Store:
    """A kvdata dataset. Use kvdata.open() to get one; use it as a context manager."""

    def __init__(self, root: str | os.PathLike[str], mode: str = "r", *, shard_size: int | str | None = None,
                 compress: bool = False, copy_threads: int | None = None, readahead: bool = True,
                 source: ShardSource | None = None) -> None:
        if mode not in ("r", "a", "w"):
            raise ValueError(f"mode must be 'r', 'a' or 'w', not {mode!r}")
        if source is not None and mode != "r":
            raise ValueError("a ShardSource serves readers; open writers in place")
        self.root = Path(root)
        self.mode = mode
        self._closed = False
        self._closers: list[Callable[[], None]] = []
        self._source = source
        self._writer: Writer | None = None
        self._pin: ReaderPin | None = None  # mode "r": keeps the files of our incarnation (store.pins)

        def make_reader(gen: Generation) -> Reader:
            return Reader(gen, source=source, copy_threads=copy_threads, readahead=readahead)

        if mode == "r":
            self._reader = make_reader(self._load())
        else:
            self._writer = Writer(self.root, shard_size=shard_size, compress=compress, reset=(mode == "w"),
                                  make_reader=make_reader)
            assert self._writer.reader is not None
            self._reader = self._writer.reader
        if source is not None:
            self._closers.append(source.close)

    # ------------------------------------------------------------ lifecycle

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call fn when the store closes (owners of engines and homes use it)."""
        self._closers.append(fn)

    def refresh(self) -> bool:
        """Move a reader to the newest committed generation; True if it changed."""
        self._check_open()
        gen = self.generation
        if read_manifest(self.root).generation != gen:
            old = self._pin
            self._reader.load(self._load())
            if old is not None and old is not self._pin:
                old.close()  # after the reader let go of the old generation's files
        return self.generation != gen

    def _load(self) -> Generation:
        """The current generation, pinned (store.pins) where this process can pin it: a
        writer's lock already keeps compaction out, and an index mirror of a remote dataset
        (its source file beside the manifest) is never compacted in place."""
        if self._writer is not None or (self.root / names.SOURCE).exists():
            return load_generation(self.root)
        gen, self._pin = load_pinned(self.root, self._pin)
        return gen

    def close(self) -> None:
        """Commit pending writes (mode a/w) and release files. Idempotent."""
        if self._closed:
            return
        try:
            if self._writer is not None:
                self._writer.close(commit=True)
        finally:
            self._closed = True
            self._reader.close()
            if self._pin is not None:
                self._pin.close()
                self._pin = None
            closers, self._closers = self._closers, []
            for fn in closers:
                fn()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self._writer is not None:
            self._writer.close(commit=False)
            self._writer = None
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_writer", None) is not None and not getattr(self, "_closed", True):
            try:
                self._writer.close(commit=False)  # type: ignore[union-attr]
            except Exception:
                pass

    def __reduce__(self) -> tuple[Any, ...]:
        if self.mode != "r":
            raise ReadOnlyError(f"{self.root}: a store open for writing cannot be pickled; pickle a read-only one")
        return (Store, (str(self.root), "r"), None, None, None)

    def __repr__(self) -> str:
        return f"<kvdata.Store {str(self.root)!r} mode={self.mode!r} samples={len(self)} generation={self.generation}>"

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.root}: the store is closed; open it again")
        self._reader.check_fork()

    # ------------------------------------------------------------ properties

    @property
    def manifest(self) -> Manifest:
        """The loaded generation's manifest (typed; `manifest["shards"]` style access also works)."""
        return self._reader.gen.manifest

    @property
    def generation(self) -> int:
        return self._reader.gen.manifest.generation

    @property
    def source(self) -> ShardSource | None:
        """Where sealed shards come from (None: read in place)."""
        return self._source

    @property
    def home(self) -> Any:
        """The dataset's home when shards come through tiers (kvdata.homes.Home), else None."""
        return self._source.home if self._source is not None else None

    @property
    def engine(self) -> Any:
        """The stager behind the source (an Engine or the daemon stager), else None."""
        return self._source.stager if self._source is not None else None

    @property
    def classes(self) -> list[str]:
        return list(self.manifest.classes)

    @property
    def fields(self) -> dict[str, dict[str, Any]]:
        return dict(self.manifest.fields)

    @property
    def labels(self) -> np.ndarray:
        """int64 label per sample (fmt.NO_LABEL where none), a read-only view of the index."""
        return self._reader.gen.index.samples["label"]

    def shard_of(self, indices: Any) -> np.ndarray:
        """Shard id of each sample index: what samplers and the stager plan with."""
        return self._reader.gen.index.samples["shard"][np.asarray(indices, dtype=np.int64)].astype(np.int64)

    @property
    def sample_shards(self) -> np.ndarray:
        """Shard id of every sample, a read-only view of the index."""
        return self._reader.gen.index.samples["shard"]

    @property
    def max_open_shards(self) -> int | None:
        """Staged shards kept mapped at once (None: unbounded, shards read in place)."""
        return self._reader.max_open

    @max_open_shards.setter
    def max_open_shards(self, n: int | None) -> None:
        self._reader.max_open = n

    @property
    def _index(self) -> Any:
        """The loaded generation's side-index (kvdata.store.index.Index), for tests and tools."""
        return self._reader.gen.index

    def __len__(self) -> int:
        return self._reader.gen.index.count

    # ------------------------------------------------------------ reads

    def get_many(self, indices: Sequence[int] | np.ndarray, *, copy: bool = False) -> list[Any]:
        """Records at sample indices, in the order given.

        Sealed records are sliced from memory maps: byte records come back as
        read-only memoryviews and array fields as read-only numpy views, valid
        while the store is open (copy=True returns owned bytes/arrays).
        """
        self._check_open()
        return self._reader.get_many(indices, copy)

    def get_one(self, index: int, *, copy: bool = False) -> Any:
        """The record at one sample index (as get_many([index])[0], with per-call work near a
        memory-map slice: what per-sample code should call)."""
        self._check_open()
        return self._reader.get_one(index, copy)

    def get_batch(self, indices: Sequence[int] | np.ndarray, *, fields: Sequence[str] | None = None,
                  alloc: ArrayAlloc | None = None) -> Any:
        """A batch as arrays: each array field stacked into one (N, ...) array (one copy per
        sample, large batches split across copy threads; `alloc(shape, dtype)` may provide
        the arrays, e.g. in shared memory), variable-length arrays as one flat array plus
        offsets (kvdata.Ragged), scalars as 1-D arrays, other arrays (owned copies), bytes and
        str as lists. Byte records come back as a list of bytes. `fields` keeps only those."""
        self._check_open()
        return self._reader.get_batch(indices, fields, alloc)

    def find(self, key: str | bytes) -> int | None:
        """Sample index of `key`, or None."""
        self._check_open()
        return self._reader.find(key)

    def __contains__(self, key: object) -> bool:
        self._check_open()
        return self._reader.contains(key)

    def get(self, key: str | bytes, default: Any = None, *, copy: bool = False) -> Any:
        """The record stored under `key`, or `default`."""
        p = self.find(key)
        return default if p is None else self._reader.get_one(p, copy)

    def __getitem__(self, item: int | str | bytes) -> Any:
        self._check_open()
        if isinstance(item, (int, np.integer)):
            return self._reader.get_one(item)
        if isinstance(item, (str, bytes)):
            p = self._reader.find(item)
            if p is None:
                raise KeyError(item)
            return self._reader.get_one(p)
        raise TypeError(f"index a Store with an int or a str key, not {type(item).__name__}")

    def __iter__(self) -> Iterator[Any]:
        n = len(self)
        for start in range(0, n, ITER_CHUNK):
            yield from self.get_many(range(start, min(n, start + ITER_CHUNK)))

    # ------------------------------------------------------------ listing

    def keys(self) -> inspection.KeysView:
        self._check_open()
        return inspection.KeysView(self._reader)

    def describe(self, start: int = 0, stop: int | None = None) -> list[dict[str, Any]]:
        """index, key, shard, slot, label and payload bytes of samples [start, stop), without reading payloads."""
        self._check_open()
        return inspection.describe(self._reader, start, stop)

    def key_at(self, index: int) -> str:
        self._check_open()
        return str(self._reader.metas([index])[0][1]["k"])

    def record_info(self, index: int) -> dict[str, Any]:
        """Metadata of one record (what `kvdata get --json` prints)."""
        self._check_open()
        return inspection.record_info(self._reader, index)

    def metas(self, positions: Any) -> list[tuple[int, dict[str, Any]]]:
        """(kind, meta) of records at sample positions, without reading payloads."""
        self._check_open()
        return self._reader.metas(positions)

    def reader(self) -> Reader:
        """The Reader behind this store (verify and tools that walk the index use it)."""
        self._check_open()
        return self._reader

    # ------------------------------------------------------------ writes (delegated)

    def _w(self) -> Writer:
        self._check_open()
        if self._writer is None:
            raise ReadOnlyError(f"{self.root} is open read-only; open it with mode='a' to write")
        return self._writer

    def put(self, key: str, value: Any, *, label: int | None = None) -> None:
        """Store `value` (bytes, or a dict of arrays/bytes/str/scalars) under `key`."""
        self._w().put(key, value, label)

    def put_many(self, pairs: Iterable[tuple[Any, ...]]) -> int:
        """Store many (key, value) or (key, value, label) tuples; returns how many."""
        return self._w().put_many(pairs)

    def delete(self, key: str) -> None:
        self._w().delete(key)

    def seal(self) -> None:
        """Seal the tail at the next commit even if it is not full.

        A finished dataset should end sealed: every record is then read by memory-map
        offset, and every shard can be compressed, checksummed, pushed and staged.
        """
        self._w().request_seal()

    def set_classes(self, classes: Sequence[str]) -> None:
        """Class names (label i -> classes[i]) kept in the manifest."""
        self._w().set_classes([str(c) for c in classes])

    def set_extra(self, name: str, value: Any) -> None:
        """Metadata kept in the manifest under `name` (plain JSON; e.g. an importer's source and
        schema), committed with the next commit and read back as `store.manifest.extra[name]`."""
        self._w().set_extra(name, value)

    def commit(self) -> int:
        """Make every write since the last commit durable and visible, atomically; returns the generation."""
        return self._w().commit()
