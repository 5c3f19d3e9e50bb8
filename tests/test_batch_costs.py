"""Per-batch shortcuts give what the general path gives.

Work a batch used to repeat although its inputs had not changed is now done
once or skipped: the batch id's formatted tick start, the log fields of
records nobody reads (:meth:`~dbtrigger.runtime.telemetry.Telemetry.logs`),
the lag clock for a cursor with no time in it. Each is held here to the
general path.
"""

from __future__ import annotations

import datetime as dt
import logging

import pytest

from dbtrigger.metrics import SafeMetrics
from dbtrigger.runtime.batches import batch_id_for
from dbtrigger.runtime.telemetry import EVENTS, Telemetry
from dbtrigger.sources.clock import DatabaseClock
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
