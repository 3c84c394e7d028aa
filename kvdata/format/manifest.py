"""The manifest schema: one dataset generation, as frozen dataclasses.

`manifest.json` is the commit point of a dataset: it names every shard (with its
size and sha256), the open tail, and the side-index files of the generation.
It also comes from remote homes, so `parse_manifest` treats it as hostile: every
name must follow `kvdata.format.names`, every number must be a non-negative int
in range, every checksum a sha256 hex digest, before anything touches a file.

Code inside kvdata reads attributes (`entry.sha256`). Mapping-style access
(`manifest["shards"][0]["name"]`) is kept on these classes for users of the
public `Store.manifest`, which was a dict before the schema was typed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptDatasetError, FormatVersionError, InvalidValueError
from . import names

FORMAT_NAME = "kvdata"
FORMAT_VERSION = 1
MAX_COUNT = 1 << 48      # samples, records, bytes: far above anything real, far below overflow
MAX_SHARDS = 1 << 24
MAX_KEY_RUNS = 256
_KNOWN = {"format", "version", "generation", "shard_size", "compress", "count", "shards", "tail", "index",
          "fields", "classes", "index_sha256", "incarnation"}


class ItemAccess:
    """`obj["field"]` and `obj.get("field")` on a dataclass: for code written against the dict
    manifest, and summaries read like the dicts other commands return (kvdata.compact)."""

    def __getitem__(self, key: str) -> Any:
        if key in {f.name for f in dataclasses.fields(self)}:  # type: ignore[arg-type]
            return getattr(self, key)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


@dataclass(frozen=True)
class ZstCopy(ItemAccess):
    """The zstd-compressed cold copy of a sealed shard (as pushed to a home). With a seek
    table (kvdata.format.frames: its size and sha256, at the end of the file), samples can be
    read from it record by record; without one it is staged whole."""

    name: str
    bytes: int
    sha256: str
    seek_bytes: int = 0
    seek_sha256: str | None = None


@dataclass(frozen=True)
class ShardEntry(ItemAccess):
    """One sealed, immutable shard: what a reader maps and a tier stages."""

    id: int
    name: str
    records: int
    bytes: int
    sha256: str
    zst: ZstCopy | None = None


@dataclass(frozen=True)
class TailEntry(ItemAccess):
    """The open shard that takes appends; `records` of its slots are committed."""

    id: int
    name: str
    records: int


@dataclass(frozen=True)
class KeyRunEntry(ItemAccess):
    name: str
    count: int


@dataclass(frozen=True)
class IndexFiles(ItemAccess):
    """The side-index files of one generation (names under index/)."""

    samples: str | None = None
    records: str | None = None
    records_count: int = 0
    keys: tuple[KeyRunEntry, ...] = ()


@dataclass(frozen=True)
class Manifest(ItemAccess):
    """One committed generation of a dataset."""

    generation: int
    count: int
    shard_size: int
    compress: bool
    shards: tuple[ShardEntry, ...]
    tail: TailEntry
    index: IndexFiles
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    classes: tuple[str, ...] = ()
    index_sha256: dict[str, str] | None = None  # set by push: checksums of the trimmed index files
    incarnation: int = 0  # the generation a "w" rewrite started at; part of every shard/tail name
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys of a newer minor writer, kept as is

    def replace(self, **changes: Any) -> Manifest:
        return dataclasses.replace(self, **changes)

    def index_files(self) -> list[tuple[str, str, int]]:
        """(kind, file name, meaningful bytes) of every index file this generation references."""
        from .record import HASH_DTYPE, RECORD_DTYPE, SAMPLE_DTYPE

        out = []
        if self.index.samples:
            out.append(("samples", self.index.samples, self.count * SAMPLE_DTYPE.itemsize))
        if self.index.records:
            out.append(("records", self.index.records, self.index.records_count * RECORD_DTYPE.itemsize))
        for r in self.index.keys:
            out.append(("keys", r.name, 2 * r.count * HASH_DTYPE.itemsize))
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update({
            "format": FORMAT_NAME,
            "version": self.version,
            "generation": self.generation,
            "shard_size": self.shard_size,
            "compress": self.compress,
            "count": self.count,
            "shards": [_shard_json(s) for s in self.shards],
            "tail": {"id": self.tail.id, "name": self.tail.name, "records": self.tail.records},
            "index": {"samples": self.index.samples, "records": self.index.records,
                      "records_count": self.index.records_count,
                      "keys": [{"name": k.name, "count": k.count} for k in self.index.keys]},
            "fields": self.fields,
            "classes": list(self.classes),
            "incarnation": self.incarnation,
        })
        if self.index_sha256 is not None:
            out["index_sha256"] = dict(self.index_sha256)
        return out


def _shard_json(s: ShardEntry) -> dict[str, Any]:
    return {"id": s.id, "name": s.name, "records": s.records, "bytes": s.bytes, "sha256": s.sha256,
            "zst": None if s.zst is None else _zst_json(s.zst)}


def _zst_json(z: ZstCopy) -> dict[str, Any]:
    out: dict[str, Any] = {"name": z.name, "bytes": z.bytes, "sha256": z.sha256}
    if z.seek_sha256 is not None:
        out["seek"] = {"bytes": z.seek_bytes, "sha256": z.seek_sha256}
    return out


def new_manifest(shard_size: int, compress: bool, generation: int = 0) -> Manifest:
    """An empty dataset's first generation; a dataset started again at generation G > 0 is
    incarnation G, so none of its file names was ever used by an earlier incarnation."""
    return Manifest(generation=generation, count=0, shard_size=int(shard_size), compress=bool(compress), shards=(),
                    tail=TailEntry(0, names.tail_name(0, generation), 0), index=IndexFiles(), incarnation=generation)


def dump_manifest(m: Manifest | Mapping[str, Any]) -> bytes:
    data = m.to_json() if isinstance(m, Manifest) else m
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode("utf-8")


# ---------------------------------------------------------------- parsing (hostile input)


class _Bad(Exception):
    pass


MAX_DEPTH = 32  # nesting of values kept as they are (field specs, unknown keys)
_SCALARS = (str, int, float, bool, type(None))


def _show(v: Any) -> str:
    """A value from a manifest in one short line: never a huge int's digits or a deep repr."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"a {v.bit_length()}-bit integer"
    if isinstance(v, _SCALARS):
        return repr(v)[:60]
    return f"a JSON {'object' if isinstance(v, dict) else 'array' if isinstance(v, list) else type(v).__name__}"


def _shallow(v: Any, depth: int = MAX_DEPTH) -> bool:
    """Whether a JSON value nests at most `depth` levels (checked without recursion)."""
    level: list[Any] = [v]
    for _ in range(depth + 1):
        nxt: list[Any] = []
        for x in level:
            if isinstance(x, dict):
                nxt.extend(x.values())
            elif isinstance(x, list):
                nxt.extend(x)
        if not nxt:
            return True
        level = nxt
    return False


def _int(v: Any, what: str, hi: int = MAX_COUNT) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise _Bad(f"{what} must be an integer in [0, {hi}], not {_show(v)}")
    return v


def _fields(fields: dict[Any, Any]) -> dict[str, dict[str, Any]]:
    """The field schema: {name: {"type": str, "dtype": str, "shape": [int | null, ...] | null, ...}}."""
    for name, spec in fields.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("type"), str) \
                or not isinstance(spec.get("dtype", ""), str) or not _shallow(spec, 2):
            raise _Bad(f"fields[{_show(name)}] is not a field schema")
        shape = spec.get("shape")
        if shape is not None and (not isinstance(shape, list) or not all(
                d is None or (isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_COUNT) for d in shape)):
            raise _Bad(f"fields[{_show(name)}].shape is not a list of sizes")
    return fields


def _classes(classes: list[Any]) -> list[str]:
    """Class names: strings (numbers are taken as their text)."""
    out = []
    for c in classes:
        if isinstance(c, bool) or not isinstance(c, (str, int, float)) or (isinstance(c, int) and c.bit_length() > 64):
            raise _Bad(f"classes holds {_show(c)}, not a class name")
        out.append(str(c))
    return out


def _sha(v: Any, what: str) -> str:
    if not names.is_sha256(v):
        raise _Bad(f"{what} is not a sha256 hex digest")
    return str(v)


def _shard(i: int, s: Any, incarnation: int) -> ShardEntry:
    if not isinstance(s, dict):
        raise _Bad(f"shard entry {i} is not an object")
    sid = _int(s.get("id"), f"shards[{i}].id", MAX_SHARDS)
    name = s.get("name")
    if not isinstance(name, str):
        raise _Bad(f"shards[{i}].name is {_show(name)}, not a file name")
    if sid != i or name != names.shard_name(sid, incarnation):  # the one canonical name, nothing else
        raise _Bad(f"shards[{i}] has id {sid} and name {str(name)[:60]!r}; "
                   f"expected {names.shard_name(i, incarnation)!r}")
    zst = None
    z = s.get("zst")
    if z is not None:
        if not isinstance(z, dict) or z.get("name") != names.zst_name(str(name)):
            raise _Bad(f"shards[{i}].zst must name {names.zst_name(str(name))!r}")
        zbytes = _int(z.get("bytes"), f"shards[{i}].zst.bytes")
        zsha = _sha(z.get("sha256"), f"shards[{i}].zst.sha256")
        seek = z.get("seek")
        if seek is None:
            zst = ZstCopy(str(z["name"]), zbytes, zsha)
        else:
            if not isinstance(seek, dict):
                raise _Bad(f"shards[{i}].zst.seek is not an object")
            zst = ZstCopy(str(z["name"]), zbytes, zsha, _int(seek.get("bytes"), f"shards[{i}].zst.seek.bytes", zbytes),
                          _sha(seek.get("sha256"), f"shards[{i}].zst.seek.sha256"))
    return ShardEntry(sid, str(name), _int(s.get("records"), f"shards[{i}].records"),
                      _int(s.get("bytes"), f"shards[{i}].bytes"), _sha(s.get("sha256"), f"shards[{i}].sha256"), zst)


def _index(idx: Any) -> IndexFiles:
    if not isinstance(idx, dict):
        raise _Bad("index is not an object")
    files: dict[str, str | None] = {}
    for kind in ("samples", "records"):
        n = idx.get(kind)
        if n is not None and not names.is_index_name(n, kind):
            raise _Bad(f"index.{kind} {_show(n)} is not an index file name")
        files[kind] = n
    runs = idx.get("keys")
    if not isinstance(runs, list) or len(runs) > MAX_KEY_RUNS:
        raise _Bad("index.keys must be a list of key runs")
    keys = []
    for r in runs:
        if not isinstance(r, dict) or not names.is_index_name(r.get("name"), "keys"):
            raise _Bad(f"index.keys entry {_show(r.get('name') if isinstance(r, dict) else r)} is not a key run")
        keys.append(KeyRunEntry(str(r["name"]), _int(r.get("count"), "index.keys[].count")))
    return IndexFiles(files["samples"], files["records"], _int(idx.get("records_count"), "index.records_count"),
                      tuple(keys))


def manifest_from_json(m: Any, where: str) -> Manifest:
    """A validated Manifest from decoded JSON; CorruptDatasetError naming what is wrong."""
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise CorruptDatasetError(f"{where}: not a kvdata manifest; run `kvdata reindex` to rebuild it from the shards")
    version = m.get("version")
    if not isinstance(version, int):
        raise CorruptDatasetError(f"{where}: manifest has no format version; run `kvdata reindex`")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: written by format version {_show(version)}, this kvdata reads up to {FORMAT_VERSION}; upgrade kvdata"
        )
    try:
        shards = m.get("shards")
        if not isinstance(shards, list) or len(shards) > MAX_SHARDS:
            raise _Bad("shards must be a list")
        incarnation = _int(m.get("incarnation", 0), "incarnation")
        entries = tuple(_shard(i, s, incarnation) for i, s in enumerate(shards))
        t = m.get("tail")
        if not isinstance(t, dict):
            raise _Bad("tail is not an object")
        tid = _int(t.get("id"), "tail.id", MAX_SHARDS)
        if not isinstance(t.get("name"), str):
            raise _Bad(f"tail.name is {_show(t.get('name'))}, not a file name")
        if t.get("name") != names.tail_name(tid, incarnation) or tid < len(entries):
            raise _Bad(f"tail {str(t.get('name'))[:60]!r} (id {tid}) does not follow the sealed shards")
        tail = TailEntry(tid, str(t["name"]), _int(t.get("records"), "tail.records"))
        fields = m.get("fields") or {}
        classes = m.get("classes") or []
        if not isinstance(fields, dict) or not isinstance(classes, list):
            raise _Bad("fields must be an object and classes a list")
        fields, classes = _fields(fields), _classes(classes)
        for k, v in m.items():
            if k not in _KNOWN and not _shallow(v):
                raise _Bad(f"{_show(k)} nests deeper than {MAX_DEPTH} levels")
        sums = m.get("index_sha256")
        if sums is not None:
            if not isinstance(sums, dict) or not all(names.is_index_name(k) for k in sums):
                raise _Bad("index_sha256 must map index file names to checksums")
            sums = {str(k): _sha(v, f"index_sha256[{k}]") for k, v in sums.items()}
        compress = m.get("compress", True)
        if not isinstance(compress, bool):
            raise _Bad("compress must be true or false")
        return Manifest(
            generation=_int(m.get("generation"), "generation"), count=_int(m.get("count"), "count"),
            shard_size=_int(m.get("shard_size"), "shard_size"), compress=compress, shards=entries, tail=tail,
            index=_index(m.get("index")), fields=fields, classes=tuple(str(c) for c in classes),
            index_sha256=sums, incarnation=incarnation, version=version, extra={k: v for k, v in m.items() if k not in _KNOWN})
    except _Bad as e:
        raise CorruptDatasetError(f"{where}: manifest has a bad field ({e}); run `kvdata reindex`") from None


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Validated manifest; a clear error for damage or a newer version."""
    try:
        m = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, an integer of more than 4300 digits
        raise CorruptDatasetError(
            f"{where}: manifest is truncated or corrupt ({e.__class__.__name__}); "
            "run `kvdata reindex` to rebuild it from the shards"
        ) from None
    return manifest_from_json(m, where)


_MANIFEST_KEYS = {"format", *(f.name for f in dataclasses.fields(Manifest))} - {"extra"}


def checked_extra(m: Manifest, name: Any, value: Any) -> Any:
    """`value` as a manifest's extra `name` will hold it (plain JSON), checked as a reader will
    parse it, so a bad value can never make the manifest unreadable; InvalidValueError if not."""
    if not isinstance(name, str) or not name or name in _MANIFEST_KEYS:
        raise InvalidValueError(f"manifest key {name!r} is empty or one kvdata uses; choose another name")
    try:
        value = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidValueError(f"manifest key {name!r}: the value is not plain JSON ({str(e)[:200]})") from None
    try:
        manifest_from_json(json.loads(dump_manifest(m.replace(extra={name: value}))), name)
    except CorruptDatasetError:  # the one way a plain JSON value fails: too deep for a reader
        raise InvalidValueError(f"manifest key {name!r}: the value nests too deeply for a manifest; "
                                "store it as a JSON string") from None
    return value
