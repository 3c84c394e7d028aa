"""Which shards a tier should hold: a pure function of (demands, residency, budget).

Readers announce the shard sequence of their epoch (from the seeded order) and
how far they have got. A shard's *next use* is its smallest distance ahead of a
reader's position. A tier should hold the shards with the nearest next use that
fit its budget (Belady's offline optimum, made online because the future is
known from the seed); anything else is evicted -- shards nobody will use first,
then the one needed furthest away -- but never a shard in use. The same function
serves the in-process engine, the daemon, and bench/staging.py's replay.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

INF = float("inf")


@dataclass(frozen=True)
class Demand:
    """One reader's announced shard sequence and where it is in it."""

    sequence: tuple[str, ...]
    position: int = 0


@dataclass(frozen=True)
class TierPlan:
    """What to fetch into a tier; eviction happens when each staged copy needs room."""

    stage: list[str] = field(default_factory=list)   # in the order to fetch them (nearest first)


def next_uses(demands: Iterable[Demand], lookahead: int | None = None) -> dict[str, int]:
    """Distance (in shard steps) to each shard's next use over all readers."""
    out: dict[str, int] = {}
    for d in demands:
        end = len(d.sequence) if lookahead is None else min(len(d.sequence), d.position + lookahead)
        for dist, key in enumerate(d.sequence[d.position:end]):
            if dist < out.get(key, 1 << 62):
                out[key] = dist
    return out


def plan_tier(budget: int, sizes: Mapping[str, int], resident: Mapping[str, int], demands: Iterable[Demand],
              in_use: Iterable[str] = (), lookahead: int | None = None) -> TierPlan:
    """The shards to stage that move a tier toward holding the nearest-needed shards.

    Only shards within `lookahead` steps of a reader are fetched ahead of time; the rest of
    the budget keeps residents in next-use order (Belady). Prefetching the whole budget ahead
    would evict shards the next epoch reads first -- the seed tells us which -- only to fetch
    them again. A shard is planned only if the evictable residents make room for it.
    """
    in_use = set(in_use)
    nu = next_uses(demands)
    held = {k for k in resident if k in in_use}   # they stay whatever we plan: they use budget
    want: list[str] = [k for k in held if k in nu]
    acc = sum(resident[k] for k in held)
    for key in sorted(nu, key=lambda k: (nu[k], k)):
        if key in held:
            continue
        size = sizes.get(key, 0)
        if acc + size > budget:
            break
        want.append(key)
        acc += size
    want_set = set(want)
    stage = [k for k in want if k not in resident and (lookahead is None or nu[k] < lookahead)]
    evictable = [k for k in resident if k not in want_set and k not in in_use]
    evictable.sort(key=lambda k: (-nu.get(k, INF), k))  # never-needed first, then furthest
    used = sum(resident.values())
    final_stage: list[str] = []
    for k in stage:
        size = sizes.get(k, 0)
        while used + size > budget and evictable:
            used -= resident[evictable.pop(0)]
        if used + size > budget:
            break  # the rest would not fit either: nothing more can be evicted
        final_stage.append(k)
        used += size
    return TierPlan(stage=final_stage)


def eviction_order(resident: Mapping[str, int], demands: Iterable[Demand], in_use: Iterable[str] = ()) -> list[str]:
    """Every evictable shard, best victim first: never needed, then furthest next use."""
    in_use = set(in_use)
    nu = next_uses(demands)
    return sorted((k for k in resident if k not in in_use), key=lambda k: (-nu.get(k, INF), k))


def plan_eviction(budget: int, resident: Mapping[str, int], demands: Iterable[Demand], incoming: int,
                  in_use: Iterable[str] = ()) -> list[str]:
    """Shards to drop so `incoming` more bytes fit: never-needed first, then furthest next use."""
    used = sum(resident.values())
    out = []
    for k in eviction_order(resident, demands, in_use):
        if used + incoming <= budget:
            break
        out.append(k)
        used -= resident[k]
    return out
