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

from .. import format as fmt
from .._util.fsutil import atomic_write, fsync_dir, unlink_quiet
from .._util.progress import progress as make_progress
from ..errors import CorruptDatasetError, KVDataError, MissingShardError, NotADatasetError
from ..format import Manifest, names
from .generation import Generation, load_generation
from .linking import link_or_copy
from .lock import WriterLock
from .merge_plan import MergePlan, PartIndex, merged_shards, plan_merge, write_merged_index
from .reader import Reader
from .shards import ENVS, open_sealed_lmdb

STAGING = ".kvdata-merge.tmp"  # the merge's own staging directory under the destination

__all__ = ["merge", "STAGING"]


@dataclass
class _LocalPart:
    root: Path
    gen: Generation

    @property
    def m(self) -> Manifest:
        return self.gen.manifest

    def index(self) -> PartIndex:
        idx = self.gen.index
        return PartIndex(str(self.root), self.m, idx.samples, idx.records,
                         tuple((run.hashes, run.pos) for run in idx.runs), f"run `kvdata verify {self.root}`")


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
    plan = _check(loaded)  # before a seal writes anything: refusals leave the parts as they were
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
            plan = _check(loaded)
        summary = _write(loaded, dest_root, plan, progress)
        if move:
            summary["left_in_parts"] = {str(p.root): left for p in loaded if (left := _remove_part(p))}
    finally:
        for lock in locks:
            lock.release()
    summary.update({"parts": [str(r) for r in roots], "sealed_parts": [str(p.root) for p in tails], "moved": move,
                    "seconds": round(time.monotonic() - t0, 3)})
    return summary


def _load(roots: list[Path]) -> list[_LocalPart]:
    """Each part's current generation."""
    return [_LocalPart(r, load_generation(r)) for r in roots]


def _check(loaded: list[_LocalPart]) -> MergePlan:
    """Everything that refuses a merge, before anything is written: the plan's checks
    (kvdata.store.merge_plan: keys, classes, each part's index) and each part's shard files."""
    plan = plan_merge([p.index() for p in loaded], lambda i, pairs: _lmdb_keys(loaded[i], pairs))
    for p in loaded:
        _check_shard_files(p)
    return plan


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


def _lmdb_keys(p: _LocalPart, pairs: Sequence[tuple[int, int]]) -> list[str]:
    """The keys of a part's records at (shard, slot), read through LMDB: sealed shards from their
    files, records of its open tail (checked before a --seal) through a Reader's tail path."""
    by_shard: dict[int, list[int]] = {}
    for j, (s, _slot) in enumerate(pairs):
        by_shard.setdefault(s, []).append(j)
    values: list[Any] = [None] * len(pairs)
    for s, js in by_shard.items():
        slots = [pairs[j][1] for j in js]
        if s >= len(p.m.shards):
            reader = Reader(p.gen)
            try:
                got = reader.tail_values(slots)
            finally:
                reader.close()
            where = p.gen.tail_path
        else:
            where = p.gen.shard_path(p.m.shards[s])
            env = open_sealed_lmdb(where)
            try:
                with ENVS.read(env) as txn:
                    got = [txn.get(fmt.slot_key(sl)) for sl in slots]
            finally:
                ENVS.release(env)
        for j, sl, v in zip(js, slots, got):
            if v is None:
                raise CorruptDatasetError(f"{where}: slot {sl} is missing; run `kvdata verify {p.root}`")
            try:
                values[j] = str(fmt.RecordHeader(v).meta(v)["k"])
            except CorruptDatasetError as e:
                raise CorruptDatasetError(f"{where}, slot {sl}: {e}") from None
    return values


def _check_shard_files(p: _LocalPart) -> None:
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


def _write(parts: list[_LocalPart], dest: Path, plan: MergePlan, progress: bool | None) -> dict[str, Any]:
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
        linked, copied = _place_shards(parts, plan, stage / names.SHARDS_DIR, progress)
        manifest = write_merged_index(plan, stage / names.INDEX_DIR, [new for _i, _e, new in merged_shards(plan)])
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


def _place_shards(parts: list[_LocalPart], plan: MergePlan, shards_dir: Path, progress: bool | None) -> tuple[int, int]:
    """Each part's shards (and cold copies) under their merged names: hard links, or verified copies."""
    placed = merged_shards(plan)
    linked = copied = 0
    bar = make_progress(sum(e.bytes for _i, e, _new in placed) or None, "merge", progress)
    try:
        for i, e, new in placed:
            src = parts[i].gen.shards_dir
            how = link_or_copy(src / e.name, shards_dir / new.name, e.bytes, e.sha256, "merged")
            if e.zst is not None and new.zst is not None:
                link_or_copy(src / e.zst.name, shards_dir / new.zst.name, e.zst.bytes, e.zst.sha256, "merged")
            if how == "link":
                linked += e.bytes
            else:
                copied += e.bytes
            bar.update(e.bytes)
    finally:
        bar.close()
    fsync_dir(shards_dir)
    return linked, copied




# ---------------------------------------------------------------- --move


def _remove_part(p: _LocalPart) -> list[str]:
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
