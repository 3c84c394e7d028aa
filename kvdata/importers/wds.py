"""Importing WebDataset tar shards: every `key.ext` group of members becomes one record.

WebDataset's grouping rule is kept: a member `dir/sample.seg.png` has key `dir/sample`
(the name up to the first dot of its last component) and extension `seg.png`, and
consecutive members with the same key form one sample. Each extension becomes a field
named by it, typed by its last part (`seg.png` is an image), except that by default an image
member with a plain image extension (`jpg`, `png`, ...) is the field `image` and `cls` (or
`label`) the field `label`, as every importer names them (common.py); `fields`
(`--field EXT=NAME`) maps any extension to another name, or keeps one (`--field png=png`).
A record with two image members (`jpg` and `png`) needs one of them mapped elsewhere.

- images (.jpg .jpeg .png .bmp .gif .webp .ppm .tif .tiff): the file bytes, or with
  decode="rgb"/"gray" raw HWC uint8 pixels (as the folder importer stores them);
- .cls .cls2 .index .label: the integer the text holds (the field `label` is also the index label);
- .txt .text: str (UTF-8); .json: the JSON text as str, checked to parse;
- .npy: the array (np.load without pickle);
- anything else: bytes.

Tars are outside input, so they are read with the standard library's `tarfile` only as
far as it is safe: the scan takes headers only, accepts only regular-file members,
never follows a link, refuses absolute names, `..` components and NUL bytes, bounds
member sizes, and checks that every member's data lies inside the file and that
nothing but zero blocks follows the last header `tarfile` could read (it stops quietly
at a damaged header). Payloads are then read by offset (`os.pread`) in the workers (in
the parent with decode="none": records.decode_workers).
Only uncompressed tars are read (a .tar.gz must be gunzipped first: records are read
by offset).

The import is all-or-nothing (one commit at the end); a bad record fails it with a line
naming the tar and member, or with skip_bad is left out and listed in the summary.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._util.sizes import parse_size
from ..errors import ConfigError, InvalidValueError
from .common import IMAGE_FIELD, LABEL_FIELD, parse_fields
from .records import Bad, Loaded, check_common, decode_image, key_problem, map_ordered, open_same, worker_pool, write_records
from .target import import_entry, refuse_existing

INSTALL_HINT = "pip install 'kvdata[images]'"
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "bmp", "gif", "webp", "ppm", "tif", "tiff"})
INT_EXTENSIONS = frozenset({"cls", "cls2", "index", "label"})
TEXT_EXTENSIONS = frozenset({"txt", "text"})
DEFAULT_MAX_MEMBER = "256MB"
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's base_plus_ext
_BLOCK = tarfile.BLOCKSIZE
# What members are called by default: the README's field names (common.py).
DEFAULT_FIELDS = {**{ext: IMAGE_FIELD for ext in sorted(IMAGE_EXTENSIONS)}, "cls": LABEL_FIELD}


class Group(NamedTuple):
    """One record to load: the tar, the key, and (field, data offset, size) of each member."""

    tar: str
    key: str
    fields: tuple[tuple[str, int, int], ...]
    where: str
    decode: str
    ident: tuple[int, int]  # (st_dev, st_ino) of the tar the scan read


class TarDamaged(InvalidValueError):
    """The tar's structure cannot be trusted past some point (not one bad record)."""


# ---------------------------------------------------------------- public entry point

@import_entry
def import_wds(sources: list[str | os.PathLike[str]], dataset: str | os.PathLike[str], *, decode: str = "none",
               workers: int = 0, skip_bad: bool = False, max_member_size: int | str = DEFAULT_MAX_MEMBER,
               shard_size: int | str | None = None, compress: bool = False,
               progress: bool | None = None, existing: str = "refuse",
               fields: Sequence[str] | Mapping[str, str] | None = None) -> dict[str, Any]:
    """Import WebDataset tar shards (files, or directories whose *.tar files are taken in name
    order) into `dataset`, one record per key group, in tar order. Returns the summary
    (kvdata.importers.common.summary plus "bad": the records left out with skip_bad).
    existing: what to do with a dataset already there ("refuse", "append", "overwrite": target.py).
    fields: {extension: field name} (or "EXT=NAME" strings) over DEFAULT_FIELDS."""
    started = time.perf_counter()
    check_common(decode, workers, shard_size, INSTALL_HINT)
    names = {**DEFAULT_FIELDS, **parse_fields(fields)}
    refuse_existing(dataset, existing)
    limit = parse_size(max_member_size, "max_member_size")
    tars = find_tars(sources)
    groups: list[Group] = []
    scan_bad: list[Bad] = []
    ignored = 0
    keys: dict[str, str] = {}
    with worker_pool(workers, decode) as pool:  # tars are scanned in the workers too, one tar each
        for found, bad, skipped in map_ordered(pool, _scan_task, [(tar, limit, decode) for tar in tars]):
            ignored += skipped
            for g in found:
                if g.key in keys:
                    bad.append(Bad(g.key, g.where, f"key {g.key!r} appears twice (first in {keys[g.key]}); "
                                                  "WebDataset keys must be unique across shards"))
                    continue
                keys[g.key] = g.where
                groups.append(g)
            if bad and not skip_bad:
                raise InvalidValueError(f"{bad[0].where}: {bad[0].reason}; nothing was imported "
                                        "(pass --skip-bad to leave such records out)")
            scan_bad.extend(bad)
        if not groups:
            raise InvalidValueError(f"{', '.join(map(str, tars[:3]))}: no WebDataset records (key.ext members) "
                                    f"found{f' ({len(scan_bad)} bad)' if scan_bad else ''}; nothing was written")
        return write_records(groups, load_group, dataset, total=len(groups), pool=pool, workers=workers,
                             skip_bad=skip_bad, scan_bad=scan_bad, shard_size=shard_size, compress=compress,
                             progress=progress, started=started, ignored=ignored, existing=existing,
                             key_of=_group_key, fields=names)


# ---------------------------------------------------------------- finding and scanning tars

def find_tars(sources: list[str | os.PathLike[str]]) -> list[str]:
    """The tar files named: files as given, directories' *.tar in name order."""
    if not sources:
        raise ConfigError("no source given; pass tar files or a directory of them")
    tars: list[str] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            found = sorted(str(c) for c in p.iterdir() if c.name.endswith(".tar") and c.is_file())
            if not found:
                raise ConfigError(f"{p}: no .tar files in this directory; pass the folder holding the shards")
            tars.extend(found)
        elif p.is_file():
            tars.append(str(p))
        else:
            raise ConfigError(f"{p}: no such tar file or directory; check the path")
    if len(set(tars)) != len(tars):
        raise ConfigError("the same tar is named twice; name each shard once")
    return tars


def _member_problem(info: tarfile.TarInfo, limit: int) -> str | None:
    """Why this member is not a readable regular file, or None."""
    name = info.name
    if "\x00" in name:
        return "its name holds a NUL byte"
    if name.startswith("/") or os.path.isabs(name):
        return "its name is an absolute path"
    if ".." in name.split("/"):
        return "its name has a '..' component"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "its name is not UTF-8"
    if info.issym() or info.islnk():
        return f"it is a {'symbolic' if info.issym() else 'hard'} link (to {info.linkname!r}); links are not followed"
    if info.issparse():
        return "it is a sparse file; only plain regular files are read"
    if not info.isreg():
        return "it is not a regular file (device, FIFO or unknown type)"
    if info.size > limit:
        return f"it declares {info.size} bytes, over the {limit}-byte limit (raise --max-member-size)"
    return None


def _group_key(g: Group) -> str:
    return g.key


def _scan_task(task: tuple[str, int, str]) -> tuple[list[Group], list[Bad], int]:
    return scan_tar(*task)


def scan_tar(tar: str, limit: int, decode: str = "none") -> tuple[list[Group], list[Bad], int]:
    """(record groups, bad records, members ignored) of one tar, from its headers only.

    A damaged structure (not a tar, a header tarfile cannot read, data past the end of the
    file) raises TarDamaged naming the tar and the last good member: what follows cannot
    be trusted, so it is never a skippable bad record."""
    try:
        raw = open(tar, "rb")  # noqa: SIM115 (closed with tf, or below)
    except OSError as e:
        raise TarDamaged(f"{tar}: cannot open it ({e.strerror or e})") from None
    st = os.fstat(raw.fileno())
    file_size, ident = st.st_size, (st.st_dev, st.st_ino)
    try:
        tf = tarfile.open(fileobj=raw, mode="r:")
    except tarfile.ReadError as e:
        raw.close()
        raise TarDamaged(f"{tar}: not an uncompressed tar ({e}); gunzip a .tar.gz first, or check the file") from None
    groups: list[Group] = []
    bad: list[Bad] = []
    ignored = 0
    last = "(the start)"
    cur_key: str | None = None
    cur_fields: list[tuple[str, int, int]] = []
    cur_bad: str | None = None
    cur_where = ""

    def close_group() -> None:
        if cur_key is None:
            return
        if cur_bad is not None:
            bad.append(Bad(cur_key, cur_where, cur_bad))
        else:
            groups.append(Group(tar, cur_key, tuple(cur_fields), cur_where, decode, ident))

    try:
        with raw, tf:
            while True:
                try:
                    info = tf.next()
                except (tarfile.TarError, ValueError, UnicodeError, OverflowError) as e:
                    raise TarDamaged(f"{tar}: unreadable tar header after member {last!r} ({e}); "
                                     "the tar is damaged") from None
                if info is None:
                    break
                name = info.name
                while name.startswith("./"):  # `tar cf x.tar ./a.jpg` names members ./a.jpg
                    name = name[2:]
                where = f"{tar}: member {info.name!r}"
                carries_data = info.isreg() or info.type not in tarfile.SUPPORTED_TYPES  # as tarfile skips it
                if carries_data and info.offset_data + info.size > file_size:
                    raise TarDamaged(f"{where} declares {info.size} bytes but the file ends at byte {file_size}; "
                                     "the tar is truncated or its header forged")
                if info.isdir():  # nothing is created from a tar, so a directory entry is just skipped
                    ignored += 1
                    last = name
                    continue
                problem = _member_problem(info, limit)
                m = _KEY_EXT.match(name) if "\x00" not in name else None
                if m is None:
                    if problem is not None:
                        bad.append(Bad(name, where, problem))
                    else:
                        ignored += 1  # no extension: webdataset skips it too
                    last = name
                    continue
                key, ext = m.group(1), m.group(2)
                if key != cur_key:
                    close_group()
                    cur_key, cur_fields, cur_bad, cur_where = key, [], None, where
                    kp = key_problem(key)
                    if kp is not None:
                        cur_bad = kp
                if problem is None and any(f == ext for f, _, _ in cur_fields):
                    problem = f"a second {ext!r} member for key {key!r}"
                if problem is not None and cur_bad is None:
                    cur_bad, cur_where = f"member {name!r}: {problem}", where
                cur_fields.append((ext, info.offset_data, info.size))
                last = name
            close_group()
            end = tf.offset
            # tarfile stops quietly at a damaged header: only zero blocks may follow the last one
            rest = os.pread(raw.fileno(), _BLOCK, end) if end < file_size else b""
    except OSError as e:
        raise TarDamaged(f"{tar}: cannot read it after member {last!r} ({e.strerror or e})") from None
    if end > file_size:
        raise TarDamaged(f"{tar}: the headers run past the end of the file after member {last!r}; the tar is "
                         "truncated or its header forged")
    if rest.strip(b"\x00"):
        raise TarDamaged(f"{tar}: unreadable tar header at byte {end}, after member {last!r}; the tar is damaged")
    return groups, bad, ignored


# ---------------------------------------------------------------- loading one record (runs in workers)

def load_group(g: Group) -> list[Loaded | Bad]:
    """The record of one group, or why it is bad (never raises for bad input)."""
    value: dict[str, Any] = {}
    try:
        fd = open_same(g.tar, g.ident)
    except OSError as e:
        return [Bad(g.key, g.where, f"cannot open the tar ({e.strerror})")]
    except InvalidValueError as e:
        return [Bad(g.key, g.where, str(e))]
    try:
        for ext, offset, size in g.fields:
            data = os.pread(fd, size, offset) if size else b""
            if len(data) != size:
                return [Bad(g.key, g.where, f"field {ext!r}: the tar changed or shrank while importing")]
            try:
                value[ext] = _field_value(ext, data, g.decode)
            except InvalidValueError as e:
                return [Bad(g.key, g.where, f"field {ext!r} of key {g.key!r}: {e}")]
    except OSError as e:
        return [Bad(g.key, g.where, f"cannot read the tar ({e.strerror})")]
    finally:
        os.close(fd)
    return [Loaded(g.key, value, None, g.where)]  # the label: write_records, after renaming


def _field_value(ext: str, data: bytes, decode: str) -> Any:
    low = ext.lower().rsplit(".", 1)[-1]  # "seg.png" is a png (webdataset decodes by the last part too)
    if low in IMAGE_EXTENSIONS and decode != "none":
        return decode_image(data, decode)
    if low in INT_EXTENSIONS:
        try:
            v = int(data.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise InvalidValueError(f"{data[:20]!r} is not an integer") from None
        if not -(1 << 63) < v < (1 << 63):
            raise InvalidValueError(f"{v} does not fit in int64")
        return v
    if low in TEXT_EXTENSIONS or low == "json":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidValueError("the text is not UTF-8") from None
        if low == "json":
            try:
                json.loads(text)
            except ValueError as e:
                raise InvalidValueError(f"not valid JSON ({e})") from None
        return text
    if low == "npy":
        import io

        try:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        except Exception as e:  # ValueError, OSError, EOFError on damaged or pickled files
            raise InvalidValueError(f"not a NumPy .npy array without pickles ({type(e).__name__}: {e})") from None
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biufc":
            raise InvalidValueError("a .npy field must hold a numeric array")
        return np.ascontiguousarray(arr)
    return data
