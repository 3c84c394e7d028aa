"""Every file name kvdata writes, built and parsed in one place.

Names from outside (a manifest fetched from a home, an index table, a protocol
frame) are checked here against the same rules that build them, so a name that
passes can be joined under its directory without escaping it: no separators, no
`..`, no leading dot, nothing longer than a file name.

Dataset layout::

    manifest.json
    index/samples-GGGGGGGG.bin  records-GGGGGGGG.bin  keys-GGGGGGGG-NN.bin
    shards/NNNNNN.mdb  NNNNNN.mdb.zst  tail-NNNNNN.mdb (+ tail-NNNNNN.mdb-lock)

A name is never reused for different bytes: a dataset written again from empty
(mode "w") starts a new *incarnation* (the generation it started at), and the
shard and tail files of incarnation I > 0 carry it: ``NNNNNN-iIIIIIIII.mdb``,
``tail-NNNNNN-iIIIIIIII.mdb``. Index file names carry their generation, and
generations only grow. So a reader still on an old generation can only ever open
old bytes, or find them gone.

Beside the manifest, two kinds of files serve compaction (kvdata.store.compact):
``readers-iIIIIIIII.lock`` is the reader registry of incarnation I (readers hold a shared
flock on it while they may open its files), and ``compact-iKKKKKKKK.json`` is the journal
of a compaction to incarnation K (what it replaces, so recovery can finish or undo it).

A tier directory holds staged copies named by content: ``<sha256>.mdb``. The index mirror of a
remote dataset keeps the seek tables of its cold copies, fetched once and shared by every
process reading it, named by content too: ``seek/<sha256>.seek``.
"""

from __future__ import annotations

import re

from .._util.digest import is_sha256

MANIFEST = "manifest.json"
LOCK = ".lock"
SHARDS_DIR = "shards"
INDEX_DIR = "index"
SOURCE = "source.json"  # an index mirror's note of the URL it mirrors
SEEK_DIR = "seek"        # an index mirror's cached seek tables (kvdata.tiers.records)

_SHARD = re.compile(r"([0-9]{6,9})(?:-i([0-9]{8,10}))?\.mdb")
_TAIL = re.compile(r"tail-([0-9]{6,9})(?:-i([0-9]{8,10}))?\.mdb")
_ZST = re.compile(r"([0-9]{6,9})(?:-i([0-9]{8,10}))?\.mdb\.zst")
_INDEX = re.compile(r"(samples|records|keys)-([0-9]{8,10})(?:-([0-9]{2,3}))?\.bin")
_STAGED = re.compile(r"([0-9a-f]{64})\.mdb")
_SEEK = re.compile(r"([0-9a-f]{64})\.seek")
_PIN = re.compile(r"readers-i([0-9]{8,10})\.lock")
_JOURNAL = re.compile(r"compact-i([0-9]{8,10})\.json")


def _inc(incarnation: int) -> str:
    return f"-i{incarnation:08d}" if incarnation else ""


def shard_name(shard_id: int, incarnation: int = 0) -> str:
    """File name of sealed shard `shard_id` of a dataset incarnation."""
    return f"{shard_id:06d}{_inc(incarnation)}.mdb"


def tail_name(shard_id: int, incarnation: int = 0) -> str:
    """File name of the open tail that will become shard `shard_id`."""
    return f"tail-{shard_id:06d}{_inc(incarnation)}.mdb"


def lmdb_lock_name(lmdb_name: str) -> str:
    """LMDB's lock file beside a subdir=False environment."""
    return lmdb_name + "-lock"


def zst_name(shard_file: str) -> str:
    """The compressed cold copy of a sealed shard file."""
    return shard_file + ".zst"


def samples_name(generation: int) -> str:
    return f"samples-{generation:08d}.bin"


def records_name(generation: int) -> str:
    return f"records-{generation:08d}.bin"


def keys_name(generation: int, run: int) -> str:
    return f"keys-{generation:08d}-{run:02d}.bin"


def reader_pin_name(incarnation: int) -> str:
    """The reader registry of an incarnation: readers hold a shared flock on it (store.pins)."""
    return f"readers-i{incarnation:08d}.lock"


def compact_journal_name(incarnation: int) -> str:
    """The journal of a compaction that makes incarnation `incarnation` (store.retire)."""
    return f"compact-i{incarnation:08d}.json"


def staged_name(sha256: str) -> str:
    """A staged copy in a tier: named by the sha256 of its bytes (content addressing)."""
    if not is_sha256(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    return f"{sha256}.mdb"


def seek_table_name(sha256: str) -> str:
    """A cold copy's seek table cached in an index mirror: named by the table's sha256."""
    if not is_sha256(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    return f"{sha256}.seek"


def temp_name(final: str, tag: str) -> str:
    """A hidden temp name beside `final` (never matched by the parsers below)."""
    return f".{final}.{tag}.tmp"


# ---------------------------------------------------------------- parsing (names from outside)


def parse_shard_name(name: object) -> tuple[int, int] | None:
    """(shard id, incarnation) of a sealed shard file name, or None if `name` is not one."""
    m = _SHARD.fullmatch(name) if isinstance(name, str) else None
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def parse_tail_name(name: object) -> tuple[int, int] | None:
    """(shard id, incarnation) of a tail file name, or None."""
    m = _TAIL.fullmatch(name) if isinstance(name, str) else None
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def is_zst_name(name: object) -> bool:
    return isinstance(name, str) and _ZST.fullmatch(name) is not None


def is_index_name(name: object, kind: str | None = None) -> bool:
    """Whether `name` is an index file name (of `kind`: samples, records or keys)."""
    m = _INDEX.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        return False
    if m.group(1) == "keys" and m.group(3) is None:
        return False
    if m.group(1) != "keys" and m.group(3) is not None:
        return False
    return kind is None or m.group(1) == kind


def index_generation(name: object) -> int | None:
    """The generation in an index file's name, or None if `name` is not an index file name."""
    if not is_index_name(name):
        return None
    m = _INDEX.fullmatch(str(name))
    return int(m.group(2)) if m else None


def parse_staged_name(name: object) -> str | None:
    """The sha256 a tier file is named by, or None if it is not a staged copy."""
    m = _STAGED.fullmatch(name) if isinstance(name, str) else None
    return m.group(1) if m else None


def parse_seek_table_name(name: object) -> str | None:
    """The sha256 a cached seek table's name gives, or None."""
    m = _SEEK.fullmatch(name) if isinstance(name, str) else None
    return m.group(1) if m else None


def parse_reader_pin_name(name: object) -> int | None:
    """The incarnation of a reader registry file name, or None."""
    m = _PIN.fullmatch(name) if isinstance(name, str) else None
    return int(m.group(1)) if m else None


def parse_compact_journal_name(name: object) -> int | None:
    """The incarnation a compaction journal's name says it makes, or None."""
    m = _JOURNAL.fullmatch(name) if isinstance(name, str) else None
    return int(m.group(1)) if m else None


def incarnation_of(name: object) -> int | None:
    """The incarnation of a file of shards/ -- a sealed shard, its cold copy, a tail, or the
    LMDB lock file of one of those -- or None if `name` is none of them."""
    if not isinstance(name, str):
        return None
    base = name[:-len("-lock")] if name.endswith("-lock") else name
    for rx in (_SHARD, _TAIL, _ZST):
        m = rx.fullmatch(base)
        if m:
            return int(m.group(2) or 0)
    return None
