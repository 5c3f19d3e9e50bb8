"""db.output / DbOut, live on SQLite, PostgreSQL and MariaDB.

Includes the idempotent-sink pattern of the runtime contract (section 9.1) end
to end: poll a source table, upsert keyed by (order_id, cursor), replay, and
the sink does not change.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import threading
import time
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import (
    DbBindings,
    DbOut,
    HandlerError,
    InMemoryCheckpointStore,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.azure import binding_of
from dbtrigger.azure.output import output_binding
from dbtrigger.dbio import DbWriter
from dbtrigger.errors import (
    CommitError,
    ConfigurationError,
    OperatorError,
    OutputConstraintError,
    OutputValueError,
    RetryableError,
    StoreUnavailableError,
    UnsafeIdentifierError,
)
from dbtrigger.output import OutputTarget
from dbtrigger.state.stores.base import CheckpointStore, StoredDocument
from tests.databases import TestDatabase


def make_sink(db: TestDatabase, *, unique: bool = True) -> sa.Table:
    """processed_orders(order_id, cursor, amount) keyed by (order_id, cursor)."""
    meta = sa.MetaData(schema=db.schema)
    key = sa.PrimaryKeyConstraint("order_id", "cursor") if unique else ()
    table = sa.Table(
        "processed_orders",
        meta,
        sa.Column("order_id", sa.Integer, nullable=False),
        sa.Column("cursor", sa.String(64), nullable=False),
        sa.Column("amount", sa.Integer),
        sa.Column("note", sa.String(50)),
        *([key] if unique else []),
    )
    meta.create_all(db.engine)
    return table


def sink_rows(db: TestDatabase, table: sa.Table) -> list[tuple[Any, ...]]:
    with db.engine.connect() as conn:
        stmt = sa.select(table.c.order_id, table.c.cursor, table.c.amount, table.c.note)
        return [tuple(r) for r in conn.execute(stmt.order_by(table.c.order_id, table.c.cursor))]


_targets: list[OutputTarget] = []


@pytest.fixture(autouse=True)
def _dispose_engines() -> Iterator[None]:
    """Engines made by bindings in a test are disposed with it (no stray connections)."""
    yield
    while _targets:
        _targets.pop().close()


def output(arg_name: str, **kwargs: Any) -> Any:
    make = output_binding(arg_name, **kwargs)

    def decorator(fn: Any) -> Any:
        wrapper = make(fn)
        _targets.append(binding_of(wrapper).output)
        return wrapper

    return decorator


def bind(db: TestDatabase, **kwargs: Any) -> Any:
    return output("out", url=db.url, table="processed_orders", schema=db.schema, **kwargs)


# --- insert and upsert ---------------------------------------------------------------


def test_insert_writes_after_the_handler_returns(db: TestDatabase) -> None:
    table = make_sink(db)
    seen_during_handler: list[int] = []

    @bind(db)
    def handler(n: int, out: DbOut) -> str:
        out.set([{"order_id": i, "cursor": "c1", "amount": i * 10} for i in range(1, n + 1)])
        seen_during_handler.append(len(sink_rows(db, table)))
        return "done"

    assert handler(n=3) == "done"
    assert seen_during_handler == [0]  # nothing is written while the handler runs
    assert sink_rows(db, table) == [(i, "c1", i * 10, None) for i in (1, 2, 3)]

    @bind(db)
    def single(out: DbOut) -> None:
        out.set({"order_id": 9, "cursor": "c9", "amount": 90, "note": "one"})

    single()
    assert sink_rows(db, table)[-1] == (9, "c9", 90, "one")


def test_rows_are_written_in_one_transaction(db: TestDatabase) -> None:
    table = make_sink(db)

    @bind(db)
    def handler(out: DbOut) -> None:
        # The third row duplicates the first: the whole write must roll back.
        out.set(
            [
                {"order_id": 1, "cursor": "a", "amount": 1},
                {"order_id": 2, "cursor": "a", "amount": 2},
                {"order_id": 1, "cursor": "a", "amount": 3},
            ]
        )

    with pytest.raises(OutputConstraintError) as err:  # a key written twice: a data problem
        handler()
    assert "processed_orders" in str(err.value)
    assert err.value.fields["rows"] == 3
    assert sink_rows(db, table) == []


def test_upsert_updates_on_the_key_and_never_duplicates(db: TestDatabase) -> None:
    table = make_sink(db)

    @bind(db, action="upsert", conflict_columns=["order_id", "cursor"])
    def handler(rows: list[dict[str, Any]], out: DbOut) -> None:
        out.set(rows)

    handler(rows=[{"order_id": 1, "cursor": "a", "amount": 10, "note": "x"}])
    handler(
        rows=[
            {"order_id": 1, "cursor": "a", "amount": 11, "note": "y"},
            {"order_id": 2, "cursor": "a", "amount": 20, "note": "z"},
        ]
    )
    assert sink_rows(db, table) == [(1, "a", 11, "y"), (2, "a", 20, "z")]
    # Only some columns given: the others keep their values.
    handler(rows=[{"order_id": 2, "cursor": "a", "amount": 21}])
    assert sink_rows(db, table) == [(1, "a", 11, "y"), (2, "a", 21, "z")]


def test_upsert_of_key_columns_only_ignores_duplicates(db: TestDatabase) -> None:
    table = make_sink(db)

    @bind(db, action="upsert", conflict_columns=["cursor", "order_id"])
    def handler(out: DbOut) -> None:
        out.set([{"order_id": 1, "cursor": "a"}, {"order_id": 2, "cursor": "a"}])

    handler()
    handler()
    assert sink_rows(db, table) == [(1, "a", None, None), (2, "a", None, None)]


def test_upsert_needs_a_matching_key(db: TestDatabase) -> None:
    make_sink(db)

    @bind(db, action="upsert", conflict_columns=["order_id"])
    def handler(out: DbOut) -> None:
        out.set({"order_id": 1, "cursor": "a"})

    with pytest.raises(ConfigurationError, match=r"no primary key or unique constraint"):
        handler()


def test_upsert_on_a_unique_index(db: TestDatabase) -> None:
    table = make_sink(db, unique=False)
    with db.engine.begin() as conn:
        sa.Index("ux_processed", table.c.order_id, table.c.cursor, unique=True).create(conn)

    @bind(db, action="upsert", conflict_columns=["order_id", "cursor"])
    def handler(amount: int, out: DbOut) -> None:
        out.set({"order_id": 1, "cursor": "a", "amount": amount})

    handler(amount=1)
    handler(amount=2)
    assert sink_rows(db, table) == [(1, "a", 2, None)]


def test_a_row_colliding_on_another_unique_key_is_refused_not_merged(db: TestDatabase) -> None:
    """An upsert on ``order_id`` whose row hits an existing row on another unique column
    fails on every database. MariaDB's ON DUPLICATE KEY UPDATE fires on any unique key:
    it used to overwrite the *other* row (order 1 took order 2's amount) and write no
    order 2, with no error. The writer's upsert builds the same statement."""
    table = make_sink(db, unique=False)
    with db.engine.begin() as conn:
        sa.Index("ux_order", table.c.order_id, unique=True).create(conn)
        sa.Index("ux_cursor", table.c.cursor, unique=True).create(conn)
        conn.execute(sa.insert(table), [{"order_id": 1, "cursor": "a", "amount": 10}])

    @bind(db, action="upsert", conflict_columns=["order_id"])
    def handler(rows: list[dict[str, Any]], out: DbOut) -> None:
        out.set(rows)

    handler(rows=[{"order_id": 1, "cursor": "a", "amount": 11}])  # the key itself: updated
    assert sink_rows(db, table) == [(1, "a", 11, None)]
    collide = [
        {"order_id": 3, "cursor": "c", "amount": 30},
        {"order_id": 2, "cursor": "a", "amount": 20},
    ]
    # A data problem, not an outage: not retryable (it used to be an OutputWriteError).
    with pytest.raises(OutputConstraintError, match=r"unique key") as err:
        handler(rows=collide)
    assert "not the upsert's conflict key (order_id)" in str(err.value), err.value
    assert "cannot help" in str(err.value), err.value
    writer = DbWriter(url=db.url, table="processed_orders", schema=db.schema)
    try:
        with pytest.raises(OutputConstraintError, match=r"unique key"):
            writer.upsert_many(rows=collide, conflict_columns=["order_id"])
    finally:
        writer.close()
    assert sink_rows(db, table) == [(1, "a", 11, None)]  # nothing merged, nothing half-written


# --- no-ops, errors, validation ----------------------------------------------------


def test_empty_set_touches_no_database() -> None:
    # An unreachable server: any connection attempt would fail the call.
    @output("out", url="postgresql+psycopg://nobody@127.0.0.1:1/none", table="t")
    def handler(rows: list[dict[str, Any]] | None, out: DbOut) -> int:
        out.set(rows)
        return len(out.get())

    assert handler(rows=[]) == 0
    assert handler(rows=None) == 0

    @output("out", url="postgresql+psycopg://nobody@127.0.0.1:1/none", table="t")
    def untouched(out: DbOut) -> str:
        return "never set"

    assert untouched() == "never set"


def test_handler_failure_discards_the_rows(db: TestDatabase) -> None:
    table = make_sink(db)

    @bind(db)
    def handler(out: DbOut) -> None:
        out.set({"order_id": 1, "cursor": "a"})
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        handler()
    assert sink_rows(db, table) == []


def test_set_replaces_and_validates(sqlite_db: TestDatabase) -> None:
    target = OutputTarget(url=sqlite_db.url, table="processed_orders")
    out = DbOut(target)
    out.set([{"order_id": 1}, {"order_id": 2}])
    out.set({"order_id": 3})
    assert out.get() == [{"order_id": 3}]
    with pytest.raises(TypeError, match="item 1"):
        out.set([{"order_id": 1}, 5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="str"):
        out.set("order_id=1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same columns"):
        out.set([{"order_id": 1}, {"order_id": 2, "cursor": "x"}])
    with pytest.raises(UnsafeIdentifierError):
        out.set({"order_id; drop table x": 1})
    assert out.get() == [{"order_id": 3}]  # a refused set() leaves the previous rows


def test_unknown_table_or_column_is_a_configuration_error(db: TestDatabase) -> None:
    make_sink(db)

    @output("out", url=db.url, table="no_such_table", schema=db.schema)
    def missing(out: DbOut) -> None:
        out.set({"a": 1})

    with pytest.raises(ConfigurationError, match="does not exist"):
        missing()

    @bind(db)
    def bad_column(out: DbOut) -> None:
        out.set({"order_id": 1, "cursor": "a", "colour": "red"})

    with pytest.raises(ConfigurationError, match="colour"):
        bad_column()


class Opaque:
    """An object no driver knows how to send."""

    def __str__(self) -> str:
        return "<Opaque marker-7731>"


@pytest.mark.parametrize(
    ("column", "value", "kind"),
    [
        ("note", {"k": "v"}, "dict"),
        ("note", ["a", "b"], "list"),
        ("amount", {"n": 1}, "dict"),
        ("amount", {1, 2}, "set"),
    ],
)
def test_a_value_its_column_cannot_store_is_named_and_not_retried(
    db: TestDatabase, column: str, value: object, kind: str
) -> None:
    """A dict in a text column failed as a retryable OutputWriteError - on MariaDB
    an SQL syntax error - naming neither the column nor the value: a batch that
    failed the same way on every delivery."""
    check_unwritable(db, column, value, kind)


@pytest.mark.parametrize("column", ["amount", "note"])
def test_an_object_the_driver_cannot_send_is_named(
    sqlite_db: TestDatabase, pg: TestDatabase, column: str
) -> None:
    """sqlite3 and psycopg refuse an object they cannot adapt, quoting its type.
    (PyMySQL sends any object as its str(): MariaDB takes it, or not, as text.)"""
    for db in (sqlite_db, pg):
        check_unwritable(db, column, Opaque(), "Opaque")


def test_an_object_in_a_number_column_is_refused_on_every_database(db: TestDatabase) -> None:
    """PyMySQL sent the object as its str(), and MariaDB outside strict mode stored it
    as 0 with a warning: the sink held a wrong amount and nothing said so."""
    check_unwritable(db, "amount", Opaque(), "Opaque")


def check_unwritable(db: TestDatabase, column: str, value: object, kind: str) -> None:
    table = make_sink(db)
    rows: list[dict[str, Any]] = [
        {"order_id": 1, "cursor": "a", "amount": 1, "note": "fine"},
        {"order_id": 2, "cursor": "a", "amount": 2, "note": "fine"},
    ]
    rows[1][column] = value

    @bind(db)
    def handler(out: DbOut) -> None:
        out.set(rows)

    with pytest.raises(OutputValueError) as err:
        handler()
    assert isinstance(err.value, OperatorError)  # a person must act: not retryable
    assert not isinstance(err.value, RetryableError)
    message = str(err.value)
    assert "cannot write row 1 to" in message
    assert "processed_orders" in message
    assert f"column {column!r}" in message
    assert f"cannot store a {kind} value" in message
    assert "marker-7731" not in message  # never the value
    assert "'k'" not in message
    assert err.value.fields["column"] == column
    assert err.value.fields["value_type"] == kind
    assert sink_rows(db, table) == []  # nothing of the batch was written

    writer = DbWriter(url=db.url, table="processed_orders", schema=db.schema)
    try:
        with pytest.raises(OutputValueError, match=f"column {column!r}"):
            writer.insert_many(rows=rows)
        with pytest.raises(OutputValueError, match=f"column {column!r}"):
            writer.update(data={column: value}, pk={"order_id": 1, "cursor": "a"})
    finally:
        writer.close()
    assert sink_rows(db, table) == []


def test_a_json_column_takes_a_dict(pg: TestDatabase) -> None:
    meta = sa.MetaData(schema=pg.schema)
    table = sa.Table(
        "docs",
        meta,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("body", sa.JSON),
        sa.Column("tags", sa.ARRAY(sa.Text)),
    )
    meta.create_all(pg.engine)

    @output("out", url=pg.url, table="docs", schema=pg.schema)
    def handler(out: DbOut) -> None:
        out.set({"id": 1, "body": {"k": ["v"]}, "tags": ["a", "b"]})

    handler()
    with pg.engine.connect() as conn:
        assert conn.execute(sa.select(table.c.body, table.c.tags)).one() == (
            {"k": ["v"]},
            ["a", "b"],
        )


def test_configuration_is_checked_at_decoration(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "sqlite://"
    with pytest.raises(UnsafeIdentifierError):
        output_binding("out", url=url, table="orders; drop table x")
    with pytest.raises(UnsafeIdentifierError):
        output_binding("out", url=url, table="t", action="upsert", conflict_columns=["a b"])
    with pytest.raises(ConfigurationError, match="conflict_columns"):
        output_binding("out", url=url, table="t", action="upsert")
    with pytest.raises(ConfigurationError, match="list"):
        output_binding("out", url=url, table="t", action="upsert", conflict_columns="id")
    with pytest.raises(ConfigurationError, match="only apply"):
        output_binding("out", url=url, table="t", conflict_columns=["id"])
    with pytest.raises(ConfigurationError, match="insert' or 'upsert"):
        output_binding("out", url=url, table="t", action="merge")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not available on mssql"):
        output_binding(
            "out", url="mssql+pyodbc://h/db", table="t", action="upsert", conflict_columns=["id"]
        )
    monkeypatch.delenv("DBT_MISSING_URL", raising=False)
    # A missing app setting is reported at first use, not at decoration (one
    # missing setting must not stop a whole Function App from indexing).
    deferred = output_binding("out", url="%DBT_MISSING_URL%", table="t")(lambda out: None)
    with pytest.raises(ConfigurationError, match="DBT_MISSING_URL"):
        assert binding_of(deferred).output.dialect
    with pytest.raises(ConfigurationError, match="has no parameter 'out'"):
        output_binding("out", url=url, table="t")(lambda rows: None)


def test_url_setting_is_resolved_and_password_never_shown(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = make_sink(pg)
    url = sa.make_url(pg.url).set(password="s3cret-pw")  # noqa: S106 - a marker, not a secret
    monkeypatch.setenv("DBT_SINK_URL", url.render_as_string(hide_password=False))
    target = OutputTarget(url="%DBT_SINK_URL%", table="processed_orders", schema=pg.schema)
    _targets.append(target)
    assert "s3cret-pw" not in repr(target.describe())
    out = DbOut(target)
    out.set({"order_id": 1, "cursor": "a"})
    assert out.flush() == 1  # trust auth ignores the password
    assert sink_rows(pg, table) == [(1, "a", None, None)]


def test_signature_hides_the_output_parameter(sqlite_db: TestDatabase) -> None:
    @output("out", url=sqlite_db.url, table="t")
    def handler(timer: int, events: list[RowChange], out: DbOut) -> None:
        return None

    assert list(inspect.signature(handler).parameters) == ["timer", "events"]
    assert set(typing.get_type_hints(handler)) == {"timer", "events", "return"}
    assert handler.__name__ == "handler"


def test_async_handler(db: TestDatabase) -> None:
    table = make_sink(db)

    @bind(db, action="upsert", conflict_columns=["order_id", "cursor"])
    async def handler(n: int, out: DbOut) -> int:
        await asyncio.sleep(0)
        out.set([{"order_id": i, "cursor": "a", "amount": n} for i in range(n)])
        return n

    assert asyncio.run(handler(n=2)) == 2
    assert asyncio.run(handler(n=3)) == 3
    assert sink_rows(db, table) == [(0, "a", 3, None), (1, "a", 3, None), (2, "a", 3, None)]


# --- the idempotent sink, end to end (contract section 9.1) ---------------------------


class FailingCommits:
    """A store whose writes after the first fail while armed (a W1 window)."""

    def __init__(self, inner: CheckpointStore) -> None:
        self.inner = inner
        self.armed = False
        self._writes = 0

    def read(self, key: str) -> StoredDocument | None:
        return self.inner.read(key)

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        self._writes += 1
        if self.armed and self._writes > 1:
            raise StoreUnavailableError("injected: storage went away after the handler ran")
        return self.inner.write(key, data, if_match=if_match)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        self.inner.delete(key, if_match=if_match)

    def list_keys(self) -> list[str]:
        return self.inner.list_keys()

    def describe(self) -> str:
        return "failing-commits"


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime(2026, 4, 7, 1, 0, tzinfo=dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture
def orders(db: TestDatabase) -> sa.Table:
    meta = sa.MetaData(schema=db.schema)
    table = sa.Table(
        "orders",
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("amount", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    meta.create_all(db.engine)
    base = dt.datetime(2026, 1, 1, 12, 0, 0)
    with db.engine.begin() as conn:
        conn.execute(
            table.insert(),
            [
                {"id": i, "amount": i * 100, "updated_at": base + dt.timedelta(seconds=i)}
                for i in range(1, 8)
            ],
        )
    return table


def test_replays_are_no_ops_at_an_upsert_sink(
    db: TestDatabase, orders: sa.Table, request: pytest.FixtureRequest
) -> None:
    sink = make_sink(db)
    store = FailingCommits(InMemoryCheckpointStore())
    clock = Clock()
    db_bindings = DbBindings()
    deliveries: list[list[int]] = []
    source = SqlAlchemySource(
        url=db.url,
        table="orders",
        schema=db.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        # Every write here commits before the poll. On PostgreSQL the "auto"
        # guard would also wait out unrelated transactions on the shared server
        # (other test runs) and make a tick idle at random; that is not under test.
        visibility="none",
    )
    request.addfinalizer(source.close)

    @db_bindings.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=store,
        name="orders",
        batch_size=5,
        max_batches_per_tick=10,
        lease_ttl_seconds=60,
        clock=clock,
    )
    @db_bindings.output(
        "out",
        url=db.url,
        table="processed_orders",
        schema=db.schema,
        action="upsert",
        conflict_columns=["order_id", "cursor"],
    )
    def orders_poll(timer: object, events: list[RowChange], out: DbOut) -> None:
        deliveries.append([e.pk["id"] for e in events])
        out.set(
            [
                {"order_id": e.pk["id"], "cursor": str(e.cursor), "amount": e.after["amount"]}
                for e in events
            ]
        )

    _targets.append(binding_of(orders_poll).output)

    # W1: the handler ran and the sink was written, then the commit failed.
    store.armed = True
    with pytest.raises(CommitError):
        orders_poll(timer=None)
    assert deliveries == [[1, 2, 3, 4, 5]]
    first = sink_rows(db, sink)
    assert [r[0] for r in first] == [1, 2, 3, 4, 5]

    # The lease expires; the next firing redelivers the same batch. The sink absorbs it.
    store.armed = False
    clock.now += dt.timedelta(seconds=61)
    orders_poll(timer=None)
    assert deliveries == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [6, 7]]
    after_replay = sink_rows(db, sink)
    assert len(after_replay) == 7
    assert after_replay[:5] == first

    # A full replay from the beginning (a reset) changes nothing either.
    store.delete("orders")
    orders_poll(timer=None)
    assert deliveries[-2:] == [[1, 2, 3, 4, 5], [6, 7]]
    assert sink_rows(db, sink) == after_replay

    # A real change is a new source state: a new (order_id, cursor) row.
    with db.engine.begin() as conn:
        conn.execute(
            orders.update()
            .where(orders.c.id == 3)
            .values(amount=333, updated_at=dt.datetime(2026, 1, 2))
        )
    orders_poll(timer=None)
    final = sink_rows(db, sink)
    assert len(final) == 8
    assert [r[2] for r in final if r[0] == 3] == [300, 333]


def test_under_a_trigger_an_unwritable_value_fails_the_batch_naming_it(
    sqlite_db: TestDatabase, request: pytest.FixtureRequest
) -> None:
    """The batch is not committed (the contract's poison batch, section 5.9: it
    comes again until the handler or the data is fixed), and what every
    delivery's failure says is the column and the type, not a database hiccup."""
    make_sink(sqlite_db)
    sqlite_db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    sqlite_db.execute("INSERT INTO orders VALUES (1, 1), (2, 2)")
    source = SqlAlchemySource(
        url=sqlite_db.url, table="orders", cursor_column="seq", pk_columns=["id"]
    )
    request.addfinalizer(source.close)
    store = InMemoryCheckpointStore()
    db_bindings = DbBindings()

    @db_bindings.trigger(arg_name="events", source=source, checkpoint_store=store, name="orders")
    @output("out", url=sqlite_db.url, table="processed_orders")
    def orders_poll(timer: object, events: list[RowChange], out: DbOut) -> None:
        out.set([{"order_id": e.pk["id"], "cursor": "c", "note": {"raw": e.after}} for e in events])

    with pytest.raises(HandlerError) as err:
        orders_poll(timer=None)
    assert isinstance(err.value.__cause__, OutputValueError)
    assert "column 'note'" in str(err.value)
    assert "cannot store a dict value" in str(err.value)
    assert db_bindings.triggers["orders"].read_state().position.cursor is None  # not committed


def test_an_upsert_row_with_a_null_conflict_column_is_refused(db: TestDatabase) -> None:
    """NULLs are never equal in a unique key: a row whose conflict column is None can
    never be matched, so every redelivery inserted the row once more (3 writes, 3 rows,
    on every database), silently defeating the idempotent sink. Refused by name."""
    meta = sa.MetaData(schema=db.schema)
    table = sa.Table(
        "processed_orders",
        meta,
        sa.Column("order_id", sa.Integer, nullable=False),
        sa.Column("cursor", sa.String(64), nullable=True),
        sa.Column("amount", sa.Integer),
        sa.UniqueConstraint("order_id", "cursor"),
    )
    meta.create_all(db.engine)

    @bind(db, action="upsert", conflict_columns=["order_id", "cursor"])
    def handler(rows: list[dict[str, Any]], out: DbOut) -> None:
        out.set(rows)

    rows = [
        {"order_id": 1, "cursor": "a", "amount": 1},
        {"order_id": 2, "cursor": None, "amount": 2},
    ]
    for _ in range(3):
        with pytest.raises(OutputValueError, match=r"row 1 .*'cursor'.*never match") as err:
            handler(rows=rows)
    assert err.value.fields["column"] == "cursor"
    writer = DbWriter(url=db.url, table="processed_orders", schema=db.schema)
    try:
        with pytest.raises(OutputValueError, match=r"row 1 .*'cursor'"):
            writer.upsert_many(rows=rows, conflict_columns=["order_id", "cursor"])
    finally:
        writer.close()
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() == 0


def test_an_upsert_row_that_leaves_out_a_conflict_column_is_refused(db: TestDatabase) -> None:
    """A row without a conflict column at all (`out.set([{"amount": 1}])` keyed on `id`)
    was sent: the database filled the key in (NULL, or a new autoincrement value), so
    every redelivery inserted the row once more (3 writes, 3 rows), as a None did before
    it was refused. Refused the same way, by name, on db.output and DbWriter."""
    meta = sa.MetaData(schema=db.schema)
    table = sa.Table(
        "processed_orders",
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("amount", sa.Integer),
    )
    meta.create_all(db.engine)

    @bind(db, action="upsert", conflict_columns=["id"])
    def handler(rows: list[dict[str, Any]], out: DbOut) -> None:
        out.set(rows)

    rows = [{"amount": 1}]
    for _ in range(3):
        with pytest.raises(OutputValueError, match=r"row 0 .*has no conflict column 'id'") as err:
            handler(rows=rows)
    assert err.value.fields["column"] == "id"
    writer = DbWriter(url=db.url, table="processed_orders", schema=db.schema)
    try:
        with pytest.raises(OutputValueError, match=r"row 0 .*'id'"):
            writer.upsert_many(rows=rows, conflict_columns=["id"])
    finally:
        writer.close()
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() == 0


@pytest.mark.parametrize("binding", ["db.output", "DbWriter"])
def test_a_write_chosen_as_deadlock_victim_is_written_again(
    server_db: TestDatabase, binding: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A deadlock victim's transaction is rolled back whole by the database, so the
    write can simply run again: it used to fail the batch (OutputWriteError), so that
    the handler ran again a tick later. The deadlock is real: another transaction holds
    row 2, the upsert takes row 1 and waits for row 2, the other asks for row 1."""
    db = server_db
    sink = db.qualified("dl_sink")
    db.execute(f"CREATE TABLE {sink} (id INTEGER PRIMARY KEY, v INTEGER)")
    db.execute(f"CREATE TABLE {db.qualified('dl_filler')} (id INTEGER PRIMARY KEY)")
    db.execute(f"INSERT INTO {sink} VALUES (1, 0), (2, 0)")
    target = OutputTarget(
        url=db.url, table="dl_sink", schema=db.schema, action="upsert", conflict_columns=["id"]
    )
    _targets.append(target)
    writer = DbWriter(url=db.url, table="dl_sink", schema=db.schema)
    outcome: list[Any] = []
    other = db.engine.connect()
    try:
        tx = other.begin()
        if db.kind == "postgresql":  # the upsert's own check finds the deadlock first
            other.exec_driver_sql("SET LOCAL deadlock_timeout = '60s'")
        else:  # InnoDB rolls back the smaller transaction: make this one the larger
            # (and see below how the test knows the upsert holds row 1)
            db.execute(
                f"CREATE TRIGGER {db.qualified('dl_mark')} BEFORE UPDATE ON {sink} FOR EACH "
                f"ROW BEGIN IF NEW.id = 1 THEN DO GET_LOCK('{db.schema}.dl', 0); END IF; END"
            )
            filler = ", ".join(f"({i})" for i in range(50))
            other.exec_driver_sql(f"INSERT INTO {db.qualified('dl_filler')} VALUES {filler}")
        other.exec_driver_sql(f"UPDATE {sink} SET v = 20 WHERE id = 2")

        def write() -> None:
            try:
                rows = [{"id": 1, "v": 1}, {"id": 2, "v": 2}]
                if binding == "db.output":
                    outcome.append(target.write(rows))
                else:
                    writer.upsert_many(rows=rows, conflict_columns=["id"])
                    outcome.append(2)
            except Exception as exc:
                outcome.append(exc)

        with caplog.at_level("INFO", logger="dbtrigger"):
            thread = threading.Thread(target=write)
            thread.start()
            wait_for_a_lock_wait(db, "dl_sink", thread)
            other.exec_driver_sql(f"UPDATE {sink} SET v = 10 WHERE id = 1")  # the deadlock
            tx.commit()
            thread.join(60)
    finally:
        other.close()
        writer.close()
    assert outcome == [2], outcome
    # Once, as a rule. The other transaction's row-1 update and the write's next try
    # both wake when the victim rolls back; on a loaded machine the try can take row 1
    # first and deadlock once more, which is the same case again (seen at load 13).
    events = [r.__dict__.get("event") for r in caplog.records]
    assert set(events) == {"output_write_retried"}, events
    with db.engine.connect() as conn:
        rows = conn.exec_driver_sql(f"SELECT id, v FROM {sink} ORDER BY id").fetchall()
    assert [tuple(r) for r in rows] == [(1, 1), (2, 2)]


def wait_for_a_lock_wait(db: TestDatabase, table: str, thread: threading.Thread) -> None:
    """Until the upsert holds row 1 of ``table`` (bounded): on PostgreSQL, until it
    waits for a row lock; on MariaDB, until its update of row 1 took the user lock
    (INNODB_TRX can stay stale for seconds on a server other sessions read it on)."""
    if db.kind == "postgresql":
        probe, params = (
            # this worker's database only: the other binding's case, on another
            # worker at the same moment, waits on a dl_sink of its own
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND strpos(query, :table) > 0",
            {"table": table},
        )
    else:
        probe, params = "SELECT IS_USED_LOCK(:name) IS NOT NULL", {"name": f"{db.schema}.dl"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and thread.is_alive():
        with db.engine.connect() as conn:
            if conn.execute(sa.text(probe), params).scalar():
                return
        time.sleep(0.05)
    raise AssertionError("the upsert never took row 1 and waited for row 2")


def test_a_writer_upsert_on_columns_that_are_no_key_is_refused(db: TestDatabase) -> None:
    """DbWriter.upsert_many did not check its conflict columns, as db.output does: on
    MariaDB an upsert on a column that is no key never matched and inserted the row
    again on every call (an AUTO_INCREMENT key takes each), and elsewhere it failed as
    a retryable write error. Now the ConfigurationError db.output gives."""
    ident = "INTEGER PRIMARY KEY" + (" AUTO_INCREMENT" if db.kind == "mariadb" else "")
    if db.kind == "postgresql":
        ident = "SERIAL PRIMARY KEY"
    db.execute(f"CREATE TABLE {db.qualified('refs')} (id {ident}, ref VARCHAR(20), n INTEGER)")
    writer = DbWriter(url=db.url, table="refs", schema=db.schema)
    try:
        for _ in range(2):
            with pytest.raises(ConfigurationError, match=r"no primary key or unique constraint"):
                writer.upsert_many(rows=[{"ref": "a", "n": 1}], conflict_columns=["ref"])
    finally:
        writer.close()
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {db.qualified('refs')}").scalar() == 0
