"""Poison batches: per-row outcomes, bisection, quarantine sinks, and the guard rails."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import logging
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import HandlerError, InMemoryCheckpointStore, RowChange
from dbtrigger.errors import PartialBatchError, QuarantineError
from dbtrigger.isolation import isolate
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.quarantine import (
    JsonLinesQuarantineSink,
    QuarantineRecord,
    QuarantineSink,
    SqlQuarantineSink,
    encode_json_value,
)
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state import document as docmod
from dbtrigger.state.document import Checkpoint
from tests.databases import TestDatabase
from tests.reliability_support import (
    Recorder,
    add_items,
    checkpoint_id,
    items_source,
    items_table,
    make_trigger,
    read_doc,
)

# --- encoding and bisection on their own -----------------------------------------------


def test_row_values_json_cannot_hold_are_tagged_with_their_kind() -> None:
    when = dt.datetime(2026, 4, 7, 1, 2, 3, 456789, tzinfo=dt.timezone.utc)
    key = uuid.UUID(int=5)
    out = encode_json_value(
        {
            "n": 1,
            "s": "x",
            "b": True,
            "none": None,
            "f": 1.5,
            "nan": float("nan"),
            "d": decimal.Decimal("12.50"),
            "ts": when,
            "naive": when.replace(tzinfo=None),
            "day": when.date(),
            "id": key,
            "raw": b"\x00\xff",
            "nested": {"list": [decimal.Decimal("1"), {"k": key}]},
            "odd": object,
        }
    )
    assert out["n"] == 1
    assert out["s"] == "x"
    assert out["b"] is True
    assert out["none"] is None
    assert out["f"] == 1.5
    assert out["nan"] == {"$type": "float", "value": "nan"}
    assert out["d"] == {"$type": "decimal", "value": "12.50"}
    assert out["ts"] == {"$type": "timestamp", "value": "2026-04-07T01:02:03.456789Z"}
    assert out["naive"] == {"$type": "naive_timestamp", "value": "2026-04-07T01:02:03.456789"}
    assert out["day"] == {"$type": "date", "value": "2026-04-07"}
    assert out["id"] == {"$type": "uuid", "value": str(key)}
    assert out["raw"] == {"$type": "bytes", "value": "00ff"}
    assert out["nested"] == {
        "list": [{"$type": "decimal", "value": "1"}, {"k": {"$type": "uuid", "value": str(key)}}]
    }
    assert out["odd"]["$type"] == "repr"
    json.dumps(out)  # all plain JSON now


def event(i: int) -> RowChange:
    return RowChange(
        event_id=f"e{i}",
        op="upsert",
        source="test",
        cursor=i,
        pk={"id": i},
        before=None,
        after={"id": i},
    )


def test_bisection_finds_exactly_the_rows_that_fail_alone() -> None:
    events = [event(i) for i in range(16)]
    bad = {3, 11}
    calls: list[list[int]] = []

    def call(part: list[RowChange]) -> None:
        ids = [int(e.pk["id"]) for e in part]
        calls.append(ids)
        if bad.intersection(ids):
            raise ValueError(f"bad {sorted(bad.intersection(ids))}")

    found = isolate(events, call, first_error=ValueError("whole"), limit=5)
    assert sorted(int(e.pk["id"]) for e, _ in found.bad) == [3, 11]
    assert all(str(exc) == f"bad [{int(e.pk['id'])}]" for e, exc in found.bad)
    assert sorted(int(e.pk["id"]) for e in found.ok) == sorted(set(range(16)) - bad)
    assert not found.aborted
    assert found.calls == len(calls) <= 2 * len(bad) * 4


def test_bisection_uses_rows_named_by_a_partial_error() -> None:
    events = [event(i) for i in range(8)]

    def call(part: list[RowChange]) -> None:
        ids = [int(e.pk["id"]) for e in part]
        if 5 in ids:
            raise PartialBatchError([{"id": 5}], causes={0: KeyError("five")})

    found = isolate(events, call, first_error=ValueError("whole"), limit=5)
    assert [(int(e.pk["id"]), type(exc)) for e, exc in found.bad] == [(5, KeyError)]
    assert found.calls == 2  # two halves; the named half is not split further


def test_bisection_stops_when_too_many_rows_fail_alone() -> None:
    events = [event(i) for i in range(16)]

    def call(part: list[RowChange]) -> None:
        raise ConnectionError("downstream is down")

    found = isolate(events, call, first_error=ConnectionError("x"), limit=2)
    assert found.aborted
    assert len(found.bad) == 3
    assert found.ok == []


# --- sinks ---------------------------------------------------------------------------------


def _records(poller: str = "items") -> list[QuarantineRecord]:
    now = dt.datetime(2026, 4, 7, tzinfo=dt.timezone.utc)
    return [
        QuarantineRecord.from_event(
            event(i),
            poller=poller,
            error=ValueError(f"bad {i}"),
            attempts=3,
            checkpoint=docmod.Position(cursor=0, pk={"id": 0}),
            batch_id="b1",
            fencing_token=4,
            owner_id="me",
            now=now,
        )
        for i in (1, 2)
    ]


def test_sql_sink_stores_each_row_once_on_every_database(db: TestDatabase) -> None:
    sink = SqlQuarantineSink(engine=db.engine, schema=db.schema, table="poison")
    assert isinstance(sink, QuarantineSink)
    sink.put(_records())
    sink.put(_records())  # a repeated put (commit failed after it) adds nothing
    got = sink.records("items")
    assert [r.event_id for r in got] == ["e1", "e2"]
    first = got[0]
    assert first.pk == {"id": 1}
    assert first.row == {"id": 1}
    assert first.error == "ValueError: bad 1"
    assert (first.attempts, first.fencing_token, first.batch_id) == (3, 4, "b1")
    assert first.checkpoint["tiebreaker"] == {"id": 0}
    assert first.quarantined_at == dt.datetime(2026, 4, 7, tzinfo=dt.timezone.utc)
    assert sink.records("other") == []
    with db.engine.connect() as conn:
        count = conn.execute(sa.select(sa.func.count()).select_from(sink.table)).scalar_one()
    assert count == 2


def test_json_lines_sink_round_trips(tmp_path: Path) -> None:
    sink = JsonLinesQuarantineSink(tmp_path / "q" / "poison.jsonl")
    assert sink.records() == []
    sink.put(_records())
    sink.put(_records("other"))
    assert [r.event_id for r in sink.records("items")] == ["e1", "e2"]
    assert len(sink.records()) == 4
    lines = (tmp_path / "q" / "poison.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["error"] == "ValueError: bad 1"


def test_a_sink_that_cannot_write_raises_quarantine_error(tmp_path: Path) -> None:
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(QuarantineError):
        JsonLinesQuarantineSink(tmp_path / "dir.jsonl").put(_records())


# --- in the tick ---------------------------------------------------------------------------


def test_poison_row_is_bisected_out_and_quarantined_in_a_table(
    db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    table = items_table(db)
    add_items(db, table, range(1, 21))
    sink = SqlQuarantineSink(engine=db.engine, schema=db.schema)
    metrics = InMemoryMetrics()
    store = InMemoryCheckpointStore()
    trigger = make_trigger(
        items_source(db), store, batch_size=20, quarantine=sink, max_attempts=3, metrics=metrics
    )
    handler = Recorder(fail_on={7})
    for attempt in (1, 2):
        with pytest.raises(HandlerError):
            trigger.tick(handler)
        doc = read_doc(store)
        assert doc.failure is not None
        assert doc.failure.attempts == attempt
        assert doc.checkpoint is None
        assert sink.records() == []
    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        assert trigger.tick(handler) == 20
    assert checkpoint_id(store) == 20
    assert read_doc(store).failure is None
    (record,) = sink.records("items")
    assert record.pk == {"id": 7}
    assert record.attempts == 3
    assert record.error == "ValueError: cannot process item(s) [7]"
    assert record.checkpoint == docmod.position_to_json(docmod.Position())
    assert record.row is not None
    assert record.row["payload"] == "p7"
    assert record.row["amount"] == {"$type": "decimal", "value": "7.25"}
    assert record.row["seen_at"] == {
        "$type": "naive_timestamp",
        "value": "2026-01-01T12:00:07.000000",
    }
    assert metrics.total("quarantined_total") == 1
    warned = [r for r in caplog.records if getattr(r, "event", None) == "row_quarantined"]
    assert len(warned) == 1
    assert warned[0].levelno == logging.WARNING
    assert read_doc(store).journal[-1]["quarantined"] == 1
    # Every good row was processed in some call; the poison row is never delivered again.
    assert set(handler.ids) == set(range(1, 21))
    handler.deliveries.clear()
    add_items(db, table, [21])
    assert trigger.tick(handler) == 1
    assert handler.ids == [21]


def test_poison_row_goes_to_a_json_lines_file(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 6))
    sink = JsonLinesQuarantineSink(tmp_path / "poison.jsonl")
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(sqlite_db), store, quarantine=sink, max_attempts=1)
    assert trigger.tick(Recorder(fail_on={5})) == 5
    assert [r.pk for r in sink.records()] == [{"id": 5}]
    assert checkpoint_id(store) == 5


class PartialHandler:
    """Processes rows one by one; rows in ``bad`` fail and are named in the error."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.processed: list[int] = []
        self.deliveries: list[list[int]] = []

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        ids = [int(e.pk["id"]) for e in events]
        self.deliveries.append(ids)
        failed = [i for i in ids if i in self.bad]
        self.processed.extend(i for i in ids if i not in self.bad)
        if failed:
            raise PartialBatchError(
                [{"id": i} for i in failed],
                causes={n: LookupError(f"no customer for {i}") for n, i in enumerate(failed)},
            )


def test_partial_failure_commits_the_head_and_skips_done_rows_on_redelivery(
    db: TestDatabase,
) -> None:
    """The design choice, proved: rows after the failed one are not redelivered."""
    table = items_table(db)
    add_items(db, table, range(1, 11))
    store = InMemoryCheckpointStore()
    metrics = InMemoryMetrics()
    trigger = make_trigger(items_source(db), store, metrics=metrics)
    handler = PartialHandler(bad={4})

    with pytest.raises(HandlerError, match="1 row"):
        trigger.tick(handler)
    doc = read_doc(store)
    assert checkpoint_id(store) == 3, "the checkpoint moves over the processed head only"
    assert doc.failure is not None
    assert doc.failure.attempts == 1
    assert doc.failure.from_position == doc.position
    assert len(doc.failure.done) == 6  # rows 5..10
    assert doc.journal[-1]["type"] == "partial_commit"
    assert metrics.total("events_total") == 3

    with pytest.raises(HandlerError):
        trigger.tick(handler)
    assert handler.deliveries[-1] == [4], "processed rows must not be delivered again"
    doc = read_doc(store)
    assert doc.failure is not None
    assert doc.failure.attempts == 2
    assert len(doc.failure.done) == 6

    handler.bad.clear()  # the missing customer arrives
    add_items(db, table, [11])
    assert trigger.tick(handler) == 8  # rows 4..11 settled
    assert handler.deliveries[-1] == [4, 11]
    assert checkpoint_id(store) == 11
    assert read_doc(store).failure is None
    assert sorted(handler.processed) == list(range(1, 12))
    assert len(handler.processed) == 11, "a processed row was delivered twice"


def test_named_rows_are_quarantined_after_max_attempts(sqlite_db: TestDatabase) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 11))
    sink = JsonLinesQuarantineSink(sqlite_db.url.split("///")[1] + ".poison.jsonl")
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(sqlite_db), store, quarantine=sink, max_attempts=2)
    handler = PartialHandler(bad={4, 6})
    with pytest.raises(HandlerError):
        trigger.tick(handler)
    assert checkpoint_id(store) == 3
    assert trigger.tick(handler) == 7  # attempt 2 at the new head: quarantine 4 and 6
    assert handler.deliveries == [list(range(1, 11)), [4, 6]]
    records = sink.records()
    assert [(r.pk["id"], r.error) for r in records] == [
        (4, "LookupError: no customer for 4"),
        (6, "LookupError: no customer for 6"),
    ]
    assert checkpoint_id(store) == 10
    assert sorted(handler.processed) == [1, 2, 3, 5, 7, 8, 9, 10]


def test_every_row_failing_looks_like_an_outage_and_nothing_is_set_aside(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 11))
    sink = JsonLinesQuarantineSink(tmp_path / "poison.jsonl")
    store = InMemoryCheckpointStore()
    trigger = make_trigger(
        items_source(sqlite_db), store, quarantine=sink, max_attempts=1, quarantine_limit=3
    )

    def outage(events: list[RowChange]) -> None:
        raise ConnectionError("downstream unavailable")

    with caplog.at_level(logging.WARNING, logger="dbtrigger"), pytest.raises(HandlerError):
        trigger.tick(outage)
    assert sink.records() == []
    assert checkpoint_id(store) is None
    assert any(getattr(r, "event", None) == "poison_batch" for r in caplog.records)


@pytest.mark.parametrize("partial", [False, True])
def test_a_small_batch_failing_entirely_is_not_quarantined(
    sqlite_db: TestDatabase, tmp_path: Path, partial: bool
) -> None:
    """Fewer rows than the limit, but none passes: an outage, not three poison rows."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    sink = JsonLinesQuarantineSink(tmp_path / "poison.jsonl")
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(sqlite_db), store, quarantine=sink, max_attempts=1)
    handler = PartialHandler(bad={1, 2, 3}) if partial else Recorder(fail_on={1, 2, 3})
    with pytest.raises(HandlerError):
        trigger.tick(handler)  # type: ignore[arg-type]
    assert sink.records() == []
    assert checkpoint_id(store) is None
    add_items(sqlite_db, table, [4])  # a row that passes: now 1-3 are poison indeed
    assert trigger.tick(handler) == 4  # type: ignore[arg-type]
    assert sorted(int(r.pk["id"]) for r in sink.records()) == [1, 2, 3]
    assert checkpoint_id(store) == 4


def test_without_a_sink_a_poison_batch_is_retried_for_ever_and_loudly(
    sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4))
    store = InMemoryCheckpointStore()
    metrics = InMemoryMetrics()
    trigger = make_trigger(items_source(sqlite_db), store, max_attempts=2, metrics=metrics)
    handler = Recorder(fail_on={2})
    with caplog.at_level(logging.ERROR, logger="dbtrigger"):
        for attempt in range(1, 6):
            with pytest.raises(HandlerError):
                trigger.tick(handler)
            doc = read_doc(store)
            assert doc.failure is not None
            assert doc.failure.attempts == attempt
    assert [ids for _, _, ids in handler.deliveries] == [[1, 2, 3]] * 5
    assert checkpoint_id(store) is None
    poison = [r for r in caplog.records if getattr(r, "event", None) == "poison_batch"]
    assert len(poison) == 1  # attempt 2, at ERROR; attempts 3..5 remind at WARNING, later
    assert "quarantine sink" in poison[0].getMessage()
    assert metrics.total("redelivered_batches_total") == 4
    assert metrics.total("quarantined_total") == 0


def test_a_failing_sink_skips_nothing(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 11))
    broken = tmp_path / "broken.jsonl"
    broken.mkdir()
    store = InMemoryCheckpointStore()
    trigger = make_trigger(
        items_source(sqlite_db),
        store,
        quarantine=JsonLinesQuarantineSink(broken),
        max_attempts=1,
    )
    handler = Recorder(fail_on={7})
    with pytest.raises(QuarantineError):
        trigger.tick(handler)
    doc = read_doc(store)
    assert checkpoint_id(store) == 6, "only the rows before the poison row are passed"
    assert doc.failure is not None
    assert len(doc.failure.done) == 3  # 8, 9, 10 passed during bisection
    handler.deliveries.clear()
    broken.rmdir()
    assert trigger.tick(handler) == 4  # row 7 quarantined now, 8..10 skipped as done
    assert handler.ids == [7]
    assert checkpoint_id(store) == 10


def test_a_failure_record_for_another_checkpoint_is_ignored(sqlite_db: TestDatabase) -> None:
    """After an operator moved the checkpoint, old attempts and done rows do not apply."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 11))
    store = InMemoryCheckpointStore()
    trigger = make_trigger(items_source(sqlite_db), store)
    handler = PartialHandler(bad={4})
    with pytest.raises(HandlerError):
        trigger.tick(handler)
    stored = store.read("items")
    assert stored is not None
    doc = docmod.loads(stored.data)
    assert doc.checkpoint is not None
    moved = docmod.StateDocument(
        poller_name=doc.poller_name,
        source_fingerprint=doc.source_fingerprint,
        checkpoint=Checkpoint(
            position=docmod.Position(cursor=10, pk={"id": 1}),
            last_successful_batch_id="manual",
            updated_at=doc.checkpoint.updated_at,
        ),
        lease=doc.lease,
        failure=doc.failure,  # left behind by the manual change
    )
    store.write("items", docmod.dumps(moved), if_match=stored.etag)
    handler.bad.clear()
    assert trigger.tick(handler) == 9
    assert handler.deliveries[-1] == list(range(2, 11)), "stale done rows were skipped"
