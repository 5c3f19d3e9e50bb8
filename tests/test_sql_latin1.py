"""The SQL history and the SQL dead-letter sink in a LATIN1 database. The history
refuses a value holding a character LATIN1 lacks with a typed error saying to keep
it in a UTF8 database, as the SQL state store does (fc64648); the sink stores such a
dead letter with those characters escaped (a refusal was retried at every tick).

psycopg encodes text for the database's encoding on the client, so a handler's
error message in Chinese (the dead letter's ``error``) escaped the sink as a bare
``UnicodeEncodeError``; with ``client_encoding=utf8`` the server refuses it (22P05).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.errors import StoreRefusedError
from dbtrigger.history import SqlHistory
from dbtrigger.quarantine import SqlQuarantineSink
from dbtrigger.runtime.context import BatchContext
from tests.databases import admin_engine
from tests.test_store_locks import quarantine_record

WIDE = "漢字"  # characters LATIN1 has no place for


@pytest.fixture
def latin1_urls() -> Iterator[list[str]]:
    """A LATIN1 database on the shared server, as psycopg reaches it by default and
    with client_encoding=utf8; dropped after the test."""
    admin = admin_engine("postgresql")
    name = f"dbtrigger_latin1_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(
            sa.text(
                f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' "
                "TEMPLATE template0"
            )
        )
    url = admin.url.set(database=name)
    try:
        yield [
            url.render_as_string(False),
            url.update_query_dict({"client_encoding": "utf8"}).render_as_string(False),
        ]
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))


def test_the_sql_history_refuses_a_record_latin1_cannot_hold(latin1_urls: list[str]) -> None:
    for poller, url in zip(("orders", "orders_utf8"), latin1_urls, strict=True):
        engine = sa.create_engine(url)
        try:
            history = SqlHistory(engine)
            at = dt.datetime.now(dt.timezone.utc).isoformat()
            history.append(poller, [{"type": "commit", "at": at, "batch_id": "b1"}], after_seq=0)
            wide = {"type": "commit", "at": at, "batch_id": f"b{WIDE}"}
            with pytest.raises(StoreRefusedError, match=r"encoding.*UTF8"):
                history.append(poller, [wide], after_seq=1)
            assert [r["batch_id"] for r in history.read(poller)] == ["b1"]
        finally:
            engine.dispose()


def test_the_sql_dead_letter_sink_escapes_what_latin1_cannot_hold(
    latin1_urls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Refused, the dead letter was retried at every tick for ever: it is stored with
    the characters the database lacks as backslash escapes, said at WARNING."""
    for poller, url in zip(("orders", "orders_utf8"), latin1_urls, strict=True):
        sink = SqlQuarantineSink(url=url)
        try:
            sink.put([dataclasses.replace(quarantine_record(), poller=poller)])
            wide = dataclasses.replace(
                quarantine_record(), poller=poller, event_id="e2", error=f"boom {WIDE}"
            )
            with caplog.at_level(logging.WARNING, logger="dbtrigger"):
                sink.put([wide])
            stored = {r.event_id: r.error for r in sink.records(poller)}
            assert stored == {"e1": "boom", "e2": "boom \\u6f22\\u5b57"}
            assert "dead_letter_escaped" in {getattr(r, "event", None) for r in caplog.records}
            caplog.clear()
        finally:
            sink.close()


@pytest.fixture
def mariadb_latin1_url() -> Iterator[str]:
    """A MariaDB database whose default character set is latin1 (so is a table
    created in it), in the server's default strict sql_mode; dropped after the test."""
    admin = admin_engine("mariadb")
    name = f"t_latin1_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET latin1"))
    try:
        yield admin.url.set(database=name).render_as_string(False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE `{name}`"))


def test_a_dead_letter_latin1_cannot_hold_does_not_stall_the_poller_on_mariadb(
    mariadb_latin1_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rejection in Chinese on a MariaDB LATIN1 dead-letter table (default settings):
    the sink's QuarantineError (1366 Incorrect string value) failed every tick, the
    batch never committed. Now it is set aside with escapes and the poller goes on."""
    url = mariadb_latin1_url
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (id INT PRIMARY KEY, seq INT NOT NULL)"))
        conn.execute(sa.text("INSERT INTO orders VALUES (1, 1), (2, 2)"))
    sink = SqlQuarantineSink(url=url)
    trigger = PollTrigger(
        name="orders",
        source=SqlAlchemySource(url=url, table="orders", cursor_column="seq", pk_columns=["id"]),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        quarantine=sink,
    )

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        for event in events:
            if event.pk["id"] == 1:
                ctx.reject(event, f"no customer {WIDE}")

    try:
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            assert trigger.tick(handler) == 2
        assert [r.error for r in sink.records("orders")] == [
            "EventRejected: no customer \\u6f22\\u5b57"
        ]
        assert trigger.read_state().checkpoint is not None
        escaped = [r for r in caplog.records if getattr(r, "event", None) == "dead_letter_escaped"]
        assert len(escaped) == 1
        assert "UTF8" in escaped[0].getMessage()
    finally:
        trigger.close()
        sink.close()
        engine.dispose()


@pytest.mark.parametrize("sql_mode", [None, ""], ids=["strict", "not-strict"])
def test_the_sql_dead_letter_sink_never_stores_a_question_mark_unsaid_on_mariadb(
    mariadb_latin1_url: str, sql_mode: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Strict, MariaDB refuses the character (1366, an error); without a strict
    sql_mode it stored '?' for it with only a warning: the reason was lost unsaid.
    Both are stored escaped now, and said."""
    connect = {} if sql_mode is None else {"init_command": f"SET SESSION sql_mode='{sql_mode}'"}
    engine = sa.create_engine(mariadb_latin1_url, connect_args=connect)
    sink = SqlQuarantineSink(engine=engine)
    try:
        wide = dataclasses.replace(quarantine_record(), error=f"boom {WIDE}")
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            sink.put([wide])
        assert [r.error for r in sink.records()] == ["boom \\u6f22\\u5b57"]
        assert "dead_letter_escaped" in {getattr(r, "event", None) for r in caplog.records}
    finally:
        sink.close()
        engine.dispose()
