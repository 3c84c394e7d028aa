"""Keys and labels of records without their payloads: a Reader's metas, find and key lookups.

A key lookup reads only the header of the record its hash points at: in place from a mapped
shard (a store.get(key) costs about one store[i]), record by record from a remote home where
the shard has no staged copy (no whole shard staged for one key), through LMDB for the tail.
The functions take the reader through the small protocol below, so this module needs none of
the Reader's read path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .. import format as fmt
from ..errors import CorruptDatasetError
from ..format import names
from .generation import Generation
from .shards import SealedShard
from .source import ShardSource
from .tail_reads import lmdb_value

# what a Reader reads at one moment: a generation and its shards' handles (Reader._state)
State = tuple[Generation, list[SealedShard | None]]

_HEAD_MASK = fmt.MAX_HEAD


class HeaderSource(Protocol):
    """What the lookups need of a Reader."""

    root: Path
    source: ShardSource | None
    max_open: int | None

    @property
    def gen(self) -> Generation: ...
    @property
    def state(self) -> State: ...
    def positions(self, indices: Any, gen: Generation | None = None) -> np.ndarray: ...
    def handle(self, shard_id: int, state: State | None = None) -> SealedShard: ...
    def tail_values(self, slots: list[int], gen: Generation | None = None) -> list[bytes]: ...


def _remote_metas(r: HeaderSource, st: State, shard: np.ndarray, slot: np.ndarray, rec: np.ndarray,
                  out: list[Any]) -> None:
    """Headers of sealed records in shards the source does not want whole (a key lookup in
    random mode), read record by record instead of staging the shard; fills `out`."""
    source = r.source
    if source is None:
        return
    sealed = rec >= 0
    shards, handles = st[0].shards, st[1]
    cold = [s for s in np.unique(shard[sealed]).tolist()  # per shard, not per sample
            if handles[s] is None and not source.wants_whole(shards[s])]
    if not cold:
        return
    groups = [np.nonzero(sealed & (shard == s))[0].tolist() for s in cold]
    got = source.read_records([(shards[s], [int(slot[j]) for j in js]) for s, js in zip(cold, groups)])
    for s, js, values in zip(cold, groups, got):
        entry = shards[s]
        if values is None:
            continue
        if len(values) != len(js):
            raise CorruptDatasetError(f"shard {entry.name}: {len(values)} records came back for {len(js)} slots")
        for j, v in zip(js, values):
            try:
                hd = fmt.RecordHeader(v)
                out[j] = (hd.kind, hd.meta(v))
            except CorruptDatasetError as e:
                raise CorruptDatasetError(f"shard {entry.name} from {source.home.url}, slot {int(slot[j])}: {e}") from None


def metas(r: HeaderSource, positions: Any, st: State | None = None) -> list[tuple[int, dict[str, Any]]]:
    """(kind, meta) of the records at sample positions of the generation in `st` (the one read
    now unless given, taken once): keys and labels without payloads."""
    st = st or r.state
    gen, handles = st
    pos = r.positions(positions, gen)
    index = gen.index
    shard, slot, rec = index.resolve(pos)
    out: list[Any] = [None] * len(pos)
    tail_at: list[int] = []
    offs = np.zeros(len(pos), np.uint64)
    offs[rec >= 0] = index.records["offset"][rec[rec >= 0]]
    _remote_metas(r, st, shard, slot, rec, out)
    for j, (s, rc, off) in enumerate(zip(shard.tolist(), rec.tolist(), offs.tolist())):
        if rc < 0:
            tail_at.append(j)
            continue
        if out[j] is not None:  # read record by record from the home
            continue
        h = handles[s] or r.handle(s, st)
        if off == int(fmt.UNKNOWN_OFFSET):
            sl = int(slot[j])
            v = lmdb_value(h, sl)
            try:
                hd = fmt.RecordHeader(v)
                out[j] = (hd.kind, hd.meta(v))
            except CorruptDatasetError as e:
                raise CorruptDatasetError(f"{h.path}, slot {sl}: {e}") from None
            continue
        if off + fmt.PREFIX_SIZE > len(h.mv):
            raise CorruptDatasetError(f"index file {r.root / names.INDEX_DIR / str(gen.manifest.index.records)}: "
                                      f"the row of sample {int(pos[j])} points past the end of shard {h.path}; "
                                      f"run `kvdata reindex {r.root}`")
        try:
            buf = h.mv[off:off + fmt.MAX_HEAD + 1]
            hd = fmt.RecordHeader(buf)
            out[j] = (hd.kind, hd.meta(buf))
        except CorruptDatasetError as e:
            raise CorruptDatasetError(f"shard {h.path}, record at offset {off}: {e}") from None
    if tail_at:
        for j, v in zip(tail_at, r.tail_values([int(slot[j]) for j in tail_at], gen)):
            try:
                hd = fmt.RecordHeader(v)
                out[j] = (hd.kind, hd.meta(v))
            except CorruptDatasetError as e:
                raise CorruptDatasetError(f"{gen.tail_path}, slot {int(slot[j])}: {e}") from None
    return out


def find(r: HeaderSource, key: str | bytes) -> int | None:
    """Sample index of `key`, or None."""
    kb = fmt.check_key(key)
    skey = kb.decode("utf-8")
    st = r.state
    index = st[0].index
    for p in index.candidates(fmt.key_hash(kb)):
        if p < index.count and key_at(r, p, st) == skey:
            return p
    return None


def key_at(r: HeaderSource, p: int, st: State | None = None) -> Any:
    """The key stored in the record of sample p (of the generation in `st`, the one read now
    unless given): read from the header of a sealed record in place with scalar work; else
    through metas."""
    st = st or r.state
    index = st[0].index
    if r.source is None and r.max_open is None:
        shard, slot, _label = index.samples[p].item()
        if shard < index.n_sealed:
            rec = int(index.base[shard]) + slot
            if rec < index.base[shard + 1]:
                off, size, hk = index.records[rec].item()
                head = hk & _HEAD_MASK
                if head >= fmt.PREFIX_SIZE and off + head + size <= index.shard_bytes[shard]:
                    h = st[1][shard] or r.handle(shard, st)
                    try:
                        buf = h.mv[off:off + head]
                        return fmt.RecordHeader(buf).meta(buf).get("k")
                    except CorruptDatasetError as e:
                        raise CorruptDatasetError(f"shard {h.path}, record at offset {off}: {e}") from None
    return metas(r, [p], st)[0][1].get("k")


def find_many(r: HeaderSource, keys: list[str], hashes: np.ndarray) -> dict[int, int]:
    """{i: sample position} for each keys[i] the generation holds (`hashes`: their key hashes),
    one index search for the whole list and one metas call for the candidates."""
    found: dict[int, int] = {}
    st = r.state
    q, p = st[0].index.candidates_many(hashes)
    if len(q):
        for qi, pi, (_kind, meta) in zip(q.tolist(), p.tolist(), metas(r, p, st)):
            if meta["k"] == keys[qi]:
                found[qi] = pi
    return found
