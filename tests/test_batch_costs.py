"""Per-batch shortcuts give what the general path gives.

Work a batch used to repeat although its inputs had not changed is now done
once or skipped: the batch id's formatted tick start, the log fields of
records nobody reads (:meth:`~dbtrigger.runtime.telemetry.Telemetry.logs`),
the lag clock for a cursor with no time in it, the events' scan of the key
and cursor columns when the source's check of the batch collected their
types. Each is held here to the general path.
"""

from __future__ import annotations

import datetime as dt
import logging
from decimal import Decimal
from typing import Any

import pytest

from dbtrigger.errors import SerializationError
from dbtrigger.events import RowShape, events_from_rows
from dbtrigger.metrics import SafeMetrics
from dbtrigger.runtime.batches import batch_id_for
from dbtrigger.runtime.telemetry import EVENTS, Telemetry
from dbtrigger.sources.clock import DatabaseClock
from dbtrigger.sources.column_checks import ShapeChecks
from dbtrigger.sources.lag_meter import LagMeter

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 4, 7, 23, 59, 58, 999999, tzinfo=UTC)
PLUS2 = dt.timezone(dt.timedelta(hours=2))


@pytest.mark.parametrize(
    ("started_at", "token"),
    [
        (T0, 1),
        (T0, 2),
        (T0.astimezone(PLUS2), 1),  # the same instant in another zone reads differently
        (T0 + dt.timedelta(seconds=1), 1),
        (dt.datetime(2026, 4, 7, 1, 2, 3), 7),  # naive
    ],
)
def test_batch_ids_are_the_formatted_tick_start(started_at: dt.datetime, token: int) -> None:
    for index in (0, 1, 9998, 10_000):
        want = f"batch_{started_at:%Y%m%d_%H%M%S}_{token}_{index + 1:04d}"
        assert batch_id_for(started_at, token, index) == want
        assert batch_id_for(started_at, token, index) == want  # from the kept prefix


@pytest.mark.parametrize("level", [logging.DEBUG, logging.INFO, logging.WARNING])
def test_logs_says_whether_emit_would_log(level: int, caplog: pytest.LogCaptureFixture) -> None:
    telemetry = Telemetry("orders", SafeMetrics(None, "orders"))  # (no metrics: no fields)
    with caplog.at_level(level, logger="dbtrigger"):
        for event, spec in EVENTS.items():
            caplog.clear()
            telemetry.emit(event, "x")
            assert telemetry.logs(event) == bool(caplog.records), event
            assert telemetry.logs(event) == (spec.level is not None and spec.level >= level)


def test_a_cursor_with_no_time_in_it_has_no_age_without_the_clock() -> None:
    def no_engine() -> None:
        raise AssertionError("the clock was asked")

    meter = LagMeter(None, DatabaseClock(no_engine, "postgresql"), source="s")  # type: ignore[arg-type]
    for value in (None, 12, 1.5, b"x", True):
        assert meter.age(value, T0) is None
    assert meter.age(T0 - dt.timedelta(seconds=3), T0) == 3.0


# --- the events' check takes the types the source's check collected ------------------


def _checks() -> ShapeChecks:
    checks = ShapeChecks(dialect="postgresql", source="s", cursor_column="v", pk_columns=["id"])
    checks.expected.update(id=frozenset({"int"}), v=frozenset({"int", "float", "decimal"}))
    return checks


def _events(
    rows: list[tuple[Any, ...]], *, collected: bool
) -> list[tuple[Any, Any, Any, str]] | str:
    """The events of ``rows`` (or the error), made with or without the types the
    source's check of the batch collected."""
    columns = ("id", "v", "note")
    types = _checks().check_rows(columns, rows) if collected else None
    shape = RowShape(
        columns, cursor_column="v", pk_columns=["id"], source="s", poller="p", batch_id="b"
    )
    try:
        events = events_from_rows(shape, rows, types)
    except SerializationError as exc:
        return str(exc)
    return [(dict(e.pk), dict(e.after or {}), e.cursor, e.event_id) for e in events]


@pytest.mark.parametrize(
    "rows",
    [
        [(1, 10, "a"), (2, 11, None), (3, 11, "c")],
        [(1, 1.5, "a"), (2, 2.5, "b")],
        [(1, Decimal("1.5"), "a"), (2, Decimal("2"), "b")],
        [(1, 10, "a"), (None, 11, "b")],  # a NULL key
        [(1, 1.5, "a"), (2, float("nan"), "b")],  # a NaN cursor
        [(1, Decimal("NaN"), "a")],
        [(1, None, "a")],
    ],
)
def test_events_from_collected_types_are_the_events_from_a_scan(
    rows: list[tuple[Any, ...]],
) -> None:
    assert _events(rows, collected=True) == _events(rows, collected=False)


def test_the_source_check_collects_each_position_column() -> None:
    rows = [(1, 10, "a"), (2, 1.5, "b")]
    assert _checks().check_rows(("id", "v", "note"), rows) == {0: {int}, 1: {int, float}}
    assert _checks().check_rows(("id", "v", "note"), []) == {}


def test_the_drain_cost_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    drain_cost = pytest.importorskip("benchmarks.drain_cost")
    from dbtrigger.runtime import bulk  # noqa: PLC0415

    age = bulk.MAX_AGE_SECONDS
    drain_cost.main(["--fake", "--batch", "1000", "--no-history"])
    assert capsys.readouterr().out.startswith("100000 rows, ")
    assert age == bulk.MAX_AGE_SECONDS  # (lengthened for the drain only: valgrind's pace)


def test_a_batchs_shape_is_made_once_per_poller_and_columns() -> None:
    """rows_to_events works a poller's shape out once and gives each later batch
    a copy with its own metadata: the events are those of a shape made afresh."""
    from dbtrigger.sources.rows import Rows, rows_to_events  # noqa: PLC0415

    rows = Rows(("id", "v", "payload"), [(1, 10, "a"), (2, 20, "b")], plain=True)

    def events(batch_id: str, poller: str = "p") -> list[Any]:
        return rows_to_events(
            rows,
            cursor_column="v",
            pk_columns=["id"],
            source="s",
            poller=poller,
            batch_id=batch_id,
        )

    first, second, other = events("b1"), events("b2"), events("b2", poller="q")
    assert first[0]._shape is not second[0]._shape
    assert [dict(e.metadata) for e in (first[0], second[1], other[0])] == [
        {"poller": "p", "batch_id": "b1"},
        {"poller": "p", "batch_id": "b2"},
        {"poller": "q", "batch_id": "b2"},
    ]
    fresh = events_from_rows(
        RowShape(
            rows.columns,
            cursor_column="v",
            pk_columns=["id"],
            source="s",
            poller="p",
            batch_id="b2",
            plain=True,
        ),
        rows.tuples,
    )
    assert second == fresh
    assert [e.event_id for e in second] == [e.event_id for e in fresh]
    assert other[0].event_id != second[0].event_id  # (the poller is in the id)
    assert type(second[0].after) is type(fresh[0].after)
