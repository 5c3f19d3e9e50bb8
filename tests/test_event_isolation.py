"""Events are the rows as read, whoever else reads them (issue #20, item 3).

A jsonb / JSON column (or a PostgreSQL array) arrives as a Python dict or
list. An event is shared: by every fan-out subscriber, by a retry of its batch
within the tick (bisection), and by the dead-letter record written after the
handler ran. A handler that changes ``e.after["payload"]["tags"]`` in place
must change none of them: every read of a nested value hands out a copy.

On SQLite and PostgreSQL the table source returns JSON as dicts; on MariaDB a
JSON column is text to the table source (nothing nested to share), and the
change log's row images (``JSON_OBJECT``) carry it nested, so MariaDB is
covered through the change log.
"""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.changelog import ChangeLogSource, install
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.rowviews import PlainRowMapping
from dbtrigger.runtime.context import BatchContext
from dbtrigger.sources.rows import plain_types
from tests.databases import TestDatabase
from tests.reliability_support import NO_WAIT, add_items, items_source, items_table

PAYLOAD = {"tags": ["a"], "meta": {"n": 1}}


def docs_table(db: TestDatabase) -> sa.Table:
    """``docs(id, version, payload JSON/jsonb[, codes int[]])`` with two rows."""
    columns: list[Any] = [
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("payload", postgresql.JSONB if db.kind == "postgresql" else sa.JSON),
    ]
    if db.kind == "postgresql":
        columns.append(sa.Column("codes", postgresql.ARRAY(sa.Integer)))
    table = sa.Table("docs", sa.MetaData(), *columns, schema=db.schema)
    table.create(db.engine)
    extra = {"codes": [1, 2]} if db.kind == "postgresql" else {}
    with db.engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"id": i, "version": i, "payload": copy.deepcopy(PAYLOAD), **extra} for i in (1, 2)],
        )
    return table


def table_source(db: TestDatabase) -> SqlAlchemySource:
    return SqlAlchemySource(
        url=db.url,
        table="docs",
        schema=db.schema,
        cursor_column="version",
        pk_columns=["id"],
        visibility="none",
    )


def vandalise(event: RowChange) -> None:
    """What a careless handler does to the nested values it reads."""
    after = event.after
    assert after is not None
    payload = after["payload"]
    assert payload == PAYLOAD, payload  # the row as read
    payload["tags"].append("mine")
    payload["meta"]["n"] = 99
    payload["new"] = True
    if "codes" in after:
        after["codes"].append(3)


def snapshot(event: RowChange) -> Any:
    """The event's row as plain JSON (what another reader sees now)."""
    assert event.after is not None
    return json.loads(json.dumps(dict(event.after), default=str))


def fan_out_isolation(source: Any, tmp_path: Path) -> None:
    """Subscriber ``a`` mutates every nested value and rejects; ``b`` reads after
    it: ``b`` and the dead-letter record both hold the rows as read."""
    a_done = threading.Event()
    seen_by_b: list[Any] = []

    def a(events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            vandalise(e)
            ctx.reject(e, "a rejects it")
        a_done.set()

    def b(events: list[RowChange]) -> None:
        a_done.wait(30)  # bounded: read only once ``a`` has done its worst
        seen_by_b.extend(snapshot(e) for e in events)

    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    trigger = PollTrigger(
        name="docs",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        quarantine=sink,
        subscribers={"a": a, "b": b},
        retry=NO_WAIT,
    )
    assert trigger.drain() == 2
    assert a_done.is_set()
    assert [s["payload"] for s in seen_by_b] == [PAYLOAD, PAYLOAD]
    records = list(sink.records())
    assert [r.row["payload"] for r in records if r.row is not None] == [PAYLOAD, PAYLOAD]
    for record, seen in zip(records, seen_by_b, strict=True):
        assert record.row is not None
        if "codes" in seen:
            assert seen["codes"] == record.row["codes"] == [1, 2]


@pytest.mark.parametrize(
    "kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)]
)
def test_fan_out_subscribers_and_the_dead_letter_keep_the_row_as_read(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    db: TestDatabase = request.getfixturevalue("pg" if kind == "postgresql" else "sqlite_db")
    docs_table(db)
    fan_out_isolation(table_source(db), tmp_path)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ],
)
def test_change_log_images_keep_nested_values_as_read(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The change log's before/after images (JSON objects parsed per event; on
    MariaDB the one place a JSON column arrives nested; SQLite's images carry
    a JSON column as text)."""
    db: TestDatabase = request.getfixturevalue("pg" if kind == "postgresql" else "mariadb")
    docs_table_for_log(db)
    install(db.engine, "docs", schema=db.schema)
    with db.engine.begin() as conn:
        for i in (1, 2):
            conn.execute(
                sa.text(
                    f"INSERT INTO {db.qualified('docs')} (id, version, payload) VALUES (:i, :i, :p)"
                ),
                {"i": i, "p": json.dumps(PAYLOAD)},
            )
    # The rows were committed before the poller starts: no guard needed (and
    # none may wait for unrelated sessions on a shared server).
    source = ChangeLogSource(url=db.url, table="docs", schema=db.schema, visibility="none")
    fan_out_isolation(source, tmp_path)


def docs_table_for_log(db: TestDatabase) -> None:
    kind = {"postgresql": "JSONB", "mariadb": "JSON"}[db.kind]
    db.execute(
        f"CREATE TABLE {db.qualified('docs')} "
        f"(id INTEGER PRIMARY KEY, version INTEGER NOT NULL, payload {kind})"
    )


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize(
    "kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)]
)
def test_a_retry_within_the_tick_and_the_quarantine_record_see_the_row_as_read(
    kind: str, lanes: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Single handler (and lanes): it mutates, then fails the batch; the bisection
    hands it the same events again, and the poison row is quarantined. Every
    call, and the quarantine record, see the row as read."""
    db: TestDatabase = request.getfixturevalue("pg" if kind == "postgresql" else "sqlite_db")
    docs_table(db)
    calls: list[list[Any]] = []
    lock = threading.Lock()

    def handler(events: list[RowChange]) -> None:
        with lock:
            calls.append([snapshot(e)["payload"] for e in events])
        for e in events:
            vandalise(e)
        if any(e.pk["id"] == 2 for e in events):
            raise ValueError("row 2 is poison")

    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    trigger = PollTrigger(
        name="docs",
        source=table_source(db),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        quarantine=sink,
        max_attempts=1,
        max_concurrency=lanes,
        retry=NO_WAIT,
    )
    assert trigger.drain(handler) == 2
    assert len(calls) >= 2  # the batch, then its parts
    assert all(payload == PAYLOAD for call in calls for payload in call), calls
    [record] = sink.records()
    assert record.pk == {"id": 2}
    assert record.row is not None
    assert record.row["payload"] == PAYLOAD


def test_a_constructed_event_copies_nested_values_in_and_out() -> None:
    tags = ["a"]
    event = RowChange(
        event_id="e1",
        op="upsert",
        source="test",
        cursor=1,
        pk={"id": 1},
        before=None,
        after={"id": 1, "payload": {"tags": tags}},
    )
    tags.append("caller changed it later")
    after = event.after
    assert after is not None
    after["payload"]["tags"].append("handler changed it")
    assert after["payload"] == {"tags": ["a"]}
    assert dict(after) == {"id": 1, "payload": {"tags": ["a"]}}
    assert after == {"id": 1, "payload": {"tags": ["a"]}}
    assert repr(after) == "mappingproxy({'id': 1, 'payload': {'tags': ['a']}})"
    with pytest.raises(TypeError):
        after["id"] = 2  # type: ignore[index]
    same = RowChange("e1", "upsert", "test", 1, {"id": 1}, None, dict(after))
    assert same == event


@pytest.mark.parametrize(
    ("kind", "plain"),
    [
        (sa.Integer(), True),
        (sa.Numeric(12, 2), True),
        (postgresql.DOUBLE_PRECISION(), True),
        (sa.String(20), True),
        (sa.Enum("a", "b"), True),
        (postgresql.TIMESTAMP(timezone=True), True),
        (postgresql.UUID(), True),
        (postgresql.BYTEA(), True),
        (mysql.LONGTEXT(), True),  # a MariaDB JSON column is text to the driver
        (sa.JSON(), False),
        (postgresql.JSONB(), False),
        (postgresql.ARRAY(sa.Integer), False),
        (postgresql.HSTORE(), False),
        (mysql.SET("a", "b"), False),  # a String that yields a Python set
        (sa.PickleType(), False),  # a TypeDecorator: any value
        (sa.types.NullType(), False),  # unknown (query mode)
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, bool) else str(v),
)
def test_which_column_types_need_no_copy_on_read(kind: Any, plain: bool) -> None:
    assert plain_types([kind]) is plain


def test_a_table_of_scalar_columns_is_read_with_no_check(db: TestDatabase, tmp_path: Path) -> None:
    """The single-handler catch-up path of a table with no nested column pays
    nothing for the copy-on-read guard; a table with one is guarded."""
    items = items_table(db)
    add_items(db, items, [1])
    events: list[RowChange] = []
    trigger = PollTrigger(
        name="items",
        source=items_source(db),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        retry=NO_WAIT,
    )
    assert trigger.drain(events.extend) == 1
    assert type(events[0].after) is PlainRowMapping
    assert events[0].after["payload"] == "p1"
    if db.kind != "mariadb":  # MariaDB's JSON is text: no nested values to guard
        docs_table(db)
        docs: list[RowChange] = []
        trigger = PollTrigger(
            name="docs",
            source=table_source(db),
            checkpoint_store=FileCheckpointStore(tmp_path / "state"),
            retry=NO_WAIT,
        )
        assert trigger.drain(docs.extend) == 2
        assert type(docs[0].after) is not PlainRowMapping
