"""`kvdata merge`: join datasets written in parallel (parts) into one, without copying record bytes.

N importer processes, or N nodes, each write a part; merge makes one dataset of them. A sealed
shard is immutable and its records' offsets are offsets inside its own file, so a part's shards
can become the merged dataset's shards as they are: hard links (a copy, hashed against the
manifest, only where the filesystem refuses links), renumbered in the order the parts are
given. The side-index is concatenated with shard numbers and sample positions remapped (numpy,
no per-record Python), labels are kept (the parts' class lists must agree), field schemas are
unioned, and one key run holds every key, checked for duplicates first.

Crash safety, like a commit: everything is checked before anything is written (duplicate keys,
classes, tails, the destination); the merged dataset is then built in a hidden staging directory
under the destination (`STAGING`), holding its shards/, index/ and manifest.json, fsync'ed; the
commit renames shards/ and index/ into place, then manifest.json, last. A kill before that leaves
a destination that is not a dataset (only `.lock` and the staging directory, which the next
merge into it removes: it made them); after it, a complete dataset. Between the renames (a few
microseconds) the shards are all there and `kvdata reindex` would rebuild the whole dataset.

Parts are never modified, except: `seal=True` seals a part's open tail first (a normal commit
of that part, as `kvdata seal` does), and `move=True` removes each part's files once the merged
dataset is committed (files the part's manifest does not name, e.g. lost+found/, are left).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import format as fmt
from .._util.fsutil import atomic_write, fsync_dir, unlink_quiet
from .._util.progress import progress as make_progress
from ..errors import (
    CorruptDatasetError,
    InvalidKeyError,
    InvalidValueError,
    KVDataError,
    MissingShardError,
    NotADatasetError,
)
from ..format import IndexFiles, KeyRunEntry, Manifest, ShardEntry, TailEntry, ZstCopy, names
from . import index as ix
from .generation import Generation, load_generation
from .linking import link_or_copy
from .lock import WriterLock
from .reader import Reader
from .shards import ENVS, open_sealed_lmdb

STAGING = ".kvdata-merge.tmp"  # the merge's own staging directory under the destination
GENERATION = 1                 # the merged dataset's first generation
SHOW_DUPLICATES = 5            # duplicate keys named in the error

__all__ = ["merge", "STAGING"]


@dataclass
class _Part:
    root: Path
    gen: Generation
    shard_base: int   # the merged id of this part's shard 0
    sample_base: int  # the merged position of this part's sample 0

    @property
    def m(self) -> Manifest:
        return self.gen.manifest


def merge(parts: Sequence[str | os.PathLike[str]], dest: str | os.PathLike[str], *, move: bool = False,
          seal: bool = False, progress: bool | None = None) -> dict[str, Any]:
    """Join the datasets `parts` (local directories, in this order) into the new dataset `dest`.

    The parts' sealed shards become `dest`'s shards, hard-linked (copied and checked against
    their sha256 where links are refused); their samples follow one another in the order given.
    A part with records in its open tail is refused unless `seal` (then it is sealed first, a
    normal commit of that part). `move` removes the parts' files once `dest` is committed.
    Refused with nothing written: duplicate keys across parts (named), class lists that
    disagree, a `dest` that exists and is not empty. Returns a summary (samples, shards,
    bytes linked and copied, seconds)."""
    t0 = time.monotonic()
    if isinstance(parts, (str, bytes, os.PathLike)):
        raise TypeError(f"parts must be a list of dataset paths, not the single path {parts!r}")
    if not parts:
        raise KVDataError("merge needs at least one part")
    roots = [Path(p) for p in parts]
    dest_root = Path(dest)
    _check_paths(roots, dest_root)
    loaded = _load(roots)
    checked = _check(loaded)  # before a seal writes anything: refusals leave the parts as they were
    tails = [p for p in loaded if p.m.tail.records]
    if tails and not seal:
        p = tails[0]
        raise KVDataError(f"{p.root}: {p.m.tail.records} record(s) are in its open tail, which merge cannot share; "
                          f"seal it first with `kvdata seal {p.root}`, or pass --seal (seal=True)")
    for p in tails:
        _seal(p.root)
    locks: list[WriterLock] = []
    try:
        if move:  # the parts' files go once dest is committed: no writer may be in them meanwhile
            for r in roots:
                locks.append(WriterLock(r))
        if tails or move:
            loaded = _load(roots)  # what was sealed, or committed before the locks were taken
            checked = _check(loaded)
        summary = _write(loaded, dest_root, *checked, progress)
        if move:
            summary["left_in_parts"] = {str(p.root): left for p in loaded if (left := _remove_part(p))}
    finally:
        for lock in locks:
            lock.release()
    summary.update({"parts": [str(r) for r in roots], "sealed_parts": [str(p.root) for p in tails], "moved": move,
                    "seconds": round(time.monotonic() - t0, 3)})
    return summary


def _load(roots: list[Path]) -> list[_Part]:
    """Each part's current generation, with where its shards and samples go in the merge."""
    loaded: list[_Part] = []
    shard_base = sample_base = 0
    for r in roots:
        gen = load_generation(r)
        loaded.append(_Part(r, gen, shard_base, sample_base))
        shard_base += len(gen.manifest.shards)
        sample_base += gen.manifest.count
    return loaded


def _check(loaded: list[_Part]) -> tuple[np.ndarray, np.ndarray, tuple[str, ...], dict[str, dict[str, Any]],
                                         dict[str, Any]]:
    """Everything that refuses a merge, before anything is written: (key hashes in merged sample
    order, the positions that sort them, classes, field schema, manifest extras the parts agree on)."""
    classes = _merge_classes(loaded)
    fields: dict[str, dict[str, Any]] = {}
    for p in loaded:
        fields = fmt.merge_schema(fields, p.m.fields)
    first = loaded[0].m.extra
    extra = {k: v for k, v in first.items() if all(p.m.extra.get(k) == v for p in loaded)}
    hashes = np.concatenate([_key_hashes(p) for p in loaded])
    order = np.argsort(hashes, kind="stable")  # once: the duplicate checks and the key run use it
    _refuse_duplicates(loaded, hashes, order)
    _refuse_deleted_later(loaded, hashes, order)
    for p in loaded:
        _check_shard_files(p)
    return hashes, order, classes, fields, extra


# ---------------------------------------------------------------- checks (nothing written yet)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_paths(roots: list[Path], dest: Path) -> None:
    """Parts are distinct existing directories; dest is none of them, nor inside or around one."""
    for i, r in enumerate(roots):
        if not r.is_dir():
            raise NotADatasetError(f"{r}: no such dataset directory; merge joins local datasets")
        for earlier in roots[:i]:
            if _same_file(r, earlier):
                raise KVDataError(f"{r} is given twice as a part (also as {earlier}); name each part once")
    real_dest = Path(os.path.realpath(dest))
    for r in roots:
        real = Path(os.path.realpath(r))
        if real_dest == real or real_dest.is_relative_to(real) or real.is_relative_to(real_dest):
            raise KVDataError(f"{dest}: the destination must be a new directory outside every part "
                              f"(it overlaps the part {r}); choose another path")
    _check_dest(dest)


def _check_dest(dest: Path) -> None:
    """dest does not exist, or is an empty directory (or holds only a killed merge's leftovers)."""
    if os.path.lexists(dest) and not dest.is_dir():
        raise NotADatasetError(f"{dest} exists and is not a directory; merge into a new path")
    if dest.is_symlink():
        raise NotADatasetError(f"{dest} is a symbolic link; merge into a new path")
    if not dest.exists():
        return
    if (dest / names.MANIFEST).exists():
        raise NotADatasetError(f"{dest} is already a dataset; merge writes a new one: choose a new path, "
                               "or name it as a part")
    extra = sorted(n for n in os.listdir(dest) if n not in (names.LOCK, STAGING))
    if extra:
        raise NotADatasetError(f"{dest} exists and is not empty (it holds {extra[0]!r}); merge into a new "
                               "or an empty directory")


def _seal(root: Path) -> None:
    """Seal a part's open tail: a normal commit of that part (as `kvdata seal` does)."""
    from .facade import Store

    with Store(root, "a") as store:
        store.seal()
        store.commit()


def _merge_classes(parts: list[_Part]) -> tuple[str, ...]:
    """One class list for all parts: labels are kept as they are, so each part's list must be a
    prefix of the longest (a part that saw fewer classes) or empty."""
    longest: tuple[str, ...] = ()
    owner: Path | None = None
    for p in parts:
        c = p.m.classes
        if len(c) > len(longest):
            longest, owner = c, p.root
    for p in parts:
        c = p.m.classes
        if c and c != longest[:len(c)]:
            i = next(i for i, (a, b) in enumerate(zip(c, longest)) if a != b)
            raise InvalidValueError(
                f"{p.root}: its classes disagree with {owner}'s (label {i} is {c[i]!r} here and "
                f"{longest[i]!r} there); labels would change meaning, so the parts cannot be merged; "
                "write them with one class list")
    return longest


def _key_hashes(p: _Part) -> np.ndarray:
    """The key hash of every sample of a part, in sample order (gathered from its key runs)."""
    if p.m.count == 0:
        return np.zeros(0, np.uint64)
    return ix.all_key_hashes(p.gen.index)


def _refuse_duplicates(parts: list[_Part], hashes: np.ndarray, order: np.ndarray) -> None:
    """InvalidKeyError naming keys that are in more than one part (hash matches are confirmed by
    comparing the keys themselves, so a hash collision is never called a duplicate)."""
    if len(hashes) < 2:
        return
    sh = hashes[order]
    same = np.nonzero(sh[1:] == sh[:-1])[0]
    if not len(same):
        return
    starts = np.array([p.sample_base for p in parts], dtype=np.int64)
    found: list[tuple[str, Path, Path]] = []
    readers: dict[int, Reader] = {}
    try:
        for j in same.tolist():
            a, b = int(order[j]), int(order[j + 1])
            ka, pa = _key_at(parts, starts, readers, a)
            kb, pb = _key_at(parts, starts, readers, b)
            if ka == kb:
                found.append((ka, parts[pa].root, parts[pb].root))
                if len(found) > SHOW_DUPLICATES:
                    break
    finally:
        for r in readers.values():
            r.close()
    if found:
        shown = "; ".join(f"{k!r} in {a} and {b}" for k, a, b in found[:SHOW_DUPLICATES])
        more = " and more" if len(found) > SHOW_DUPLICATES else ""
        raise InvalidKeyError(f"duplicate keys across parts: {shown}{more}; every key must be in one part only; "
                              "nothing was written")


def _key_at(parts: list[_Part], starts: np.ndarray, readers: dict[int, Reader], pos: int) -> tuple[str, int]:
    i = int(np.searchsorted(starts, pos, "right")) - 1
    while parts[i].m.count == 0 or pos - parts[i].sample_base >= parts[i].m.count:
        i -= 1  # parts with no samples share their start with the next one
    if i not in readers:
        readers[i] = Reader(parts[i].gen)
    return str(readers[i].metas([pos - parts[i].sample_base])[0][1].get("k")), i


def _refuse_deleted_later(parts: list[_Part], hashes: np.ndarray, order: np.ndarray) -> None:
    """InvalidKeyError if a key live in one part has a tombstone (a delete) in a later part.

    The merged dataset reads right, but `kvdata reindex` replays records in shard order and
    the later delete would drop the earlier part's record; the fix is to name that part first."""
    found: list[tuple[str, Path, Path]] = []
    readers: dict[int, Reader] = {}
    starts = np.array([p.sample_base for p in parts], dtype=np.int64)
    sh = hashes[order]
    try:
        for p in parts:
            if p.sample_base == 0:
                continue  # nothing before it
            keys = _tombstone_keys(p)
            if not keys:
                continue
            th = np.array([fmt.key_hash(k.encode("utf-8")) for k in keys], dtype=np.uint64)  # deletes are few
            lo, hi = np.searchsorted(sh, th, "left"), np.searchsorted(sh, th, "right")
            for k, a, b in zip(keys, lo.tolist(), hi.tolist()):
                for pos in order[a:b].tolist():
                    if pos >= p.sample_base:
                        continue  # only parts before this one
                    live, i = _key_at(parts, starts, readers, pos)
                    if live == k:
                        found.append((k, parts[i].root, p.root))
                if len(found) >= SHOW_DUPLICATES:
                    break
    finally:
        for r in readers.values():
            r.close()
    if found:
        shown = "; ".join(f"{k!r} is in {a} and deleted in {b}" for k, a, b in found[:SHOW_DUPLICATES])
        raise InvalidKeyError(f"keys deleted in a later part: {shown}; `kvdata reindex` of the merged dataset would "
                              f"drop them; give {found[0][2]} before {found[0][1]}; nothing was written")


def _tombstone_keys(p: _Part) -> list[str]:
    """Keys of the tombstones (deletes) in a part's sealed shards, read through LMDB."""
    idx = p.gen.index
    rows = np.nonzero((np.asarray(idx.records["head_kind"]) >> fmt.KIND_SHIFT) == fmt.KIND_TOMBSTONE)[0]
    if not len(rows):
        return []
    shard = np.searchsorted(idx.base, rows, "right") - 1
    slot = rows - idx.base[shard]
    keys: list[str] = []
    for s in np.unique(shard).tolist():
        env = open_sealed_lmdb(p.gen.shard_path(p.m.shards[s]))
        try:
            with ENVS.read(env) as txn:
                for sl in slot[shard == s].tolist():
                    v = txn.get(fmt.slot_key(int(sl)))
                    if v is None:
                        raise CorruptDatasetError(f"{p.gen.shard_path(p.m.shards[s])}: slot {sl} is missing; "
                                                  f"run `kvdata verify {p.root}`")
                    keys.append(str(fmt.RecordHeader(v).meta(v).get("k")))
        finally:
            ENVS.release(env)
    return keys


def _check_shard_files(p: _Part) -> None:
    """The part's shards/ and index/ are real directories (not links: --move deletes in them),
    and every shard (and cold copy) the part names is a regular file of the recorded size."""
    for sub in (names.SHARDS_DIR, names.INDEX_DIR):
        try:
            st = os.lstat(p.root / sub)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise CorruptDatasetError(f"{p.root / sub} is not a directory of the part (a symbolic link?); "
                                      f"put the part's files there and run `kvdata verify {p.root}`")
    for e in p.m.shards:
        for name, size in [(e.name, e.bytes)] + ([(e.zst.name, e.zst.bytes)] if e.zst else []):
            path = p.gen.shards_dir / name
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                raise MissingShardError(f"shard {path} is missing; restore it, then merge") from None
            if not stat.S_ISREG(st.st_mode):
                raise CorruptDatasetError(f"{path} is not a regular file; restore it and run `kvdata verify {p.root}`")
            if st.st_size != size:
                raise CorruptDatasetError(f"{path} is {st.st_size} bytes, its manifest says {size}; "
                                          f"run `kvdata verify {p.root}`")


# ---------------------------------------------------------------- writing


def _write(parts: list[_Part], dest: Path, hashes: np.ndarray, order: np.ndarray, classes: tuple[str, ...],
           fields: dict[str, dict[str, Any]], extra: dict[str, Any], progress: bool | None) -> dict[str, Any]:
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    own_lock_file = not os.path.lexists(dest / names.LOCK)
    lock = WriterLock(dest)  # refused while another merge builds it: then all of dest is left alone
    stage = dest / STAGING
    ok = made_stage = False
    try:
        _check_dest(dest)  # again, under the lock
        if os.path.lexists(stage):
            _remove_stage(stage)  # a killed merge's staging: links and copies it made
        stage.mkdir()
        made_stage = True
        (stage / names.SHARDS_DIR).mkdir()
        (stage / names.INDEX_DIR).mkdir()
        linked, copied, entries = _place_shards(parts, stage / names.SHARDS_DIR, progress)
        manifest = _write_index(parts, stage, hashes[order], order, entries, classes, fields, extra)
        atomic_write(stage / names.MANIFEST, fmt.dump_manifest(manifest))
        fsync_dir(stage)
        # the commit: shards and index into place, the manifest last
        os.rename(stage / names.SHARDS_DIR, dest / names.SHARDS_DIR)
        os.rename(stage / names.INDEX_DIR, dest / names.INDEX_DIR)
        os.rename(stage / names.MANIFEST, dest / names.MANIFEST)
        fsync_dir(dest)
        ok = True
        stage.rmdir()
    finally:
        if not ok and made_stage:
            shutil.rmtree(stage, ignore_errors=True)
        if not ok:
            if own_lock_file:
                unlink_quiet(dest / names.LOCK)  # dest is left as it was found
        lock.release()
        if not ok and created:
            try:
                dest.rmdir()
            except OSError:
                pass
    return {"dataset": str(dest), "generation": manifest.generation, "samples": manifest.count,
            "shards": len(manifest.shards), "bytes": sum(e.bytes for e in manifest.shards),
            "bytes_linked": linked, "bytes_copied": copied}


def _remove_stage(stage: Path) -> None:
    """Remove a killed merge's staging directory, but only if it holds nothing but what a merge
    makes (shards/ of shard files, index/ of index files, the manifest): anything else is the
    user's, so the merge is refused and nothing is removed."""
    def own(path: Path, kind: str) -> bool:
        st = os.lstat(path)
        if kind == "dir":
            return stat.S_ISDIR(st.st_mode)
        return stat.S_ISREG(st.st_mode)

    expected = {names.SHARDS_DIR: lambda n: names.parse_shard_name(n) is not None or names.is_zst_name(n),
                names.INDEX_DIR: lambda n: names.is_index_name(n)}
    files: list[Path] = []
    dirs: list[Path] = []
    stranger: str | None = None
    if not own(stage, "dir"):
        stranger = str(stage)
    else:
        for n in os.listdir(stage):
            path = stage / n
            if n in expected and own(path, "dir"):
                dirs.append(path)
                for m in os.listdir(path):
                    if expected[n](m) and own(path / m, "file"):
                        files.append(path / m)
                    else:
                        stranger = stranger or str(path / m)
            elif (n == names.MANIFEST or n.startswith(names.MANIFEST + ".tmp")) and own(path, "file"):
                files.append(path)
            else:
                stranger = stranger or str(path)
    if stranger is not None:
        raise NotADatasetError(f"{stranger} was not made by a merge (the merge's staging directory {stage} must hold "
                               "only shards/, index/ and manifest.json); move it away, then merge again")
    for f in files:
        f.unlink()
    for d in dirs:
        d.rmdir()
    stage.rmdir()


def _place_shards(parts: list[_Part], shards_dir: Path, progress: bool | None) -> tuple[int, int, list[ShardEntry]]:
    """Each part's shards (and cold copies) under their merged names: hard links, or verified copies."""
    total = sum(e.bytes for p in parts for e in p.m.shards)
    linked = copied = 0
    entries: list[ShardEntry] = []
    bar = make_progress(total or None, "merge", progress)
    try:
        for p in parts:
            for e in p.m.shards:
                new_id = p.shard_base + e.id
                name = names.shard_name(new_id)
                how = link_or_copy(p.gen.shards_dir / e.name, shards_dir / name, e.bytes, e.sha256, "merged")
                zst = None
                if e.zst is not None:
                    zname = names.zst_name(name)
                    link_or_copy(p.gen.shards_dir / e.zst.name, shards_dir / zname, e.zst.bytes, e.zst.sha256,
                                 "merged")
                    zst = ZstCopy(zname, e.zst.bytes, e.zst.sha256, e.zst.seek_bytes, e.zst.seek_sha256)
                entries.append(ShardEntry(new_id, name, e.records, e.bytes, e.sha256, zst))
                if how == "link":
                    linked += e.bytes
                else:
                    copied += e.bytes
                bar.update(e.bytes)
    finally:
        bar.close()
    fsync_dir(shards_dir)
    return linked, copied, entries


def _write_index(parts: list[_Part], stage: Path, sorted_hashes: np.ndarray, order: np.ndarray,
                 entries: list[ShardEntry],
                 classes: tuple[str, ...], fields: dict[str, dict[str, Any]], extra: dict[str, Any]) -> Manifest:
    """The merged side-index (records concatenated, samples with shard ids moved by each part's
    shard base, one key run of every key) and its manifest; nothing is named by a manifest yet."""
    index_dir = stage / names.INDEX_DIR
    samples_name, records_name = names.samples_name(GENERATION), names.records_name(GENERATION)
    samples = np.concatenate([p.gen.index.samples for p in parts])  # one file each, one fsync
    records = np.concatenate([p.gen.index.records for p in parts])
    start = 0
    for p in parts:
        rows = samples[start:start + p.m.count]
        if len(rows) and int(rows["shard"].max()) >= len(p.m.shards):
            raise CorruptDatasetError(f"{p.root}: a sample points into its open tail; seal it first with "
                                      f"`kvdata seal {p.root}`")
        rows["shard"] += np.uint32(p.shard_base)
        start += p.m.count
    count, records_count = len(samples), len(records)
    if count:
        ix.write_new(index_dir / samples_name, samples)
    if records_count:
        ix.write_new(index_dir / records_name, records)
    runs: tuple[KeyRunEntry, ...] = ()
    if count:
        run = names.keys_name(GENERATION, 0)
        ix.write_key_run(index_dir / run, sorted_hashes, order.astype(np.uint64))  # already sorted: O(n)
        runs = (KeyRunEntry(run, count),)
    fsync_dir(index_dir)
    first = parts[0].m
    n = len(entries)
    return Manifest(generation=GENERATION, count=count, shard_size=first.shard_size, compress=first.compress,
                    shards=tuple(entries), tail=TailEntry(n, names.tail_name(n), 0),
                    index=IndexFiles(samples_name if count else None, records_name if records_count else None,
                                     records_count, runs),
                    fields=fields, classes=classes, extra=extra)


# ---------------------------------------------------------------- --move


def _remove_part(p: _Part) -> list[str]:
    """After the commit: remove the files the part's manifest names (its manifest first, so a
    crash here leaves no dataset that looks whole); returns what is left (not removed)."""
    root = p.root
    m = p.m
    unlink_quiet(root / names.MANIFEST)
    fsync_dir(root)
    shard_files = {e.name for e in m.shards} | {e.zst.name for e in m.shards if e.zst} \
        | {m.tail.name, names.lmdb_lock_name(m.tail.name)} | {names.lmdb_lock_name(e.name) for e in m.shards}
    for name in shard_files:
        unlink_quiet(root / names.SHARDS_DIR / name)
    for _kind, name, _n in m.index_files():
        unlink_quiet(root / names.INDEX_DIR / name)
    left: list[str] = []
    for sub in (names.SHARDS_DIR, names.INDEX_DIR):
        try:
            (root / sub).rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            left += sorted(f"{sub}/{n}" for n in os.listdir(root / sub))
    for reg in root.glob("readers-i*.lock"):  # the part's reader registries (store.pins): nothing to pin any more
        if names.parse_reader_pin_name(reg.name) is not None:
            unlink_quiet(reg)
    unlink_quiet(root / names.LOCK)  # ours (held since the merge began); unlinking it frees no one
    try:
        root.rmdir()
    except OSError:
        left += sorted(n for n in os.listdir(root) if n not in (names.SHARDS_DIR, names.INDEX_DIR))
    return left
