"""Readers that open and read continuously while a writer commits, seals and rewrites ("w").

Regression for issue 11's races: a reader opening while the writer seals re-created an empty
tail file and failed with "tail record N is missing"; a dataset written again with mode "w"
reused shard file names, so a reader on the old generation could be served the new records.
Every value encodes its key and the writer's round, so a wrong value is detected, not only a
crash: within one open generation every record must come from one round.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import kvdata
from kvdata.errors import MissingShardError

WRITER = textwrap.dedent("""
    import sys, kvdata
    path, rounds = sys.argv[1], int(sys.argv[2])
    r = 0
    while True:
        r += 1
        mode = "w" if r > 1 else "a"
        with kvdata.open(path, mode, shard_size="64KB") as s:
            n = 0
            for commit in range(rounds):
                for i in range(7):
                    key = f"k{n:06d}"
                    s.put(key, (key + "|" + str(r) + "|").encode() * 40)
                    n += 1
                s.commit()
                if commit % 5 == 4:
                    s.seal()
                    s.commit()
""")


def _check(store: kvdata.Store, rng: random.Random) -> int:
    n = len(store)
    if n == 0:
        return 0
    idx = [rng.randrange(n) for _ in range(12)]
    rounds = set()
    for i, v in zip(idx, store.get_many(idx)):
        key = store.key_at(i)
        text = bytes(v).decode()
        head, r, _ = text.split("|", 2)
        assert head == key, f"sample {i}: key {key!r} holds the value of {head!r}"
        assert text == (key + "|" + r + "|") * 40, f"sample {i} ({key}): damaged value"
        rounds.add(r)
    assert len(rounds) == 1, f"one generation mixes values of rounds {sorted(rounds)}"
    return len(idx)


def run_readers(path: Path, opens: int, seed: int = 0) -> dict[str, int]:
    """Open and read `opens` times while a writer subprocess rewrites the dataset."""
    with kvdata.open(path, "a") as s:
        s.put("k000000", ("k000000|0|" * 40).encode())
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "30"])
    rng = random.Random(seed)
    stats = {"opens": 0, "values": 0, "errors": 0}
    try:
        while stats["opens"] < opens:
            assert writer.poll() is None, "the writer died"
            try:
                with kvdata.open(path) as store:
                    stats["values"] += _check(store, rng)
            except MissingShardError:  # a shard of a generation "w" replaced: the one allowed outcome
                stats["errors"] += 1
            stats["opens"] += 1
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    return stats


def test_reader_opening_while_writer_seals_and_rewrites(tmp_path: Path) -> None:
    path = tmp_path / "ds"
    stats = run_readers(path, 2000)
    assert stats["opens"] == 2000 and stats["values"] > 0
    shards = path / "shards"
    # no orphan tail re-created by a reader: every tail file is the manifest's (or was being written)
    m = kvdata.open(path).manifest
    tails = [p.name for p in shards.iterdir() if p.name.startswith("tail-") and not p.name.endswith("-lock")]
    assert set(tails) <= {m.tail.name} | {n for n in tails if n > m.tail.name}, tails
    # nor an orphan LMDB lock file of a tail sealed and removed while a reader opened it. (A lock
    # of a tail newer than the manifest's is the killed writer's own uncommitted work -- LMDB
    # creates a lock file before its data file -- and the next writer's recovery removes it.)
    locks = [p.name[:-len("-lock")] for p in shards.iterdir() if p.name.endswith("-lock")]
    assert {n for n in locks if n <= m.tail.name} <= set(tails) | {m.tail.name}, (locks, tails)
    with kvdata.open(path, "a"):
        left = {p.name[:-len("-lock")] for p in shards.iterdir() if p.name.endswith("-lock")}
        assert left <= {p.name for p in shards.iterdir()}, left


def test_rewrite_gives_new_file_names(tmp_path: Path) -> None:
    """A reader still on an old generation can only see old bytes, or find them gone."""
    path = tmp_path / "ds"
    with kvdata.open(path, "a", shard_size="64KB") as s:
        for i in range(50):
            s.put(f"k{i}", b"old" * 1000)
        s.seal()
    old = kvdata.open(path)
    old_names = {e.name for e in old.manifest.shards}
    with kvdata.open(path, "w", shard_size="64KB") as s:
        for i in range(50):
            s.put(f"k{i}", b"new" * 1000)
        s.seal()
    new = kvdata.open(path)
    assert not old_names & {e.name for e in new.manifest.shards}
    try:
        for i in range(50):
            assert bytes(old[i]) == b"old" * 1000  # never new bytes: old ones, or a clear error
    except MissingShardError:
        pass
    assert all(bytes(new[i]) == b"new" * 1000 for i in range(50))
    old.close()
    new.close()


def test_reader_on_old_tail_never_serves_a_rewritten_datasets_shard(tmp_path: Path) -> None:
    """Regression: a reader whose tail was gone looked for a shard with the tail's id in the
    current manifest without checking the incarnation, and served the new dataset's records."""
    path = tmp_path / "ds"
    with kvdata.open(path, "a") as s:
        for i in range(3):
            s.put(f"k{i}", b"old-%d" % i)
    old = kvdata.open(path)
    assert old.manifest.tail.records == 3
    code = f"""
import kvdata
with kvdata.open({str(path)!r}, "w") as s:
    for i in range(3):
        s.put(f"k{{i}}", b"NEW-%d" % i)
    s.seal()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    try:
        got = old.get_many([0, 1, 2])
    except MissingShardError as e:
        assert "written again" in str(e)
    else:
        assert [bytes(v) for v in got] == [b"old-0", b"old-1", b"old-2"]
    old.close()
