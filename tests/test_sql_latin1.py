"""The SQL history and the SQL dead-letter sink in a LATIN1 PostgreSQL database: a
value holding a character LATIN1 lacks is refused with a typed error saying to keep
them in a UTF8 database, as the SQL state store does (fc64648).

psycopg encodes text for the database's encoding on the client, so a handler's
error message in Chinese (the dead letter's ``error``) escaped the sink as a bare
``UnicodeEncodeError``; with ``client_encoding=utf8`` the server refuses it (22P05).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dbtrigger.errors import QuarantineError, StoreRefusedError
from dbtrigger.history import SqlHistory
from dbtrigger.quarantine import SqlQuarantineSink
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


def test_the_sql_dead_letter_sink_refuses_a_row_latin1_cannot_hold(
    latin1_urls: list[str],
) -> None:
    for poller, url in zip(("orders", "orders_utf8"), latin1_urls, strict=True):
        sink = SqlQuarantineSink(url=url)
        try:
            sink.put([dataclasses.replace(quarantine_record(), poller=poller)])
            wide = dataclasses.replace(
                quarantine_record(), poller=poller, event_id="e2", error=f"boom {WIDE}"
            )
            with pytest.raises(QuarantineError, match=r"encoding.*UTF8"):
                sink.put([wide])
            assert [r.event_id for r in sink.records(poller)] == ["e1"]
        finally:
            sink.close()
