"""Replaying batches committed while a retry held the checkpoint back.

A batch's record spans ``from`` -> ``to``, the checkpoint before and after it;
with an event waiting for its retry the checkpoint stays below it, so a batch
holds events past its ``to`` (the rest of its fetch), and a later batch spans
rows earlier batches delivered. Nothing changed in the table: a verify of
every batch finds no drift, and a replay delivers each batch as recorded.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.changelog import ChangeLogSource, install
from dbtrigger.cli import main
from dbtrigger.errors import HandlerError
from dbtrigger.history import history_for
from dbtrigger.history.records import image_text
from dbtrigger.replay.batches import plan
from dbtrigger.runtime.context import BatchContext
from tests.databases import TestDatabase
from tests.test_history_replay import Calls, orders_table, register


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime.now(dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now


def _retrying_once(live: list[list[RowChange]]) -> object:
    asked: set[object] = set()

    def handle(events: list[RowChange], ctx: BatchContext) -> None:
        live.append(list(events))
        for event in events:
            if event.pk["id"] == 14 and 14 not in asked:
                asked.add(14)
                ctx.retry(event, "search index busy")

    return handle


def _drain_with_a_retry(trigger: PollTrigger, clock: Clock) -> list[list[RowChange]]:
    live: list[list[RowChange]] = []
    handle = _retrying_once(live)
    with pytest.raises(HandlerError, match="wait for a retry"):  # not done: 14 waits
        trigger.drain(handle, retry_wait_seconds=0)
    clock.now += dt.timedelta(hours=1)  # the retry is due
    trigger.drain(handle)
    return live


def _batches(trigger: PollTrigger) -> list[dict[str, object]]:
    history = history_for(trigger.store)
    assert history is not None
    return [r for r in history.read(trigger.name) if r["type"] == "commit"]


def _cli(capsys: pytest.CaptureFixture[str], spec: str, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main([*argv, "--trigger", spec])
    out, err = capsys.readouterr()
    return code, out + err


def test_a_polled_table_s_batches_around_a_retry_verify_without_drift(
    db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    orders_table(db)
    clock = Clock()
    source = SqlAlchemySource(
        url=db.url,
        schema=db.schema,
        table="orders",
        cursor_column="seq",
        pk_columns=["id"],
        visibility="none",
    )
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=10,
        clock=clock,
    )
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    live = _drain_with_a_retry(trigger, clock)
    records = _batches(trigger)
    assert [int(str(r["rows"])) for r in records] == [10, 10, 5, 1]  # 14 came again last
    for record in records:
        code, out = _cli(capsys, spec, "replay", "orders", "--batch", str(record["batch_id"]))
        assert code == 0, out
        assert "identical to the record" in out, out
        assert "drift" not in out, out
    code, out = _cli(
        capsys,
        spec,
        "replay",
        "orders",
        "--from-batch",
        str(records[0]["batch_id"]),
        "--to-batch",
        str(records[-1]["batch_id"]),
        "--yes",
        "--reason",
        "rebuild the index",
    )
    assert code == 0, out
    again = [events for events, _ in calls.batches]
    assert [[e.event_id for e in b] for b in again] == [[e.event_id for e in b] for b in live]

    # A row written into batch 2's range since (a late commit, say) is added there only.
    db.execute(f"INSERT INTO {db.qualified('orders')} (id, seq, status) VALUES (100, 12, 'late')")
    drifts = []
    for record in records:
        code, out = _cli(
            capsys, spec, "replay", "orders", "--batch", str(record["batch_id"]), "--verify"
        )
        drifts.append([ln.split()[1:3] for ln in out.splitlines() if ln.startswith("    drift")])
    assert drifts == [[], [["added", "id=100:"]], [], []]


def test_a_change_log_s_batches_around_a_retry_replay_exactly(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = orders_table(sqlite_db, rows=0)
    install(sqlite_db.engine, "orders", schema=sqlite_db.schema)
    with sqlite_db.engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"id": i, "seq": i, "status": "new", "amount": i} for i in range(1, 26)],
        )
        conn.execute(table.update().where(table.c.id == 3).values(status="paid"))
    clock = Clock()
    source = ChangeLogSource(url=sqlite_db.url, table="orders", visibility="none")
    trigger = PollTrigger(
        name="orders-log",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=10,
        clock=clock,
    )
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    live = _drain_with_a_retry(trigger, clock)
    records = _batches(trigger)
    assert sum(int(str(r["rows"])) for r in records) == 27  # 26 changes, 14 twice
    with sqlite_db.engine.begin() as conn:  # the table moves on; its log does not
        conn.execute(sa.text("UPDATE orders SET status = 'gone' WHERE id = 14"))
    code, out = _cli(
        capsys,
        spec,
        "replay",
        "orders-log",
        "--from-batch",
        str(records[0]["batch_id"]),
        "--to-batch",
        str(records[-1]["batch_id"]),
        "--yes",
        "--reason",
        "replica rebuild",
    )
    assert code == 0, out
    assert "mode exact" in out
    again = [events for events, _ in calls.batches]
    assert [[image_text(e) for e in b] for b in again] == [[image_text(e) for e in b] for b in live]
    assert [[e.event_id for e in b] for b in again] == [[e.event_id for e in b] for b in live]


def test_a_change_log_batch_recorded_without_its_last_event_is_read_on_to_find_it(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Records written before a batch's record said where its last event is
    (``last``): a batch whose events reach past its ``to`` is read on (bounded)
    until its recorded events are found, not refused as pruned."""
    table = orders_table(sqlite_db, rows=0)
    install(sqlite_db.engine, "orders", schema=sqlite_db.schema)
    with sqlite_db.engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"id": i, "seq": i, "status": "new", "amount": i} for i in range(1, 26)],
        )
    clock = Clock()
    source = ChangeLogSource(url=sqlite_db.url, table="orders", visibility="none")
    trigger = PollTrigger(
        name="orders-log",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=10,
        clock=clock,
    )
    register(trigger, Calls(), monkeypatch, tmp_path)
    _drain_with_a_retry(trigger, clock)
    records = _batches(trigger)
    old = []
    for record in records:
        detail = dict(record["detail"])  # type: ignore[call-overload]
        detail.pop("last")
        old.append({**record, "detail": detail})
    replay = plan(trigger, old, old)
    assert not replay.refusals(), replay.refusals()
    assert not replay.drift
    assert [len(b.events) for b in replay.batches] == [int(str(r["rows"])) for r in records]
