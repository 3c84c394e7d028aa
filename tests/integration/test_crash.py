"""A writer SIGKILLed at random moments never loses a commit() that returned.

20 kill cycles on one dataset (64 KB shards, so sealing happens all the time): a child
(tests/crash_writer.py) puts, overwrites and deletes records in journaled batches until it
is killed; after each kill the dataset must open, `verify` must pass, and its contents must
equal the journal's state exactly. The harness and the checker live in tests/crash_check.py
(bench/crash_kill.py runs the same loop 1,000 times). Run with -s to see the summary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvdata
from kvdata.reader.open import verify

import crash_check as cc  # tests/crash_check.py (shared with bench/crash_kill.py); tests/ is on sys.path

KILLS = 20
SEED = 20240601


@pytest.mark.slow
@pytest.mark.timeout(900)  # 20 kill cycles: ~20-30 s on 2 idle cores, far more on a loaded box
def test_sigkilled_writer_keeps_every_returned_commit(tmp_path: Path) -> None:
    ds, journal = tmp_path / "ds", tmp_path / "ds.journal"
    cc.prepare(ds, journal)
    rng = np.random.default_rng(SEED)
    summary = cc.Summary()
    for i in range(KILLS):
        summary.add(i, cc.kill_cycle(ds, journal, rng, SEED))
    print("\n" + summary.report())
    assert summary.ok, summary.report()
    assert summary.lost == 0 and summary.verify_failures == 0
    # the kill moments must reach inside commit(), or this test would prove little
    assert summary.in_commit >= 1, summary.report()

    # after the last kill, a writer opens the dataset (recovery) and commits on top of it
    gen = cc.check(ds, journal).generation
    with kvdata.open(ds, "a") as s:
        assert s.generation == gen
        s.put("after-the-crashes", b"still writable")
    with kvdata.open(ds) as r:
        assert r.generation == gen + 1
        assert bytes(r.get("after-the-crashes")) == b"still writable"
    assert verify(ds, progress=False)["ok"]
