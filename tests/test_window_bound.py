"""The settled window's bound holds for events waiting for a retry too (issue 20, item 9).

A batch of 3,000 events, each retried once, used to make a 590 KB document
(the bound is 48 KiB): on the Table store every commit was refused, the batch
was delivered again on every tick with its attempts never counted, and the
error told the operator to lower ``journal_limit``. Now the entries a batch
adds for retries are bounded like settled ones (those that do not fit are
delivered again, said at WARNING), the batches after it are cut to what the
window can hold as waiting, and every "document too large" error names what
takes the space - checked on each store: file, SQL (SQLite, PostgreSQL,
MariaDB), Blob and Table on Azurite.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.errors import UnsupportedDocumentError
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state import document as docmod
from dbtrigger.state import sizes
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.sql import SqlCheckpointStore
from dbtrigger.state.stores.table import TableCheckpointStore
from dbtrigger.state.window import Window
from tests.databases import TestDatabase, make_database
from tests.reliability_support import add_items, items_source, items_table
from tests.test_blob_store import make_store, new_container

UTC = dt.timezone.utc
BOUND = 48 * 1024
#: Four times what the window holds as waiting, on every store. The reported batch
#: was 3,000 (on the Table store, 12 s of CPU here for the same checks): 600 events
#: each retried once made a document of about 120 KB before the fix, over the
#: bound as well, and the Table store's own refusal of a document too large has
#: a test of its own below.
ROWS = 600


@pytest.fixture(params=["file", "sql-sqlite", "sql-postgresql", "sql-mariadb", "blob", "table"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStore]:
    kind = request.param
    if kind == "file":
        yield FileCheckpointStore(tmp_path / "state")
    elif kind.startswith("sql-"):
        (tmp_path / "store").mkdir()
        for db in make_database(kind.removeprefix("sql-"), tmp_path / "store"):
            yield SqlCheckpointStore(engine=db.engine, schema=db.schema)
    else:
        azurite = request.getfixturevalue("azurite")
        if kind == "table":
            table = TableCheckpointStore(
                connection_string=azurite.connection_string, table=f"t{uuid.uuid4().hex[:12]}"
            )
            yield table
            table.close()
            return
        for container in new_container(azurite):
            blob = make_store(azurite, container)
            yield blob
            blob.close()


class RetryEachOnce:
    """Asks to retry every event on its first delivery (a downstream that
    answers 429 once), accepts it on the next."""

    def __init__(self) -> None:
        self.deliveries = 0
        self.accepted: set[int] = set()

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            self.deliveries += 1
            if ctx.attempts(e) == 1:
                ctx.retry(e, "429 from billing, retry in a while")
            else:
                self.accepted.add(int(e.pk["id"]))


def test_a_batch_of_retries_larger_than_the_window_stays_within_its_bound(
    sqlite_db: TestDatabase,
    store: CheckpointStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    rows = ROWS
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, rows + 1))
    now = [dt.datetime(2026, 3, 1, tzinfo=UTC)]
    trigger = PollTrigger(
        name="items",
        source=items_source(sqlite_db),
        checkpoint_store=store,
        clock=lambda: now[0],
        batch_size=rows,
    )
    handler = RetryEachOnce()
    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        for _ in range(200):
            trigger.tick(handler)  # raises if a commit is refused
            stored = store.read("items")
            assert stored is not None
            doc = docmod.loads(stored.data)
            window = doc.window or Window()
            assert window.encoded_size() <= BOUND, sizes.explain(stored.data)
            assert len(stored.data) < 2 * BOUND  # the rest of the document is small
            if len(handler.accepted) == rows and doc.window is None:
                break
            now[0] += dt.timedelta(minutes=10)  # past every backoff
    assert handler.accepted == set(range(1, rows + 1))
    # Cut to what the window holds: not the whole backlog again after each round.
    assert handler.deliveries <= 3 * rows, handler.deliveries
    overflow = [r for r in caplog.records if getattr(r, "event", None) == "window_overflow"]
    assert overflow
    assert "asked to retry could not be remembered as waiting" in overflow[0].getMessage()


def test_a_document_too_large_for_the_table_store_names_the_window(
    azurite: Any, sqlite_db: TestDatabase
) -> None:
    """A window bound larger than the store can hold: the refusal names the
    window and window_max_bytes, not journal_limit."""
    table = items_table(sqlite_db)
    add_items(sqlite_db, table, range(1, 4001))
    store = TableCheckpointStore(
        connection_string=azurite.connection_string, table=f"t{uuid.uuid4().hex[:12]}"
    )
    trigger = PollTrigger(
        name="items",
        source=items_source(sqlite_db),
        checkpoint_store=store,
        batch_size=4000,
        window_max_events=5000,
        window_max_bytes=4 * 1024 * 1024,
    )
    with pytest.raises(UnsupportedDocumentError) as caught:
        trigger.tick(RetryEachOnce())
    message = str(caught.value)
    assert "settled window takes the most (4000 event(s) waiting for a retry" in message
    assert "window_max_bytes" in message
    assert "journal_limit" not in message
    store.close()


def test_a_document_larger_than_max_allowed_packet_is_refused_naming_the_journal(
    tmp_path: Path,
) -> None:
    """MariaDB drops the connection on a statement over max_allowed_packet
    ("server has gone away"), which passed for an outage and was retried."""
    for db in make_database("mariadb", tmp_path):
        with db.engine.connect() as conn:
            packet = int(conn.execute(sa.text("SELECT @@max_allowed_packet")).scalar_one())
        store = SqlCheckpointStore(engine=db.engine, schema=db.schema)
        entry = {"type": "commit", "note": "x" * 1000}
        data = json.dumps({"version": 1, "journal": [entry] * (packet // 1000 + 1)}).encode()
        with pytest.raises(UnsupportedDocumentError) as caught:
            store.write("items", data, if_match=None)
        assert "max_allowed_packet" in str(caught.value)
        assert "the journal takes the most" in str(caught.value)
        assert "journal_limit" in str(caught.value)


# (description, document, expected phrase)
EXPLAIN = [
    (
        "window",
        {"window": {"settled": [], "pending": [{"at": {}, "reason": "x" * 500}] * 3}},
        "the settled window takes the most (3 event(s) waiting for a retry, 0 settled",
    ),
    ("journal", {"journal": [{"type": "commit", "x": "y" * 300}] * 4}, "journal_limit"),
    ("failure record", {"failure": {"done_event_ids": ["e" * 40] * 50}}, "lower batch_size"),
    ("other", {"checkpoint": {"x": "y" * 900}}, "report it"),
]


@pytest.mark.parametrize(("raw", "phrase"), [c[1:] for c in EXPLAIN], ids=[c[0] for c in EXPLAIN])
def test_explain_names_the_part_that_takes_the_space(raw: dict[str, Any], phrase: str) -> None:
    data = json.dumps(raw).encode()
    text = sizes.explain(data)
    assert phrase in text
    assert text.startswith(f"the document is {len(data)} bytes")
    assert sizes.explain(b"not json") == "the document is 8 bytes"
