"""SqlAlchemySource against SQLite, PostgreSQL and MariaDB (the source contract).

Each test gets an isolated schema (``db`` fixture). Cursor values are set
explicitly and lie in the past, so the tests are about ordering and encoding,
not about timing.
"""

from __future__ import annotations

import datetime as dt
import decimal
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from dbtrigger import (
    FileCheckpointStore,
    InMemoryCheckpointStore,
    PollTrigger,
    RowChange,
    SerializationError,
    SqlAlchemySource,
)
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.errors import ConfigurationError, UnsafeIdentifierError
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.sources.base import SourceAdapter
from dbtrigger.state.document import position_from_json, position_to_json
from tests.databases import TestDatabase

UTC = dt.timezone.utc
BASE = dt.datetime(2020, 1, 1, tzinfo=UTC)


def precise_datetime(timezone: bool) -> sa.types.TypeEngine[Any]:
    """A DateTime that keeps microseconds on MariaDB too (DATETIME(6))."""
    return sa.DateTime(timezone=timezone).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def make_table(
    db: TestDatabase, name: str, *columns: sa.Column[Any], index: tuple[str, ...] = ()
) -> sa.Table:
    table = sa.Table(name, sa.MetaData(), *columns, schema=db.schema)
    if index:
        sa.Index(f"ix_{name}_cursor_pk", *(table.c[c] for c in index))
    table.metadata.create_all(db.engine)
    return table


def orders_table(db: TestDatabase) -> sa.Table:
    return make_table(
        db,
        "orders",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("updated_at", precise_datetime(timezone=False), nullable=True),
        sa.Column("note", sa.String(50)),
        index=("updated_at", "id"),
    )


def source_for(db: TestDatabase, table: str = "orders", **kwargs: Any) -> SqlAlchemySource:
    kwargs.setdefault("cursor_column", "updated_at")
    kwargs.setdefault("pk_columns", ["id"])
    return SqlAlchemySource(url=db.url, table=table, schema=db.schema, **kwargs)


def naive(seconds: float) -> dt.datetime:
    return (BASE + dt.timedelta(seconds=seconds)).replace(tzinfo=None)


def insert(db: TestDatabase, table: sa.Table, rows: list[dict[str, Any]]) -> None:
    with db.engine.begin() as conn:
        conn.execute(table.insert(), rows)


def keys(rows: Any) -> list[Any]:
    return [r["id"] for r in rows]


def first_fetch(source: SqlAlchemySource, position: Any, limit: int) -> list[Any]:
    """A source's first fetch, waiting (bounded) while its guard holds every row back.

    On MariaDB the timestamp guard has no bound at all while a write transaction
    that was open at its first observation stays open, on any schema of the
    shared server (another test's, for seconds): the fetch then returns nothing,
    reported held back, after a 2 s settle. Each empty fetch must say so; the
    first one that returns rows is the one the caller checks. Later fetches of
    the same source keep that bound (it never moves back).
    """
    deadline = time.monotonic() + 60
    while True:
        rows = source.fetch(position, limit)
        if rows:
            return rows
        info = source.last_fetch_info
        assert info is not None
        assert info.held_back, info  # waiting, never silently empty
        assert time.monotonic() < deadline, info


def drain_positions(source: SourceAdapter, limit: int) -> list[Any]:
    """Fetch everything page by page, restarting each page from a JSON round trip."""
    seen: list[Any] = []
    position = BEGINNING
    deadline = time.monotonic() + 60
    for _ in range(10_000):
        rows = source.fetch(position, limit)
        assert len(rows) <= limit
        info = getattr(source, "last_fetch_info", None)
        if not rows and info is not None and info.held_back and time.monotonic() < deadline:
            # Not the end: on MariaDB the horizon is server-wide, and another
            # session's open writer holds it back for a while (bounded wait).
            time.sleep(0.05)
            continue
        if not rows:
            return seen
        events = source.to_events(rows, poller="p", batch_id="b")
        seen.extend(dict(e.pk) | {"cursor": e.cursor} for e in events)
        last = events[-1]
        position = position_from_json(position_to_json(Position(last.cursor, dict(last.pk))))
    raise AssertionError("did not finish")


class TestFetchContract:
    def test_is_a_source_adapter(self, db: TestDatabase) -> None:
        assert isinstance(source_for(db), SourceAdapter)

    def test_orders_by_cursor_then_key_and_respects_limit(self, db: TestDatabase) -> None:
        table = orders_table(db)
        insert(
            db,
            table,
            [
                {"id": 5, "updated_at": naive(1)},
                {"id": 3, "updated_at": naive(2)},
                {"id": 1, "updated_at": naive(2)},
                {"id": 4, "updated_at": naive(0)},
                {"id": 2, "updated_at": naive(2)},
            ],
        )
        source = source_for(db)
        assert keys(first_fetch(source, BEGINNING, 10)) == [4, 5, 1, 2, 3]
        assert keys(source.fetch(BEGINNING, 2)) == [4, 5]

    def test_fetch_is_strictly_after_the_position(self, db: TestDatabase) -> None:
        table = orders_table(db)
        insert(db, table, [{"id": i, "updated_at": naive(i // 3)} for i in range(9)])
        source = source_for(db)
        # Equal cursors split across the boundary: the tiebreaker decides.
        assert keys(first_fetch(source, Position(naive(1), {"id": 4}), 10)) == [5, 6, 7, 8]
        assert keys(source.fetch(Position(naive(1), {"id": 5}), 10)) == [6, 7, 8]
        assert keys(source.fetch(Position(naive(2), {"id": 8}), 10)) == []
        # A position between existing values works too.
        assert keys(source.fetch(Position(naive(0.5), {"id": 0}), 2)) == [3, 4]

    def test_paging_sees_every_row_once_with_many_equal_cursors(self, db: TestDatabase) -> None:
        table = orders_table(db)
        insert(db, table, [{"id": i, "updated_at": naive(i % 4)} for i in range(103)])
        seen = drain_positions(source_for(db), limit=7)
        assert sorted(r["id"] for r in seen) == list(range(103))
        assert [(r["cursor"], r["id"]) for r in seen] == sorted(
            (r["cursor"], r["id"]) for r in seen
        )

    def test_events_carry_row_key_cursor_and_ids(self, db: TestDatabase) -> None:
        table = orders_table(db)
        insert(db, table, [{"id": 1, "updated_at": naive(5), "note": "hello"}])
        source = source_for(db)
        rows = first_fetch(source, BEGINNING, 10)
        (event,) = source.to_events(rows, poller="orders", batch_id="b1")
        assert isinstance(event, RowChange)
        assert event.op == "upsert"
        assert event.pk == {"id": 1}
        assert event.before is None
        assert event.after is not None
        assert event.after["note"] == "hello"
        assert event.metadata == {"poller": "orders", "batch_id": "b1"}
        assert event.source == source.name
        again = source.to_events(source.fetch(BEGINNING, 10), poller="orders", batch_id="b2")
        assert again[0].event_id == event.event_id

    def test_where_and_parameters_filter(self, db: TestDatabase) -> None:
        table = orders_table(db)
        insert(
            db,
            table,
            [
                {"id": i, "updated_at": naive(i), "note": "keep" if i % 2 else "drop"}
                for i in range(6)
            ],
        )
        source = source_for(db, where="note = :wanted", parameters={"wanted": "keep"})
        assert keys(first_fetch(source, BEGINNING, 10)) == [1, 3, 5]
        assert keys(source.fetch(Position(naive(3), {"id": 3}), 10)) == [5]

    def test_query_mode(self, db: TestDatabase) -> None:
        table = orders_table(db)
        insert(db, table, [{"id": i, "updated_at": naive(i), "note": f"n{i}"} for i in range(5)])
        qualified = db.qualified("orders")
        source = SqlAlchemySource(
            url=db.url,
            query=f"SELECT id, updated_at, note FROM {qualified} WHERE id >= :low",
            parameters={"low": 1},
            cursor_column="updated_at",
            pk_columns=["id"],
        )
        first = first_fetch(source, BEGINNING, 2)
        assert keys(first) == [1, 2]
        events = source.to_events(first, poller="q", batch_id="b")
        assert keys(source.fetch(Position(events[-1].cursor, dict(events[-1].pk)), 10)) == [3, 4]

    def test_null_cursor_rows_are_excluded_and_reported(
        self, db: TestDatabase, caplog: pytest.LogCaptureFixture
    ) -> None:
        table = orders_table(db)
        insert(
            db,
            table,
            [
                {"id": 1, "updated_at": naive(1)},
                {"id": 2, "updated_at": None},
                {"id": 3, "updated_at": naive(2)},
                {"id": 4, "updated_at": None},
            ],
        )
        source = source_for(db)
        assert keys(first_fetch(source, BEGINNING, 10)) == [1, 3]
        assert source.null_cursor_keys() == [{"id": 2}, {"id": 4}]
        metrics = InMemoryMetrics()
        trigger = PollTrigger(
            name="orders",
            source=source,
            checkpoint_store=InMemoryCheckpointStore(),
            metrics=metrics,
        )
        delivered: list[int] = []
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            assert trigger.drain(lambda events: delivered.extend(e.pk["id"] for e in events)) == 2
        assert delivered == [1, 3]  # the poller was not stalled by the NULLs
        warnings = [r for r in caplog.records if getattr(r, "event", None) == "null_cursor_rows"]
        assert len(warnings) == 1
        assert warnings[0].keys == [{"id": 2}, {"id": 4}]  # type: ignore[attr-defined]
        assert "{'id': 2}" in warnings[0].getMessage()
        assert metrics.gauge("null_cursor_rows") == 2
        # Once the row gets a cursor value it is delivered like any other.
        with db.engine.begin() as conn:
            conn.execute(table.update().where(table.c.id == 2).values(updated_at=naive(9)))
        assert trigger.drain(lambda events: delivered.extend(e.pk["id"] for e in events)) == 1
        assert delivered == [1, 3, 2]

    def test_count_after(self, db: TestDatabase) -> None:
        table = orders_table(db)
        insert(db, table, [{"id": i, "updated_at": naive(i)} for i in range(10)])
        source = source_for(db)
        assert source.count_after(BEGINNING) == 10
        assert source.count_after(Position(naive(6), {"id": 6})) == 3


class TestConfigurationErrors:
    def test_missing_columns_name_the_column(self, db: TestDatabase) -> None:
        orders_table(db)
        source = source_for(db, cursor_column="modified_at")
        with pytest.raises(SerializationError, match=r"no column.*modified_at") as info:
            source.fetch(BEGINNING, 10)
        assert "updated_at" in str(info.value)  # lists what is available

    def test_missing_pk_column(self, db: TestDatabase) -> None:
        orders_table(db)
        with pytest.raises(SerializationError, match="order_no"):
            source_for(db, pk_columns=["order_no"]).fetch(BEGINNING, 1)

    def test_missing_table(self, db: TestDatabase) -> None:
        with pytest.raises(ConfigurationError, match="does not exist"):
            source_for(db, table="nope").fetch(BEGINNING, 1)

    def test_query_missing_cursor_column(self, db: TestDatabase) -> None:
        orders_table(db)
        source = SqlAlchemySource(
            url=db.url,
            query=f"SELECT id FROM {db.qualified('orders')}",
            cursor_column="updated_at",
            pk_columns=["id"],
        )
        with pytest.raises(SerializationError, match="updated_at"):
            source.fetch(BEGINNING, 1)

    def test_rows_missing_columns_are_serialization_errors(self) -> None:
        source = SqlAlchemySource(url="sqlite://", table="t", cursor_column="c", pk_columns=["id"])
        with pytest.raises(SerializationError, match="lacks column 'c'"):
            source.to_events([{"id": 1}], poller="p", batch_id="b")
        with pytest.raises(SerializationError, match="NULL primary key"):
            source.to_events([{"id": None, "c": 1}], poller="p", batch_id="b")
        with pytest.raises(SerializationError, match="timedelta"):
            source.to_events([{"id": 1, "c": dt.timedelta(1)}], poller="p", batch_id="b")

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"table": "orders; DROP TABLE x"},
            {"table": "orders", "schema": "public.x"},
            {"table": "orders", "cursor_column": "updated_at desc"},
            {"table": "orders", "pk_columns": ["id", "1=1"]},
            {"table": 'or"ders'},
        ],
    )
    def test_unsafe_identifiers_are_refused(self, kwargs: dict[str, Any]) -> None:
        base: dict[str, Any] = {
            "url": "sqlite://",
            "cursor_column": "updated_at",
            "pk_columns": ["id"],
        }
        with pytest.raises(UnsafeIdentifierError, match="not a safe SQL identifier"):
            SqlAlchemySource(**(base | kwargs))

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"table": "t", "query": "select 1"}, "exactly one of"),
            ({}, "exactly one of"),
            ({"table": "t", "pk_columns": "id"}, "list of column names"),
            ({"table": "t", "pk_columns": []}, "at least one"),
            ({"table": "t", "pk_columns": ["id", "id"]}, "names a column twice"),
            ({"table": "t", "url": "not a url"}, "not a valid database URL"),
        ],
    )
    def test_bad_definitions(self, kwargs: dict[str, Any], message: str) -> None:
        base: dict[str, Any] = {"url": "sqlite://", "cursor_column": "c", "pk_columns": ["id"]}
        with pytest.raises(ConfigurationError, match=message):
            SqlAlchemySource(**(base | kwargs))

    def test_a_missing_url_setting_is_reported_at_first_use(self) -> None:
        # Not at construction: in a Function App that would stop every function indexing.
        source = SqlAlchemySource(
            url="%DBTRIGGER_TEST_UNSET_SETTING%", table="t", cursor_column="c", pk_columns=["id"]
        )
        for use in (source.fingerprint, lambda: source.name, lambda: source.fetch(BEGINNING, 1)):
            with pytest.raises(ConfigurationError, match="'DBTRIGGER_TEST_UNSET_SETTING' is"):
                use()


class TestFingerprint:
    def make(self, **overrides: Any) -> SqlAlchemySource:
        kwargs: dict[str, Any] = {
            "url": "postgresql+psycopg://app:s3cr3t-pw@db.example:5432/shop?sslmode=require&password=qpw",
            "table": "orders",
            "schema": "sales",
            "cursor_column": "updated_at",
            "pk_columns": ["id"],
        }
        return SqlAlchemySource(**(kwargs | overrides))

    def test_stable_and_excludes_secrets(self) -> None:
        a, b = self.make(), self.make()
        assert a.fingerprint() == b.fingerprint()
        assert a.fingerprint().startswith("sha256:")
        for text in (a.fingerprint(), a.safe_url, str(a.describe()), a.name):
            assert "s3cr3t-pw" not in text
            assert "qpw" not in text
        assert "sslmode=require" in a.safe_url

    def test_password_change_does_not_change_fingerprint(self) -> None:
        other = self.make(
            url="postgresql+psycopg://app:rotated@db.example:5432/shop?sslmode=require"
        )
        assert other.fingerprint() == self.make().fingerprint()

    @pytest.mark.parametrize(
        "change",
        [
            {"url": "postgresql+psycopg://app:s3cr3t-pw@other-host:5432/shop"},
            {"table": "orders2"},
            {"schema": "public"},
            {"cursor_column": "created_at"},
            {"pk_columns": ["id", "region"]},
            {"where": "status = 'x'"},
            {"where": "status = :s", "parameters": {"s": "paid"}},
        ],
    )
    def test_definition_changes_change_it(self, change: dict[str, Any]) -> None:
        assert self.make(**change).fingerprint() != self.make().fingerprint()

    def test_app_setting_reference_is_resolved(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("DBTRIGGER_TEST_DB_URL", "sqlite:///tmp/x.db")
        source = SqlAlchemySource(
            url="%DBTRIGGER_TEST_DB_URL%", table="t", cursor_column="c", pk_columns=["id"]
        )
        assert source.dialect_name == "sqlite"
        assert source.safe_url == "sqlite:///tmp/x.db"


# --- cursor types, live, through the JSON checkpoint and back into the query ----------------

CursorCase = tuple[str, Callable[[], sa.types.TypeEngine[Any]], Callable[[int], Any]]

CURSOR_CASES: list[CursorCase] = [
    ("bigint", sa.BigInteger, lambda i: 2**40 + i // 3),
    (
        "timestamptz",
        lambda: precise_datetime(True),
        lambda i: BASE + dt.timedelta(seconds=i // 3, microseconds=i % 3 * 7),
    ),
    (
        "naive_timestamp",
        lambda: precise_datetime(False),
        lambda i: naive(i // 3 + (i % 3) * 0.000001),
    ),
    (
        "numeric",
        lambda: sa.Numeric(20, 6),
        lambda i: decimal.Decimal(i // 3) + decimal.Decimal("0.000001") * (i % 3),
    ),
    ("date", sa.Date, lambda i: dt.date(2020, 1, 1) + dt.timedelta(days=i // 3)),
]


def _normalise(kind: str, db: TestDatabase, value: Any) -> Any:
    """What the database gives back for what we inserted (documented per dialect)."""
    if db.kind == "sqlite" and isinstance(value, dt.datetime):
        # SQLite has no date/time type: the cursor is the exact stored text.
        return value.replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")
    if db.kind == "sqlite" and isinstance(value, dt.date):
        return value.isoformat()
    if kind == "timestamptz" and db.kind != "postgresql":
        return value.replace(tzinfo=None)  # MariaDB/SQLite have no zone-aware type
    return value


@pytest.mark.parametrize("case", CURSOR_CASES, ids=[c[0] for c in CURSOR_CASES])
def test_cursor_types_round_trip_live(db: TestDatabase, case: CursorCase, tmp_path: Any) -> None:
    kind, type_factory, value_of = case
    if kind == "numeric" and db.kind == "sqlite":
        pytest.importorskip(
            "sqlite3"
        )  # SQLite has no exact numeric; covered by the text case below
    table = make_table(
        db,
        "typed",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("c", type_factory(), nullable=False),
        index=("c", "id"),
    )
    n = 30
    insert(db, table, [{"id": i, "c": value_of(i)} for i in range(n)])
    source = SqlAlchemySource(
        url=db.url, table="typed", schema=db.schema, cursor_column="c", pk_columns=["id"]
    )
    store = FileCheckpointStore(tmp_path / "state")
    seen: list[RowChange] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # A new trigger every tick: the checkpoint is read back from the JSON file each time.
        trigger = PollTrigger(name="typed", source=source, checkpoint_store=store, batch_size=4)
        result = trigger.tick_result(seen.extend)
        if result.rows == 0 and not result.held_back:  # (MariaDB: held by another session)
            break
    assert [e.pk["id"] for e in seen] == list(range(n))
    expected = [_normalise(kind, db, value_of(i)) for i in range(n)]
    got = [e.cursor for e in seen]
    assert got == expected
    state = trigger.read_state()
    assert state is not None
    assert state.position.cursor == seen[-1].cursor
    assert type(state.position.cursor) is type(seen[-1].cursor)


def test_uuid_and_composite_keys_round_trip_live(db: TestDatabase, tmp_path: Any) -> None:
    table = make_table(
        db,
        "composite",
        sa.Column("region", sa.String(8), primary_key=True),
        sa.Column("ref", sa.Uuid, primary_key=True),
        sa.Column("updated_at", precise_datetime(False), nullable=False),
        index=("updated_at", "region", "ref"),
    )
    refs = sorted(uuid.UUID(int=(i * 7919) % 97 + 1) for i in range(24))
    rows = [
        {"region": ("eu", "us")[i % 2], "ref": refs[i], "updated_at": naive(i // 8)}
        for i in range(24)
    ]
    insert(db, table, rows)
    source = SqlAlchemySource(
        url=db.url,
        table="composite",
        schema=db.schema,
        cursor_column="updated_at",
        pk_columns=["region", "ref"],
    )
    store = FileCheckpointStore(tmp_path / "state")
    seen: list[RowChange] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        trigger = PollTrigger(name="composite", source=source, checkpoint_store=store, batch_size=5)
        result = trigger.tick_result(seen.extend)
        if result.rows == 0 and not result.held_back:  # (MariaDB: held by another session)
            break
    assert len(seen) == 24
    assert len({(e.pk["region"], str(e.pk["ref"])) for e in seen}) == 24
    state = trigger.read_state()
    assert state is not None
    last = seen[-1]
    assert state.position.pk == dict(last.pk)
    ordered = [(str(e.cursor), e.pk["region"], str(e.pk["ref"]).replace("-", "")) for e in seen]
    assert ordered == sorted(ordered)
