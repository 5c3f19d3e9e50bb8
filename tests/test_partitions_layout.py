"""The partition layout and balancing rules: pure functions, table by table."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest

from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, CorruptStateError
from dbtrigger.partitions.buckets import BUCKETS, bucket_of, key_text
from dbtrigger.partitions.layout import (
    Floor,
    Member,
    Membership,
    Partition,
    balance,
    dumps,
    even_ranges,
    loads,
    new_membership,
    regroup,
    shares,
)

NOW = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.timezone.utc)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 8, 16, 255, 256])
def test_even_ranges_tile_the_bucket_space(count: int) -> None:
    ranges = even_ranges(count)
    assert len(ranges) == count
    assert ranges[0].lo == 0
    assert ranges[-1].hi == BUCKETS
    assert all(a.hi == b.lo for a, b in itertools.pairwise(ranges))
    sizes = [p.hi - p.lo for p in ranges]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("count", [0, 257, -1])
def test_partition_count_out_of_range_is_refused(count: int) -> None:
    with pytest.raises(ConfigurationError, match="between 1 and 256"):
        even_ranges(count)


def test_split_children_lie_inside_one_parent() -> None:
    four = even_ranges(4)
    plan = regroup(four, 8)
    assert len(plan.partitions) == 8
    for child in plan.partitions:
        (parent,) = plan.parents[child.id]
        assert parent.lo <= child.lo < child.hi <= parent.hi


def test_merge_parents_cover_the_child_exactly() -> None:
    plan = regroup(even_ranges(8), 4)
    for child in plan.partitions:
        parents = plan.parents[child.id]
        assert len(parents) == 2
        assert parents[0].lo == child.lo
        assert parents[-1].hi == child.hi


def test_a_count_that_would_move_rows_is_refused_with_workable_counts() -> None:
    with pytest.raises(ConfigurationError, match=r"split or merge cleanly: 1, 2, 8"):
        regroup(even_ranges(4), 3)


def test_buckets_are_stable_and_spread() -> None:
    assert bucket_of([42]) == bucket_of([42])
    assert key_text([1, "a"]) == "1|a"
    counts = [0] * BUCKETS
    for key in range(25_600):
        counts[bucket_of([key])] += 1
    assert min(counts) > 50  # about 100 each
    with pytest.raises(ConfigurationError, match="integer, text or UUID"):
        bucket_of([1.5])
    with pytest.raises(ConfigurationError, match="integer, text or UUID"):
        bucket_of([True])


def doc(members: dict[str, Member], count: int = 8) -> Membership:
    return Membership("orders", "sha256:x", 1, even_ranges(count), members)


def owns(*pids: str, since: int = 0) -> dict[str, int]:
    return dict.fromkeys(pids, since)


IDS = [p.id for p in even_ranges(8)]


def test_first_member_claims_everything() -> None:
    decision = balance(doc({}), me="a", live=frozenset(), min_hold_beats=2, now=NOW)
    assert decision.owned == tuple(sorted(IDS))
    assert decision.claimed == tuple(IDS)
    assert decision.document is not None
    assert decision.document.members["a"].beat == 1


def test_join_converges_within_two_cycles_from_both_sides() -> None:
    state = doc({"a": Member(10, owns(*IDS[:4])), "b": Member(10, owns(*IDS[4:]))})
    live = frozenset({"a", "b", "c"})
    # c joins: target ceil(8/3) = 3. Cycle 1: c steals one from the most loaded,
    # and a, above target with c below target - 1, sheds one.
    for _ in range(2):
        for me in ("c", "a", "b"):
            decision = balance(state, me=me, live=live - {me}, min_hold_beats=2, now=NOW)
            assert decision.document is not None
            state = decision.document
    loads_ = sorted(len(m.owns) for m in state.members.values())
    assert loads_ == [2, 3, 3]
    owned = [p for m in state.members.values() for p in m.owns]
    assert sorted(owned) == sorted(IDS), "every partition owned exactly once"


def test_dead_members_partitions_are_claimed_at_once_up_to_the_target() -> None:
    state = doc({"a": Member(5, owns(*IDS[:4])), "b": Member(5, owns(*IDS[4:]))})
    decision = balance(state, me="a", live=frozenset(), min_hold_beats=2, now=NOW)
    assert decision.dead == ("b",)
    assert decision.owned == tuple(sorted(IDS))
    assert decision.claimed == tuple(IDS[4:])


def test_no_steal_from_a_member_that_just_took_the_partition() -> None:
    state = doc({"a": Member(3, owns(*IDS, since=2)), "c": Member(0, {})})
    decision = balance(state, me="c", live=frozenset({"a"}), min_hold_beats=2, now=NOW)
    assert decision.stolen == ()  # a has held them 1 beat: too fresh
    older = doc({"a": Member(5, owns(*IDS, since=2)), "c": Member(0, {})})
    decision = balance(older, me="c", live=frozenset({"a"}), min_hold_beats=2, now=NOW)
    assert len(decision.stolen) == 1
    assert decision.document is not None
    assert len(decision.document.members["a"].owns) == 7


def test_at_most_one_steal_per_cycle() -> None:
    state = doc({"a": Member(9, owns(*IDS)), "b": Member(9, {})})
    decision = balance(state, me="b", live=frozenset({"a"}), min_hold_beats=2, now=NOW)
    assert len(decision.stolen) == 1
    assert len(decision.owned) == 1


def test_leaving_releases_everything() -> None:
    state = doc({"a": Member(4, owns(*IDS[:4])), "b": Member(4, owns(*IDS[4:]))})
    decision = balance(
        state, me="a", live=frozenset({"b"}), min_hold_beats=2, now=NOW, leaving=True
    )
    assert decision.owned == ()
    assert decision.document is not None
    assert "a" not in decision.document.members
    assert decision.released == tuple(sorted(IDS[:4]))


def test_partitions_no_longer_in_the_layout_are_dropped() -> None:
    state = Membership("orders", "sha256:x", 2, even_ranges(4), {"a": Member(4, owns(*IDS[:4]))})
    decision = balance(state, me="a", live=frozenset(), min_hold_beats=2, now=NOW)
    assert set(decision.owned) == {p.id for p in even_ranges(4)}
    assert set(IDS[:4]) - set(decision.owned) <= set(decision.released)


def test_document_round_trip_with_floors() -> None:
    floor = Floor(0, 32, Position(cursor=7, pk={"id": 3}))
    original = Membership(
        "orders",
        "sha256:x",
        3,
        (Partition(0, 64, (floor,)), *even_ranges(4)[1:]),
        {"a": Member(2, {"p000-064": 1}, NOW)},
    )
    assert loads(dumps(original)) == original
    assert loads(dumps(new_membership("o", "f", 4))).partitions == even_ranges(4)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[]", "not a dbtrigger membership"),
        (b"{", "not valid JSON"),
        (
            b'{"kind":"dbtrigger-membership","version":1,"bucket_space":256,"poller":"o",'
            b'"source_fingerprint":"f","generation":1,"partitions":[{"lo":0,"hi":100}]}',
            "end at 100",
        ),
        (
            b'{"kind":"dbtrigger-membership","version":1,"bucket_space":256,"poller":"o",'
            b'"source_fingerprint":"f","generation":1,"partitions":[{"lo":0,"hi":100},'
            b'{"lo":120,"hi":256}]}',
            "do not tile",
        ),
        (
            b'{"kind":"dbtrigger-membership","version":1,"bucket_space":512,"poller":"o"}',
            "512 buckets",
        ),
    ],
)
def test_malformed_membership_documents_are_corrupt_state(raw: bytes, message: str) -> None:
    with pytest.raises(CorruptStateError, match=message):
        loads(raw)


@pytest.mark.parametrize("newcomers", [["b"], ["b", "c"]])
def test_one_member_holding_all_reaches_the_fair_share_in_two_cycles(newcomers: list[str]) -> None:
    ids = [p.id for p in even_ranges(6)]
    state = Membership("orders", "sha256:x", 1, even_ranges(6), {"a": Member(9, owns(*ids))})
    everyone = ["a", *newcomers]
    for _ in range(2):
        for me in [*newcomers, "a"]:
            decision = balance(
                state, me=me, live=frozenset(everyone) - {me}, min_hold_beats=2, now=NOW
            )
            assert decision.document is not None
            state = decision.document
    share = 6 // len(everyone)
    assert sorted(len(m.owns) for m in state.members.values()) == [share] * len(everyone)
    assert sorted(p for m in state.members.values() for p in m.owns) == sorted(ids)


# --- fair shares by rank --------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "members", "expected"),
    [
        (4, 3, [2, 1, 1]),
        (8, 3, [3, 3, 2]),
        (12, 3, [4, 4, 4]),
        (8, 5, [2, 2, 2, 1, 1]),
        (4, 5, [1, 1, 1, 1, 0]),
        (1, 2, [1, 0]),
        (6, 4, [2, 2, 1, 1]),
    ],
)
def test_shares_by_rank_add_up_to_the_partitions(
    count: int, members: int, expected: list[int]
) -> None:
    group = {f"m{i}": Member(1) for i in range(members)}
    fair = shares(group, even_ranges(count))
    assert sorted(fair.values(), reverse=True) == expected


def test_the_extra_partitions_stay_with_the_members_that_hold_them() -> None:
    ids = [p.id for p in even_ranges(4)]
    group = {"a": Member(5, owns(ids[0])), "b": Member(5, owns(*ids[1:3])), "c": Member(5, {})}
    assert shares(group, even_ranges(4)) == {"b": 2, "a": 1, "c": 1}


def converge(
    state: Membership, names: list[str], *, rounds: int, order_seed: int = 0
) -> tuple[Membership, int]:
    """Balance every member once per round in a shuffled order, until nothing changes."""
    import random  # noqa: PLC0415

    rng = random.Random(order_seed)
    quiet_rounds = 0
    for done in range(1, rounds + 1):
        changed = False
        order = names[:]
        rng.shuffle(order)
        for me in order:
            decision = balance(
                state, me=me, live=frozenset(names) - {me}, min_hold_beats=2, now=NOW
            )
            assert decision.document is not None
            changed = changed or decision.changed
            state = decision.document
        quiet_rounds = 0 if changed else quiet_rounds + 1
        if quiet_rounds == 3:
            return state, done - 3
    return state, rounds


@pytest.mark.parametrize(
    ("count", "start", "expected"),
    [
        (4, {"a": 2, "b": 2, "c": 0}, [2, 1, 1]),  # the 2/2/0 a new user saw
        (4, {"a": 4, "b": 0, "c": 0}, [2, 1, 1]),
        (8, {"a": 8, "b": 0, "c": 0}, [3, 3, 2]),
        (8, {"a": 4, "b": 4, "c": 0}, [3, 3, 2]),
        (8, {"a": 0, "b": 0, "c": 0}, [3, 3, 2]),
        (12, {"a": 12, "b": 0, "c": 0}, [4, 4, 4]),
        (8, {"a": 2, "b": 2, "c": 2, "d": 2, "e": 0}, [2, 2, 2, 1, 1]),
    ],
)
@pytest.mark.parametrize("seed", range(4))
def test_any_start_converges_to_the_fair_shares_and_stays(
    count: int, start: dict[str, int], expected: list[int], seed: int
) -> None:
    ids = [p.id for p in even_ranges(count)]
    members, next_id = {}, 0
    for name, held in start.items():
        members[name] = Member(10, owns(*ids[next_id : next_id + held], since=1))
        next_id += held
    state = Membership("orders", "sha256:x", 1, even_ranges(count), members)
    state, rounds = converge(state, list(start), rounds=12, order_seed=seed)
    assert rounds <= 4, f"took {rounds} rounds"
    assert sorted((len(m.owns) for m in state.members.values()), reverse=True) == expected
    assert sorted(p for m in state.members.values() for p in m.owns) == sorted(ids)
    # Converged: every member's next cycle says so, and changes nothing (no ping-pong).
    for me in start:
        decision = balance(state, me=me, live=frozenset(start) - {me}, min_hold_beats=2, now=NOW)
        assert decision.settled
        assert not decision.changed


def test_a_member_that_sees_a_new_heartbeat_gives_up_its_excess_at_once() -> None:
    state = doc({"a": Member(9, owns(*IDS[:4])), "b": Member(9, owns(*IDS[4:])), "c": Member(0)})
    decision = balance(state, me="a", live=frozenset({"b", "c"}), min_hold_beats=2, now=NOW)
    assert decision.released == (IDS[3],)  # 4 -> its share of 3 in the same cycle
    assert not decision.settled


def test_a_joining_member_beats_but_claims_nothing() -> None:
    decision = balance(doc({}), me="a", live=frozenset(), min_hold_beats=2, now=NOW, joining=True)
    assert decision.owned == ()
    assert decision.document is not None
    assert decision.document.members["a"].beat == 1
    assert not decision.settled
    # The others already count it: they make room for it while it waits.
    state = doc({"a": Member(9, owns(*IDS)), "b": Member(1)})
    decision = balance(state, me="a", live=frozenset({"b"}), min_hold_beats=2, now=NOW)
    assert len(decision.owned) == 4


def test_steals_only_from_a_member_above_its_share() -> None:
    # 4 partitions, 3 members: a holds 2 (its share by rank), b 2 (one above), c none.
    ids = [p.id for p in even_ranges(4)]
    state = Membership(
        "orders",
        "sha256:x",
        1,
        even_ranges(4),
        {"a": Member(9, owns(*ids[:2])), "b": Member(9, owns(*ids[2:])), "c": Member(9)},
    )
    decision = balance(state, me="c", live=frozenset({"a", "b"}), min_hold_beats=2, now=NOW)
    assert decision.stolen == (ids[2],)
    assert decision.document is not None
    assert len(decision.document.members["a"].owns) == 2


def test_host_is_kept_for_people() -> None:
    decision = balance(doc({}), me="a", live=frozenset(), min_hold_beats=2, now=NOW, host="web-1")
    assert decision.document is not None
    assert loads(dumps(decision.document)).members["a"].host == "web-1"
    again = balance(decision.document, me="a", live=frozenset(), min_hold_beats=2, now=NOW)
    assert again.document is not None
    assert again.document.members["a"].host == "web-1"
