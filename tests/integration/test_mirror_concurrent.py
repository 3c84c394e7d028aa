"""Regression (found by the multi-node run, tests/integration/test_multinode.py): two readers
starting together made kvdatad mirror one remote dataset's index on two threads at once, and
both wrote the same temp file (named by the process id only). One thread's rename then failed
(`FileNotFoundError ... samples-00000001.bin.tmp<pid>`, the `open` refused, the reader staged
in-process), or one truncated what the other had checked and was about to rename. Temp names
now carry the thread too."""

from __future__ import annotations

import threading
from pathlib import Path

from kvdata.format.codec import file_sha256
from kvdata.homes import open_home
from kvdata.store.generation import read_manifest
from kvdata.sync.mirror import mirror

from helpers.servers import S3Server, build_dataset, push_s3

THREADS = 8


def _mirror_at_once(url: str, root: Path) -> tuple[list[Path], list[BaseException]]:
    """THREADS threads, each with its own home, released together into mirror(home, root)."""
    go = threading.Barrier(THREADS)
    got: list[Path] = []
    errors: list[BaseException] = []

    def one() -> None:
        home = open_home(url)
        try:
            go.wait()
            got.append(mirror(home, root))
        except BaseException as e:  # noqa: BLE001 -- collected and asserted by the test
            errors.append(e)
        finally:
            home.close()

    threads = [threading.Thread(target=one) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got, errors


def test_threads_mirroring_one_dataset_at_once_all_get_the_verified_index(s3_server: S3Server, tmp_path: Path) -> None:
    url = push_s3(build_dataset(tmp_path / "src.kv", n=600), s3_server, "mirror-race")
    for attempt in range(3):  # the race needs the threads inside fetch_exact together: a few rounds
        got, errors = _mirror_at_once(url, tmp_path / f"cache{attempt}")
        assert not errors, f"round {attempt}: {errors[0]!r}"
        assert len(got) == THREADS and len(set(got)) == 1
        local = got[0]
        m = read_manifest(local)
        for _kind, name, size in m.index_files():
            p = local / "index" / name
            assert p.stat().st_size == size
            assert file_sha256(p)[1] == (m.index_sha256 or {})[name]
        leftovers = [p.name for p in (local / "index").iterdir() if ".tmp" in p.name]
        leftovers += [p.name for p in local.iterdir() if ".tmp" in p.name]
        assert not leftovers, leftovers
