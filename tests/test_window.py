"""The settled window's pure decisions (dbtrigger.state.window), table by table."""

from __future__ import annotations

import datetime as dt
import decimal
import uuid

import pytest

from dbtrigger.cursor import Position
from dbtrigger.errors import CorruptStateError
from dbtrigger.state.backoff import backoff_seconds
from dbtrigger.state.window import (
    Bound,
    Pending,
    Window,
    entry_size,
    gone,
    key_of,
    plan,
    precedes,
    retry_entry,
    settle,
)

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 1, tzinfo=UTC)
BIG = Bound(1000, 1 << 20)


def pos(i: int) -> Position:
    return Position(cursor=10 * i, pk={"id": i})


def ids(positions: tuple[Position, ...]) -> list[int]:
    return [int(p.pk["id"]) for p in positions]


def waiting(i: int, attempts: int = 1, due: float = 0.0) -> Pending:
    return Pending(pos(i), attempts, T0 + dt.timedelta(seconds=due), "busy")


def test_key_is_the_full_cursor_and_pk_tuple() -> None:
    assert key_of(pos(1)) == key_of(Position(cursor=10, pk={"id": 1}))
    assert key_of(pos(1)) != key_of(Position(cursor=11, pk={"id": 1}))  # updated row
    assert key_of(pos(1)) != key_of(Position(cursor=10, pk={"id": 2}))  # same cursor


# (description, window, fetched ids, now offset, batch size, bound, chosen ids, pressure)
PLAN = [
    ("no window: the first rows", Window(), [1, 2, 3], 0, 2, BIG, [1, 2], False),
    (
        "settled rows are skipped",
        Window(settled=(pos(2), pos(3))),
        [1, 2, 3, 4],
        0,
        5,
        BIG,
        [1, 4],
        False,
    ),
    (
        "a retry not yet due is skipped, later rows flow",
        Window(pending=(waiting(1, due=5),)),
        [1, 2, 3],
        0,
        5,
        BIG,
        [2, 3],
        False,
    ),
    (
        "a due retry comes back in order",
        Window(pending=(waiting(1, due=5),), settled=(pos(2),)),
        [1, 2, 3],
        5,
        5,
        BIG,
        [1, 3],
        False,
    ),
    (
        "under pressure only rows inside the window",
        Window(settled=(pos(2), pos(4), pos(5)), pending=(waiting(1, due=0),)),
        [1, 2, 3, 4, 5, 6, 7],
        0,
        5,
        Bound(5, 1 << 20),
        [1, 3],
        True,
    ),
    (
        "no more new rows than the window can still remember",
        Window(settled=(pos(2),), pending=(waiting(1, due=9),)),
        [1, 2, 3, 4, 5, 6],
        0,
        5,
        Bound(4, 1 << 20),
        [3, 4],
        False,
    ),
]


@pytest.mark.parametrize(
    ("window", "fetched", "now", "batch", "bound", "chosen", "pressure"),
    [c[1:] for c in PLAN],
    ids=[c[0] for c in PLAN],
)
def test_plan_table(
    window: Window,
    fetched: list[int],
    now: float,
    batch: int,
    bound: Bound,
    chosen: list[int],
    pressure: bool,
) -> None:
    positions = [pos(i) for i in fetched]
    got = plan(
        [key_of(p) for p in positions],
        [entry_size(p) for p in positions],
        window,
        now=T0 + dt.timedelta(seconds=now),
        batch_size=batch,
        bound=bound,
    )
    assert [fetched[i] for i in got.deliver] == chosen
    assert got.pressure is pressure


def settled_keys(*items: int) -> set[str]:
    return {key_of(pos(i)) for i in items}


# (description, window, fetched, complete, settled now, retried now,
#  checkpoint, settled after, pending after)
SETTLE = [
    ("all settled: to the end, no window", Window(), [1, 2, 3], True, [1, 2, 3], [], 3, [], []),
    ("a retry pins; the rest is remembered", Window(), [1, 2, 3], True, [1, 3], [2], 1, [3], [2]),
    ("first row retried: nothing moves", Window(), [1, 2], True, [2], [1], None, [2], [1]),
    (
        "the pinned row settles: jump over the window",
        Window(settled=(pos(2), pos(3)), pending=(waiting(1),)),
        [1, 2, 3, 4],
        True,
        [1],
        [],
        3,
        [],
        [],
    ),
    (
        "a pinned row that is gone no longer pins (complete read)",
        Window(settled=(pos(2),), pending=(waiting(1),)),
        [2, 3],
        True,
        [3],
        [],
        3,
        [],
        [],
    ),
    (
        "an incomplete read keeps entries it did not see",
        Window(settled=(pos(9),), pending=(waiting(1),)),
        [1, 2],
        False,
        [2],
        [],
        None,
        [2, 9],
        [1],
    ),
]


@pytest.mark.parametrize(
    ("window", "fetched", "complete", "now_settled", "now_retried", "cp", "after", "pending"),
    [c[1:] for c in SETTLE],
    ids=[c[0] for c in SETTLE],
)
def test_settle_table(
    window: Window,
    fetched: list[int],
    complete: bool,
    now_settled: list[int],
    now_retried: list[int],
    cp: int | None,
    after: list[int],
    pending: list[int],
) -> None:
    got = settle(
        [pos(i) for i in fetched],
        complete=complete,
        window=window,
        settled=settled_keys(*now_settled),
        retried={key_of(pos(i)): waiting(i, 2) for i in now_retried},
        bound=BIG,
    )
    assert (None if got.checkpoint is None else int(got.checkpoint.pk["id"])) == cp
    assert ids(got.window.settled) == after
    assert [int(p.position.pk["id"]) for p in got.window.pending] == pending
    assert got.overflow == 0


def test_settle_never_drops_pending_and_reports_overflow() -> None:
    got = settle(
        [pos(i) for i in range(1, 8)],
        complete=True,
        window=Window(),
        settled=settled_keys(*range(2, 8)),
        retried={key_of(pos(1)): waiting(1)},
        bound=Bound(4, 1 << 20),
    )
    assert got.checkpoint is None
    assert [int(p.position.pk["id"]) for p in got.window.pending] == [1]
    assert ids(got.window.settled) == [2, 3, 4]  # the newest are not remembered ...
    assert got.overflow == 3  # ... and that is reported, never silent


@pytest.mark.parametrize(
    ("attempts", "jitter", "seconds"),
    [(1, 0.0, 2.5), (1, 0.999999, 5.0), (2, 0.0, 5.0), (3, 1.0, 20.0), (10, 1.0, 60.0)],
)
def test_backoff_doubles_with_jitter_and_is_capped(
    attempts: int, jitter: float, seconds: float
) -> None:
    got = backoff_seconds(attempts, base=5, cap=60, jitter=jitter)
    assert got == pytest.approx(seconds, rel=1e-5)


def test_retry_entry_counts_attempts_and_truncates_the_reason() -> None:
    first = retry_entry(pos(1), None, reason="x" * 500, now=T0, base=5, cap=60, jitter=0.0)
    assert (first.attempts, len(first.reason), first.not_before) == (
        1,
        200,
        T0 + dt.timedelta(seconds=2.5),
    )
    again = retry_entry(pos(1), first, reason="y", now=T0, base=5, cap=60, jitter=0.0)
    assert again.attempts == 2


def test_window_json_round_trip_and_errors() -> None:
    window = Window(settled=(pos(2),), pending=(waiting(1, 3, 7.5),))
    raw = window.to_json()
    assert raw is not None
    assert Window.from_json(raw) == window
    assert Window().to_json() is None
    assert Window.from_json(None) == Window()
    assert window.encoded_size() > entry_size(pos(2))
    with pytest.raises(CorruptStateError, match="window"):
        Window.from_json([1])
    with pytest.raises(CorruptStateError, match="attempts"):
        Window.from_json({"pending": [{"at": raw["settled"][0]}]})


def test_a_retry_reason_is_redacted_before_it_reaches_the_document() -> None:
    entry = retry_entry(
        pos(1),
        None,
        reason="429 from https://user:hunter2@billing.example/api?sig=abcdef123456",
        now=T0,
        base=5,
        cap=60,
        jitter=0.0,
    )
    assert "hunter2" not in entry.reason
    assert "abcdef123456" not in entry.reason
    assert entry.reason.startswith("429 from")


# --- entries whose rows are gone (issue 20, item 1) --------------------------------------

NAIVE = dt.datetime(2026, 1, 1, 12, 0)
# (description, a, b, columns, a before b?)
PRECEDES = [
    ("smaller cursor", Position(1, {"id": 9}), Position(2, {"id": 1}), ("id",), True),
    ("larger cursor", Position(3, {"id": 1}), Position(2, {"id": 9}), ("id",), False),
    (
        "equal cursor: the key decides",
        Position(2, {"id": 1}),
        Position(2, {"id": 9}),
        ("id",),
        True,
    ),
    ("the same tuple", Position(2, {"id": 1}), Position(2, {"id": 1}), ("id",), False),
    (
        "keys in the source's column order, not the stored one",
        Position(2, {"b": 9, "a": 1}),
        Position(2, {"b": 1, "a": 2}),
        ("a", "b"),
        True,
    ),
    ("decimal and int", Position(decimal.Decimal("1.5"), {}), Position(2, {}), (), True),
    ("timestamps", Position(T0, {}), Position(T0 + dt.timedelta(seconds=1), {}), (), True),
    ("naive timestamps", Position(NAIVE, {}), Position(NAIVE.replace(hour=13), {}), (), True),
    ("dates", Position(dt.date(2026, 1, 1), {}), Position(dt.date(2026, 1, 2), {}), (), True),
    # Orders a database may see otherwise: unknown, so never taken for "gone".
    ("text cursor (collation)", Position("a", {}), Position("b", {}), (), None),
    ("equal cursor, text key", Position(2, {"k": "a"}), Position(2, {"k": "b"}), ("k",), None),
    ("uuid", Position(uuid.UUID(int=1), {}), Position(uuid.UUID(int=2), {}), (), None),
    ("bytes", Position(b"a", {}), Position(b"b", {}), (), None),
    ("naive against aware", Position(NAIVE, {}), Position(T0, {}), (), None),
    ("a date against a timestamp", Position(dt.date(2026, 1, 1), {}), Position(T0, {}), (), None),
    ("NaN", Position(float("nan"), {}), Position(1.0, {}), (), None),
    ("text against a number", Position("1", {}), Position(2, {}), (), None),
]


@pytest.mark.parametrize(
    ("a", "b", "columns", "expected"), [c[1:] for c in PRECEDES], ids=[c[0] for c in PRECEDES]
)
def test_precedes_is_sure_or_says_unknown(
    a: Position, b: Position, columns: tuple[str, ...], expected: bool | None
) -> None:
    assert precedes(a, b, columns) is expected


# (description, window, fetched ids, complete, gone ids)
GONE = [
    ("nothing in the window", Window(), [1, 2], False, []),
    ("every entry returned: none gone", Window(settled=(pos(2),)), [1, 2, 3], False, []),
    (
        "passed without being returned: gone, settled or pending",
        Window(settled=(pos(2), pos(4)), pending=(waiting(3),)),
        [1, 5, 6],
        False,
        [2, 3, 4],
    ),
    ("beyond the last row read: kept", Window(settled=(pos(9),)), [1, 2], False, []),
    ("a complete read: every entry not returned", Window(settled=(pos(9),)), [1, 2], True, [9]),
    ("an empty complete read", Window(settled=(pos(9),), pending=(waiting(8),)), [], True, [8, 9]),
]


@pytest.mark.parametrize(
    ("window", "fetched", "complete", "dropped"), [c[1:] for c in GONE], ids=[c[0] for c in GONE]
)
def test_gone_needs_no_complete_read(
    window: Window, fetched: list[int], complete: bool, dropped: list[int]
) -> None:
    assert gone(window, [pos(i) for i in fetched], complete=complete) == settled_keys(*dropped)


def test_a_text_entry_the_read_cannot_place_is_kept() -> None:
    entry = Position("s0005", {"code": "k5"})
    window = Window(settled=(entry,))
    read = [Position("s0001", {"code": "k1"}), Position("s0009", {"code": "k9"})]
    assert gone(window, read, complete=False) == set()


def test_plan_counts_what_the_bound_keeps_back_and_still_hands_out_due_retries() -> None:
    # Room for one more event: row 2 goes out, 3 and 4 wait; 5 is a due retry
    # (its entry exists: it needs no room) and goes out after them.
    window = Window(settled=(pos(6),), pending=(waiting(1, due=99), waiting(5, due=0)))
    positions = [pos(i) for i in (1, 2, 3, 4, 5, 6)]
    got = plan(
        [key_of(p) for p in positions],
        [entry_size(p) for p in positions],
        window,
        now=T0,
        batch_size=10,
        bound=Bound(4, 1 << 20),
    )
    assert [positions[i].pk["id"] for i in got.deliver] == [2, 5]
    assert (got.withheld, got.full, got.new, got.blocked) == (2, True, 1, False)


def test_plan_is_blocked_when_rows_wait_and_none_goes_out() -> None:
    window = Window(settled=(pos(2), pos(3)), pending=(waiting(1, due=99),))
    positions = [pos(i) for i in (1, 2, 3, 4, 5)]
    got = plan(
        [key_of(p) for p in positions],
        [entry_size(p) for p in positions],
        window,
        now=T0,
        batch_size=10,
        bound=Bound(4, 1 << 20),
    )
    assert got.deliver == ()
    assert (got.pressure, got.withheld, got.blocked) == (True, 2, True)


def test_settle_keeps_the_order_of_entries_the_read_did_not_return() -> None:
    """The same outcome encodes the same bytes, so a tick that changes
    nothing writes nothing (it used to rewrite them in set order)."""
    window = Window(settled=tuple(pos(i) for i in range(30, 10, -1)), pending=(waiting(1),))
    got = settle(
        [pos(1)],
        complete=False,
        window=window,
        settled=frozenset(),
        retried={},
        bound=BIG,
    )
    assert got.window == window


# --- waiting entries are bounded too (issue 20, item 9) -------------------------------------


def test_settle_bounds_the_entries_a_batch_adds_for_retries_newest_first() -> None:
    """Ten new retries into a window of four: the first four (in source order)
    are remembered, six are not (they come again); an entry that was already
    waiting is never the one dropped."""
    window = Window(pending=(waiting(9),))
    got = settle(
        [pos(i) for i in range(1, 11)],
        complete=True,
        window=window,
        settled=frozenset(),
        retried={key_of(pos(i)): waiting(i) for i in range(1, 11)},
        bound=Bound(4, 1 << 20),
    )
    assert [int(p.position.pk["id"]) for p in got.window.pending] == [1, 2, 3, 9]
    assert (got.unremembered, got.overflow, got.checkpoint) == (6, 0, None)


def test_plan_reserves_room_for_waiting_entries_even_in_an_empty_window_when_asked() -> None:
    positions = [pos(i) for i in range(1, 11)]
    keys = [key_of(p) for p in positions]
    sizes = [entry_size(p) for p in positions]
    free = plan(keys, sizes, Window(), now=T0, batch_size=10, bound=Bound(4, 1 << 20))
    assert len(free.deliver) == 10  # the usual batch: no window, no reservation
    cut = plan(keys, sizes, Window(), now=T0, batch_size=10, bound=Bound(4, 1 << 20), reserve=True)
    assert cut.deliver == (0, 1, 2, 3)
