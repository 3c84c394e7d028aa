"""`kvdata merge URL... URL`: parts pushed to a home joined into one dataset at that home.

Each node of a cluster writes its part locally and pushes it under its own prefix
(`kvdata push part s3://bucket/ds.parts/node-3`); one `kvdata merge` then publishes the whole
at `s3://bucket/ds`. No record byte passes through the merging client: each part's cold copies
(`shards/*.mdb.zst`) are copied by the store itself (S3 CopyObject, UploadPartCopy above 5 GiB;
an fsspec filesystem's own `cp_file`), under the merged names. The client reads only the parts'
manifests and index files (checked against the sha256 push recorded in each manifest), and the
records of keys whose hashes match (to name a duplicate, or tell a hash collision from one).

The checks and the merged index are the local merge's (kvdata.store.merge_plan). Everything is
checked before anything is written: every part's manifest (validated as hostile input), its
index files, every source object's size and recorded sha256 against the part's manifest, keys
across parts, and every object already at the destination. Then the shard objects are copied,
the index files uploaded, and the manifest written last: until it is, DEST is not a dataset;
a merge killed at any moment is run again to completion (objects already there with the right
sha256 are skipped). An object is never overwritten: one already at DEST under a merged name
with other bytes refuses the merge, naming it.

One merge into a DEST at a time (the nodes push, one of them merges); a DEST that already holds
a dataset is refused, unless it is exactly the dataset this merge would write (then nothing is
done: a re-run after a merge that finished).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import format as fmt
from .._util.progress import progress as make_progress
from ..errors import CorruptDatasetError, KVDataError, NotADatasetError, ReadOnlyError
from ..format import Manifest, ShardEntry, dump_manifest, names, parse_manifest
from ..format.codec import CHUNK, file_sha256
from ..homes import Home, ObjectInfo, is_url, open_home
from ..store.index import load_array
from ..store.merge import merge as merge_local
from ..store.merge_plan import PartIndex, merged_shards, plan_merge, write_merged_index
from ..tiers.records import RecordReader
from .mirror import MAX_MANIFEST_BYTES, fetch_exact

COPIES_IN_FLIGHT = 16  # server-side copies at once (each is the store's work, not this process's)

__all__ = ["merge", "merge_at_home"]


def merge(parts: Sequence[str | os.PathLike[str]], dest: str | os.PathLike[str], *, move: bool = False,
          seal: bool = False, progress: bool | None = None) -> dict[str, Any]:
    """`kvdata.merge`: local datasets by path (kvdata.store.merge.merge), or parts pushed to a
    home by URL (merge_at_home: every part and `dest` URLs of one s3:// or fsspec home)."""
    if isinstance(parts, (str, bytes, os.PathLike)):
        raise TypeError(f"parts must be a list of dataset paths or URLs, not the single path {parts!r}")
    urls = [is_url(str(p)) for p in [*parts, dest]]
    if not any(urls):
        return merge_local(parts, dest, move=move, seal=seal, progress=progress)
    if not all(urls):
        local = next(str(p) for p, u in zip([*parts, dest], urls) if not u)
        raise KVDataError(f"{local} is a local path and the others are URLs: merge joins local datasets, or parts "
                          "at one home; push the local part first (`kvdata push PART URL`)")
    if move or seal:
        raise KVDataError("--move and --seal are for local parts; parts at a home are sealed by push and left as "
                          "they are (remove their prefixes once the merge is done)")
    return merge_at_home([str(p) for p in parts], str(dest), progress=progress)


@dataclass
class _HomePart:
    url: str
    home: Home
    manifest: Manifest
    index: PartIndex
    reader: RecordReader


def merge_at_home(parts: Sequence[str], dest: str, *, progress: bool | None = None,
                  copy_options: dict[str, int] | None = None) -> dict[str, Any]:
    """Join the parts pushed at the URLs `parts` (in this order) into the new dataset at `dest`,
    on the same home, without moving record bytes through this process (see the module doc).
    `copy_options` go to the home's `copy_from` (S3: `multipart_over`, `part_size`). Returns a
    summary (samples, shards, objects copied and skipped, bytes copied at the home, bytes read)."""
    t0 = time.monotonic()
    if not parts:
        raise KVDataError("merge needs at least one part")
    _check_urls(parts, dest)
    out = open_home(dest)
    homes: list[Home] = []
    try:
        if not out.writable:
            raise ReadOnlyError(f"{dest} is read-only (an http(s):// home); merge parts at an s3:// or fsspec home")
        if out.local_path("") is not None:
            raise KVDataError(f"{dest} is a local path: merge local datasets by path (`kvdata merge P1 P2 DEST`); for "
                              "parts pushed to a shared filesystem, name them and DEST as fsspec+file:// URLs")
        for url in parts:
            home = open_home(url)
            homes.append(home)
            if not out.can_copy_from(home):
                raise KVDataError(f"{url} and {dest} are not at the same home: merge copies objects inside one store "
                                  "(all s3://, or one fsspec filesystem); push the part there first")
        with tempfile.TemporaryDirectory(prefix="kvdata-merge-") as tmpd:
            return _merge(homes, out, Path(tmpd), progress, copy_options or {}, t0)
    finally:
        for home in homes:
            home.close()
        out.close()


def _merge(homes: list[Home], out: Home, tmp: Path, progress: bool | None, copy_options: dict[str, int],
           t0: float) -> dict[str, Any]:
    """Load and check everything, then write: shard copies, index files, the manifest last."""
    downloaded = 0
    loaded: list[_HomePart] = []
    for i, home in enumerate(homes):
        part, n = _load(home, tmp / f"p{i}")
        loaded.append(part)
        downloaded += n
    sources = _check_sources(loaded)
    plan = plan_merge([p.index for p in loaded], lambda i, pairs: _keys(loaded[i], pairs))
    placed = merged_shards(plan)
    index_dir = tmp / "merged"
    index_dir.mkdir()
    manifest = write_merged_index(plan, index_dir, [new for _i, _e, new in placed])
    sums = {name: file_sha256(index_dir / name)[1] for _kind, name, _n in manifest.index_files()}
    manifest = manifest.replace(index_sha256=sums)
    blob = dump_manifest(manifest)
    key_bytes = sum(p.reader.bytes_fetched for p in loaded)
    summary: dict[str, Any] = {
        "dataset": out.url, "parts": [p.url for p in loaded], "generation": manifest.generation,
        "samples": manifest.count, "shards": len(manifest.shards), "bytes": sum(e.bytes for e in manifest.shards),
        "objects_copied": 0, "objects_skipped": 0, "bytes_copied_at_home": 0, "index_uploaded": 0,
        "bytes_downloaded": downloaded + key_bytes, "bytes_read_for_keys": key_bytes, "already_merged": False}
    existing = out.info(names.MANIFEST)
    if existing is not None:
        if existing.size == len(blob) and out.read(names.MANIFEST, MAX_MANIFEST_BYTES) == blob:
            summary.update(already_merged=True, objects_skipped=len(placed) + len(sums),
                           seconds=round(time.monotonic() - t0, 3))
            return summary  # a re-run of a merge that finished: the very dataset it would write
        raise NotADatasetError(f"{out.where(names.MANIFEST)} exists: {out.url} is already a dataset; merge writes a new "
                               "one: choose a new URL")
    # every object at DEST, before anything is written
    copies = [(i, e, new) for i, e, new in placed if not _holds(out, _shard_object(new), _zst(new).bytes, _zst(new).sha256)]
    uploads = [name for name, sha in sums.items()
               if not _holds(out, f"{names.INDEX_DIR}/{name}", (index_dir / name).stat().st_size, sha)]
    summary["objects_skipped"] = len(placed) - len(copies) + len(sums) - len(uploads)
    _copy_shards(out, loaded, copies, sources, progress, copy_options)
    summary["objects_copied"] = len(copies)
    summary["bytes_copied_at_home"] = sum(_zst(new).bytes for _p, _e, new in copies)
    for name in uploads:
        out.put_file(f"{names.INDEX_DIR}/{name}", index_dir / name, sha256=sums[name])
    summary["index_uploaded"] = len(uploads)
    mpath = tmp / names.MANIFEST
    mpath.write_bytes(blob)
    out.put_file(names.MANIFEST, mpath, sha256=hashlib.sha256(blob).hexdigest())  # last: now it is a dataset
    summary["seconds"] = round(time.monotonic() - t0, 3)
    return summary


# ---------------------------------------------------------------- the URLs


def _split(url: str) -> tuple[str, list[str]]:
    """(scheme, path segments) of a part or destination URL; '.' and '..' segments are refused:
    an object store takes them literally, a filesystem does not, so they could name two places."""
    scheme, rest = url.split("://", 1)
    segs = [p for p in rest.split("/") if p]
    if any(p in (".", "..") for p in segs) or "\x00" in url:
        raise KVDataError(f"{url}: a merge URL may not contain '.' or '..' segments (or NUL); name the prefix plainly")
    return scheme.lower(), segs


def _check_urls(parts: Sequence[str], dest: str) -> None:
    """Parts are distinct; dest is none of them, nor under or above one (by path segments)."""
    seen: dict[tuple[str, tuple[str, ...]], str] = {}
    for url in parts:
        scheme, segs = _split(url)
        key = (scheme, tuple(segs))
        if key in seen:
            raise KVDataError(f"{url} is given twice as a part (also as {seen[key]}); name each part once")
        seen[key] = url
    d_scheme, d_segs = _split(dest)
    for (scheme, part_segs), url in seen.items():
        n = min(len(part_segs), len(d_segs))
        if scheme == d_scheme and list(part_segs[:n]) == d_segs[:n]:
            raise KVDataError(f"{dest}: the destination must be a new prefix outside every part (it overlaps the "
                              f"part {url}); choose another URL")


# ---------------------------------------------------------------- the parts (hostile input)


def _load(home: Home, tmp: Path) -> tuple[_HomePart, int]:
    """A part's manifest (validated) and index files (checked against the sha256 its manifest
    gives), with the number of bytes read."""
    url = home.url
    blob = home.read(names.MANIFEST, MAX_MANIFEST_BYTES)
    m = parse_manifest(blob, home.where(names.MANIFEST))
    fix = f"push the part again (`kvdata push PART {url}`)"
    if m.tail.records:
        raise CorruptDatasetError(f"{url}: {m.tail.records} record(s) are in its open tail; {fix} (push seals it)")
    for e in m.shards:
        if e.zst is None:
            raise CorruptDatasetError(f"{url}: shard {e.name} has no cold copy (.mdb.zst) in its manifest; {fix}")
    sums = m.index_sha256 or {}
    tmp.mkdir()
    n = len(blob)
    for _kind, name, size in m.index_files():
        if name not in sums:
            raise CorruptDatasetError(f"{url}: its manifest gives no sha256 for {names.INDEX_DIR}/{name}; {fix}")
        fetch_exact(home, f"{names.INDEX_DIR}/{name}", size, sums[name], tmp / name)
        n += size
    idx = m.index
    samples = load_array(tmp / idx.samples, fmt.SAMPLE_DTYPE, m.count) if idx.samples else np.zeros(0, fmt.SAMPLE_DTYPE)
    records = load_array(tmp / idx.records, fmt.RECORD_DTYPE, idx.records_count) if idx.records \
        else np.zeros(0, fmt.RECORD_DTYPE)
    runs = []
    for r in idx.keys:
        arr = load_array(tmp / r.name, fmt.HASH_DTYPE, 2 * r.count)
        runs.append((arr[:r.count], arr[r.count:]))
    part = PartIndex(url, m, samples, records, tuple(runs), fix)
    return _HomePart(url, home, m, part, RecordReader(home)), n


def _zst(e: ShardEntry) -> Any:
    assert e.zst is not None  # every part shard has one (_load), so every merged one does
    return e.zst


def _shard_object(e: ShardEntry) -> str:
    return f"{names.SHARDS_DIR}/{_zst(e).name}"


def _check_sources(parts: list[_HomePart]) -> dict[tuple[int, int], ObjectInfo]:
    """Every cold copy a part's manifest names is at its home with the size it gives and, where
    the home recorded one, the sha256: a manifest that lies is refused before anything is written."""
    jobs = [(i, e) for i, p in enumerate(parts) for e in p.manifest.shards]

    def check(job: tuple[int, ShardEntry]) -> ObjectInfo:
        i, e = job
        p = parts[i]
        z = _zst(e)
        name = _shard_object(e)
        got = p.home.info(name)
        if got is None:
            raise CorruptDatasetError(f"{p.home.where(name)} is missing; {p.index.repair}")
        if got.size != z.bytes:
            raise CorruptDatasetError(f"{p.home.where(name)} has {got.size} bytes, its part's manifest says {z.bytes}; "
                                      f"{p.index.repair}")
        if got.sha256 is not None and got.sha256 != z.sha256:
            raise CorruptDatasetError(f"{p.home.where(name)} was uploaded with sha256 {got.sha256}, its part's manifest "
                                      f"says {z.sha256}; {p.index.repair}")
        return got

    with ThreadPoolExecutor(COPIES_IN_FLIGHT, thread_name_prefix="kvdata-merge") as pool:
        infos = list(pool.map(check, jobs))
    return {(i, e.id): got for (i, e), got in zip(jobs, infos)}


def _keys(p: _HomePart, pairs: Sequence[tuple[int, int]]) -> list[str]:
    """The keys of a part's records at (shard, slot), read record by record from its cold copies
    (frames checked against the seek table its manifest names)."""
    by_shard: dict[int, list[int]] = {}
    for j, (s, _slot) in enumerate(pairs):
        by_shard.setdefault(s, []).append(j)
    order = list(by_shard.items())
    got = p.reader.read_many([(p.manifest.shards[s], [pairs[j][1] for j in js]) for s, js in order])
    keys: list[str] = [""] * len(pairs)
    for (s, js), values in zip(order, got):
        entry = p.manifest.shards[s]
        if values is None:
            raise CorruptDatasetError(f"{p.url}: the cold copy of shard {entry.name} cannot be read record by record "
                                      f"(no seek table); {p.index.repair} with this kvdata")
        for j, v in zip(js, values):
            try:
                keys[j] = str(fmt.RecordHeader(v).meta(v)["k"])
            except CorruptDatasetError as e:
                raise CorruptDatasetError(f"{p.url}, shard {entry.name} slot {pairs[j][1]}: {e}") from None
    return keys


# ---------------------------------------------------------------- the destination


def _holds(home: Home, name: str, size: int, sha256: str) -> bool:
    """Whether `name` at DEST already holds exactly these bytes (skip it); False if absent.
    An object with other bytes refuses the merge (a name is never reused for other bytes).
    Where the home records no sha256 (fsspec), an object of the right size is hashed by reading
    it: only objects a killed merge left are ever there to read."""
    got = home.info(name)
    if got is None:
        return False
    same = got.sha256 == sha256 if got.sha256 is not None else got.size == size and _read_sha256(home, name, got.size) == sha256
    if not same:
        raise KVDataError(f"{home.where(name)} exists with other bytes than the merge would put there ({size} bytes, "
                          f"sha256 {sha256}); nothing was written. {home.url} has no manifest: remove what is under "
                          "it, or merge into a new URL")
    return True


def _read_sha256(home: Home, name: str, size: int) -> str:
    h = hashlib.sha256()
    with ThreadPoolExecutor(4, thread_name_prefix="kvdata-merge-read") as pool:
        for part in home.parts(name, size, pool, part_size=CHUNK):
            h.update(part)
    return h.hexdigest()


def _copy_shards(out: Home, parts: list[_HomePart], copies: list[tuple[int, ShardEntry, ShardEntry]],
                 sources: dict[tuple[int, int], ObjectInfo], progress: bool | None, options: dict[str, int]) -> None:
    """The cold copies, copied by the home itself, several at once (each pinned to the source
    object `_check_sources` checked)."""
    bar = make_progress(sum(_zst(new).bytes for _i, _e, new in copies) or None, "merge", progress)

    def copy(c: tuple[int, ShardEntry, ShardEntry]) -> int:
        i, e, new = c
        out.copy_from(parts[i].home, _shard_object(e), _shard_object(new), sources[(i, e.id)], _zst(e).sha256,
                      **options)
        return int(_zst(new).bytes)

    try:
        with ThreadPoolExecutor(COPIES_IN_FLIGHT, thread_name_prefix="kvdata-merge") as pool:
            for n in pool.map(copy, copies):
                bar.update(n)
    finally:
        bar.close()
