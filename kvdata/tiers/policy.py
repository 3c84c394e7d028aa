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

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

INF = float("inf")


@dataclass(frozen=True)
class Demand:
    """One reader's announced shard sequence and where it is in it."""

    sequence: tuple[str, ...]
    position: int = 0
    # where the next pass starts in `sequence`, when the announcer said (ShardShuffleSampler
    # does): the boundary cannot always be inferred (next_pass_start), e.g. a rank of many
    # whose next epoch shares no shard with this one. None: inferred.
    next_start: int | None = None

    def pass_end(self) -> int:
        """Index of the next pass's first shard (len(sequence): no next pass)."""
        n = self.next_start
        return n if n is not None and 0 <= n <= len(self.sequence) else next_pass_start(self.sequence)


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


def next_pass_start(sequence: Sequence[str]) -> int:
    """Where an announced sequence starts its next pass, as ShardShuffleSampler announces
    them (this epoch's shards in first-use order, then the next epoch's): the first index whose
    shard came before, if what follows repeats nothing and is at least half as long as the
    first pass; else its length (one pass, or an order that merely comes back to a shard)."""
    seen: set[str] = set()
    for i, key in enumerate(sequence):
        if key in seen:
            rest = sequence[i:]
            if 2 * len(rest) >= i and len(set(rest)) == len(rest):
                return i
            return len(sequence)
        seen.add(key)
    return len(sequence)


def keep_for_next_pass(demands: Iterable[Demand], sizes: Mapping[str, int], room: int,
                       default_size: int = 0, resident: Collection[str] | None = None,
                       held: Collection[str] = (), reading: int = 0,
                       admitted: Collection[str] | None = None) -> set[str] | None:
    """The shards worth a whole copy in tiers of `room` bytes: those the readers' next passes
    read first, up to the room (Belady with bypass). None when every shard of the announced
    passes fits, or when no order has a next pass: then every shard is staged whole.

    When the data is larger than the tiers, a shard staged whole only to be read once this
    pass takes the place of one the next pass reads first, and costs a fetch then. Read by
    record instead, it costs the same bytes now and nothing later: home traffic per pass is
    then 1 - room/data, the optimum, whatever window and prefetch the readers work with.

    With `resident` (the shards the tiers hold now) the set is the one for this moment of
    the pass, not only for its end:

    - the room that copies still in use take is not the next pass's: a resident shard this
      pass still reads (at or after a reader's position), or one a reader maps (`held`), keeps
      its place until it is done, so the keep set gets the room less theirs -- it grows as
      they are read. Without this, the shards the next pass reads first, met while two
      windows of this pass are mapped (two DataLoader workers a window apart), evicted what
      this pass was about to read, or found no room and were fetched whole into private copies;
    - a shard that cannot be kept any more -- not resident, and this pass read it already
      (read by record when its turn came) -- is left out, so the next one in the next pass's
      order takes its place instead of the set keeping a hole (Belady's choice: what is
      needed soonest among what can still be had). So is one within `reading` shards of a
      reader's position -- which it may be reading now -- unless it was in the set the readers
      had before (`admitted`; None: none was given for these orders, which only a reader at
      position 0 can still take as "nothing read yet"): read by record so far, then staged
      whole, it would cost its bytes twice (a window of ShardShuffleSampler is read together,
      and the position it announces trails the furthest shard it reached by a window)."""
    firsts: dict[str, int] = {}
    every: set[str] = set()
    this_pass: set[str] = set()
    ahead: set[str] = set()
    unread: set[str] = set()  # not reached by a reader yet: can still be staged whole before it is read
    fresh: set[str] = set()   # ahead of a reader that has not moved since it announced its order
    for d in demands:
        seq = d.sequence
        every.update(seq)
        start = d.pass_end()
        this_pass.update(seq[:start])
        ahead.update(seq[min(d.position, start):start])
        unread.update(seq[min(d.position + reading, start):start])
        if d.position == 0:
            fresh.update(seq[:start])
        for rank, key in enumerate(seq[start:]):
            if rank < firsts.get(key, 1 << 62):
                firsts[key] = rank
    if not firsts or sum(sizes.get(k, default_size) for k in every) <= room:
        return None
    busy: set[str] = set()
    if resident is not None:
        busy = {k for k in resident if k in ahead or k in held}
        room -= sum(sizes.get(k, default_size) for k in busy)
    keep: set[str] = set()
    used = 0
    for key in sorted(firsts, key=lambda k: (firsts[k], k)):
        if resident is not None and key not in resident and key not in unread and key in this_pass \
                and not (key in ahead and (key in admitted if admitted is not None else key in fresh)):
            continue  # read (or being read by record) this pass, and no copy: not without a second fetch
        size = 0 if key in busy else sizes.get(key, default_size)  # (a busy copy's room is counted)
        if used + size > room:
            break
        keep.add(key)
        used += size
    return keep


LOOKAHEAD_SHARE = 0.25  # of the room a tier has for announced orders that prefetching ahead may take


def prefetch_depth(lookahead: int, room: int, shard_bytes: float, share: float = LOOKAHEAD_SHARE) -> int:
    """How many shards ahead of its readers a tier prefetches: `lookahead`, but at most
    `share` of the `room` (bytes) it has for announced orders, and at least one.

    Prefetching trades hits for stalls: a shard fetched d steps early takes the place of one
    that Belady would have kept for its next use, so a depth of d costs about d shards of
    hits per epoch. In a tier that holds 16 shards, a depth of 16 turns every hit of the
    next epoch into a fetch (measured: 0.84 datasets per warm epoch at a 25% budget, where
    the optimum is 0.75); a quarter of the room keeps both the stalls and the loss small."""
    if shard_bytes <= 0:
        return max(1, lookahead)
    return max(1, min(lookahead, int(room * share // shard_bytes)))


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


# ------------------------------------------------------------ unannounced (random) orders
#
# A dataset nobody announced an order for is read in an order the cache cannot know: every
# shard is as likely next as any other. Then LRU or next-use eviction only thrashes (CoorDL,
# Mohan et al. VLDB 2021): the best a tier can do is keep a *fixed* set of whole shards that
# fits its share of the budget -- those samples hit, every epoch -- and read every other
# sample without keeping its shard (record by record, or a private copy that no tier holds).
# The set is the dataset's shards of lowest sha256 (deterministic: every process, the
# daemon and a restarted daemon choose the same one, and the sha256s spread it evenly over
# the dataset's samples). While shard-aware readers (announced orders) share the tier, the
# random-order datasets' sets together take at most RANDOM_SHARE of it and the shard-aware
# readers plan with the rest: neither evicts the other's shards.

SHARD_AWARE = "shard-aware"
RANDOM = "random"
RANDOM_SHARE = 0.5   # of a tier that random-order datasets' resident sets take while shard-aware readers share it


def dataset_key(shas: Iterable[str]) -> str:
    """A dataset's identity for the policy: a hash of its set of shard sha256s (so every
    process and the daemon name it alike, whatever path or URL it was opened by)."""
    import hashlib

    h = hashlib.sha256()
    for s in sorted(set(shas)):
        h.update(s.encode())
    return h.hexdigest()[:16]


def random_quotas(budget: int, totals: Mapping[str, int], shared_with_aware: bool) -> dict[str, int]:
    """Bytes of a tier each random-order dataset's resident set may take: the tier's budget
    (RANDOM_SHARE of it while shard-aware readers share it), split in proportion to the
    datasets' sizes (so each gets the same hit fraction), never more than a dataset's size."""
    room = int(budget * (RANDOM_SHARE if shared_with_aware else 1.0))
    whole = sum(totals.values())
    if whole <= room:
        return dict(totals)
    return {k: room * t // whole for k, t in totals.items()}


def resident_set(by_sha: Iterable[tuple[str, int]], quota: int) -> tuple[set[str], str]:
    """The fixed resident set of a random-order dataset: its shards in sha256 order (the
    caller passes them sorted), as many as fit `quota`; and the largest sha256 in it ("" when
    empty), so a process that does not know the dataset's shard list can still tell
    (sha <= threshold) which copies are part of it."""
    out: set[str] = set()
    acc = 0
    last = ""
    for sha, size in by_sha:
        if acc + size > quota:
            break
        out.add(sha)
        acc += size
        last = sha
    return out, last


def looks_random(shards: Sequence[int], num_shards: int, window: int = 16) -> bool:
    """Whether a run of accessed samples' shards (in access order) comes from an order that
    is not shard-grouped. A shard-grouped order (ShardShuffleSampler with a window of up to
    `window` shards, a sequential or strided order, any rank's share of them) does not come
    back to a shard once it has left its window, so the run's first and last quarters share
    no shard unless the whole run lies in one or two windows (at most 2*window+1 shards). A
    random permutation keeps coming back: a shard of the first quarter turns up in the last
    with probability 1 - exp(-quarter/num_shards). True when the run touches more shards than
    two windows and at least half the expected number (and 3) come back."""
    import math

    n = len(shards)
    if n < 8 or num_shards <= 1:
        return False
    q = n // 4
    first, last = set(shards[:q]), set(shards[n - q:])
    expected = len(first) * (1.0 - math.exp(-q / num_shards))
    return len(set(shards)) > 2 * window + 1 and len(first & last) >= max(3.0, 0.5 * expected)
