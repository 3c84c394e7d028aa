"""Record-granular reads from remote homes (issue 12, item 1): a sample whose shard has no
staged copy is read on its own from the home's framed cold copy (kvdata.format.frames),
verified, without staging the shard.

Homes are real endpoints (moto's S3 server and nginx, tests/helpers/servers.py). The source
is told to read record by record (`wants_whole` answers False, as the engine's policy does
for an unannounced order); values are compared with the local dataset, bytes fetched from
the home are counted through the home object.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

import kvdata
from kvdata.errors import ChecksumMismatchError, KVDataError
from kvdata.format import dump_manifest, frames, names, parse_manifest
from kvdata.format.codec import compress_file, zst_copy
from kvdata.homes import open_home
from kvdata.reader.daemon_client import DaemonStager
from kvdata.reader.open import open_dataset
from kvdata.tiers.staging.keep_set import KEEP_TTL
from kvdata.tiers.tier import Tier

from helpers.daemon import Kit
from helpers.servers import NginxHome, S3Server, metadata_bytes, push_local, push_s3, tiers_config

N = 60
SHAPE = (160, 160, 3)     # 76.8 KB of noise per sample: incompressible, like photos
SHARD = "1MB"


def sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(1000 + i)
    return {"image": rng.integers(0, 256, size=SHAPE, dtype=np.uint8), "label": i % 5, "name": f"s{i}"}


def as_tuple(v: Any) -> tuple:
    return (np.asarray(v["image"]).tobytes(), int(v["label"]), str(v["name"]))


def reframe(root: Path, keep_seek: bool = True, old_style: bool = False) -> None:
    """Write every shard's cold copy as compress_file frames it (or, old_style, as one zstd
    frame like kvdata before the framing) and record it in the local manifest."""
    m = parse_manifest((root / names.MANIFEST).read_bytes(), str(root))
    entries = []
    for e in m.shards:
        src = root / names.SHARDS_DIR / e.name
        dst = src.with_name(names.zst_name(e.name))
        with open(dst, "wb") as f:
            if old_style:
                cctx = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=True)
                f.write(cctx.compress(src.read_bytes()))
            else:
                res = compress_file(src, f)
        if old_style or not keep_seek:
            data = dst.read_bytes()
            z = kvdata.format.ZstCopy(dst.name, len(data), hashlib.sha256(data).hexdigest())
        else:
            z = zst_copy(dst.name, res)
        entries.append(e.__class__(e.id, e.name, e.records, e.bytes, e.sha256, z))
    (root / names.MANIFEST).write_bytes(dump_manifest(m.replace(shards=tuple(entries))))


def build(path: Path, **kw: Any) -> Path:
    with kvdata.open(path, "w", shard_size=SHARD) as s:
        for i in range(N):
            s.put(f"k{i:04d}", sample(i))
        s.seal()
    reframe(path, **kw)
    return path


@dataclass
class Env:
    src: Path
    ref: list[tuple]
    entries: list[Any]
    s3: S3Server
    nginx: NginxHome
    scratch: Path
    counter: int = 0

    def publish(self, kind: str, src: Path | None = None) -> str:
        self.counter += 1
        name = f"h{self.counter}"
        src = src or self.src
        if kind == "s3":
            return push_s3(src, self.s3, name)
        local = push_local(src, self.scratch / name)
        shutil.copytree(local, self.nginx.www / name)
        return self.nginx.url(name)

    def put(self, kind: str, url: str, name: str, data: bytes) -> None:
        if kind == "s3":
            self.s3.put_bytes(url.split("/", 3)[3], name, data)
        else:
            (self.nginx.www / url.rsplit("/", 1)[1] / name).write_bytes(data)

    def shard_samples(self, shard: int) -> list[int]:
        start = sum(e.records for e in self.entries[:shard])
        return list(range(start, start + self.entries[shard].records))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, nginx_home: NginxHome) -> Env:
    p = build(tmp_path_factory.mktemp("rr") / "src.kv")
    with kvdata.open(p) as s:
        ref = [as_tuple(v) for v in s.get_many(list(range(N)))]
        entries = list(s.manifest.shards)
    assert len(entries) >= 4 and all(e.zst is not None and e.zst.seek_sha256 for e in entries)
    return Env(p, ref, entries, s3_server, nginx_home, tmp_path_factory.mktemp("scratch"))


class Counted:
    """Counts the bytes and requests a home answers (wraps read_range on the home object)."""

    def __init__(self, home: Any) -> None:
        self.bytes = 0
        self.requests = 0
        inner = home.read_range

        def read_range(name: str, start: int, length: int) -> bytes:
            data = inner(name, start, length)
            self.bytes += len(data)
            self.requests += 1
            return data

        home.read_range = read_range

    def reset(self) -> None:
        self.bytes = self.requests = 0


@pytest.fixture
def record_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sources read every shard without a mapped copy record by record (as the policy does
    for unannounced orders)."""
    from kvdata.tiers.source import EngineSource

    monkeypatch.setattr(EngineSource, "wants_whole", lambda self, entry: False)
    monkeypatch.setattr(DaemonStager, "wants_whole", lambda self, entry: False)


def open_remote(url: str, tmp_path: Path) -> Any:
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "64MB"))
    return open_dataset(url, config=cfg, use_daemon=False), cfg


def staged_copies(cfg: Any) -> list[str]:
    return sorted(p.name for t in cfg.tiers for p in (Path(t.path) / "shards").glob("*.mdb")) \
        if all((Path(t.path) / "shards").is_dir() for t in cfg.tiers) else []


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_samples_are_read_record_by_record_and_match(kind: str, env: Env, tmp_path: Path, record_mode: None) -> None:
    url = env.publish(kind)
    st, cfg = open_remote(url, tmp_path)
    with st:
        counted = Counted(st.home)
        # single samples, one from each shard
        for shard in range(len(env.entries)):
            i = env.shard_samples(shard)[1]
            assert as_tuple(st[i]) == env.ref[i]
        first = counted.bytes
        # a batch across every shard (the tables are cached now)
        counted.reset()
        batch = [env.shard_samples(s)[-1] for s in range(len(env.entries))] + [3, 0]
        got = st.get_many(batch)
        assert [as_tuple(v) for v in got] == [env.ref[i] for i in batch]
        fetched = counted.bytes
        shard_bytes = sum(e.bytes for e in env.entries)   # every shard is touched
        per_sample = fetched / len(batch)
        print(f"{kind}: {len(batch)} samples, {fetched} bytes from the home ({per_sample:.0f} per sample of "
              f"{SHAPE[0] * SHAPE[1] * SHAPE[2]} payload bytes; shards hold {shard_bytes}), "
              f"{counted.requests} requests; the first {len(env.entries)} single samples took {first} bytes "
              f"with their shards' seek tables")
        assert fetched < shard_bytes / 4
        assert per_sample < 1.3 * SHAPE[0] * SHAPE[1] * SHAPE[2]
        # get_batch stacks the same arrays; copy=True gives bytes, as from a mapped shard
        b = st.get_batch(batch[:4])
        assert [bytes(x) for x in np.asarray(b["image"])] == [env.ref[i][0] for i in batch[:4]]
        assert isinstance(st._reader.get_many([5], copy=True)[0]["image"], np.ndarray)
        assert st.engine.status()["bytes_from_home"] >= fetched
    assert staged_copies(cfg) == []   # nothing was staged whole


def test_a_seek_table_is_fetched_once_and_kept_in_the_index_mirror(env: Env, tmp_path: Path,
                                                                   record_mode: None) -> None:
    """The seek table of a shard read by record is kept in the dataset's index mirror, named by
    its sha256: another process (a DataLoader worker of the next epoch) reads it there instead of
    asking the home again; a kept table that does not match its name is not used, but fetched."""
    url = env.publish("s3")
    shard = env.entries[1]
    idx = env.shard_samples(1)[:2]
    want = [env.ref[i] for i in idx]
    st, cfg = open_remote(url, tmp_path)
    with st:
        counted = Counted(st.home)
        assert [as_tuple(v) for v in st.get_many(idx)] == want
        first = counted.requests
        kept = st.root / names.SEEK_DIR / names.seek_table_name(shard.zst.seek_sha256)
    assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name]
    for tampered in (False, True):
        if tampered:
            blob = bytearray(kept.read_bytes())
            blob[-1] ^= 1
            kept.write_bytes(bytes(blob))
        again = open_dataset(url, config=cfg, use_daemon=False)  # a new process's view: no table in memory
        with again:
            counted = Counted(again.home)
            assert [as_tuple(v) for v in again.get_many(idx)] == want
            assert counted.requests == (first if tampered else first - 1), (tampered, counted.requests, first)
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == shard.zst.seek_sha256  # put right by the fetch


def test_a_tampered_frame_is_refused_and_other_samples_still_read(env: Env, tmp_path: Path, record_mode: None) -> None:
    url = env.publish("s3")
    shard = 2
    e = env.entries[shard]
    assert e.zst is not None
    home = open_home(url)
    try:
        blob = home.read(f"shards/{e.zst.name}")
    finally:
        home.close()
    table = frames.decode_seek_table(blob[-e.zst.seek_bytes:], zst_bytes=len(blob), shard_bytes=e.bytes,
                                     records=e.records, where="test")
    assert table.slot_off is not None
    samples = env.shard_samples(shard)
    victim = samples[len(samples) // 2]
    slot = victim - samples[0]
    frame = table.frames_of(int(table.slot_off[slot]), int(table.slot_off[slot] + table.slot_size[slot]))[0]
    bad = bytearray(blob)
    bad[(int(table.c_off[frame]) + int(table.c_off[frame + 1])) // 2] ^= 0x01
    env.put("s3", url, f"shards/{e.zst.name}", bytes(bad))
    st, cfg = open_remote(url, tmp_path)
    with st:
        with pytest.raises(ChecksumMismatchError) as err:
            st.get_many([victim])
        msg = str(err.value)
        assert f"frame {frame}" in msg and e.name in msg and "\n" not in msg
        assert isinstance(err.value, KVDataError)
        others = [i for i in samples if i != victim and
                  frame not in table.frames_of(int(table.slot_off[i - samples[0]]),
                                               int(table.slot_off[i - samples[0]] + table.slot_size[i - samples[0]]))]
        assert others
        assert [as_tuple(v) for v in st.get_many(others)] == [env.ref[i] for i in others]
        with pytest.raises(ChecksumMismatchError):  # never served later either
            st[victim]
    assert staged_copies(cfg) == []


@pytest.mark.parametrize("style", ["old-zst", "no-seek-in-manifest"])
def test_a_copy_without_a_seek_table_is_staged_whole(style: str, env: Env, tmp_path: Path, record_mode: None) -> None:
    src = build(tmp_path / "old.kv", old_style=style == "old-zst", keep_seek=False)
    url = env.publish("s3", src)
    st, cfg = open_remote(url, tmp_path)
    with st:
        counted = Counted(st.home)
        assert as_tuple(st[7]) == env.ref[7]
        assert [as_tuple(v) for v in st.get_many([0, N - 1])] == [env.ref[0], env.ref[N - 1]]
        assert counted.bytes > 0
    assert len(staged_copies(cfg)) >= 2   # the shards were staged whole, as before


def test_the_daemon_stager_reads_records_in_process(env: Env, tmp_path: Path) -> None:
    url = env.publish("http")
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "64MB"))
    home = open_home(url)
    stager = DaemonStager(None, url, home, cfg)
    try:
        e = env.entries[1]
        slots = [0, e.records - 1, 2]
        got, other = stager.read_records([(e, slots), (env.entries[0], [1])])
        assert got is not None and len(got) == 3 and other is not None and len(other) == 1
        base = env.shard_samples(1)[0]
        with kvdata.open(env.src) as local:
            assert [as_tuple(local._reader.decode_value(v, True)) for v in got] == [env.ref[base + s] for s in slots]
    finally:
        stager.close()


def test_local_homes_are_read_in_place(env: Env, tmp_path: Path, record_mode: None) -> None:
    from kvdata.tiers.records import reader_for

    home = open_home(str(env.src))
    try:
        assert reader_for(home).read(env.entries[0], [0]) is None
    finally:
        home.close()


def test_the_manifest_records_the_seek_table(env: Env) -> None:
    doc = json.loads((env.src / names.MANIFEST).read_text())
    z = doc["shards"][0]["zst"]
    assert set(z) == {"name", "bytes", "sha256", "seek"} and set(z["seek"]) == {"bytes", "sha256"}
    data = (env.src / names.SHARDS_DIR / z["name"]).read_bytes()
    assert hashlib.sha256(data[-z["seek"]["bytes"]:]).hexdigest() == z["seek"]["sha256"]
    # the whole copy still decompresses, as one stream, to the shard
    out = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True).read()
    assert out == (env.src / names.SHARDS_DIR / doc["shards"][0]["name"]).read_bytes()



class SlowHome:
    """A remote-looking home serving the local dataset's .zst files after `delay` seconds per
    request, recording how many requests were in flight at once."""

    def __new__(cls, root: Path, delay: float) -> Any:
        import threading
        import time

        from kvdata.homes import Home

        class _Slow(Home):
            url = "s3://slow/ds"

            def __init__(self) -> None:
                self.lock = threading.Lock()
                self.now = self.peak = self.requests = 0

            def read_range(self, name: str, start: int, length: int) -> bytes:
                with self.lock:
                    self.now += 1
                    self.requests += 1
                    self.peak = max(self.peak, self.now)
                try:
                    time.sleep(delay)
                    with open(root / name, "rb") as f:
                        f.seek(start)
                        return f.read(length)
                finally:
                    with self.lock:
                        self.now -= 1

        return _Slow()


def test_a_batch_fetches_every_shard_at_once(env: Env, tmp_path: Path, record_mode: None) -> None:
    """A batch over every shard costs about two round trips (seek tables, then frames), not two
    per shard: the GETs of the whole batch are in flight together."""
    import time

    from kvdata.store import Store
    from kvdata.tiers.source import EngineSource
    from kvdata.tiers.staging import Engine

    delay = 0.3
    home = SlowHome(env.src, delay)
    cfg = tiers_config(tmp_path / "tiers", ("ssd", "64MB"))
    engine = Engine(cfg)
    shards = tuple(parse_manifest((env.src / names.MANIFEST).read_bytes(), "x").shards)
    source = EngineSource(engine, home, shards, own_engine=True)
    batch = [env.shard_samples(s)[k] for s in range(len(shards)) for k in (0, 5)]
    with Store(env.src, "r", source=source) as st:
        t0 = time.monotonic()
        got = st.get_many(batch)
        cold = time.monotonic() - t0
        t0 = time.monotonic()
        st.get_many([i + 1 for i in batch])
        warm = time.monotonic() - t0
    assert [as_tuple(v) for v in got] == [env.ref[i] for i in batch]
    serial = len(shards) * 2 * delay
    print(f"{len(batch)} samples over {len(shards)} shards: {cold:.2f}s with cold seek tables, {warm:.2f}s warm "
          f"(one request at a time would take >= {serial:.1f}s); {home.requests} requests, {home.peak} at once")
    assert home.peak >= len(shards)
    assert cold < serial / 2 and warm < 3 * delay
    assert staged_copies(cfg) == []


def test_dataloader_workers_read_record_by_record(env: Env, tmp_path: Path, record_mode: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from helpers.servers import write_toml

    url = env.publish("s3")
    monkeypatch.setenv("KVDATA_CONFIG", str(write_toml(tmp_path / "kvdata.toml", tmp_path / "tiers", ("ssd", "64MB"))))
    ds = kvdata.Dataset(url)
    try:
        loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, shuffle=True,
                                             generator=torch.Generator().manual_seed(0), collate_fn=kvdata.collate)
        seen = {}
        for batch in loader:
            for img, name in zip(batch["image"].numpy(), batch["name"]):
                seen[int(str(name)[1:])] = img.tobytes()
        assert sorted(seen) == list(range(N))
        assert all(seen[i] == env.ref[i][0] for i in range(N))
    finally:
        ds.store.close()
    assert not list((tmp_path / "tiers").rglob("*.mdb"))


@pytest.mark.parametrize("compress", [False, True])
def test_a_dataset_as_written_and_pushed_is_read_record_by_record(compress: bool, env: Env, tmp_path: Path,
                                                                  record_mode: None) -> None:
    """The ordinary path, no reframing by hand: the cold copy made at seal (compress=True)
    or by `kvdata push` carries its seek table."""
    p = tmp_path / "plain.kv"
    with kvdata.open(p, "w", shard_size=SHARD, compress=compress) as s:
        for i in range(N):
            s.put(f"k{i:04d}", sample(i))
    url = push_s3(p, env.s3, f"plain-{compress}")
    st, cfg = open_remote(url, tmp_path)
    with st:
        assert all(e.zst is not None and e.zst.seek_sha256 for e in st.manifest.shards)
        counted = Counted(st.home)
        batch = [1, 17, 33, 49, N - 1]
        assert [as_tuple(v) for v in st.get_many(batch)] == [env.ref[i] for i in batch]
        assert counted.bytes < sum(e.bytes for e in st.manifest.shards) / 4
    assert staged_copies(cfg) == []


def test_key_lookups_read_record_by_record_too(env: Env, tmp_path: Path, record_mode: None) -> None:
    """`store[key]`, `find` and `key_at` read the records' headers from the home instead of
    staging whole shards (they used to map every shard a lookup touched)."""
    url = env.publish("s3")
    st, cfg = open_remote(url, tmp_path)
    with kvdata.open(env.src) as local:
        keys = [local.key_at(i) for i in (0, len(local) // 2, len(local) - 1)]
        want = {k: as_tuple(local[k]) for k in keys}
    with st:
        for k in keys:
            i = st.find(k)
            assert i is not None and st.key_at(i) == k
            assert as_tuple(st[k]) == want[k]
        assert st.find("no-such-key") is None
    assert staged_copies(cfg) == []


def test_kvdatad_tells_its_readers_when_its_tier_is_congested(env: Env, kit: Kit,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Through kvdatad, a shard-aware reader whose tier is full of copies readers hold: the
    daemon serves the shard that found no room as a private copy and says its tier is
    congested; the reader then reads the shards without a copy record by record (no more
    whole private copies fetched and thrown away), and still maps the staged one."""
    url = env.publish("http")
    by_id = {e.id: e for e in env.entries}
    size = max(e.bytes for e in env.entries)
    held, second, third = sorted((e for e in env.entries if e.bytes == size), key=lambda e: e.id)[:3] \
        if sum(e.bytes == size for e in env.entries) >= 3 else (by_id[0], by_id[1], by_id[2])
    cfg = kit.root / "one-tier.toml"
    budget = max(held.bytes, second.bytes) + metadata_bytes(env.src)  # (its index mirror counts too)
    cfg.write_text(f'[[tiers]]\nname = "ram"\npath = "{kit.tiers["ram"]}"\nbudget = {budget}\n'
                   f'[daemon]\nallow_homes = ["{url.rsplit("/", 1)[0]}/"]\n')
    d = kit.daemon(config=cfg)
    for k, v in kit.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("KVDATA_CONFIG", str(cfg))
    with kvdata.open(url) as s:
        source = s.source
        assert isinstance(source, DaemonStager) and source.client is not None
        source.announce("r0", [held, second, third], 0)  # shard-aware

        def read(*es: Any) -> None:
            idx = [i for e in es for i in env.shard_samples(e.id)]
            assert [as_tuple(v) for v in s.get_many(idx)] == [env.ref[i] for i in idx]

        read(held)  # staged, and mapped by this reader
        assert all(source.wants_whole(e) for e in (held, second, third))
        read(held, second)  # a batch of both: no room beside the held copy: a private copy, and the daemon says so
        assert d.status()["private_copies"] == 1
        assert source.wants_whole(held) and not source.wants_whole(third)
        read(third)  # record by record
        assert d.status()["private_copies"] == 1, "a whole private copy was fetched for a congested tier"
        staged = [p.name for p in (kit.tiers["ram"] / "shards").glob("*.mdb")]
        assert staged == [names.staged_name(held.sha256)]
    assert d.terminate() == 0


def test_a_shard_aware_order_larger_than_the_tier_keeps_what_the_next_epoch_reads_first(env: Env,
                                                                                          tmp_path: Path) -> None:
    """ShardShuffleSampler's announcement (this epoch's shards, then the next epoch's) over a
    dataset larger than the tier: only the shards the next epoch reads first get whole copies
    (policy.keep_for_next_pass, with the room the copies this epoch still reads take); the others
    are read record by record and never staged. A warm epoch then fetches about 1 - room/data
    from the home, and its first shards are hits."""
    url = env.publish("http")
    entries = env.entries
    size = max(e.bytes for e in entries)
    total = sum(e.bytes for e in entries)
    budget = 4 * size + size // 2
    assert total > budget
    cfg = tiers_config(tmp_path / "tiers", ("ssd", budget))
    st = open_dataset(url, config=cfg, use_daemon=False)
    prev_keep: set[str] = set()
    try:
        order = [list(reversed(entries)), entries[1:] + entries[:1], entries[2:] + entries[:2]]
        eng = st.engine
        for epoch in range(2):
            seq = order[epoch] + order[epoch + 1]
            st.source.announce("r0", seq, 0)
            keep = eng.keep_set()[0]
            assert keep is not None and 1 <= len(keep) < len(entries)
            assert keep == {e.sha256 for e in order[epoch + 1][:len(keep)]}  # what the next epoch reads first
            before = eng.status()["bytes_from_home"]
            hits = eng.status()["hits"]
            staged: set[str] = set()
            for i, e in enumerate(order[epoch]):
                st.source.progress("r0", i)
                idx = env.shard_samples(e.id)
                assert [as_tuple(v) for v in st.get_many(idx)] == [env.ref[j] for j in idx]
                staged |= set(Tier(cfg.tiers[0]).resident())
                assert Tier(cfg.tiers[0]).used() <= budget
            fetched = eng.status()["bytes_from_home"] - before
            time.sleep(KEEP_TTL)  # (the keep set is recomputed at most this often)
            keep = eng.keep_set()[0]
            assert keep is not None
            resident = set(Tier(cfg.tiers[0]).resident())
            # what this epoch's next one reads first, and what the previous epoch kept for this one (it
            # stays until its room is needed); never a shard read once this epoch
            assert staged <= keep | prev_keep, "a shard read once this epoch was staged whole"
            assert resident & keep == keep, "a shard kept for the next epoch was lost"
            if epoch == 1:  # warm: what the previous epoch kept is read from the tier
                kept = sum(e.bytes for e in entries if e.sha256 in prev_keep)
                assert eng.status()["hits"] > hits
                assert fetched <= (total - kept) * 1.15, (fetched, total, kept)
            prev_keep = keep
    finally:
        st.close()


def policy_demand(seq: list[Any]) -> Any:
    from kvdata.tiers.policy import Demand

    return Demand(tuple(e.sha256 for e in seq), 0)


def test_dataloader_workers_stage_only_the_keep_set_of_the_samplers_order(env: Env, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """DataLoader workers never see the sampler's announcement in their own engine: they read
    it from the orders the main process published in the tier, and stage whole only what the
    next epoch reads first (the rest record by record), like the main process would."""
    torch = pytest.importorskip("torch")
    from helpers.servers import write_toml

    url = env.publish("http")
    size = max(e.bytes for e in env.entries)
    tiers = tmp_path / "tiers"
    monkeypatch.setenv("KVDATA_CONFIG", str(write_toml(tmp_path / "kvdata.toml", tiers, ("ssd", 4 * size + size // 2))))
    ds = kvdata.Dataset(url)
    try:
        sampler = kvdata.ShardShuffleSampler(ds, window=2, seed=1)
        loader = torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=8, num_workers=2,
                                             collate_fn=kvdata.collate)
        keeps: list[set[str]] = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            names_seen = [str(n) for b in loader for n in b["name"]]
            assert sorted(names_seen) == sorted(f"s{i}" for i in range(N))
            keep = ds.store.engine.keep_set()[0]
            assert keep is not None and 0 < len(keep) < len(env.entries)
            keeps.append(keep)
            resident = {p.stem for p in tiers.rglob("*.mdb")}
            assert resident <= set().union(*keeps[-2:]), "a worker staged whole a shard read once this epoch"
    finally:
        ds.store.close()


def test_a_tiers_budget_counts_the_remote_datasets_index_kept_in_it(env: Env, tmp_path: Path) -> None:
    """The verified manifest and index of a remote dataset live in the last tier (mirror
    cache_root): the budget bounds everything under the tier's directory, copies and that index
    alike, and `status` counts both."""
    url = env.publish("http")
    size = max(e.bytes for e in env.entries)
    budget = 2 * size + metadata_bytes(env.src) // 2  # the index takes room two whole copies would need
    cfg = tiers_config(tmp_path / "tiers", ("ssd", budget))
    st = open_dataset(url, config=cfg, use_daemon=False)
    try:
        rng = np.random.default_rng(0)
        for _epoch in range(2):  # random order: a resident set, the rest record by record
            perm = rng.permutation(N).tolist()
            for i in range(0, N, 8):
                got = st.get_many(perm[i:i + 8])
                assert [as_tuple(v) for v in got] == [env.ref[j] for j in perm[i:i + 8]]
        on_disk = sum(p.stat().st_size for p in (tmp_path / "tiers" / "ssd").rglob("*") if p.is_file())
        tier = st.engine.status()["tiers"][0]
        assert tier["metadata"] > 0 and tier["used"] <= budget and on_disk <= budget, (tier, on_disk, budget)
        assert tier["shards"] == 1  # two copies would not fit beside the index
    finally:
        st.close()


def test_neighbouring_records_share_one_get(env: Env) -> None:
    """Frames end at values, so the page header and padding between two values can be frames
    of their own; a read of neighbouring records fetches them inside one GET (a request costs
    more than a few KiB) without decoding them, and a single record costs about its bytes."""
    from kvdata.tiers.records import RecordReader

    url = env.publish("http")
    home = open_home(url)
    try:
        e = env.entries[1]
        reader = RecordReader(home)
        reader.table(e)
        before = (reader.requests, reader.bytes_fetched)
        one = reader.read(e, [2])
        assert one is not None and reader.requests == before[0] + 1
        assert reader.bytes_fetched - before[1] < 1.05 * len(one[0])
        before = (reader.requests, reader.bytes_fetched)
        got = reader.read(e, [0, 1, 2])
        assert got is not None and reader.requests == before[0] + 1
        base = env.shard_samples(1)[0]
        with kvdata.open(env.src) as local:
            assert [as_tuple(local._reader.decode_value(v, True)) for v in got] == [env.ref[base + s] for s in (0, 1, 2)]
    finally:
        home.close()
