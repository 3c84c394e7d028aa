"""Who reads which dataset how: the read modes of the policy for unannounced orders (kvdata.tiers).

A dataset read while nobody announced an order for it (DataLoader(shuffle=True), any sampler
but ShardShuffleSampler) is read in *random* mode: each tier keeps a fixed resident set of its
whole shards (lowest sha256 first, up to the tier's share: policy.random_quotas), never evicted
while the dataset is read so; every other shard is read record by record. A dataset some reader
announced an order over is read *shard-aware*: staged whole, ahead of the order.

Which datasets are read, and how, is shared by every process of this uid through claim files in
each tier's locks directory (flocked while held; Tier.claim/claims): a DataLoader worker sees the
sampler's announcement in the main process, and an engine never evicts another process's resident
set (whose threshold sha256 the claim file carries). The staging engine (kvdata.tiers.staging)
asks this module which tiers a shard may go to and which copies it must not evict.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..format import ShardEntry
from . import policy
from .tier import Tier

MODE_TTL = 0.5  # seconds the tiers' claims are trusted before a rescan
CLAIM_SIZE = 256  # bytes of a claim file: "<bytes> <threshold sha256 or -> <label>\n", space-padded
ORDER_PREFIX_SHARDS = 64  # an announced order claims the datasets of its first this many shards


@dataclass
class _Dataset:
    """A dataset this process reads shards of."""

    key: str
    label: str
    by_sha: list[tuple[str, int]]   # (sha256, bytes) of its shards, in sha256 order
    total: int
    active: bool = False            # read since opened (it then claims its mode in the tiers)
    from_home: int = 0              # bytes of whole shards read from its home (staged, private copies, in
                                    # place); record reads are in the engine's bytes_from_home only
    claims: dict[str, tuple[str, int]] = field(default_factory=dict)  # tier -> (claim file name, descriptor)


@dataclass
class _TierView:
    """What a tier's claims say (policy.random_quotas): the datasets read shard-aware, and the
    resident sets of those read in random order."""

    aware: set[str] = field(default_factory=set)
    quota: dict[str, int] = field(default_factory=dict)       # random dataset key -> bytes of this tier
    sets: dict[str, set[str]] = field(default_factory=dict)   # own random datasets -> resident shas
    foreign: list[str] = field(default_factory=list)          # other processes' random sets: sha thresholds
    labels: dict[str, tuple[int, str]] = field(default_factory=dict)  # claimed dataset key -> (bytes, name)


class ReadModes:
    """The datasets this process reads, their mode, and their claims in the tiers."""

    def __init__(self, tiers: Callable[[], list[Tier]]) -> None:
        """tiers: the engine's current tiers (a daemon reload swaps them)."""
        self._tiers = tiers
        self._lock = threading.RLock()
        self._datasets: dict[str, _Dataset] = {}
        self._ds_of: dict[str, list[str]] = {}         # shard sha -> keys of the datasets holding it
        self._aware_readers: dict[str, set[str]] = {}  # reader -> keys of the datasets it announced
        self._views: tuple[float, dict[str, _TierView]] = (0.0, {})
        self._views_gen = 0   # bumped when the claims change: views computed before are not cached
        self._pid = os.getpid()

    # ------------------------------------------------------------ datasets

    def open_dataset(self, entries: Sequence[ShardEntry], label: str | None = None) -> str:
        """Learn a dataset's shard list (its key: policy.dataset_key); returns the key. It is
        claimed in the tiers (read shard-aware or in random order) once its shards are read."""
        key = policy.dataset_key(e.sha256 for e in entries)
        with self._lock:
            d = self._datasets.get(key)
            if d is None:
                by_sha = sorted({(e.sha256, e.bytes) for e in entries})
                d = self._datasets[key] = _Dataset(key, label or "", by_sha, sum(b for _s, b in by_sha))
                for sha, _b in by_sha:
                    keys = self._ds_of.setdefault(sha, [])
                    if key not in keys:
                        keys.append(key)
            if label:
                d.label = label
        return key

    def activate(self, keys: Sequence[str]) -> None:
        """These datasets are being read through this engine: claim them in the tiers."""
        with self._lock:
            idle = [k for k in keys if k in self._datasets and not self._datasets[k].active]
            for k in idle:
                self._datasets[k].active = True
            if idle:
                self._stale()
        if idle:
            self._update_claims()

    def deactivate(self, key: str) -> None:
        """Nobody reads this dataset through this engine any more (kvdatad: its last client
        left): its claims go, so its resident set is no longer kept."""
        with self._lock:
            d = self._datasets.get(key)
            if d is None or not d.active:
                return
            d.active = False
            self._stale()
        self._update_claims()

    def name(self, home_url: str, sha: str) -> None:
        """Name a dataset by its home in status (the first home its shards are read from)."""
        with self._lock:
            for k in self._ds_of.get(sha, ()):
                d = self._datasets[k]
                if not d.label:
                    d.label = home_url

    def fetched(self, entry: ShardEntry) -> None:
        """A whole shard was read from its home (counted per dataset for status)."""
        with self._lock:
            for k in self._ds_of.get(entry.sha256, ()):
                self._datasets[k].from_home += entry.bytes

    # ------------------------------------------------------------ announced orders

    def announced(self, reader: str, shas: Iterable[str]) -> None:
        """A reader announced an order over these shards: their datasets are read shard-aware
        (and active: a sampler that announces in the main process reads through its workers)."""
        with self._lock:
            keys = {k for sha in shas for k in self._ds_of.get(sha, ())}
            before = self._aware_readers.get(reader, set())
            self._aware_readers[reader] = keys
            idle = [key for key in keys if not self._datasets[key].active]
            for key in idle:
                self._datasets[key].active = True
            if keys != before or idle:
                self._stale()
        if keys != before or idle:
            self._update_claims()

    def released(self, reader: str) -> None:
        with self._lock:
            had = self._aware_readers.pop(reader, None)
            if had:
                self._stale()
        if had:
            self._update_claims()

    # ------------------------------------------------------------ what the engine asks

    def mode(self, key: str) -> str:
        """policy.SHARD_AWARE when some reader (of this process or another, or a client of
        kvdatad) announced an order over this dataset, else policy.RANDOM."""
        return policy.SHARD_AWARE if self._aware([key], self._tier_views()) else policy.RANDOM

    def resident_threshold(self, key: str) -> str:
        """The largest sha256 in this dataset's resident sets ("" when none): a shard of it is
        resident iff its sha256 <= this (what kvdatad tells its clients)."""
        members = [v.sets.get(key, set()) for v in self._tier_views().values()]
        return max((max(m) for m in members if m), default="")

    def tiers_for(self, sha: str) -> list[Tier]:
        """The tiers a shard may be staged into: all of them for a shard-aware (or unknown)
        dataset; for a random-order one, the tiers whose resident set holds it (maybe none)."""
        with self._lock:
            keys = list(self._ds_of.get(sha, ()))
        if not keys:
            return list(self._tiers())
        self.activate(keys)
        views = self._tier_views()
        if self._aware(keys, views):
            return list(self._tiers())
        return [t for t in self._tiers()
                if t.name in views and any(sha in views[t.name].sets.get(k, ()) for k in keys)]

    def protected(self, tier: Tier, resident: dict[str, int] | None = None) -> set[str]:
        """Copies in this tier that belong to random-order datasets' resident sets (ours, and
        other processes' by their claimed thresholds): never evicted while so read."""
        v = self._tier_views().get(tier.name)
        if v is None:
            return set()
        out: set[str] = set().union(*v.sets.values()) if v.sets else set()
        if v.foreign:
            top = max(v.foreign)
            out |= {s for s in (tier.resident() if resident is None else resident) if s <= top}
        return out

    def status(self, staged: Callable[[str], bool]) -> list[dict[str, Any]]:
        """How each dataset this process reads is read: mode, and in random mode its resident
        set (staged: whether a shard has a copy in some tier); then those other processes of
        this uid claim."""
        views = self._tier_views()
        with self._lock:
            active = [d for d in self._datasets.values() if d.active]
        out = []
        for d in active:
            aware = self._aware([d.key], views)
            members: set[str] = set()
            quota = 0
            if not aware:
                for v in views.values():
                    members |= v.sets.get(d.key, set())
                    quota += v.quota.get(d.key, 0)
            sizes = dict(d.by_sha)
            out.append({"dataset": d.label or d.key, "key": d.key,
                        "mode": policy.SHARD_AWARE if aware else policy.RANDOM,
                        "shards": len(d.by_sha), "bytes": d.total, "resident_shards": len(members),
                        "resident_bytes": sum(sizes[s] for s in members),
                        "resident_staged": sum(staged(s) for s in members),
                        "resident_budget": quota, "shard_bytes_from_home": d.from_home})
        mine = {d.key for d in active}
        others: dict[str, tuple[int, str]] = {}
        for v in views.values():
            for k, got in v.labels.items():
                if k not in mine:
                    others.setdefault(k, got)
        for k, (total, label) in sorted(others.items()):  # read by other processes of this uid
            aware = any(k in v.aware for v in views.values())
            out.append({"dataset": label or k, "key": k, "mode": policy.SHARD_AWARE if aware else policy.RANDOM,
                        "shards": None, "bytes": total, "resident_shards": None, "resident_bytes": None,
                        "resident_staged": None,
                        "resident_budget": 0 if aware else sum(v.quota.get(k, 0) for v in views.values())})
        return out

    def close(self) -> None:
        """Let go of every claim (in the process that took them: a fork's are its parent's)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            held = [fd for d in self._datasets.values() for _n, fd in d.claims.values()]
            for d in self._datasets.values():
                d.claims = {}
        for fd in held:
            os.close(fd)

    # ------------------------------------------------------------ claims in the tiers

    def _aware(self, keys: Sequence[str], views: dict[str, _TierView]) -> bool:
        with self._lock:
            if any(k in ks for ks in self._aware_readers.values() for k in keys):
                return True
        return any(k in v.aware for v in views.values() for k in keys)

    def _stale(self) -> None:
        """(Under the lock, with the change that calls for it) what the tiers' views were
        computed from changed: the next caller computes them again, and a computation that
        started before is not cached. Without this, a thread that read the cache between
        another thread's activating a dataset and its claims landing got views without the
        dataset: its shards had no tier and were fetched into private copies, then again."""
        self._views_gen += 1
        self._views = (0.0, {})

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:  # the parent's claims are its own (inherited descriptors stay)
            with self._lock:
                for d in self._datasets.values():
                    d.claims = {}
                self._views = (0.0, {})
                self._pid = os.getpid()

    def _update_claims(self) -> None:
        """Hold, in every tier, one claim per dataset this process reads: `.aware` when it
        announced an order over it, else `.random` (content: its size and resident
        threshold, rewritten by _tier_views)."""
        self._check_fork()
        uid = os.geteuid()
        with self._lock:
            aware = {k for ks in self._aware_readers.values() for k in ks}
            datasets = list(self._datasets.values())
        tiers = self._tiers()
        for d in datasets:
            for t in tiers:
                want = None if not d.active else f"use-{uid}-{d.key}." + ("aware" if d.key in aware else "random")
                have = d.claims.get(t.name)
                if have is not None and have[0] == want:
                    continue
                if have is not None:
                    os.close(have[1])
                    del d.claims[t.name]
                if want is None:
                    continue
                try:
                    fd = t.claim(want)
                except OSError:
                    continue
                write_claim(fd, d.total, "", d.label)
                d.claims[t.name] = (want, fd)
        with self._lock:
            self._stale()

    def _tier_views(self) -> dict[str, _TierView]:
        """Each tier's claims, rescanned at most every MODE_TTL seconds; our random-order
        datasets' resident sets computed from them (and their thresholds written back)."""
        now = time.monotonic()
        until, views = self._views
        if now < until and os.getpid() == self._pid:
            return views
        self._check_fork()
        with self._lock:
            gen = self._views_gen
            own = {k: d for k, d in self._datasets.items() if d.active}
            announced = {a for ks in self._aware_readers.values() for a in ks}
        prefix = f"use-{os.geteuid()}-"
        views = {}
        for t in self._tiers():
            v = _TierView()
            try:
                found = t.claims(prefix) if t.healthy() else {}
            except OSError:
                found = {}
            totals: dict[str, int] = {}
            thresholds: dict[str, str] = {}
            for name, content in found.items():
                key, _dot, kind = name[len(prefix):].partition(".")
                got = read_claim(content)
                if got is not None:
                    v.labels.setdefault(key, (got[0], got[2]))
                if kind == "aware":
                    v.aware.add(key)
                elif kind == "random" and got is not None:
                    totals[key], thresholds[key] = got[0], got[1]
            for k in own:  # our claims may be missing from a tier whose locks directory failed
                if k not in v.aware and k not in totals and k not in announced:
                    totals[k] = own[k].total
            totals = {k: b for k, b in totals.items() if k not in v.aware}
            v.quota = policy.random_quotas(t.room(), totals, bool(v.aware))
            for k, q in v.quota.items():
                d = own.get(k)
                if d is None:
                    if thresholds.get(k):
                        v.foreign.append(thresholds[k])
                    continue
                members, last = policy.resident_set(d.by_sha, q)
                v.sets[k] = members
                held = d.claims.get(t.name)
                if held is not None and held[0].endswith(".random"):
                    write_claim(held[1], d.total, last, d.label)
            views[t.name] = v
        with self._lock:
            if self._views_gen == gen:  # nothing changed meanwhile (_stale)
                self._views = (now + MODE_TTL, views)
        return views


def write_claim(fd: int, total: int, threshold: str, label: str) -> None:
    """A claim's content: the dataset's bytes, its resident set's largest sha256 ("-": none,
    or read shard-aware) and what it is called (for `kvdata status` in another process)."""
    data = f"{total} {threshold or '-'} {label[:150]}\n".encode(errors="replace")[:CLAIM_SIZE - 1]
    try:
        os.pwrite(fd, data.ljust(CLAIM_SIZE), 0)
    except OSError:
        pass


def read_claim(content: bytes) -> tuple[int, str, str] | None:
    """(bytes, threshold, label) of a claim's content; None when it is not one (a file being
    written, or damaged: it then only says the dataset is read, not how much to keep)."""
    parts = content.decode("utf-8", "replace").strip().split(" ", 2)
    if not parts[0].isdigit():
        return None
    thr = parts[1] if len(parts) > 1 and parts[1] != "-" else ""
    return int(parts[0]), thr, parts[2].strip() if len(parts) > 2 else ""
