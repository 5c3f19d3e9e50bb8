"""The words of one tick's line (``TickResult.summary``), as a new user first reads them.

A Functions timer firing that left rows behind said "more pending, ticking again
at once" in Application Insights, although nothing ticks before the next
firing; and one row was "1 rows".
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.runtime.trigger import TickResult


def test_one_row_is_a_row() -> None:
    text, _ = TickResult(1, 1, "committed").summary(None)
    assert text.startswith("committed 1 row in 1 batch,")
    text, _ = TickResult(2, 1, "committed").summary(None)
    assert text.startswith("committed 2 rows in 1 batch,")


def test_a_worker_ticks_again_at_once_a_timer_firing_does_not() -> None:
    worker, _ = TickResult(100, 1, "committed", more=True).summary(0)
    assert worker.endswith("; more pending, ticking again at once")
    firing, _ = TickResult(100, 1, "committed", more=True).summary(None)
    assert "ticking again at once" not in firing
    assert firing.endswith(
        "; more pending, left for the next tick (raise max_batches_per_tick to take more)"
    )


def test_a_plain_tick_with_rows_left_says_they_wait(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with sqlite3.connect(tmp_path / "shop.db") as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, updated_at TEXT)")
        conn.executemany(
            "INSERT INTO orders VALUES (?, ?)", [(i, f"2026-11-26 10:00:{i:02d}") for i in range(5)]
        )
    trigger = PollTrigger(
        name="orders",
        source=SqlAlchemySource(
            url=f"sqlite:///{tmp_path / 'shop.db'}",
            table="orders",
            cursor_column="updated_at",
            pk_columns=["id"],
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=2,
    )
    with caplog.at_level(logging.INFO, logger="dbtrigger.runtime"):
        assert trigger.run(handler=lambda events: None) == 2
    (line,) = [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "tick"]
    assert line.startswith("orders: committed 2 rows in 1 batch,")
    assert line.endswith(
        "; more pending, left for the next tick (raise max_batches_per_tick to take more)"
    )


def test_a_commit_that_left_the_beginning_says_so() -> None:
    """Fan-out with a subscriber retrying the first rows: the commit keeps the beginning,
    and the line read "committed 100 rows in 1 batch, checkpoint None (committed ...)"."""
    import datetime as dt  # noqa: PLC0415

    from dbtrigger.cursor import BEGINNING, Position  # noqa: PLC0415

    at = dt.datetime(2026, 11, 26, 23, 39, 31, 820000, tzinfo=dt.timezone.utc)
    text, fields = TickResult(100, 1, "committed", checkpoint=BEGINNING, committed_at=at).summary(0)
    assert text.startswith(
        "committed 100 rows in 1 batch, checkpoint (beginning) (committed 23:39:31.820Z)"
    )
    assert fields["checkpoint"] == "checkpoint (beginning) (committed 23:39:31.820Z)"
    later = TickResult(1, 1, "committed", checkpoint=Position(7, {"id": 7})).summary(0)[0]
    assert later.startswith("committed 1 row in 1 batch, checkpoint 7 id=7")


def test_the_demo_says_one_row() -> None:
    """`dbtrigger demo` printed "batch_...    1 rows (0 new, 1 updated)"."""
    from dbtrigger.demo import rows_text  # noqa: PLC0415

    assert (rows_text(1), rows_text(10), rows_text(0)) == ("  1 row ", " 10 rows", "  0 rows")
