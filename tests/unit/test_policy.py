"""kvdata.tiers.policy: which shards a tier holds, from the readers' announced order.

The documented behaviour: a shard's next use is its smallest distance ahead of any
reader; a tier holds the nearest-needed shards that fit its budget (Belady), stages
them nearest first and only within `lookahead` steps; evicts never-needed shards
first, then the one needed furthest away; never a shard in use.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdata.tiers.policy import (
    Demand,
    TierPlan,
    eviction_order,
    next_pass_start,
    next_uses,
    plan_eviction,
    plan_tier,
)

# ---------------------------------------------------------------- the scenario of the docs

#   x: resident, never announced;  one reader: a b c d e f a;  every shard 1 unit;  budget 4
SEQ = ("a", "b", "c", "d", "e", "f", "a")
ONE = {k: 1 for k in "abcdefx"}


def at(pos: int, seq: tuple[str, ...] = SEQ) -> list[Demand]:
    return [Demand(seq, pos)]


def test_next_use_is_the_distance_ahead_of_the_reader() -> None:
    assert next_uses(at(0)) == {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4, "f": 5}
    assert next_uses(at(1)) == {"b": 0, "c": 1, "d": 2, "e": 3, "f": 4, "a": 5}  # a comes back at the end
    assert next_uses(at(6)) == {"a": 0}
    assert next_uses(at(7)) == {}  # past the end: nothing is needed


def test_next_use_is_the_nearest_over_all_readers() -> None:
    demands = [Demand(("a", "b", "c"), 0), Demand(("c", "b", "a"), 0), Demand(("z", "a"), 1)]
    assert next_uses(demands) == {"a": 0, "b": 1, "c": 0}


def test_next_use_within_a_lookahead() -> None:
    assert next_uses(at(0), lookahead=2) == {"a": 0, "b": 1}
    assert next_uses(at(5), lookahead=10) == {"f": 0, "a": 1}


def test_cold_tier_stages_the_nearest_shards_that_fit_nearest_first() -> None:
    plan = plan_tier(4, ONE, {}, at(0))
    assert isinstance(plan, TierPlan)
    assert plan.stage == ["a", "b", "c", "d"]


def test_never_needed_shard_is_evicted_first_not_the_furthest_needed() -> None:
    resident = {"x": 1, "a": 1, "b": 1, "c": 1}
    assert eviction_order(resident, at(0)) == ["x", "c", "b", "a"]
    assert plan_tier(4, ONE, resident, at(0)).stage == ["d"]  # room made by dropping x
    assert plan_eviction(4, resident, at(0), incoming=1) == ["x"]


def test_progress_evicts_the_shard_needed_furthest_away() -> None:
    resident = {"a": 1, "b": 1, "c": 1, "d": 1}
    # at position 1: b0 c1 d2 e3 f4 a5 -- e is prefetched, a (needed again last) goes
    assert plan_tier(4, ONE, resident, at(1)).stage == ["e"]
    assert eviction_order(resident, at(1))[0] == "a"
    assert plan_eviction(4, resident, at(1), incoming=1) == ["a"]
    # at position 2 b is never needed again: it goes before a
    resident = {"b": 1, "c": 1, "d": 1, "e": 1}
    assert eviction_order(resident, at(2))[0] == "b"
    assert plan_tier(4, ONE, resident, at(2)).stage == ["f"]


def test_lookahead_limits_prefetch_but_keeps_residents() -> None:
    assert plan_tier(4, ONE, {}, at(0), lookahead=2).stage == ["a", "b"]
    # residents needed later than the lookahead are kept (not evicted to make room for nothing)
    resident = {"c": 1, "d": 1}
    assert plan_tier(4, ONE, resident, at(0), lookahead=2).stage == ["a", "b"]
    assert plan_tier(4, ONE, resident, at(0), lookahead=0).stage == []


def test_shard_in_use_is_never_evicted_and_counts_against_the_budget() -> None:
    resident = {"x": 1}
    assert eviction_order(resident, at(0), in_use={"x"}) == []
    assert plan_eviction(4, resident, at(0), incoming=4, in_use={"x"}) == []
    # x holds one unit of the four: three slots for the nearest shards
    assert plan_tier(4, ONE, resident, at(0), in_use={"x"}).stage == ["a", "b", "c"]
    # every slot held: nothing can be staged, however near
    full = {k: 1 for k in "wxyz"}
    assert plan_tier(4, ONE, full, at(0), in_use=set(full)).stage == []


def test_shard_larger_than_the_budget_is_not_staged() -> None:
    sizes = {"a": 10, "b": 1}
    assert plan_tier(4, sizes, {}, [Demand(("a", "b"))]).stage == []  # nearest first: b waits behind a
    assert plan_tier(4, sizes, {}, [Demand(("b", "a"))]).stage == ["b"]


def test_resident_shards_are_not_staged_again() -> None:
    resident = {"a": 1, "b": 1}
    assert plan_tier(4, ONE, resident, at(0)).stage == ["c", "d"]


def test_no_demand_stages_nothing_and_evicts_by_key() -> None:
    assert plan_tier(4, ONE, {"b": 1, "a": 1}, []).stage == []
    assert eviction_order({"b": 1, "a": 1}, []) == ["a", "b"]


# ---------------------------------------------------------------- properties

KEYS = st.sampled_from([f"s{i}" for i in range(12)])


@st.composite
def situations(draw: st.DrawFn) -> dict:
    """A tier (budget, residents, shards in use) and readers announcing orders over 12 shards."""
    universe = [f"s{i}" for i in range(12)]
    sizes = {k: draw(st.integers(1, 8)) for k in universe}
    demands = []
    for _ in range(draw(st.integers(0, 3))):
        seq = tuple(draw(st.lists(KEYS, max_size=20)))
        demands.append(Demand(seq, draw(st.integers(0, len(seq) + 1))))
    resident_keys = draw(st.sets(KEYS, max_size=8))
    resident = {k: sizes[k] for k in sorted(resident_keys)}
    in_use = draw(st.sets(st.sampled_from(sorted(resident_keys)), max_size=3)) if resident_keys else set()
    budget = draw(st.integers(1, 60))
    lookahead = draw(st.none() | st.integers(0, 10))
    return {"sizes": sizes, "demands": demands, "resident": resident, "in_use": in_use, "budget": budget,
            "lookahead": lookahead}


def brute_next_uses(demands: list[Demand], lookahead: int | None = None) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in demands:
        for i in range(d.position, len(d.sequence)):
            dist = i - d.position
            if lookahead is not None and dist >= lookahead:
                break
            k = d.sequence[i]
            out[k] = min(out.get(k, dist), dist)
    return out


@settings(max_examples=300, deadline=None)
@given(situations())
def test_next_uses_matches_a_brute_force(s: dict) -> None:
    assert next_uses(s["demands"]) == brute_next_uses(s["demands"])
    assert next_uses(s["demands"], s["lookahead"]) == brute_next_uses(s["demands"], s["lookahead"])


@settings(max_examples=300, deadline=None)
@given(situations())
def test_eviction_order_never_needed_then_furthest_never_in_use(s: dict) -> None:
    order = eviction_order(s["resident"], s["demands"], s["in_use"])
    assert sorted(order) == sorted(set(s["resident"]) - s["in_use"])
    nu = next_uses(s["demands"])
    dist = [nu.get(k, math.inf) for k in order]
    assert dist == sorted(dist, reverse=True), "never-needed first, then furthest next use"


@settings(max_examples=300, deadline=None)
@given(situations(), st.integers(0, 30))
def test_plan_eviction_makes_just_enough_room(s: dict, incoming: int) -> None:
    budget, resident, in_use = s["budget"], s["resident"], s["in_use"]
    victims = plan_eviction(budget, resident, s["demands"], incoming, in_use)
    order = eviction_order(resident, s["demands"], in_use)
    assert victims == order[:len(victims)], "victims are taken in eviction order"
    assert not set(victims) & in_use
    left = sum(resident.values()) - sum(resident[k] for k in victims)
    if left + incoming > budget:
        assert victims == order, "room is short only when every evictable shard went"
    if victims:
        assert left + resident[victims[-1]] + incoming > budget, "one victim fewer would have been enough"


@settings(max_examples=500, deadline=None)
@given(situations())
def test_plan_tier_stages_the_nearest_needed_within_budget_and_lookahead(s: dict) -> None:
    sizes, resident, in_use, budget, lookahead = s["sizes"], s["resident"], s["in_use"], s["budget"], s["lookahead"]
    stage = plan_tier(budget, sizes, resident, s["demands"], in_use=in_use, lookahead=lookahead).stage
    nu = next_uses(s["demands"])
    assert len(stage) == len(set(stage))
    assert all(k in nu and k not in resident for k in stage), "only needed shards that are not resident"
    if lookahead is not None:
        assert all(nu[k] < lookahead for k in stage), "nothing beyond the lookahead is prefetched"
    ranks = [(nu[k], k) for k in stage]
    assert ranks == sorted(ranks), "nearest next use first"
    held = sum(resident[k] for k in in_use)
    assert held + sum(sizes[k] for k in stage) <= budget or not stage, \
        "staging fits beside the shards in use (which are never evicted)"
    # Belady: no needed shard that is not staged is nearer than one that is
    candidates = [k for k in nu if k not in resident and (lookahead is None or nu[k] < lookahead)]
    if stage:
        last = max(ranks)
        assert all((nu[k], k) > last for k in candidates if k not in stage)


@settings(max_examples=200, deadline=None)
@given(situations())
def test_plan_tier_with_room_for_everything_stages_every_needed_shard(s: dict) -> None:
    sizes, resident, lookahead = s["sizes"], s["resident"], s["lookahead"]
    budget = sum(sizes.values())
    stage = plan_tier(budget, sizes, resident, s["demands"], in_use=s["in_use"], lookahead=lookahead).stage
    nu = next_uses(s["demands"])
    want = {k for k in nu if k not in resident and (lookahead is None or nu[k] < lookahead)}
    assert set(stage) == want


@pytest.mark.parametrize("budget", [1, 3, 4, 100])
def test_plan_is_deterministic(budget: int) -> None:
    """The daemon, the in-process engine and bench replay must agree: same input, same plan."""
    demands = [Demand(SEQ, 1), Demand(tuple(reversed(SEQ)), 2)]
    plans = {tuple(plan_tier(budget, ONE, {"x": 1, "c": 1}, demands).stage) for _ in range(5)}
    assert len(plans) == 1


def test_prefetch_depth_is_at_most_a_quarter_of_the_room() -> None:
    from kvdata.tiers.policy import prefetch_depth

    assert prefetch_depth(16, room=1000 * 100, shard_bytes=100) == 16      # a large tier: the lookahead
    assert prefetch_depth(16, room=16 * 100, shard_bytes=100) == 4         # 16 shards of room: 4 ahead
    assert prefetch_depth(16, room=2 * 100, shard_bytes=100) == 1          # at least one
    assert prefetch_depth(16, room=0, shard_bytes=100) == 1
    assert prefetch_depth(8, room=10**9, shard_bytes=0) == 8               # sizes unknown


# ---------------------------------------------------------------- keep_for_next_pass (bypass)


def test_next_pass_start_finds_the_samplers_second_epoch_only() -> None:
    from kvdata.tiers.policy import next_pass_start

    assert next_pass_start(list("abcdef") + list("fedcba")) == 6   # this epoch, then the next
    assert next_pass_start(list("abcdef") + list("cab")) == 6       # a shorter next pass (another rank's share)
    assert next_pass_start(list("abcdef")) == 6                     # one pass
    assert next_pass_start(list("abcdefa")) == 7                    # an order that comes back to one shard
    assert next_pass_start(list("abcabcabc")) == 9                  # three passes: not the sampler's two
    assert next_pass_start([]) == 0


def test_keep_for_next_pass_keeps_what_the_next_pass_reads_first() -> None:
    from kvdata.tiers.policy import keep_for_next_pass

    seq = list("abcdefgh") + list("hgfedcba")
    sizes = {k: 10 for k in "abcdefgh"}
    assert keep_for_next_pass([Demand(tuple(seq), 0)], sizes, 30) == {"h", "g", "f"}
    assert keep_for_next_pass([Demand(tuple(seq), 5)], sizes, 35) == {"h", "g", "f"}  # whole shards only
    assert keep_for_next_pass([Demand(tuple(seq), 0)], sizes, 80) is None     # everything fits: stage all
    assert keep_for_next_pass([Demand(tuple("abcdefgh"), 0)], sizes, 30) is None  # one pass: nothing to keep for
    # two readers: the earliest next use over both, unknown sizes at the default
    other = Demand(tuple("xyz") + tuple("zyx"), 0)
    assert keep_for_next_pass([Demand(tuple(seq), 0), other], sizes, 40, default_size=10) == {"h", "z", "g", "y"}


def test_an_announced_next_pass_is_kept_even_when_it_shares_no_shard_with_this_one() -> None:
    """A rank of many: its next epoch's shards are another part of the dataset, none of this
    epoch's. The boundary cannot be inferred from a repeat (next_pass_start sees one pass and
    nothing would be worth keeping: every shard staged whole, thrashing); the sampler says it."""
    from kvdata.tiers.policy import keep_for_next_pass

    this, nxt = tuple("abcd"), tuple("wxyz")
    sizes = {k: 10 for k in this + nxt}
    assert next_pass_start(this + nxt) == 8                                         # not inferable
    assert keep_for_next_pass([Demand(this + nxt, 0)], sizes, 30) is None
    assert keep_for_next_pass([Demand(this + nxt, 0, next_start=4)], sizes, 30) == {"w", "x", "y"}
    # a boundary that says "no next pass", and out-of-range ones (taken as not given)
    assert keep_for_next_pass([Demand(this + nxt, 0, next_start=8)], sizes, 30) is None
    assert Demand(this + nxt, 0, next_start=9).pass_end() == 8
    assert Demand(tuple("abcd") + tuple("dcba"), 0, next_start=-1).pass_end() == 4
    # where the inference would cut elsewhere, the announced boundary wins
    seq = tuple("abcab") + tuple("cd")             # this pass a,b,c,a,b (a reader revisits); next c,d
    assert next_pass_start(seq) == 3
    assert keep_for_next_pass([Demand(seq, 0, next_start=5)], {k: 10 for k in "abcd"}, 10) == {"c"}


@settings(max_examples=200, deadline=None)
@given(st.permutations(list(range(12))), st.permutations(list(range(12))), st.integers(0, 130))
def test_keep_for_next_pass_fits_the_room_and_is_a_prefix_of_the_next_pass(first: list[int], second: list[int],
                                                                           room: int) -> None:
    from kvdata.tiers.policy import keep_for_next_pass

    seq = tuple(f"s{i}" for i in first + second)
    sizes = {f"s{i}": 10 for i in range(12)}
    keep = keep_for_next_pass([Demand(seq, 0)], sizes, room)
    if room >= 120:
        assert keep is None
    else:
        assert keep is not None and len(keep) * 10 <= room < (len(keep) + 1) * 10
        assert keep == set(seq[12:12 + len(keep)])


def test_keep_for_next_pass_leaves_the_room_of_copies_still_in_use() -> None:
    """A resident shard this pass still reads, or one a reader maps, keeps its place until it
    is done: the keep set gets the rest, and grows as they are read."""
    from kvdata.tiers.policy import keep_for_next_pass

    seq = tuple("abcdefgh") + tuple("hgfedcba")
    sizes = {k: 10 for k in "abcdefgh"}
    # a and b (kept for this pass) are still to be read: 10 of the 30 are left for the next pass
    assert keep_for_next_pass([Demand(seq, 0)], sizes, 30, resident={"a", "b"}) == {"h"}
    # read: their room is the next pass's
    assert keep_for_next_pass([Demand(seq, 2)], sizes, 30, resident={"a", "b"}) == {"h", "g", "f"}
    # ... unless a reader still maps one of them
    assert keep_for_next_pass([Demand(seq, 2)], sizes, 30, resident={"a", "b"}, held={"a"}) == {"h", "g"}
    # a copy in use that the next pass wants early is kept at no extra room (h: its room is counted)
    assert keep_for_next_pass([Demand(seq, 6)], sizes, 30, resident={"h", "f"}) == {"h", "g", "f"}
    # nothing resident: the same set as planning from scratch
    assert keep_for_next_pass([Demand(seq, 0)], sizes, 30, resident=set()) == {"h", "g", "f"}


def test_keep_for_next_pass_replaces_shards_it_can_no_longer_keep() -> None:
    """A shard this pass read already without keeping a copy is left out, and the next one in
    the next pass's order takes its place; so is one a reader may be reading now (`reading`)."""
    from kvdata.tiers.policy import keep_for_next_pass

    seq = tuple("abcdefgh") * 2
    sizes = {k: 10 for k in "abcdefgh"}
    assert keep_for_next_pass([Demand(seq, 3)], sizes, 30) == {"a", "b", "c"}  # without residency: a fixed prefix
    # a was kept; b and c were read by record: d and e take their places
    assert keep_for_next_pass([Demand(seq, 3)], sizes, 30, resident={"a"}) == {"a", "d", "e"}
    # the reader may be reading d and e by record now: f and g instead
    assert keep_for_next_pass([Demand(seq, 3)], sizes, 30, resident={"a"}, reading=2) == {"a", "f", "g"}
    # ... unless the readers were told to stage them whole before they got there
    assert keep_for_next_pass([Demand(seq, 3)], sizes, 30, resident={"a"}, reading=2, admitted={"d"}) == {"a", "d", "f"}
    # a reader that has not moved yet has read nothing: its first shards are candidates
    assert keep_for_next_pass([Demand(seq, 0)], sizes, 30, resident=set(), reading=2) == {"a", "b", "c"}
    assert keep_for_next_pass([Demand(seq, 0)], sizes, 30, resident=set(), reading=2, admitted={"a"}) == {"a", "c", "d"}
    # a resident copy stays a candidate wherever the reader is
    assert keep_for_next_pass([Demand(seq, 7)], sizes, 30, resident={"a", "b"}, reading=2) == {"a", "b"}


@settings(max_examples=200, deadline=None)
@given(st.permutations(list(range(10))), st.permutations(list(range(10))), st.integers(0, 10),
       st.sets(st.integers(0, 9)), st.sets(st.integers(0, 9)), st.integers(0, 3), st.integers(0, 95))
def test_keep_for_next_pass_fits_beside_the_copies_in_use(first: list[int], second: list[int], position: int,
                                                          resident_ids: set[int], held_ids: set[int], reading: int,
                                                          room: int) -> None:
    """Whatever is resident and held: the keep set and the copies still in use fit the room
    together, and every shard in it not resident can still be staged before this pass reads it
    (or nothing was read yet: a reader at position 0 that nobody gave a set before)."""
    from kvdata.tiers.policy import keep_for_next_pass

    seq = tuple(f"s{i}" for i in first + second)
    sizes = {f"s{i}": 10 for i in range(10)}
    resident = {f"s{i}" for i in resident_ids}
    held = {f"s{i}" for i in held_ids} & resident
    keep = keep_for_next_pass([Demand(seq, position)], sizes, room, resident=resident, held=held, reading=reading)
    assert keep is not None
    busy = {k for k in resident if k in seq[position:10] or k in held}
    assert 10 * len(keep | busy) <= max(room, 10 * len(busy))
    for k in keep - resident:
        assert seq.index(k) >= position + reading or position == 0, (k, position)
    # a set given before: only what it admitted may still be staged within `reading` of the position
    again = keep_for_next_pass([Demand(seq, position)], sizes, room, resident=resident, held=held, reading=reading,
                               admitted=set())
    assert again is not None
    for k in again - resident:
        assert seq.index(k) >= position + reading, (k, position)
