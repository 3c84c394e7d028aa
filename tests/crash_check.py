"""Kill-a-writer crash harness, shared by tests/integration/test_crash.py and bench/crash_kill.py.

A child (tests/crash_writer.py) puts, overwrites and deletes records in a loop, committing
after each batch, until it is SIGKILLed. Around every commit it keeps a journal (JSON lines,
each fsync'ed):

    {"t": "init",   "gen": G}                         the dataset exists, empty, at generation G
    {"t": "start",  "n": R}                           restart R of the child begins writing
    {"t": "intent", "gen": G, "put": {key: [version, digest]}, "del": [key, ...]}
                                                      written BEFORE commit(); G = expected generation
    {"t": "done",   "gen": G}                         written AFTER commit() returned G
    {"t": "abort",  "gen": G}                         a restarted child found the intent never landed

A kill between intent and done leaves the intent outstanding: the dataset must then be at G
(the commit landed) or at G - 1 (it did not), and its contents must equal the journal state
of that generation exactly. The next child resolves the intent (done or abort) from the
generation it finds. Record values are derived from (key, version), so the journal holds
only versions and digests, and the checker recomputes the expected bytes.

Everything that decides pass or fail lives here, once: the child and both runners import it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SHARD_SIZE = "64KB"
WRITER = Path(__file__).with_name("crash_writer.py")
MIN_VALUE, MAX_VALUE = 100, 40_000
# how the parent picks the moment to kill: (mode, probability)
KILL_MODES = (("random", 0.5), ("commit", 0.35), ("open", 0.15))


# ---------------------------------------------------------------- values


def value_for(key: str, version: str) -> bytes | dict[str, Any]:
    """The deterministic value of `key` at `version`: bytes (100 B..40 KB) or a dict record."""
    seed = int.from_bytes(hashlib.blake2b(f"{key}|{version}".encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    size = int(math.exp(rng.uniform(math.log(MIN_VALUE), math.log(MAX_VALUE))))
    if rng.random() < 0.8:
        if rng.random() < 0.5:
            return rng.bytes(size)
        return rng.integers(0, 16, size, dtype=np.uint8).tobytes()  # compressible
    dtype = np.dtype(rng.choice(["u1", "<i2", "<f4"]))
    n = max(1, size // dtype.itemsize)
    w = int(rng.integers(1, 64))
    h = max(1, n // w)
    x = (rng.integers(0, 200, (h, w)) if dtype.kind in "iu" else rng.standard_normal((h, w))).astype(dtype)
    return {"x": x, "label": int(rng.integers(0, 10)), "name": key, "blob": rng.bytes(int(rng.integers(0, 64)))}


def digest(value: Any) -> str:
    """A canonical digest of a value as written or as read back (views, memoryviews, arrays)."""
    h = hashlib.sha256()
    if isinstance(value, dict):
        h.update(b"D")
        for name in sorted(value):
            v = value[name]
            h.update(name.encode() + b"\0")
            if isinstance(v, np.ndarray):
                h.update(f"A{v.dtype.str}{v.shape}".encode())
                h.update(np.ascontiguousarray(v).tobytes())
            elif isinstance(v, (bytes, bytearray, memoryview)):
                b = bytes(v)
                h.update(b"B%d:" % len(b) + b)
            elif isinstance(v, str):
                b = v.encode()
                h.update(b"S%d:" % len(b) + b)
            else:
                h.update(f"V{type(v).__name__}:{v!r};".encode())
    else:
        h.update(b"R" + bytes(value))
    return h.hexdigest()[:32]


# ---------------------------------------------------------------- journal


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Complete journal lines; a torn last line (killed mid-write) is ignored."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    end = data.rfind(b"\n")
    return [json.loads(line) for line in data[:end + 1].splitlines() if line]


def repair_journal(path: Path) -> None:
    """Cut a torn last line so appends start on a fresh line (the child, at start)."""
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())


class Journal:
    """Append-only, each line fsync'ed before append() returns."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, entry: dict[str, Any]) -> None:
        data = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        done = 0
        while done < len(data):
            done += os.write(self.fd, data[done:])
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


State = dict[str, tuple[str, str]]  # key -> (version, digest)


def apply(state: State, intent: dict[str, Any]) -> State:
    out = dict(state)
    for k in intent["del"]:
        del out[k]
    for k, (ver, dig) in intent["put"].items():
        out[k] = (ver, dig)
    return out


@dataclass
class Replay:
    """The committed state the journal proves, and an intent that may or may not have landed."""

    state: State = field(default_factory=dict)
    generation: int = -1
    pending: dict[str, Any] | None = None
    seen: set[str] = field(default_factory=set)  # every key ever named by an intent
    restarts: int = 0
    next_key: int = 0


def replay(entries: list[dict[str, Any]]) -> Replay:
    r = Replay()
    for e in entries:
        t = e["t"]
        if r.pending is not None and t not in ("done", "abort"):
            raise ValueError(f"journal: {t!r} line follows an unresolved intent for generation {r.pending['gen']}")
        if t == "init":
            r.generation = int(e["gen"])
        elif t == "start":
            r.restarts = max(r.restarts, int(e["n"]) + 1)
        elif t == "intent":
            if int(e["gen"]) != r.generation + 1:
                raise ValueError(f"journal: intent for generation {e['gen']} after generation {r.generation}")
            r.pending = e
            for k in list(e["put"]) + list(e["del"]):
                r.seen.add(k)
                r.next_key = max(r.next_key, int(k[1:]) + 1)
        elif t in ("done", "abort"):
            if r.pending is None or int(e["gen"]) != int(r.pending["gen"]):
                raise ValueError(f"journal: {t} for generation {e['gen']} without its intent")
            if t == "done":
                r.state = apply(r.state, r.pending)
                r.generation = int(e["gen"])
            r.pending = None
        else:
            raise ValueError(f"journal: unknown line type {t!r}")
    return r


# ---------------------------------------------------------------- check


@dataclass
class Check:
    """What one post-kill check found. problems is empty when everything holds."""

    opened: bool = False
    verify_ok: bool = False
    generation: int = -1
    pending: bool = False  # an intent was outstanding: the kill landed inside a commit
    landed: bool = False  # ... and that commit had passed its commit point
    live: int = 0
    lost: int = 0  # journaled records missing or with other bytes
    resurrected: int = 0  # deleted keys that came back
    extra: int = 0  # keys nobody committed
    problems: list[str] = field(default_factory=list)


def check(ds: Path, journal: Path) -> Check:
    """Open the dataset read-only, verify it, and compare it with the journal state."""
    import kvdata
    from kvdata.reader.open import verify

    c = Check()
    r = replay(read_journal(journal))
    try:
        s = kvdata.open(ds)
    except Exception as e:  # noqa: BLE001 - any failure to open is the finding
        c.problems.append(f"dataset does not open: {type(e).__name__}: {e}")
        return c
    c.opened = True
    try:
        c.generation = s.generation
        expected = r.state
        if r.pending is not None:
            c.pending = True
            if c.generation == int(r.pending["gen"]):
                c.landed = True
                expected = apply(r.state, r.pending)
            elif c.generation != r.generation:
                c.problems.append(f"generation {c.generation}: expected {r.generation} or {r.pending['gen']} "
                                  "(an intent was outstanding)")
        elif c.generation != r.generation:
            c.problems.append(f"generation {c.generation}: the journal's last commit is {r.generation}")
        _compare(s, expected, r.seen, c)
    finally:
        s.close()
    try:
        rep = verify(ds, progress=False)
    except Exception as e:  # noqa: BLE001
        c.problems.append(f"verify raised {type(e).__name__}: {e}")
    else:
        c.verify_ok = bool(rep["ok"])
        if not c.verify_ok:
            found = {k: rep[k] for k in ("bad_shards", "bad_records", "index_problems")}
            c.problems.append("verify: " + json.dumps(found)[:2000])
    return c


def _compare(s: Any, expected: State, seen: set[str], c: Check) -> None:
    try:
        n = len(s)
        keys = list(s.keys())
        values = s.get_many(np.arange(n)) if n else []
    except Exception as e:  # noqa: BLE001
        c.problems.append(f"reading all records raised {type(e).__name__}: {e}")
        c.lost = len(expected)
        return
    c.live = n
    if n != len(expected):
        c.problems.append(f"len {n}, the journal has {len(expected)} live keys")
    if len(set(keys)) != len(keys):
        c.problems.append(f"{len(keys) - len(set(keys))} duplicate keys")
    got = dict(zip(keys, values))
    for k, (ver, dig) in expected.items():
        if digest(value_for(k, ver)) != dig:
            c.problems.append(f"journal digest of {k!r}@{ver} does not match value_for (harness bug)")
        if k not in got:
            c.lost += 1
            if c.lost <= 5:
                c.problems.append(f"committed key {k!r} (version {ver}) is missing")
        elif digest(got[k]) != dig:
            c.lost += 1
            if c.lost <= 5:
                c.problems.append(f"committed key {k!r} (version {ver}) reads other bytes")
        elif (v := s.get(k)) is None or digest(v) != dig:
            c.lost += 1
            if c.lost <= 5:
                c.problems.append(f"get({k!r}) by key disagrees with its sample")
    for k in got:
        if k not in expected:
            if k in seen:
                c.resurrected += 1
            else:
                c.extra += 1
    for k in seen - expected.keys() - got.keys():
        if k in s:
            c.resurrected += 1
            c.problems.append(f"deleted or uncommitted key {k!r} is not listed but `in` finds it")
            break
    if c.resurrected or c.extra:
        c.problems.append(f"{c.resurrected} deleted/uncommitted keys present, {c.extra} unknown keys present")


def leftovers(ds: Path, pid: int) -> set[str]:
    """Files a killed writer left behind, which say where it was: read before any writer reopens."""
    out: set[str] = set()
    try:
        m = json.loads((ds / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return {"no-manifest"}
    if any(ds.glob(f"manifest.json.tmp{pid}-*")):  # fsutil.temp_beside: .tmp<pid>-<thread>
        out.add("manifest-tmp")
    names = {s["name"] for s in m["shards"]} | {s["zst"]["name"] for s in m["shards"] if s.get("zst")}
    tail = m["tail"]["name"]
    for p in (ds / "shards").iterdir():
        if p.name.endswith(".tmp"):
            out.add("seal-tmp")
        elif p.name.endswith(".mdb") and p.name not in names and p.name != tail:
            out.add("uncommitted-shard" if not p.name.startswith("tail-") else "extra-tail")
    idx = m["index"]
    refs = {idx["samples"], idx["records"]} | {r["name"] for r in idx["keys"]}
    if any(p.name not in refs for p in (ds / "index").iterdir()):
        out.add("unreferenced-index")
    return out


# ---------------------------------------------------------------- the kill loop


def prepare(ds: Path, journal: Path, shard_size: str = SHARD_SIZE) -> None:
    """Create the empty dataset and the journal's init line (before any child runs).

    The shard size is fixed here, at creation: the child's own shard_size is then ignored.
    """
    import kvdata

    with kvdata.open(ds, "a", shard_size=shard_size) as s:
        gen = s.generation
    j = Journal(journal)
    try:
        j.append({"t": "init", "gen": gen})
    finally:
        j.close()


class _Lines:
    """Lines from a child's stdout, with a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.buf = b""
        self.sel = selectors.DefaultSelector()
        self.sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        self.eof = False

    def wait_for(self, tag: bytes, count: int, timeout: float) -> bool:
        """True once `count` lines starting with `tag` were seen; False at EOF or timeout."""
        seen = 0
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if line.split(b" ", 1)[0] == tag:
                    seen += 1
                    if seen >= count:
                        return True
            left = deadline - time.monotonic()
            if self.eof or left <= 0:
                return False
            if self.sel.select(left):
                chunk = os.read(self.proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
                if not chunk:
                    self.eof = True
                self.buf += chunk

    def close(self) -> None:
        self.sel.close()


@dataclass
class Cycle:
    mode: str
    delay: float
    seconds: float
    check: Check
    where: set[str]
    child_error: str | None = None


def kill_cycle(ds: Path, journal: Path, rng: np.random.Generator, seed: int) -> Cycle:
    """Start a writer child, SIGKILL it at a random moment, then check the dataset."""
    t0 = time.perf_counter()
    names = [m for m, _p in KILL_MODES]
    mode = str(rng.choice(names, p=[p for _m, p in KILL_MODES]))
    errpath = journal.with_name(journal.name + ".stderr")
    child_error = None
    with open(errpath, "wb") as err:
        proc = subprocess.Popen([sys.executable, str(WRITER), str(ds), str(seed), str(journal)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
    lines = _Lines(proc)
    try:
        if mode == "commit":
            # right after the child announces a commit (its intent is already durable)
            lines.wait_for(b"I", int(rng.integers(1, 4)), 20.0)
            delay = float(rng.uniform(0.0, 0.015))
        else:
            lines.wait_for(b"R", 1, 20.0)
            delay = float(rng.uniform(0.05, 0.6) if mode == "random" else rng.uniform(0.0, 0.03))
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        rc = proc.wait()
        if rc != -signal.SIGKILL:
            child_error = f"child exited with {rc} before the kill: " + errpath.read_text(errors="replace")[-3000:]
    finally:
        lines.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    where = leftovers(ds, proc.pid)
    c = check(ds, journal)
    if child_error:
        c.problems.append(child_error)
    return Cycle(mode, delay, time.perf_counter() - t0, c, where, child_error)


@dataclass
class Summary:
    kills: int = 0
    verify_failures: int = 0
    open_failures: int = 0
    lost: int = 0
    resurrected: int = 0
    extra: int = 0
    in_commit: int = 0
    landed: int = 0
    child_errors: int = 0
    modes: dict[str, int] = field(default_factory=dict)
    where: dict[str, int] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    max_generation: int = 0
    live: int = 0

    def add(self, i: int, cy: Cycle) -> None:
        c = cy.check
        self.kills += 1
        self.verify_failures += int(c.opened and not c.verify_ok)
        self.open_failures += int(not c.opened)
        self.lost += c.lost
        self.resurrected += c.resurrected
        self.extra += c.extra
        self.in_commit += int(c.pending)
        self.landed += int(c.landed)
        self.child_errors += int(cy.child_error is not None)
        self.modes[cy.mode] = self.modes.get(cy.mode, 0) + 1
        for w in cy.where:
            self.where[w] = self.where.get(w, 0) + 1
        self.seconds.append(cy.seconds)
        self.max_generation = max(self.max_generation, c.generation)
        self.live = c.live
        if c.problems:
            self.failures.append(f"kill {i} ({cy.mode}, {cy.delay * 1000:.0f} ms, generation {c.generation}): "
                                 + " | ".join(c.problems))

    @property
    def ok(self) -> bool:
        return not self.failures

    def report(self) -> str:
        med = float(np.median(self.seconds)) if self.seconds else 0.0
        lines = [
            f"kills: {self.kills}  (modes: {', '.join(f'{k} {v}' for k, v in sorted(self.modes.items()))})",
            f"verify failures: {self.verify_failures}   open failures: {self.open_failures}   "
            f"child errors: {self.child_errors}",
            f"lost committed records: {self.lost}   resurrected: {self.resurrected}   unknown: {self.extra}",
            f"kills with a commit in flight (intent outstanding): {self.in_commit}  "
            f"(commit point passed, 'done' not yet journaled: {self.landed})",
            "files left by the killed writer: " + (", ".join(f"{k} {v}" for k, v in sorted(self.where.items())) or "none"),
            f"median time per cycle: {med:.3f} s   highest generation: {self.max_generation}   "
            f"live keys at the end: {self.live}",
        ]
        for f in self.failures[:20]:
            lines.append("FAIL " + f)
        return "\n".join(lines)
