"""The settled window never stalls on entries whose rows are gone (issue 20, item 1).

A retried event pins the checkpoint; rows settled above it are then updated
(each gets a new cursor: a new tuple) while more rows wait than one read
returns. Their old tuples are never read again. Before the fix those entries
stayed for good - no read was "complete" - kept the window at its 75% mark,
and not one row was handed out again: ticks reported ``idle`` or ``committed
rows=0`` while thousands of rows waited. Now a read that went past an entry's
tuple without returning it drops the entry, and what a read cannot place (text
values whose order a collation decides) is looked up by its exact tuple when
the window blocks. A blocked window is said once, at WARNING, and ``status``
shows it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.cli.main import main
from dbtrigger.cursor import Position
from dbtrigger.runtime.context import BatchContext
from dbtrigger.sources.memory import MemorySource
from dbtrigger.state.window import Window
from tests.databases import TestDatabase
from tests.reliability_support import add_items, checkpoint_id, items_source, items_table, read_doc

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@dataclass
class Pinned:
    """Retries the first row for as long as ``pin`` is set; accepts the rest."""

    first: Any
    pin: bool = True
    seen: list[Any] = field(default_factory=list)

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            key = next(iter(e.pk.values()))
            self.seen.append((key, e.cursor))
            if key == self.first and self.pin:
                ctx.retry(e, "billing answers 429")


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == name]


def outcome(trigger: PollTrigger) -> str:
    assert trigger.last_result is not None
    return trigger.last_result.outcome


def tick_until_blocked(trigger: PollTrigger, handler: Pinned, ticks: int = 60) -> None:
    for _ in range(ticks):
        trigger.tick(handler)
        result = trigger.last_result
        assert result is not None
        if result.outcome == "idle":
            return
    raise AssertionError("the window never filled up")


def stall_scenario(
    db: TestDatabase,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    *,
    rows: int,
    **options: Any,
) -> None:
    """Pin row 1, fill the window to its pressure mark, update every settled row
    to a new cursor with a backlog bigger than one read: rows must flow again."""
    table = items_table(db)
    add_items(db, table, range(1, rows + 1))
    store = FileCheckpointStore(tmp_path / "state")
    clock = Clock()
    trigger = PollTrigger(
        name="items",
        source=items_source(db),
        checkpoint_store=store,
        clock=clock,
        retry_delay_seconds=3600,  # the pin holds for the whole test
        retry_delay_max_seconds=3600,
        **options,
    )
    handler = Pinned(first=1)
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        tick_until_blocked(trigger, handler)
        # Blocked: idle ticks that write nothing (not "committed 0" every tick),
        # said once at WARNING.
        trigger.tick(handler)
        assert outcome(trigger) == "idle"
        blocked = events(caplog, "window_blocked")
        assert [r.levelno for r in blocked] == [logging.WARNING]
        assert "billing answers 429" in blocked[0].getMessage()

        window = read_doc(store).window or Window()
        settled = [int(p.pk["id"]) for p in window.settled]
        waiting = rows - len(handler.seen)
        assert waiting > trigger.batch_size + len(window)  # more than one read returns
        with db.engine.begin() as conn:  # every settled row gets a new cursor
            conn.execute(
                table.update()
                .where(table.c.id.in_(settled))
                .values(version=table.c.version + 10 * rows)
            )
        before = len(handler.seen)
        trigger.tick(handler)
        assert outcome(trigger) == "committed"
        assert len(handler.seen) > before
        assert events(caplog, "window_entries_gone")

    # The pin is released: everything drains, nothing is lost, the window empties.
    handler.pin = False
    clock.now += dt.timedelta(hours=2)
    trigger.drain(handler)
    final = {(i, 10 * i + (10 * rows if i in settled else 0)) for i in range(1, rows + 1)}
    assert final <= set(handler.seen)
    assert checkpoint_id(store) is not None
    assert read_doc(store).window is None


def test_rows_updated_above_a_pinned_retry_do_not_stall_the_poller(
    db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stall_scenario(db, tmp_path, caplog, rows=160, batch_size=10, window_max_events=40)


def test_the_reported_stall_with_default_batch_size_and_bound(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As reported: default batch size and window bound, 2,300+ rows waiting."""
    stall_scenario(sqlite_db, tmp_path, caplog, rows=2800)


# --- entries a read cannot place: text cursors and keys -----------------------------------


def notes_table(db: TestDatabase) -> sa.Table:
    table = sa.Table(
        "notes",
        sa.MetaData(),
        sa.Column("code", sa.String(20), primary_key=True),
        sa.Column("stamp", sa.String(20), nullable=False),
        sa.Index("ix_notes_stamp_code", "stamp", "code"),
        schema=db.schema,
    )
    table.create(db.engine)
    return table


def text_scenario(trigger: PollTrigger, update: Any, caplog: pytest.LogCaptureFixture) -> None:
    handler = Pinned(first="k0000")
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        tick_until_blocked(trigger, handler)
        window = trigger.read_state().window or Window()  # type: ignore[union-attr]
        update([str(p.pk["code"]) for p in window.settled])
        before = len(handler.seen)
        trigger.tick(handler)
        assert outcome(trigger) == "committed"
        assert len(handler.seen) > before  # rows flow again
        assert events(caplog, "window_entries_gone")
        assert len(trigger.read_state().window or Window()) < len(window)  # type: ignore[union-attr]


def test_text_tuples_the_read_cannot_place_are_looked_up(
    db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Text sorts by collation, so the read cannot tell whether it went past
    an entry: the source looks those exact tuples up when the window blocks."""
    table = notes_table(db)
    with db.engine.begin() as conn:
        conn.execute(
            table.insert(), [{"code": f"k{i:04d}", "stamp": f"s{i:05d}"} for i in range(150)]
        )
    source = SqlAlchemySource(
        url=db.url,
        table="notes",
        schema=db.schema,
        cursor_column="stamp",
        pk_columns=["code"],
        visibility="none",
    )
    trigger = PollTrigger(
        name="notes",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        clock=Clock(),
        batch_size=10,
        window_max_events=40,
        retry_delay_seconds=3600,
        retry_delay_max_seconds=3600,
    )

    def update(codes: list[str]) -> None:
        with db.engine.begin() as conn:
            conn.execute(
                table.update().where(table.c.code.in_(codes)).values(stamp="t" + table.c.code)
                if db.kind != "mariadb"
                else table.update()
                .where(table.c.code.in_(codes))
                .values(stamp=sa.func.concat("t", table.c.code))
            )

    text_scenario(trigger, update, caplog)


class PortOnly:
    """A source with the port and nothing else: it cannot look rows up."""

    def __init__(self, inner: MemorySource) -> None:
        self.inner = inner
        self.name = inner.name

    def fingerprint(self) -> str:
        return self.inner.fingerprint()

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        return self.inner.fetch(after, limit)

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        return self.inner.to_events(rows, poller=poller, batch_id=batch_id)

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    def close(self) -> None:
        pass


@pytest.mark.parametrize("lookup", [True, False], ids=["memory-source", "source-without-lookup"])
def test_a_source_that_cannot_look_rows_up_never_stalls_either(
    lookup: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = MemorySource(
        [{"code": f"k{i:04d}", "stamp": f"s{i:05d}"} for i in range(150)],
        cursor_column="stamp",
        pk_columns=["code"],
    )
    trigger = PollTrigger(
        name="notes",
        source=rows if lookup else PortOnly(rows),  # type: ignore[arg-type]
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        clock=Clock(),
        batch_size=10,
        window_max_events=40,
        retry_delay_seconds=3600,
        retry_delay_max_seconds=3600,
    )

    def update(codes: list[str]) -> None:
        rows.put(*({"code": c, "stamp": "t" + c} for c in codes))

    text_scenario(trigger, update, caplog)


# --- status --------------------------------------------------------------------------------


def test_status_shows_the_window_and_what_pins_it(
    sqlite_db: TestDatabase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 81))
    store = FileCheckpointStore(tmp_path / "state")
    trigger = PollTrigger(
        name="items",
        source=items_source(sqlite_db),
        checkpoint_store=store,
        batch_size=10,
        window_max_events=40,
        retry_delay_seconds=3600,
        retry_delay_max_seconds=3600,
    )
    tick_until_blocked(trigger, Pinned(first=1))

    assert main(["status", "items", "--store", str(tmp_path / "state")]) == 0
    out = capsys.readouterr().out
    fields = {line[:12].strip(): line[13:] for line in out.splitlines()}
    assert fields["window"].startswith("30 events (1 waiting for a retry, 29 settled)")
    assert fields["window"].endswith(
        "of 40 events / 49152 bytes (75% used) - AT PRESSURE: no new rows go out"
    )
    assert "the oldest, 10 id=1, has had 1 attempt(s), due in " in fields["blocking"]
    assert "billing answers 429" in fields["blocking"]

    assert main(["status", "items", "--json", "--store", str(tmp_path / "state")]) == 0
    window = json.loads(capsys.readouterr().out)["window"]
    assert (window["events"], window["pending"], window["pressure"]) == (30, 1, True)
    assert window["pinned_by"]["attempts"] == 1
    assert window["pinned_by"]["reason"] == "billing answers 429"
    assert window["next_due"] == window["pinned_by"]["due"]

    assert main(["status", "--store", str(tmp_path / "state")]) == 0
    assert "30 (1 retrying) AT PRESSURE" in capsys.readouterr().out
