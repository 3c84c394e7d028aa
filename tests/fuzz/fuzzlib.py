"""Fuzz targets for every decoder of bytes that come from outside, shared by tests/fuzz and bench/fuzz.py.

A target generates one case from a `random.Random` (so a case is reproduced by its seed)
and runs it. The rule every case checks: only `kvdata.errors.KVDataError` (and its
subclasses) may escape, never IndexError/OverflowError/struct.error/ValueError/
UnicodeDecodeError/RecursionError/MemoryError and the like; CLI commands exit non-zero
with exactly one `kvdata: error:` line; and nothing is written outside the temp root.

Targets (their `name` is what tests and bench/fuzz.py report):

- record_header   RecordHeader, record_crc_ok, layout()/meta() on random and mutated records
- record_layout   make_plan / layout_plan / decode_plan on layouts (msgpack) and payloads
- record_decode   Reader.decode_value on mutated records (tail records, shards without offsets)
- manifest_json   parse_manifest / manifest_from_json on random JSON and mutated valid manifests
- manifest_store  a mutated manifest in a real dataset: open, reads, verify, mirror, a writer
- index_files     damaged, truncated, garbage index files: open, get/find/keys/describe/verify
- index_writer    a writer (put, delete, seal, commit) on damaged index files, tails and planted links
- shard_records   damaged sealed shards (record bytes, sizes) and tails (LMDB file, lock file)
- cli             `kvdata get/ls/rm/info/verify` (in process) on damaged index and manifest files
- protocol_frame  decode_body / encode round trips on random, truncated and huge-container frames
- protocol_client a fake kvdatad on a Unix socket answering with garbage frames
- caffe_datum     random and mutated Datum protobuf bytes through the importer's parse path
- caffe_import    `import_caffe` of a small LMDB with garbage keys and values

Cases that touch files run inside a `Sandbox`: HOME, XDG_* and the working directory
point into a fresh temp root, hostile names aim at its parent directory, and after each
case every file outside the allowed directories is compared with a snapshot.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import shutil
import socket
import stat
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

import kvdata
from kvdata import protocol
from kvdata.errors import KVDataError
from kvdata.format import record as rec
from kvdata.format.manifest import manifest_from_json, parse_manifest

ENV_DIRS = {"HOME": "home", "XDG_CONFIG_HOME": "config", "XDG_CACHE_HOME": "cache", "XDG_RUNTIME_DIR": "run"}
ENV_UNSET = ("KVDATA_CONFIG", "KVDATA_SOCKET", "KVDATA_S3_ADDRESSING")
ALLOWED_DIRS = ("data", "work", *ENV_DIRS.values())  # under the root: where kvdata may write
INTERESTING = (0, 1, 7, 8, 19, 20, 24, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
               1 << 32, 1 << 48, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


# ====================================================================== sandbox

class Sandbox:
    """A temp root for cases that touch files: <parent>/root/{data,work,home,config,cache,run,cwd}.

    While entered, HOME/XDG_* point into the root and the working directory is root/cwd.
    `parent` is a directory of its own, so "compare a listing of the root's parent" is
    exact: `escapes()` lists every path outside root/{data,work,home,config,cache,run} that
    appeared, changed or vanished since the last `snapshot()`."""

    def __init__(self) -> None:
        self.parent = Path(tempfile.mkdtemp(prefix="kvfuzz-")).resolve()
        self.root = self.parent / "root"
        for d in (*ALLOWED_DIRS, "cwd"):
            (self.root / d).mkdir(parents=True, mode=0o700)
        (self.parent / "bystander.txt").write_text("must stay as it is\n")
        self.work = self.root / "work"
        self._cases = 0
        self._saved_env: dict[str, str | None] = {}
        self._saved_cwd: str | None = None
        self._snap: dict[str, tuple[int, int, int]] = {}

    def __enter__(self) -> Sandbox:
        for var in (*ENV_DIRS, *ENV_UNSET):
            self._saved_env[var] = os.environ.get(var)
        for var, d in ENV_DIRS.items():
            os.environ[var] = str(self.root / d)
        for var in ENV_UNSET:
            os.environ.pop(var, None)
        self._saved_cwd = os.getcwd()
        os.chdir(self.root / "cwd")
        self.snapshot()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved_cwd is not None:
            os.chdir(self._saved_cwd)
        for var, v in self._saved_env.items():
            if v is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = v
        shutil.rmtree(self.parent, ignore_errors=True)

    def case_dir(self) -> Path:
        """A fresh directory under work/ for one case (never reused: LMDB envs are per path)."""
        self._cases += 1
        d = self.work / f"c{self._cases}"
        d.mkdir()
        return d

    def _listing(self) -> dict[str, tuple[int, int, int]]:
        out: dict[str, tuple[int, int, int]] = {}
        allowed = {self.root / d for d in ALLOWED_DIRS}
        todo = [self.parent]
        while todo:
            d = todo.pop()
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                p = Path(e.path)
                if p in allowed:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                out[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns)
                if e.is_dir(follow_symlinks=False):
                    todo.append(p)
        return out

    def snapshot(self) -> None:
        self._snap = self._listing()

    def escapes(self) -> list[str]:
        """Paths outside the allowed directories that changed since the last snapshot (then
        removes what appeared and snapshots again, so the next case starts clean)."""
        now = self._listing()
        changed = sorted({p for p in now.keys() | self._snap.keys() if now.get(p) != self._snap.get(p)})
        for p in changed:
            if p not in self._snap:
                q = Path(p)
                if q.is_dir() and not q.is_symlink():
                    shutil.rmtree(q, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        q.unlink()
        if changed:
            self.snapshot()
        return changed

    def clean_work(self) -> None:
        """Remove the case directories (the bench calls this every few hundred cases)."""
        for d in self.work.iterdir():
            shutil.rmtree(d, ignore_errors=True)


def hostile_names(parent: Path | str) -> list[str]:
    """Names a hostile manifest or index table could carry: escapes, separators, look-alikes."""
    p = str(parent)
    return ["../escape.bin", "../../escape.bin", "../../../escape.bin", "../../../../escape.bin",
            "../../../../../escape.bin", f"{p}/abs-escape.bin", f"{p}/root/abs-escape.bin", "/etc/passwd",
            "index/../../x.bin", "samples-00000001.bin/..", "", ".", "..", "a/b", "nul\x00.bin",
            "\u0660\u0660\u0660\u0660\u0660\u0660.mdb", "000000.mdb\n", " samples-00000002.bin",
            "samples-00000002.bin ", "x" * 300, "000000.mdb", "tail-000002.mdb", "samples-00000002.bin",
            "records-00000001.bin", "keys-00000002-00.bin", "../shards/000000.mdb", "000000.mdb.zst",
            f"..{os.sep}..{os.sep}escape.bin"]


# ====================================================================== random values and mutations

def rand_int(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.4:
        return rng.choice(INTERESTING) * rng.choice((1, 1, 1, -1))
    if r < 0.8:
        return rng.randint(-1000, 100000)
    if r < 0.95:
        return rng.getrandbits(rng.choice((16, 32, 63, 64, 65, 128)))
    return rng.getrandbits(rng.randint(200, 20000)) * rng.choice((1, -1))  # more digits than int() prints


def rand_str(rng: random.Random, names: list[str] | None = None) -> str:
    r = rng.random()
    if names and r < 0.4:
        return rng.choice(names)
    if r < 0.7:
        return "".join(rng.choice("abcxyz0123456789-_./") for _ in range(rng.randint(0, 12)))
    if r < 0.85:
        return "".join(chr(rng.choice((rng.randint(0, 0x7F), rng.randint(0x80, 0x7FF), rng.randint(0x800, 0xD7FF),
                                       rng.randint(0x10000, 0x10FFFF)))) for _ in range(rng.randint(1, 8)))
    return rng.choice(("k0", "k1", "late", "tail1", "image", "label", "bytes", "str", "int", "<f4", "|u1", "O",
                       "V8", "M8[ns]", "i4,i4", "(2)i4", "<U4", "S3", "float", "none", "bool", "uint"))


def rand_value(rng: random.Random, depth: int = 3, names: list[str] | None = None, binary: bool = False) -> Any:
    """A random JSON (or, with binary, msgpack) value."""
    r = rng.random()
    if depth <= 0 or r < 0.55:
        kind = rng.randrange(7 if binary else 6)
        if kind == 0:
            return None
        if kind == 1:
            return rng.random() < 0.5
        if kind == 2:
            return rand_int(rng) if binary is False else max(-(1 << 63), min((1 << 64) - 1, rand_int(rng)))
        if kind == 3:
            return rng.choice((0.0, -0.0, 1.5, 1e308, -1e308, float("nan"), float("inf"), rng.random()))
        if kind in (4, 5):
            return rand_str(rng, names)
        return rng.randbytes(rng.randint(0, 16))
    if r < 0.8:
        return [rand_value(rng, depth - 1, names, binary) for _ in range(rng.randint(0, 4))]
    return {rand_str(rng, names): rand_value(rng, depth - 1, names, binary) for _ in range(rng.randint(0, 4))}


def deep(depth: int, leaf: Any = 0, as_dict: bool = False) -> Any:
    v = leaf
    for _ in range(depth):
        v = {"k": v} if as_dict else [v]
    return v


def mutate_bytes(rng: random.Random, data: bytes, ops: int | None = None) -> bytes:
    """A few random edits: bit flips, interesting integers, truncation, insertion, deletion, splices."""
    b = bytearray(data)
    for _ in range(ops or rng.randint(1, 4)):
        op = rng.randrange(9)
        if op == 0 and b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op in (2, 3) and len(b) >= 4:
            size = 8 if op == 3 and len(b) >= 8 else 4
            at = rng.randrange(len(b) - size + 1)
            if rng.random() < 0.5:
                at -= at % size
            b[at:at + size] = (rng.choice(INTERESTING) % (1 << (8 * size))).to_bytes(size, rng.choice(("little", "big")))
        elif op == 4:
            del b[rng.randrange(len(b) + 1):]
        elif op == 5:
            at = rng.randrange(len(b) + 1)
            b[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == 6 and b:
            at = rng.randrange(len(b))
            del b[at:at + rng.randint(1, 16)]
        elif op == 7 and b:
            a = rng.randrange(len(b))
            chunk = b[a:a + rng.randint(1, 32)]
            at = rng.randrange(len(b) + 1)
            b[at:at] = chunk
        else:
            b += rng.randbytes(rng.randint(1, 64))
    return bytes(b)


def _paths(obj: Any, max_depth: int = 12) -> list[tuple]:
    """Paths (key tuples) to the values of a tree, down to max_depth (iteratively: trees may be deep)."""
    out: list[tuple] = []
    todo: list[tuple[tuple, Any]] = [((), obj)]
    while todo:
        prefix, v = todo.pop()
        out.append(prefix)
        if len(prefix) >= max_depth:
            continue
        if isinstance(v, dict):
            todo.extend((prefix + (k,), x) for k, x in v.items())
        elif isinstance(v, list):
            todo.extend((prefix + (i,), x) for i, x in enumerate(v))
    return out  # in a stable order (dicts keep theirs): a case is reproduced from its seed


def mutate_tree(rng: random.Random, obj: Any, names: list[str], binary: bool = False, ops: int | None = None) -> Any:
    """Replace, delete, deepen or retype values at random paths of a JSON-like tree (a copy)."""
    obj = json.loads(json.dumps(obj)) if not binary else msgpack.unpackb(msgpack.packb(obj), strict_map_key=False)
    for _ in range(ops or rng.randint(1, 3)):
        paths = [p for p in _paths(obj) if p]
        if not paths:
            return rand_value(rng, 3, names, binary)
        path = rng.choice(paths)
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        r = rng.random()
        if r < 0.15 and isinstance(parent, dict):
            del parent[key]
        elif r < 0.2:
            # (msgpack's packer stops at 511 levels; deeper msgpack comes from raw bytes instead)
            parent[key] = deep(rng.choice((50, 200, 400) if binary else (50, 200, 900, 3000)), parent[key],
                               rng.random() < 0.5)
        elif r < 0.45 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            v = rand_int(rng)
            parent[key] = v if not binary else max(-(1 << 63), min((1 << 64) - 1, v))
        elif r < 0.65 and isinstance(parent[key], str):
            parent[key] = rng.choice(names) if rng.random() < 0.7 else rand_str(rng, names)
        else:
            parent[key] = rand_value(rng, 3, names, binary)
    return obj


# ====================================================================== outcomes

@dataclass
class Failure:
    """One case that broke a rule: the exception (or rule) and where it came from."""

    target: str
    kind: str            # exception type name, "escape" or "cli-output"
    message: str
    where: str           # innermost frame inside kvdata, else the innermost frame
    detail: str = ""     # the case input, abbreviated

    def line(self) -> str:
        return f"{self.target}: {self.kind} at {self.where}: {self.message[:200]}"


def describe_exception(target: str, e: BaseException, detail: str = "") -> Failure:
    tb = traceback.extract_tb(e.__traceback__)
    ours = [f for f in tb if "/kvdata/" in f.filename or "/daemon/" in f.filename] or list(tb)
    where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} ({ours[-1].name})" if ours else "?"
    try:
        msg = str(e).splitlines()[0] if str(e) else ""
    except Exception:  # noqa: BLE001 - a message that cannot be printed is still a failure to report
        msg = "<unprintable>"
    return Failure(target, type(e).__name__, msg, where, detail)


def abbreviate(v: Any, n: int = 300) -> str:
    try:
        s = repr(v)
    except (RecursionError, ValueError):
        s = f"<{type(v).__name__}>"
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


def allowed(fn: Callable[[], Any]) -> bool:
    """Run fn; True if it returned, False if it raised a KVDataError; anything else propagates."""
    try:
        fn()
        return True
    except KVDataError:
        return False


# ====================================================================== the shared context

@dataclass
class Ctx:
    """What targets share: the sandbox, a pristine dataset to copy, a reader for decode_value."""

    sandbox: Sandbox
    dataset: Path
    keys: list[str]
    records: dict[str, bytes]                 # sample encoded records, seeds for mutations
    store: Any = None
    _datum: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return hostile_names(self.sandbox.parent)

    def datum(self) -> Any:
        if self._datum is None:
            from kvdata.importers.caffe import datum_class
            self._datum = datum_class()
        return self._datum

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        daemon = self.extra.pop("daemon", None)
        if daemon is not None:
            daemon.close()

    def sealed_offsets(self) -> dict[str, list[int]]:
        """Known record offsets of each sealed shard file of the pristine dataset (by relative path)."""
        if "offsets" not in self.extra:
            out: dict[str, list[int]] = {}
            with kvdata.open(self.dataset) as s:
                index = s.reader().gen.index
                for e in s.manifest.shards:
                    rows = index.records[index.base[e.id]:index.base[e.id + 1]]
                    out[f"shards/{e.name}"] = [int(o) for o in rows["offset"] if int(o) != int(rec.UNKNOWN_OFFSET)]
            self.extra["offsets"] = out
        return self.extra["offsets"]


def build_dataset(root: Path) -> list[str]:
    """A small dataset that has every structure a decoder reads: two sealed shards (raw and
    field records, an overwrite and a delete), records in the tail, two key runs.
    Returns its keys in sample order."""
    rng = np.random.default_rng(0)

    def val(i: int) -> Any:
        if i % 3 == 0:
            return rng.integers(0, 256, 300 + i, dtype=np.uint8).tobytes()
        return {"image": np.arange(60, dtype=np.uint8).reshape(6, 10) + i, "label": i, "name": f"n{i}",
                "f": 1.5, "b": b"xy", "ok": True, "z": None, "u": 1 << 63, "v": np.arange(3, dtype="<f4")}

    with kvdata.open(root, "a", shard_size="64KB", compress=True) as s:
        for i in range(6):
            s.put(f"k{i}", val(i), label=i)
        s.seal()
        for i in range(6, 10):
            s.put(f"k{i}", val(i), label=i)
        s.commit()
        s.seal()
        s.put("k1", b"over")
        s.delete("k2")
        s.put("late", {"x": np.ones((3,), "<f4"), "s": "text"})
        s.commit()
        s.put("tail1", b"t")
        s.put("tail2", {"y": np.zeros((2, 2), "<i8"), "s": "\u00e9"})
        s.commit()
    with kvdata.open(root) as s:
        return list(s.keys())


@contextlib.contextmanager
def context() -> Iterator[Ctx]:
    """A sandbox (entered) with the pristine dataset and sample records."""
    with Sandbox() as sb:
        ds = sb.root / "data" / "pristine"
        keys = build_dataset(ds)
        records = {
            "raw": rec.encode_record("rawkey", b"payload bytes", 3)[0],
            "fields": rec.encode_record("fkey", {"a": np.arange(6, dtype="<f4").reshape(2, 3), "s": "t\u00e9xt",
                                                 "b": b"\x00\x01", "i": -5, "u": 1 << 63, "f": 2.5, "t": True,
                                                 "n": None}, 7)[0],
            "tombstone": rec.encode_tombstone("gone"),
            "empty": rec.encode_record("e", {})[0],
        }
        sb.snapshot()
        ctx = Ctx(sb, ds, keys, records)
        try:
            ctx.store = kvdata.open(ds)
            yield ctx
        finally:
            ctx.close()


# ====================================================================== targets

@dataclass
class Target:
    name: str
    gen: Callable[[random.Random, Ctx], Any]
    run: Callable[[Any, Ctx], None]
    files: bool = False          # writes files: check the sandbox after each case
    weight: int = 10             # share of bench/fuzz.py's cases


TARGETS: dict[str, Target] = {}


def target(name: str, files: bool = False, weight: int = 10) -> Callable[[Callable[[random.Random, Ctx], Any]],
                                                                          Callable[[random.Random, Ctx], Any]]:
    """Register `gen` (decorated) under `name`; its runner is `run_<name>` (set below)."""
    def deco(gen: Callable[[random.Random, Ctx], Any]) -> Callable[[random.Random, Ctx], Any]:
        TARGETS[name] = Target(name, gen, lambda case, ctx: None, files, weight)
        return gen
    return deco


def runner(name: str) -> Callable[[Callable[[Any, Ctx], None]], Callable[[Any, Ctx], None]]:
    def deco(fn: Callable[[Any, Ctx], None]) -> Callable[[Any, Ctx], None]:
        TARGETS[name].run = fn
        return fn
    return deco


def run_case(t: Target, case: Any, ctx: Ctx) -> list[Failure]:
    """Run one case; the rule violations it showed (empty: it passed)."""
    out: list[Failure] = []
    try:
        t.run(case, ctx)
    except KVDataError:
        pass
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - every other exception is what we are looking for
        out.append(describe_exception(t.name, e, abbreviate(case)))
    if t.files:
        esc = ctx.sandbox.escapes()
        if esc:
            out.append(Failure(t.name, "escape", f"{len(esc)} path(s) written outside the temp root: {esc[:5]}",
                               "sandbox", abbreviate(case)))
    return out


# ---------------------------------------------------------------------- record_header

@target("record_header", weight=14)
def gen_record_header(rng: random.Random, ctx: Ctx) -> bytes:
    r = rng.random()
    if r < 0.2:
        return rng.randbytes(rng.randint(0, 64))
    base = ctx.records[rng.choice(sorted(ctx.records))]
    if r < 0.35:  # a valid prefix with random lengths over random bytes
        body = rng.randbytes(rng.randint(0, 200))
        return rec.PREFIX.pack(rec.MAGIC, rng.randrange(4), rng.randrange(3), 0, rng.choice(INTERESTING) & 0xFFFFFFFF,
                               rng.choice(INTERESTING) & 0xFFFFFFFF, rng.randint(0, 64), 0) + body
    return mutate_bytes(rng, base)


@runner("record_header")
def run_record_header(buf: bytes, ctx: Ctx) -> None:
    rec.record_crc_ok(buf)
    rec.record_crc_ok(memoryview(buf))
    h = rec.RecordHeader(buf)
    allowed(lambda: rec.field_schema(h.layout(buf)))
    allowed(lambda: h.meta(buf))
    allowed(lambda: rec.RecordHeader(memoryview(buf)).meta(memoryview(buf)))


# ---------------------------------------------------------------------- record_layout

def _valid_layout(rng: random.Random) -> list:
    fields: dict[str, Any] = {}
    for i in range(rng.randint(0, 5)):
        k = rng.randrange(6)
        fields[f"f{i}"] = (np.zeros(tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3))),
                                    dtype=rng.choice(("<f4", "|u1", "<i8", ">f8", "|b1", "<c8", "<f2")))
                           if k == 0 else b"xy" if k == 1 else "s" if k == 2 else rng.randint(-5, 5) if k == 3
                           else 1.5 if k == 4 else None)
    return rec.encode_record("k", fields)[2]


@target("record_layout", weight=12)
def gen_record_layout(rng: random.Random, ctx: Ctx) -> tuple[Any, bytes]:
    r = rng.random()
    payload = rng.randbytes(rng.choice((0, 8, 24, 64, 200)))
    if r < 0.15:
        return rng.randbytes(rng.randint(0, 48)), payload
    if r < 0.3:
        return rand_value(rng, 3, ["bytes", "str", "int", "uint", "float", "bool", "none", "<f4", "|u1", "O"],
                          binary=True), payload
    layout = _valid_layout(rng)
    if r < 0.4:
        return layout, payload
    codes = ["bytes", "str", "int", "uint", "float", "bool", "none", "<f4", "|u1", "O", "V8", "<U2", "i4,i4",
             "(2)i4", "M8[ns]", "float32", "=f4", "<f4 ", "|S3", "object", "f"]
    return mutate_tree(rng, layout or [["a", "<f4", [2], 0, 8]], codes, binary=True), payload


@runner("record_layout")
def run_record_layout(case: tuple[Any, bytes], ctx: Ctx) -> None:
    layout, payload = case
    layout_b = layout if isinstance(layout, bytes) else msgpack.packb(layout, use_bin_type=True)
    plan = rec.layout_plan(layout_b)
    if not isinstance(layout, bytes):
        rec.make_plan(layout)
    u8 = np.frombuffer(payload, np.uint8)
    for copy in (False, True):
        rec.decode_plan(plan, u8, memoryview(payload), 0, copy)
        rec.decode_plan(plan, u8, memoryview(payload), min(8, len(payload)), copy, len(payload))


# ---------------------------------------------------------------------- record_decode

@target("record_decode", weight=10)
def gen_record_decode(rng: random.Random, ctx: Ctx) -> bytes:
    if rng.random() < 0.1:
        return rng.randbytes(rng.randint(0, 64))
    base = ctx.records[rng.choice(sorted(ctx.records))]
    if rng.random() < 0.3:  # a layout that parses, over a payload that does not match it
        lay = msgpack.packb(mutate_tree(rng, _valid_layout(rng) or [["a", "|u1", [1], 0, 1]], ["<f4", "str"],
                                        binary=True))
        meta = msgpack.packb({"k": "x"})
        head = (rec.PREFIX_SIZE + len(lay) + len(meta) + 7) & ~7
        body = bytearray(rec.PREFIX.pack(rec.MAGIC, rec.KIND_FIELDS, 1, 0, head, len(lay), len(meta), 0) + lay + meta)
        body += b"\x00" * (head - len(body)) + rng.randbytes(rng.randint(0, 64))
        return bytes(body)
    return mutate_bytes(rng, base)


@runner("record_decode")
def run_record_decode(v: bytes, ctx: Ctx) -> None:
    reader = ctx.store.reader()
    allowed(lambda: reader.decode_value(v, False))
    reader.decode_value(v, True)


# ---------------------------------------------------------------------- manifest_json

def pristine_manifest(ctx: Ctx) -> dict[str, Any]:
    if "manifest" not in ctx.extra:
        ctx.extra["manifest"] = json.loads((ctx.dataset / "manifest.json").read_text())
    return ctx.extra["manifest"]


@target("manifest_json", weight=14)
def gen_manifest_json(rng: random.Random, ctx: Ctx) -> bytes | Any:
    r = rng.random()
    valid = pristine_manifest(ctx)
    if r < 0.1:
        return rng.randbytes(rng.randint(0, 64))
    if r < 0.2:
        v = rand_value(rng, 4, ctx.names)
        try:
            return json.dumps(v).encode()
        except ValueError:  # an int of more than 4300 digits: json cannot write it, so give it as is
            return v
    if r < 0.3:
        return mutate_bytes(rng, json.dumps(valid).encode())
    if r < 0.35:
        return rng.choice((b"[" * 100000, b'{"a":' * 50000, b'{"format":"kvdata","version":1,"count":' + b"9" * 5000 + b"}",
                           b'{"format":"kvdata","version":' + b"9" * 4400 + b"}", b"\xff\xfe{}", b'{"format":"kvdata"}'))
    tree = mutate_tree(rng, valid, ctx.names)
    if rng.random() < 0.5:
        return tree
    try:
        return json.dumps(tree).encode()
    except (ValueError, RecursionError):
        return tree


@runner("manifest_json")
def run_manifest_json(case: Any, ctx: Ctx) -> None:
    m = parse_manifest(case, "fuzz/manifest.json") if isinstance(case, bytes) else manifest_from_json(case, "fuzz")
    m.index_files()
    m.to_json()
    for s in m.shards:  # every name that passed must stay a plain name under its directory
        _check_plain(s.name)
        if s.zst is not None:
            _check_plain(s.zst.name)
    _check_plain(m.tail.name)
    for _kind, name, _size in m.index_files():
        _check_plain(name)
    for name in m.index_sha256 or {}:
        _check_plain(name)


def _check_plain(name: str) -> None:
    if not name or "/" in name or "\x00" in name or name in (".", "..") or name.startswith(".") or len(name) > 255:
        raise AssertionError(f"parse_manifest accepted the file name {name!r}")


# ---------------------------------------------------------------------- damaged datasets

@dataclass
class Damage:
    """One edit of one file of a dataset copy (relative path, what, parameters)."""

    path: str
    op: str
    arg: Any = None

    def __repr__(self) -> str:
        return f"Damage({self.path!r}, {self.op!r}, {abbreviate(self.arg, 80)})"


def files_of(ds: Path, under: str) -> list[str]:
    return sorted(str(p.relative_to(ds)) for p in (ds / under).iterdir() if p.is_file())


def gen_damage(rng: random.Random, ctx: Ctx, rel: str) -> Damage:
    data = (ctx.dataset / rel).read_bytes()
    r = rng.random()
    if r < 0.45:
        return Damage(rel, "bytes", mutate_bytes(rng, data))
    if r < 0.6:  # an interesting integer at a row-aligned position (index rows are 8/16/24 bytes)
        size = rng.choice((4, 8))
        at = rng.randrange(max(1, len(data) // size)) * size
        return Damage(rel, "int", (at, size, rng.choice(INTERESTING) % (1 << (8 * size))))
    if r < 0.75:
        return Damage(rel, "truncate", rng.randrange(len(data) + 1) if data else 0)
    if r < 0.85:
        return Damage(rel, "bytes", rng.randbytes(rng.randint(0, 2 * len(data) + 8)))
    return Damage(rel, rng.choice(("remove", "dir", "empty", "symlink-out", "symlink-loop")))


def apply_damage(ds: Path, d: Damage, sandbox: Sandbox) -> None:
    p = ds / d.path
    if p.is_symlink():  # an earlier damage planted a link: never write through it (that would be our escape)
        raise OSError(errno.ELOOP, "already a symbolic link", str(p))
    if d.op == "bytes":
        p.write_bytes(d.arg)
    elif d.op == "int":
        at, size, value = d.arg
        with open(p, "r+b") as f:
            f.seek(at)
            f.write(value.to_bytes(size, "little"))
    elif d.op == "truncate":
        os.truncate(p, d.arg)
    elif d.op == "remove":
        p.unlink()
    elif d.op == "dir":
        p.unlink()
        p.mkdir()
    elif d.op == "empty":
        p.write_bytes(b"")
    elif d.op == "symlink-out":  # a planted link to a file outside the dataset
        target_file = sandbox.parent / "bystander.txt"
        p.unlink()
        p.symlink_to(target_file)
    elif d.op == "symlink-loop":
        p.unlink()
        p.symlink_to(p.name)
    else:
        raise ValueError(d.op)


def fresh_copy(ctx: Ctx, damages: list[Damage]) -> Path:
    ds = ctx.sandbox.case_dir() / "ds"
    shutil.copytree(ctx.dataset, ds, symlinks=True)
    for d in damages:
        with contextlib.suppress(OSError):  # an earlier damage removed or replaced the file
            apply_damage(ds, d, ctx.sandbox)
    return ds


def exercise(ds: Path, keys: list[str]) -> None:
    """Every read entry point on a (possibly damaged) dataset; each may fail only with KVDataError."""
    from kvdata.store.inspection import describe
    from kvdata.store.verify import verify_store

    try:
        store = kvdata.open(ds)
    except KVDataError:
        return
    with store:
        n = len(store)
        allowed(lambda: store.get_many(list(range(n))))
        allowed(lambda: store.get_many(list(range(n))[::-1], copy=True))
        for i in range(n):
            allowed(lambda i=i: store[i])
            allowed(lambda i=i: store.record_info(i))
        for k in (*keys, "missing-key", "k1", "tail2"):
            allowed(lambda k=k: store.find(k))
            allowed(lambda k=k: store.get(k))
            allowed(lambda k=k: k in store)
        allowed(lambda: list(store.keys()))
        allowed(lambda: describe(store.reader()))
        allowed(lambda: store.describe(1, 3))
        allowed(lambda: store.metas(list(range(n))))
        allowed(lambda: (store.labels, store.sample_shards, store.fields, store.classes))
        allowed(lambda: verify_store(store))
        allowed(lambda: store.refresh())


@target("index_files", files=True, weight=8)
def gen_index_files(rng: random.Random, ctx: Ctx) -> list[Damage]:
    rels = files_of(ctx.dataset, "index")
    return [gen_damage(rng, ctx, rng.choice(rels)) for _ in range(rng.choice((1, 1, 1, 2)))]


@runner("index_files")
def run_index_files(damages: list[Damage], ctx: Ctx) -> None:
    exercise(fresh_copy(ctx, damages), ctx.keys)


@target("index_writer", files=True, weight=3)
def gen_index_writer(rng: random.Random, ctx: Ctx) -> list[Damage]:
    rels = files_of(ctx.dataset, "index") + [r for r in files_of(ctx.dataset, "shards") if "tail" in r]
    return [gen_damage(rng, ctx, rng.choice(rels)) for _ in range(rng.choice((1, 1, 2)))]


@runner("index_writer")
def run_index_writer(damages: list[Damage], ctx: Ctx) -> None:
    """A writer on a dataset whose index (or tail) is damaged or holds planted links: it appends,
    deletes (a rewrite), seals and commits -- or refuses with a KVDataError; it never writes
    through a link to outside the dataset."""
    ds = fresh_copy(ctx, damages)
    with kvdata.open(ds, "a") as w:
        w.put("fuzz-new", b"x" * 100)
        with contextlib.suppress(KeyError):  # (the damage may have hidden it: delete of a missing key)
            allowed(lambda: w.delete("k3"))
        w.seal()
        w.put("fuzz-tail", {"a": np.ones(2)})
        w.commit()


@target("shard_records", files=True, weight=8)
def gen_shard_records(rng: random.Random, ctx: Ctx) -> list[Damage]:
    rels = [r for r in files_of(ctx.dataset, "shards") if r.endswith(".mdb") or r.endswith("-lock")]
    rel = rng.choice(rels)
    if "tail" not in rel and rng.random() < 0.7:
        # sealed shards: damage record bytes in place (same size), which readers slice by offset
        data = bytearray((ctx.dataset / rel).read_bytes())
        offs = ctx.sealed_offsets().get(rel, [])
        if offs:
            off = rng.choice(offs)
            span = bytes(data[off:off + 160])
            data[off:off + len(span)] = mutate_bytes(rng, span).ljust(len(span), b"\x00")[:len(span)]
            return [Damage(rel, "bytes", bytes(data))]
    if "tail" in rel and "lock" not in rel and rng.random() < 0.5:
        return [Damage(rel, "truncate", rng.randrange(len((ctx.dataset / rel).read_bytes())))]
    return [gen_damage(rng, ctx, rel)]


@runner("shard_records")
def run_shard_records(damages: list[Damage], ctx: Ctx) -> None:
    exercise(fresh_copy(ctx, damages), ctx.keys)


@target("manifest_store", files=True, weight=5)
def gen_manifest_store(rng: random.Random, ctx: Ctx) -> tuple[Any, bool]:
    tree = mutate_tree(rng, pristine_manifest(ctx), ctx.names, ops=rng.randint(1, 2))
    return tree, rng.random() < 0.3


@runner("manifest_store")
def run_manifest_store(case: tuple[Any, bool], ctx: Ctx) -> None:
    """A mutated manifest in a copy of the dataset: reads, verify, an index mirror (the remote-home
    path, here from a local "home"), and (sometimes) a writer that appends and commits."""
    from kvdata.homes import open_home
    from kvdata.sync.mirror import mirror

    tree, write = case
    ds = fresh_copy(ctx, [])
    try:
        text = json.dumps(tree, indent=1).encode()
    except (ValueError, RecursionError):
        return
    (ds / "manifest.json").write_bytes(text)
    exercise(ds, ctx.keys)

    def mirrored() -> None:
        home = open_home(str(ds))
        try:
            mirror(home, ctx.sandbox.root / "cache" / "kvdata" / "datasets")
        finally:
            home.close()
    allowed(mirrored)
    if write:
        def append() -> None:
            with kvdata.open(ds, "a") as w:
                w.put("fuzz-new", b"new")
                w.commit()
        allowed(append)


# ---------------------------------------------------------------------- cli

CLI_COMMANDS = (("get", "{ds}", "k4"), ("get", "{ds}", "k3", "--json"), ("get", "{ds}", "tail2", "--field", "s"),
                ("ls", "{ds}", "-l"), ("ls", "{ds}", "--json"), ("info", "{ds}"), ("info", "{ds}", "--json"),
                ("rm", "{ds}", "k5"), ("verify", "{ds}"), ("get", "{ds}", "late", "--json"))


@dataclass
class CliResult:
    rc: int
    out: bytes
    err: str


def run_cli(args: list[str]) -> CliResult:
    """`kvdata ARGS` in this process (click's main, as the console script calls it); an exception
    that escapes it is what a user would see as a traceback, so it propagates."""
    from kvdata.cli import main

    out = io.BytesIO()
    err = io.StringIO()
    stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    rc = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
        try:
            main.main(args=args, prog_name="kvdata")
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    stdout.flush()
    return CliResult(rc, out.getvalue(), err.getvalue())


def check_cli_output(r: CliResult, args: list[str]) -> None:
    """A failed command prints exactly one `kvdata: error:` line (verify: BAD lines first)."""
    if r.rc == 0:
        return
    lines = r.err.splitlines()
    errors = [x for x in lines if x.startswith("kvdata: error:")]
    others = [x for x in lines if not x.startswith("kvdata: error:") and not (args[0] == "verify" and x.startswith("BAD"))]
    if len(errors) != 1 or others or not r.err.endswith("\n"):
        raise CliOutputError(f"`kvdata {' '.join(args)}` exited {r.rc} with stderr {r.err[:300]!r}")


class CliOutputError(AssertionError):
    pass


@target("cli", files=True, weight=4)
def gen_cli(rng: random.Random, ctx: Ctx) -> tuple[list[Damage], list[str]]:
    rels = files_of(ctx.dataset, "index") + ["manifest.json"]
    rel = rng.choice(rels)
    if rel == "manifest.json" and rng.random() < 0.6:
        tree = mutate_tree(rng, pristine_manifest(ctx), ctx.names)
        try:
            dmg = Damage(rel, "bytes", json.dumps(tree).encode())
        except (ValueError, RecursionError):
            dmg = Damage(rel, "truncate", 10)
    else:
        dmg = gen_damage(rng, ctx, rel)
    return [dmg], list(rng.choice(CLI_COMMANDS))


@runner("cli")
def run_cli_case(case: tuple[list[Damage], list[str]], ctx: Ctx) -> None:
    damages, cmd = case
    ds = fresh_copy(ctx, damages)
    args = [a.format(ds=ds) for a in cmd]
    check_cli_output(run_cli(args), args)


# ---------------------------------------------------------------------- protocol_frame

def _valid_messages() -> list[dict[str, Any]]:
    sha = "ab" * 32
    return [{"t": "hello", "id": 1, "version": 1, "pid": 123}, {"t": "open", "id": 2, "dataset": "/data/x.kv"},
            {"t": "announce", "id": 3, "dataset": "s3://b/x", "reader": "r0", "shards": list(range(20)), "position": 3},
            {"t": "need", "id": 4, "dataset": "/d", "shard": 7, "sha256": sha},
            {"t": "want", "id": 5, "dataset": "/d", "shards": [[1, sha], [2, sha]]},
            {"id": 6, "ok": False, "error": "no such dataset", "code": "bad_request"},
            {"id": 7, "ok": True, "path": "/t/x.mdb", "staged": True}]


@target("protocol_frame", weight=12)
def gen_protocol_frame(rng: random.Random, ctx: Ctx) -> bytes:
    r = rng.random()
    if r < 0.2:
        return rng.randbytes(rng.randint(0, 48))
    if r < 0.3:  # containers declaring huge lengths (array32/map32/str32/bin32 headers)
        code = rng.choice((b"\xdd", b"\xdf", b"\xdb", b"\xc6", b"\xc9", b"\xdc", b"\xde"))
        n = rng.choice((0xFFFFFFFF, protocol.MAX_ITEMS + 1, 1 << 24, 70000)) & (0xFFFF if code in (b"\xdc", b"\xde") else
                                                                              0xFFFFFFFF)
        width = 2 if code in (b"\xdc", b"\xde") else 4
        return b"\x81\xa1t" + code + n.to_bytes(width, "big") + rng.randbytes(rng.randint(0, 32))
    if r < 0.4:  # many small containers, deep nesting
        kind = rng.randrange(3)
        if kind == 0:
            return b"\x81\xa1t\xdd" + (protocol.MAX_CONTAINERS + 5).to_bytes(4, "big") + b"\x90" * (protocol.MAX_CONTAINERS + 5)
        if kind == 1:
            return b"\x81\xa1t" + b"\x91" * rng.choice((100, 1000, 5000)) + b"\xc0"
        return b"\x81\xa1t" + b"\x81\xa1k" * rng.choice((100, 1000, 5000)) + b"\xc0"
    msg = rng.choice(_valid_messages())
    if r < 0.7:
        return mutate_bytes(rng, msgpack.packb(msg, use_bin_type=True))
    return msgpack.packb(mutate_tree(rng, msg, ["hello", "/etc/passwd", "../x", "ab" * 32], binary=True), use_bin_type=True)


@runner("protocol_frame")
def run_protocol_frame(body: bytes, ctx: Ctx) -> None:
    msg = protocol.decode_body(body)
    again = protocol.decode_body(protocol.encode(msg)[protocol.HEADER.size:])
    if type(again) is not dict:
        raise AssertionError("a decoded frame did not round-trip to a map")


# ---------------------------------------------------------------------- protocol_client

class FakeDaemon:
    """A Unix socket that answers every connection's first frame with the bytes it is given."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.reply = b""

    def serve_one(self) -> threading.Thread:
        def run() -> None:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    head = _recv_exact(conn, protocol.HEADER.size)
                    _recv_exact(conn, protocol.HEADER.unpack(head)[0])
                    conn.sendall(self.reply)
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(65536):  # until the client hangs up
                        pass
                except OSError:
                    pass
        t = threading.Thread(target=run, name="fake-kvdatad", daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise OSError(errno.ECONNRESET, "closed")
        buf += chunk
    return buf


@target("protocol_client", weight=3)
def gen_protocol_client(rng: random.Random, ctx: Ctx) -> bytes:
    hello = {"id": 1, "ok": True, "version": 1, "pid": 1}
    r = rng.random()
    if r < 0.15:
        return rng.randbytes(rng.randint(0, 40))
    if r < 0.3:  # a declared length past the limit, or a body shorter than declared
        return protocol.HEADER.pack(rng.choice((protocol.MAX_FRAME + 1, 0xFFFFFFFF, 100, 1 << 20))) + rng.randbytes(20)
    if r < 0.4:
        err: Any = rng.choice(("line one\nline two", "", (1 << 64) - 1, b"\xff", None, "x" * 100000, [1, [2]], {"a": 1}))
        return protocol.encode({"id": 1, "ok": False, "error": err})
    if r < 0.5:  # deep nesting (deeper than msgpack's packer goes): in the error, or as the id
        nest = rng.choice((b"\x91", b"\x81\xa1k")) * rng.choice((600, 1000, 1100))
        body = (b"\x83\xa2id\x01\xa2ok\xc2\xa5error" if rng.random() < 0.5 else b"\x82\xa2ok\xc3\xa2id") + nest + b"\xc0"
        return protocol.HEADER.pack(len(body)) + body
    if r < 0.55:
        return protocol.encode({"id": rng.choice((2, "1", None, [1], (1 << 64) - 1, -1)), "ok": True})
    body = msgpack.packb(mutate_tree(rng, hello, ["ok", "id", "error"], binary=True), use_bin_type=True) \
        if r < 0.8 else mutate_bytes(rng, msgpack.packb(hello))
    return protocol.HEADER.pack(len(body)) + body


@runner("protocol_client")
def run_protocol_client(reply: bytes, ctx: Ctx) -> None:
    daemon = ctx.extra.get("daemon")
    if daemon is None:
        daemon = ctx.extra["daemon"] = FakeDaemon(ctx.sandbox.root / "run" / "fake.sock")
    daemon.reply = reply
    t = daemon.serve_one()
    try:
        client = protocol.Client(daemon.path, timeout=5)
        client.close()
    finally:
        t.join(10)


# ---------------------------------------------------------------------- caffe_datum

def _datum_seeds(ctx: Ctx) -> list[bytes]:
    if "datums" not in ctx.extra:
        from PIL import Image

        D = ctx.datum()
        png = io.BytesIO()
        Image.new("RGB", (4, 3), (1, 2, 3)).save(png, "PNG")
        gray = io.BytesIO()
        Image.new("L", (2, 2), 9).save(gray, "PNG")
        ctx.extra["datums"] = [
            D(channels=3, height=2, width=2, data=bytes(range(12)), label=3).SerializeToString(),
            D(channels=1, height=2, width=3, float_data=[0.5] * 6, label=-1).SerializeToString(),
            D(channels=3, height=3, width=4, data=png.getvalue(), label=1, encoded=True).SerializeToString(),
            D(channels=1, height=2, width=2, data=gray.getvalue(), label=2, encoded=True).SerializeToString(),
            D(data=b"\xff\xd8\xff\xe0" + bytes(40), encoded=True).SerializeToString(),
        ]
    return ctx.extra["datums"]


@target("caffe_datum", weight=8)
def gen_caffe_datum(rng: random.Random, ctx: Ctx) -> tuple[bytes, bool]:
    r = rng.random()
    if r < 0.2:
        data = rng.randbytes(rng.randint(0, 64))
    elif r < 0.3:  # nested groups, huge varints, lengths past the end
        data = rng.choice((b"\x0b" * rng.randint(1, 5000), b"\x08" + b"\xff" * 10 + b"\x01",
                           b"\x22" + b"\xff\xff\xff\xff\x0f" + b"x", b"\x32\x80\x80\x80\x80\x10" + bytes(8)))
    else:
        data = mutate_bytes(rng, rng.choice(_datum_seeds(ctx)))
    return data, rng.random() < 0.3


@runner("caffe_datum")
def run_caffe_datum(case: tuple[bytes, bool], ctx: Ctx) -> None:
    from kvdata.importers import caffe

    data, keep = case
    datum = caffe._parse(Path("src.lmdb"), "00000000_x", data, ctx.datum())
    caffe.datum_to_value(datum, "00000000_x", keep_encoded=keep, where="src.lmdb")


@target("caffe_import", files=True, weight=1)
def gen_caffe_import(rng: random.Random, ctx: Ctx) -> list[tuple[bytes, bytes]]:
    seeds = _datum_seeds(ctx)
    out = []
    for i in range(rng.randint(1, 4)):
        r = rng.random()
        key = f"{i:08d}_img{i}.jpg".encode() if r < 0.8 else rng.randbytes(rng.randint(1, 12))
        v = rng.choice(seeds[:2])
        v = v if rng.random() < 0.4 else mutate_bytes(rng, rng.choice(seeds)) if rng.random() < 0.7 \
            else rng.randbytes(rng.randint(0, 40))
        out.append((key, v))
    return out


@runner("caffe_import")
def run_caffe_import(records: list[tuple[bytes, bytes]], ctx: Ctx) -> None:
    import lmdb

    from kvdata.importers.caffe import import_caffe

    d = ctx.sandbox.case_dir()
    env = lmdb.open(str(d / "src"), map_size=1 << 22)
    try:
        with env.begin(write=True) as txn:
            for k, v in records:
                txn.put(k, v)
    finally:
        env.close()
    import_caffe(d / "src", d / "ds", progress=False)


# ====================================================================== helpers for the tests

FUZZ_SCALE = float(os.environ.get("KVDATA_FUZZ_SCALE", "1"))  # more examples locally: KVDATA_FUZZ_SCALE=10


def fuzz_settings(examples: int) -> Any:
    """Hypothesis settings of the CI fuzz tests: deterministic (derandomize, no example database),
    `examples` cases (times $KVDATA_FUZZ_SCALE), no deadline (2 shared cores), no health checks
    (slow and large examples are the point)."""
    from hypothesis import HealthCheck, settings

    return settings(max_examples=max(1, int(examples * FUZZ_SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


def check(name: str, case: Any, ctx: Ctx) -> None:
    """Run one case of target `name` and fail (AssertionError) on any rule it breaks."""
    failures = run_case(TARGETS[name], case, ctx)
    if failures:
        raise AssertionError("; ".join(f.line() for f in failures) + f" -- case {abbreviate(case)}")


def is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


__all__ = ["Ctx", "Damage", "Failure", "Sandbox", "TARGETS", "Target", "apply_damage", "build_dataset", "check",
           "check_cli_output", "context", "exercise", "fresh_copy", "fuzz_settings", "hostile_names", "mutate_bytes",
           "mutate_tree", "rand_value", "run_case", "run_cli"]
