"""What a merge is, wherever its parts live: the checks and the merged side-index, computed from
each part's manifest and index arrays alone.

Two drivers call this module: kvdata.store.merge joins local datasets (their index memory-mapped,
keys read through LMDB, shards hard-linked) and kvdata.sync.home_merge joins parts pushed to a
home (their index downloaded and checked against the sha256 push recorded, keys read record by
record, shard objects copied by the home itself). Both hand `plan_merge` one `PartIndex` per
part and a `KeyReader`; the plan refuses everything that would refuse the merge before the
caller writes anything (a key in two parts, a key deleted in a later part, class lists that
disagree, an index that does not describe its part), and `write_merged_index` writes the merged
index files and returns the manifest that will name them.

Parts from a home are hostile input: their manifests are already validated by parse_manifest,
and the plan checks what the arrays claim against them (every sample points at a sealed record,
the key runs hold each sample position exactly once, a key read back hashes to its run's hash),
so a lying part is refused rather than merged into a dataset that misreads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import format as fmt
from .._util.fsutil import fsync_dir
from ..errors import CorruptDatasetError, InvalidKeyError, InvalidValueError, KVDataError
from ..format import IndexFiles, KeyRunEntry, Manifest, ShardEntry, TailEntry, ZstCopy, names
from . import index as ix

GENERATION = 1      # the merged dataset's first generation
SHOW_DUPLICATES = 5  # duplicate keys named in the error
MAX_FALSE_MATCHES = 10_000  # hash matches of different keys tolerated (a real 64-bit collision is rare)

#: the keys of records of part `i`, given as (shard id, slot) pairs, in that order (the shard id of
#: the part's open tail for its records: only the local driver checks parts before sealing them)
KeyReader = Callable[[int, Sequence[tuple[int, int]]], list[str]]

__all__ = ["GENERATION", "KeyReader", "MergePlan", "PartIndex", "merged_shards", "plan_merge", "write_merged_index"]


@dataclass(frozen=True)
class PartIndex:
    """One part as merge sees it: its validated manifest and the index arrays it names."""

    label: str                 # how messages name the part (a path, a URL)
    manifest: Manifest
    samples: np.ndarray        # SAMPLE_DTYPE, manifest.count rows
    records: np.ndarray        # RECORD_DTYPE, one row per slot of each sealed shard
    runs: tuple[tuple[np.ndarray, np.ndarray], ...]  # (hashes, positions) of each key run
    repair: str = "run `kvdata verify` on it"  # how to fix a part whose index is refused


@dataclass(frozen=True)
class MergePlan:
    """A merge that passed every check: where each part's shards and samples go, the key hash
    of every merged sample (and the order that sorts them), classes, schema and extras."""

    parts: tuple[PartIndex, ...]
    shard_base: tuple[int, ...]    # the merged id of each part's shard 0
    sample_base: tuple[int, ...]   # the merged position of each part's sample 0
    hashes: np.ndarray
    order: np.ndarray
    classes: tuple[str, ...]
    fields: dict[str, dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.hashes)


def plan_merge(parts: Sequence[PartIndex], read_keys: KeyReader) -> MergePlan:
    """Check the parts (in merge order) against each other and against their own manifests;
    InvalidKeyError / InvalidValueError / CorruptDatasetError naming the part and the fix.
    `read_keys` is asked only for records whose key hash matches another's, and for tombstones."""
    if not parts:
        raise KVDataError("merge needs at least one part")
    shard_base: list[int] = []
    sample_base: list[int] = []
    ns = nc = 0
    for p in parts:
        _check_part(p)
        shard_base.append(ns)
        sample_base.append(nc)
        ns += len(p.manifest.shards)
        nc += p.manifest.count
    classes = _merge_classes(parts)
    fields: dict[str, dict[str, Any]] = {}
    for p in parts:
        try:
            fields = fmt.merge_schema(fields, p.manifest.fields)
        except (KeyError, TypeError, ValueError):
            raise CorruptDatasetError(f"{p.label}: its manifest's field schema cannot be merged; {p.repair}") from None
    first = parts[0].manifest.extra
    extra = {k: v for k, v in first.items() if all(p.manifest.extra.get(k) == v for p in parts)}
    hashes = np.concatenate([_key_hashes(p) for p in parts]) if nc else np.zeros(0, np.uint64)
    order = np.argsort(hashes, kind="stable")  # once: the duplicate checks and the key run use it
    plan = MergePlan(tuple(parts), tuple(shard_base), tuple(sample_base), hashes, order, classes, fields, extra)
    keys = _Keys(plan, read_keys)
    _refuse_duplicates(plan, keys)
    _refuse_deleted_later(plan, keys)
    return plan


# ---------------------------------------------------------------- one part against its manifest


def _check_part(p: PartIndex) -> None:
    """The arrays hold what the manifest says: a row per sample and per sealed slot, every
    sample at a sealed record, every position in exactly one key run."""
    m = p.manifest
    bad = f"{p.label}: its index does not match its manifest"
    if p.samples.dtype != fmt.SAMPLE_DTYPE or p.records.dtype != fmt.RECORD_DTYPE or len(p.samples) != m.count:
        raise CorruptDatasetError(f"{bad} ({len(p.samples)} sample rows for {m.count} samples); {p.repair}")
    shard_records = np.array([e.records for e in m.shards], dtype=np.int64)
    if len(p.records) != int(shard_records.sum()):
        raise CorruptDatasetError(f"{bad} ({len(p.records)} record rows for {int(shard_records.sum())} sealed "
                                  f"records); {p.repair}")
    if m.count:
        shard = p.samples["shard"].astype(np.int64)
        slot = p.samples["slot"].astype(np.int64)
        sealed = shard < len(shard_records)
        outside = ~sealed & ((shard != m.tail.id) | (slot >= m.tail.records))  # a tail's are checked, never merged
        if sealed.any():
            outside[sealed] = slot[sealed] >= shard_records[shard[sealed]]
        if outside.any():
            i = int(np.nonzero(outside)[0][0])
            raise CorruptDatasetError(f"{p.label}: sample {i} points at shard {int(shard[i])} slot {int(slot[i])}, "
                                      f"which is not a record of it; {p.repair}")
    total = sum(len(h) for h, _pos in p.runs)
    if total != m.count or any(len(h) != len(pos) for h, pos in p.runs):
        raise CorruptDatasetError(f"{p.label}: its key runs hold {total} keys for {m.count} samples; {p.repair}")


def _key_hashes(p: PartIndex) -> np.ndarray:
    """The key hash of every sample of a part, in sample order, from its runs (each position
    exactly once: a position twice would leave another sample without a key)."""
    n = p.manifest.count
    out = np.zeros(n, dtype=np.uint64)
    seen = np.zeros(n, dtype=bool)
    for hashes, pos in p.runs:
        if not len(pos):
            continue
        pos = np.asarray(pos, dtype=np.uint64)
        if int(pos.max()) >= n:
            raise CorruptDatasetError(f"{p.label}: a key run holds a sample position past its {n} samples; {p.repair}")
        ipos = pos.astype(np.int64)
        if seen[ipos].any() or len(np.unique(ipos)) != len(ipos):
            raise CorruptDatasetError(f"{p.label}: its key runs hold a sample position twice; {p.repair}")
        seen[ipos] = True
        out[ipos] = hashes
    return out


def _merge_classes(parts: Sequence[PartIndex]) -> tuple[str, ...]:
    """One class list for all parts: labels are kept as they are, so each part's list must be a
    prefix of the longest (a part that saw fewer classes) or empty."""
    longest: tuple[str, ...] = ()
    owner = ""
    for p in parts:
        c = p.manifest.classes
        if len(c) > len(longest):
            longest, owner = c, p.label
    for p in parts:
        c = p.manifest.classes
        if c and c != longest[:len(c)]:
            i = next(i for i, (a, b) in enumerate(zip(c, longest)) if a != b)
            raise InvalidValueError(
                f"{p.label}: its classes disagree with {owner}'s (label {i} is {c[i]!r} here and "
                f"{longest[i]!r} there); labels would change meaning, so the parts cannot be merged; "
                "write them with one class list")
    return longest


# ---------------------------------------------------------------- keys across parts


class _Keys:
    """Keys read back through the caller's KeyReader, by merged sample position; a key read
    for a position must hash to the hash its part's key run gives it."""

    def __init__(self, plan: MergePlan, read_keys: KeyReader) -> None:
        self.plan = plan
        self.read_keys = read_keys
        self.starts = np.array(plan.sample_base, dtype=np.int64)

    def part_of(self, pos: int) -> int:
        i = int(np.searchsorted(self.starts, pos, "right")) - 1
        while self.plan.parts[i].manifest.count == 0 or pos - self.plan.sample_base[i] >= self.plan.parts[i].manifest.count:
            i -= 1  # parts with no samples share their start with the next one
        return i

    def at(self, positions: Sequence[int]) -> list[tuple[str, int]]:
        """(key, part number) of each merged sample position, read a part at a time."""
        out: list[tuple[str, int] | None] = [None] * len(positions)
        by_part: dict[int, list[int]] = {}
        for j, pos in enumerate(positions):
            by_part.setdefault(self.part_of(pos), []).append(j)
        for i, js in by_part.items():
            p = self.plan.parts[i]
            local = [positions[j] - self.plan.sample_base[i] for j in js]
            rows = p.samples[np.array(local, dtype=np.int64)]
            pairs = [(int(s), int(t)) for s, t in zip(rows["shard"].tolist(), rows["slot"].tolist())]
            keys = self.read_keys(i, pairs)
            for j, pos, (s, t), k in zip(js, local, pairs, keys):
                if fmt.key_hash(k.encode("utf-8")) != int(self.plan.hashes[positions[j]]):
                    raise CorruptDatasetError(
                        f"{p.label}: its key index gives sample {pos} another key hash than its record's key {k[:80]!r} "
                        f"(shard {s} slot {t}); {p.repair}")
                out[j] = (k, i)
        return [o for o in out if o is not None]


def _refuse_duplicates(plan: MergePlan, keys: _Keys) -> None:
    """InvalidKeyError naming keys that are in more than one part (hash matches are confirmed by
    reading the keys themselves, so a hash collision is never called a duplicate)."""
    if plan.count < 2:
        return
    sh = plan.hashes[plan.order]
    same = np.nonzero(sh[1:] == sh[:-1])[0]
    found: list[tuple[str, str, str]] = []
    false_matches = 0
    batch = 256
    for b in range(0, len(same), batch):
        js = same[b:b + batch]
        a_pos = plan.order[js].tolist()
        b_pos = plan.order[js + 1].tolist()
        got = keys.at(a_pos + b_pos)
        for (ka, pa), (kb, pb) in zip(got[:len(js)], got[len(js):]):
            if ka == kb:
                found.append((ka, plan.parts[pa].label, plan.parts[pb].label))
            else:
                false_matches += 1
        if len(found) > SHOW_DUPLICATES:
            break
        if false_matches > MAX_FALSE_MATCHES:
            raise CorruptDatasetError(f"more than {MAX_FALSE_MATCHES} samples of the parts share a key hash with "
                                      "another key; their key indexes are damaged: reindex the parts")
    if found:
        shown = "; ".join(f"{k!r} in {a} and {b}" for k, a, b in found[:SHOW_DUPLICATES])
        more = " and more" if len(found) > SHOW_DUPLICATES else ""
        raise InvalidKeyError(f"duplicate keys across parts: {shown}{more}; every key must be in one part only; "
                              "nothing was written")


def _refuse_deleted_later(plan: MergePlan, keys: _Keys) -> None:
    """InvalidKeyError if a key live in one part has a tombstone (a delete) in a later part.

    The merged dataset reads right, but `kvdata reindex` replays records in shard order and
    the later delete would drop the earlier part's record; the fix is to name that part first."""
    found: list[tuple[str, str, str]] = []
    sh = plan.hashes[plan.order]
    for i, p in enumerate(plan.parts):
        if plan.sample_base[i] == 0:
            continue  # nothing before it
        dead = _tombstone_keys(p, i, keys.read_keys)
        if not dead:
            continue
        th = np.array([fmt.key_hash(k.encode("utf-8")) for k in dead], dtype=np.uint64)  # deletes are few
        lo, hi = np.searchsorted(sh, th, "left"), np.searchsorted(sh, th, "right")
        for k, a, b in zip(dead, lo.tolist(), hi.tolist()):
            earlier = [pos for pos in plan.order[a:b].tolist() if pos < plan.sample_base[i]]
            for live, j in keys.at(earlier) if earlier else []:
                if live == k:
                    found.append((k, plan.parts[j].label, p.label))
            if len(found) >= SHOW_DUPLICATES:
                break
    if found:
        shown = "; ".join(f"{k!r} is in {a} and deleted in {b}" for k, a, b in found[:SHOW_DUPLICATES])
        raise InvalidKeyError(f"keys deleted in a later part: {shown}; `kvdata reindex` of the merged dataset would "
                              f"drop them; give {found[0][2]} before {found[0][1]}; nothing was written")


def _tombstone_keys(p: PartIndex, i: int, read_keys: KeyReader) -> list[str]:
    """Keys of the tombstones (deletes) in a part's sealed shards."""
    rows = np.nonzero((np.asarray(p.records["head_kind"]) >> fmt.KIND_SHIFT) == fmt.KIND_TOMBSTONE)[0]
    if not len(rows):
        return []
    base = np.zeros(len(p.manifest.shards) + 1, dtype=np.int64)
    np.cumsum([e.records for e in p.manifest.shards], out=base[1:])
    shard = np.searchsorted(base, rows, "right") - 1
    return read_keys(i, [(int(s), int(r - base[s])) for s, r in zip(shard.tolist(), rows.tolist())])


# ---------------------------------------------------------------- the merged dataset


def merged_shards(plan: MergePlan) -> list[tuple[int, ShardEntry, ShardEntry]]:
    """(part number, the part's entry, the merged entry) of every shard: renumbered in part
    order, under the merged dataset's names (incarnation 0), with the same bytes and checksums."""
    out: list[tuple[int, ShardEntry, ShardEntry]] = []
    for i, p in enumerate(plan.parts):
        for e in p.manifest.shards:
            new_id = plan.shard_base[i] + e.id
            name = names.shard_name(new_id)
            zst = None
            if e.zst is not None:
                zst = ZstCopy(names.zst_name(name), e.zst.bytes, e.zst.sha256, e.zst.seek_bytes, e.zst.seek_sha256)
            out.append((i, e, ShardEntry(new_id, name, e.records, e.bytes, e.sha256, zst)))
    return out


def write_merged_index(plan: MergePlan, index_dir: Path, shards: Sequence[ShardEntry]) -> Manifest:
    """The merged side-index written under `index_dir` (records concatenated, samples with shard
    ids moved by each part's shard base, one key run of every key), fsync'ed, and the manifest
    naming it and `shards`; nothing is named by a manifest yet."""
    for p in plan.parts:
        if p.manifest.tail.records:  # the drivers seal (local) or refuse (a home) such parts first
            raise KVDataError(f"{p.label}: {p.manifest.tail.records} record(s) are in its open tail, which merge "
                              "cannot share; seal it first")
    samples_name, records_name = names.samples_name(GENERATION), names.records_name(GENERATION)
    samples = np.concatenate([p.samples for p in plan.parts])  # one file each, one fsync
    records = np.concatenate([p.records for p in plan.parts])
    for i, p in enumerate(plan.parts):
        rows = samples[plan.sample_base[i]:plan.sample_base[i] + p.manifest.count]
        rows["shard"] += np.uint32(plan.shard_base[i])
    count, records_count = len(samples), len(records)
    if count:
        ix.write_new(index_dir / samples_name, samples)
    if records_count:
        ix.write_new(index_dir / records_name, records)
    runs: tuple[KeyRunEntry, ...] = ()
    if count:
        run = names.keys_name(GENERATION, 0)
        ix.write_key_run(index_dir / run, plan.hashes[plan.order], plan.order.astype(np.uint64))  # sorted: O(n)
        runs = (KeyRunEntry(run, count),)
    fsync_dir(index_dir)
    first = plan.parts[0].manifest
    n = len(shards)
    return Manifest(generation=GENERATION, count=count, shard_size=first.shard_size, compress=first.compress,
                    shards=tuple(shards), tail=TailEntry(n, names.tail_name(n), 0),
                    index=IndexFiles(samples_name if count else None, records_name if records_count else None,
                                     records_count, runs),
                    fields=plan.fields, classes=plan.classes, extra=plan.extra)
