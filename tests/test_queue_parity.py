"""The claim queue behaves as the poller does where they share a concept (issue #20 item 15).

One rule for when a handler receives the context, ``%SETTING%`` options on
the Functions decorator, ``engine=`` on the source, the contexts' marking
methods; and the claim columns' types checked when the queue starts.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import re
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import (
    ClaimContext,
    ClaimSource,
    DbBindings,
    DbTriggerError,
    FileCheckpointStore,
    QueueTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.azure import binding_of, entra_id_engine
from dbtrigger.errors import ConfigurationError
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.kernel import wants_context
from dbtrigger.state.window import Window
from tests.databases import TestDatabase
from tests.reliability_support import (
    add_items,
    checkpoint_id,
    items_source,
    items_table,
    make_trigger,
    read_doc,
)
from tests.test_event_outcomes import T0, Clock
from tests.test_queue_columns import make_jobs, rows


def claim_source(db: TestDatabase) -> ClaimSource:
    return ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])


# --- one rule for the context slot --------------------------------------------------


def test_a_defaulted_second_parameter_is_the_handlers_own_option(
    sqlite_db: TestDatabase,
) -> None:
    """``def h(events, retries=3)`` is called with the events alone, as a poller calls it."""
    make_jobs(sqlite_db, 4)
    source = claim_source(sqlite_db)
    seen: list[Any] = []

    def handle(events: list[RowChange], retries: int = 3) -> None:
        seen.append(retries)

    async def handle_async(events: list[RowChange], retries: int = 3) -> None:
        seen.append(retries)

    def named(events: list[RowChange], ctx: ClaimContext | None = None) -> None:
        seen.append(type(ctx).__name__)

    def annotated(events: list[RowChange], claim: ClaimContext | None = None) -> None:
        seen.append(type(claim).__name__)

    try:
        q = QueueTrigger(name="jobs", source=source, batch_size=1)
        assert q.tick(handle) == 1
        assert asyncio.run(q.tick_async(handle_async)) == 1
        assert q.tick(named) == 1
        assert q.tick(annotated) == 1
        assert seen == [3, 3, "ClaimContext", "ClaimContext"]
    finally:
        source.close()
    # One function decides, for every kind of handler.
    assert [wants_context(f) for f in (handle, handle_async, named, annotated)] == [
        False,
        False,
        True,
        True,
    ]


# --- %SETTING% options on @db.queue_trigger -----------------------------------------


def test_queue_trigger_numbers_may_be_app_settings(
    sqlite_db: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on ``@db.trigger``: a missing setting fails the invocation (naming it), not
    the import; once set, the numbers are read at the first use."""
    monkeypatch.delenv("QUEUE_BATCH", raising=False)
    monkeypatch.setenv("QUEUE_TICKS", "2")
    monkeypatch.setenv("QUEUE_VT", "30")
    make_jobs(sqlite_db, 10)
    db = DbBindings()
    source = claim_source(sqlite_db)
    seen: list[int] = []
    try:

        @db.queue_trigger(
            arg_name="events",
            source=source,
            batch_size="%QUEUE_BATCH%",
            max_batches_per_tick="%QUEUE_TICKS%",
            visibility_timeout_seconds="%QUEUE_VT%",
        )
        def send(timer: object, events: list[RowChange]) -> None:
            seen.extend(e.pk["id"] for e in events)

        assert "send" not in db.queues  # not built yet: a setting is missing
        with pytest.raises(ConfigurationError, match="batch_size: app setting 'QUEUE_BATCH'"):
            send(None)
        monkeypatch.setenv("QUEUE_BATCH", "not a number")
        with pytest.raises(ConfigurationError, match="batch_size='%QUEUE_BATCH%' is 'not a"):
            send(None)
        monkeypatch.setenv("QUEUE_BATCH", "3")
        send(None)
        assert len(seen) == 6  # two batches of three
        queue = db.queues["send"]
        assert (queue.batch_size, queue.visibility_timeout) == (3, 30.0)
        assert binding_of(send).queue_trigger is queue
    finally:
        source.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"batch_size": "many"}, "batch_size must be a whole number or a '%SETTING%'"),
        ({"batch_size": True}, "batch_size must be a whole number"),
        ({"batch_size": 2.5}, "batch_size must be a whole number"),
        ({"max_batches_per_tick": [1]}, "max_batches_per_tick must be a whole number"),
        ({"visibility_timeout_seconds": float("nan")}, "visibility_timeout_seconds must be a"),
        ({"max_batches_per_tick": 0}, "max_batches_per_tick must be >= 1"),
    ],
)
def test_queue_trigger_refuses_bad_numbers_naming_the_option(
    sqlite_db: TestDatabase, options: dict[str, Any], match: str
) -> None:
    source = claim_source(sqlite_db)
    try:
        with pytest.raises(ConfigurationError, match=re.escape(match)):
            DbBindings().queue_trigger(
                arg_name="events", source=source, **{"max_batches_per_tick": 1, **options}
            )
    finally:
        source.close()


def test_both_decorators_read_numbers_by_one_rule(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    make_jobs(sqlite_db, 1)
    claims = claim_source(sqlite_db)
    keyset = SqlAlchemySource(
        url=sqlite_db.url, table="jobs", cursor_column="id", pk_columns=["id"]
    )
    db = DbBindings()
    try:
        for decorate in (
            lambda: db.queue_trigger(
                arg_name="events", source=claims, batch_size=True, max_batches_per_tick=1
            ),
            lambda: db.trigger(
                arg_name="events",
                source=keyset,
                checkpoint_store=FileCheckpointStore(tmp_path),
                batch_size=True,
            ),
        ):
            with pytest.raises(ConfigurationError, match="batch_size must be a whole number"):
                decorate()(lambda timer, events: None)
    finally:
        claims.close()


# --- engine= on the claim source ----------------------------------------------------


def test_claim_source_shares_an_engine_without_changing_it(db: TestDatabase) -> None:
    make_jobs(db, 5)
    engine = sa.create_engine(db.url)
    pool = engine.pool
    source = ClaimSource(engine=engine, table="jobs", schema=db.schema, pk_columns=["id"])
    try:
        assert source.name.endswith("jobs")
        seen: list[int] = []
        q = QueueTrigger(name="jobs", source=source, batch_size=2)
        assert q.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 5
        assert sorted(seen) == [1, 2, 3, 4, 5]
        assert {r["dbt_status"] for r in rows(db).values()} == {"done"}
        source.close()
        assert engine.pool is pool  # close() leaves a shared engine's pool alone
        # The engine's other users see no change: no autocommit, no write lock up front.
        with engine.connect() as conn:
            assert conn.get_isolation_level() != "AUTOCOMMIT"
            if db.kind == "sqlite":
                with conn.begin():
                    conn.execute(sa.text("SELECT count(*) FROM jobs"))
                    other = sqlite3.connect(engine.url.database or "", timeout=0.1)
                    other.execute("UPDATE jobs SET payload = 'free' WHERE id = 1")
                    other.commit()
                    other.close()
    finally:
        source.close()
        engine.dispose()


class FakeCredential:
    """What ``azure.identity`` credentials offer: ``get_token(scope).token``."""

    def __init__(self) -> None:
        self.scopes: list[str] = []

    def get_token(self, scope: str) -> Any:
        self.scopes.append(scope)
        return type("AccessToken", (), {"token": "entra-token"})()


def test_passwordless_claim_source_with_an_entra_id_engine(pg: TestDatabase) -> None:
    """The recipe of docs/azure.md, for a queue: the engine logs in with a token."""
    make_jobs(pg, 3)
    credential = FakeCredential()
    url = sa.make_url(pg.url).set(password=None).render_as_string(hide_password=False)
    engine = entra_id_engine(url, credential=credential)
    source = ClaimSource(engine=engine, table="jobs", schema=pg.schema, pk_columns=["id"])
    try:
        assert QueueTrigger(name="jobs", source=source).drain(lambda events: None) == 3
        assert credential.scopes, "the connection was not made with a token"
        assert "entra-token" not in str(source.describe())
    finally:
        source.close()
        engine.dispose()


def test_claim_source_needs_a_url_or_an_engine(sqlite_db: TestDatabase) -> None:
    with pytest.raises(ConfigurationError, match="needs url= or engine="):
        ClaimSource(table="jobs", pk_columns=["id"])
    engine = sa.create_engine(sqlite_db.url)
    with pytest.raises(ConfigurationError, match="with engine= configure that engine"):
        ClaimSource(engine=engine, table="jobs", pk_columns=["id"], engine_kwargs={"echo": True})
    engine.dispose()


# --- claim column types, checked at start ------------------------------------------

#: Per database: a claim column declared with a type the claim cannot use.
WRONG_TYPES = {
    "sqlite": [
        ("dbt_visible_at", "TIMESTAMP NOT NULL DEFAULT '2000-01-01 00:00:00.000'"),
        ("dbt_done_at", "DATETIME"),
    ],
    "postgresql": [
        ("dbt_visible_at", "timestamp without time zone NOT NULL DEFAULT now()"),
        ("dbt_last_error", "varchar(100)"),
    ],
    "mariadb": [
        ("dbt_visible_at", "TIMESTAMP(6) NOT NULL DEFAULT '2000-01-01'"),
        ("dbt_claim_token", "int"),
    ],
}
EXPECTED = {
    "sqlite": "VARCHAR(23)",
    "postgresql": "TIMESTAMP WITH TIME ZONE",
    "mariadb": "DATETIME(6)",
}


def test_claim_columns_of_the_wrong_type_are_refused_at_start(db: TestDatabase) -> None:
    """On SQLite a TIMESTAMP/DATETIME claim column made every settlement fail; on the
    other databases a wrong type fails rarely or is quietly wrong. Each is refused
    when the queue starts, naming the column, its declared type and the expected one."""
    columns = {
        "dbt_status": "varchar(8) NOT NULL DEFAULT 'ready'",
        "dbt_attempts": "integer NOT NULL DEFAULT 0",
        "dbt_visible_at": {
            "sqlite": "varchar(23) NOT NULL DEFAULT '2000-01-01 00:00:00.000'",
            "postgresql": "timestamptz NOT NULL DEFAULT now()",
            "mariadb": "datetime(6) NOT NULL DEFAULT '2000-01-01'",
        }[db.kind],
        "dbt_claim_token": "varchar(36)",
        "dbt_claimed_by": "varchar(200)",
        "dbt_last_error": "varchar(2000)",
        "dbt_done_at": {"postgresql": "timestamptz", "mariadb": "datetime(6)"}.get(
            db.kind, "varchar(23)"
        ),
    }
    for name, declared in WRONG_TYPES[db.kind]:
        columns[name] = declared
    listed = ", ".join(f"{name} {declared}" for name, declared in columns.items())
    db.execute(f"CREATE TABLE {db.qualified('jobs')} (id integer PRIMARY KEY, {listed})")
    db.execute(f"INSERT INTO {db.qualified('jobs')} (id) VALUES (1)")
    source = claim_source(db)
    try:
        with pytest.raises(ConfigurationError) as info:
            QueueTrigger(name="jobs", source=source).tick(lambda events: None)
    finally:
        source.close()
    message = str(info.value)
    for name, _ in WRONG_TYPES[db.kind]:
        assert f"jobs.{name} is declared" in message
    first = WRONG_TYPES[db.kind][0][0]
    assert f"jobs.{first} is declared" in message
    assert f"expected {EXPECTED[db.kind]}" in message
    assert "dbtrigger queue install" in message
    assert {r["dbt_status"] for r in rows(db).values()} == {"ready"}  # nothing claimed


# --- one way to mark events, on both contexts --------------------------------------


@pytest.mark.parametrize("method", ["reject", "retry", "attempts"])
def test_both_contexts_mark_events_with_one_signature(method: str) -> None:
    def shape(cls: type) -> list[tuple[str, Any, Any]]:
        params = inspect.signature(getattr(cls, method)).parameters.values()
        return [(p.name, p.kind, p.default) for p in params]

    assert shape(ClaimContext) == shape(BatchContext)


def retry_two_later(events: list[RowChange], ctx: Any) -> None:
    """One handler for both triggers: row 2 asks to come back in two minutes."""
    for e in events:
        if e.pk["id"] == 2 and ctx.attempts(e) == 1:
            ctx.retry(e, "429: retry after 120 s", delay_seconds=120)


def test_a_poller_retry_waits_the_handlers_delay(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    """``delay_seconds`` replaces the backoff (10 s here) for that event."""
    add_items(sqlite_db, items_table(sqlite_db), [1, 2, 3])
    clock = Clock()
    store = FileCheckpointStore(tmp_path / "state")
    trigger = make_trigger(
        items_source(sqlite_db), store, clock=clock, retry_delay_seconds=10, quarantine=None
    )
    seen: list[int] = []

    def handle(events: list[RowChange], ctx: BatchContext) -> None:
        seen.extend(int(e.pk["id"]) for e in events)
        retry_two_later(events, ctx)

    assert trigger.tick(handle) == 3
    [pending] = (read_doc(store).window or Window()).pending
    assert pending.not_before == T0 + dt.timedelta(seconds=120)
    assert pending.reason == "429: retry after 120 s"
    clock.advance(60)  # past any backoff of 10 s, not past the handler's delay
    assert trigger.tick_result(handle).outcome == "idle"
    clock.advance(61)
    assert trigger.tick(handle) == 1
    assert seen == [1, 2, 3, 2]
    assert checkpoint_id(store) == 3


TOKEN = "c" * 32


def test_a_queue_retry_waits_the_handlers_delay(sqlite_db: TestDatabase) -> None:
    make_jobs(sqlite_db, 3)
    source = claim_source(sqlite_db)
    try:
        q = QueueTrigger(name="jobs", source=source, retry_delay_seconds=0)
        assert q.tick(retry_two_later) == 2
        assert q.status().delayed == 1
        with pytest.warns(DeprecationWarning, match=r"use ctx\.attempts\(event\)"):
            ClaimContext(
                queue_name="q",
                claim_token=TOKEN,
                owner_id="w",
                claimed_at=T0,
                keys={"e": (1,)},
                attempts={"e": 1},
                lost=threading.Event(),
            ).attempt(type("E", (), {"event_id": "e"})())  # type: ignore[arg-type]
    finally:
        source.close()
    wait = rows(sqlite_db)[2]["dbt_visible_at"]
    assert wait > (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=100)).strftime(
        "%Y-%m-%d %H:%M:%S"
    )


@pytest.mark.parametrize("delay", [-1, float("nan"), True, "5", 1e12])
def test_a_bad_delay_is_refused_by_both_contexts(
    sqlite_db: TestDatabase, tmp_path: Path, delay: Any
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), [1])
    make_jobs(sqlite_db, 1)
    refused: list[str] = []

    def handle(events: list[RowChange], ctx: Any) -> None:
        try:
            ctx.retry(events[0], "later", delay_seconds=delay)
        except ConfigurationError as exc:
            refused.append(str(exc))

    source = claim_source(sqlite_db)
    try:
        QueueTrigger(name="jobs", source=source).tick(handle)
    finally:
        source.close()
    trigger = make_trigger(
        items_source(sqlite_db), FileCheckpointStore(tmp_path / "state"), clock=Clock()
    )
    # A refused mark fails the poller's batch even when the handler swallows it.
    with pytest.raises(ConfigurationError, match="delay_seconds"):
        trigger.tick(handle)
    assert len(refused) == 2
    assert all("give a number of seconds from 0" in r for r in refused)


def test_a_fan_out_subscriber_cannot_set_its_own_delay(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), [1, 2])
    trigger = make_trigger(
        items_source(sqlite_db),
        FileCheckpointStore(tmp_path / "state"),
        clock=Clock(),
        subscribers={"a": lambda events: None, "b": retry_two_later},
    )
    with pytest.raises(DbTriggerError, match="in subscriber 'b'"):
        trigger.tick()
