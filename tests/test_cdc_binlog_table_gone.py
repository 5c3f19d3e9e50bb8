"""BinlogSource when a watched table is renamed away or dropped under a running poller.

The binary log names tables, and the source reads the changes of the names it
watches. After ``RENAME TABLE items TO gone`` the application's writes carry
the new name, and the poller went quiet without a word: every tick idle, the
changes under the new name never read. A ``DROP TABLE`` removed every row
without a delete event, also without a word (a ``TRUNCATE`` is a ``truncate``
event: tests/test_cdc_truncate_binlog.py). Both are now logged at WARNING
(``cdc_table_gone``) naming the table and what to do; a table created again
under the watched name is read on as before.
"""

from __future__ import annotations

import logging

import pytest

from dbtrigger.cdc import BinlogSource
from tests.cdc_servers import BinlogDatabase
from tests.test_cdc_binlog import Collector, make_table, trigger

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("ddl", "said"),
    [
        ("RENAME TABLE items TO gone", "renamed to gone"),
        ("ALTER TABLE items RENAME TO gone", "renamed to gone"),
        ("DROP TABLE items", "dropped"),
    ],
)
def test_a_watched_table_renamed_or_dropped_is_said(
    binlog_db: BinlogDatabase, ddl: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    table = make_table(binlog_db)
    source = BinlogSource(binlog_db.url, [table], reader="r1")
    poller = trigger(source)
    seen = Collector()
    try:
        binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 10)")
        poller.drain(seen)
        binlog_db.execute(ddl)
        if "DROP" in ddl:  # created again under the watched name: read on
            make_table(binlog_db)
            binlog_db.execute(f"INSERT INTO {table} VALUES (2, 'b', 20)")
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            poller.drain(seen)
    finally:
        poller.close()
        source.close()
    [record] = [r for r in caplog.records if getattr(r, "event", "") == "cdc_table_gone"]
    assert record.levelno == logging.WARNING
    assert record.table == f"{binlog_db.name}.items"  # type: ignore[attr-defined]
    assert said in record.getMessage()
    assert [e.pk["id"] for e in seen.events] == ([1, 2] if "DROP" in ddl else [1])
