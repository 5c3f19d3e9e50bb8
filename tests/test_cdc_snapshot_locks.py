"""A binlog snapshot chunk behind a table's metadata lock waits for the next read.

The chunk bounded its row locks (``innodb_lock_wait_timeout``, the source's
``snapshot_lock_timeout_seconds``) but not its metadata lock: behind another
session holding the watched table (``LOCK TABLES ... WRITE``, or an ``ALTER TABLE``
waiting for a long transaction, which queues every later statement on the table
behind it) the chunk's ``SELECT ... LOCK IN SHARE MODE`` waited the server's
``lock_wait_timeout``, a day by default, inside the tick, and said nothing. Now it
gives up after the same bound and is tried again at the next read, as a chunk
whose row locks were not granted is.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import BinlogSource
from tests.cdc_servers import BinlogDatabase
from tests.test_ddl_locks import outcome

pytestmark = [pytest.mark.mariadb, pytest.mark.timeout(120)]


@contextlib.contextmanager
def table_locked(db: BinlogDatabase, table: str) -> Iterator[None]:
    """Another session holds ``table`` with ``LOCK TABLES ... WRITE``."""
    holder = db.connect()
    try:
        with holder.cursor() as cur:
            cur.execute(f"LOCK TABLES {table} WRITE")
        yield
    finally:
        with holder.cursor() as cur:
            cur.execute("UNLOCK TABLES")
        holder.close()


def test_a_chunk_behind_a_metadata_lock_waits_for_the_next_read(
    binlog_db: BinlogDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    binlog_db.execute("CREATE TABLE items (id INT PRIMARY KEY, n INT)")
    binlog_db.execute("INSERT INTO items VALUES " + ", ".join(f"({i}, 0)" for i in range(1, 31)))
    source = BinlogSource(
        binlog_db.url, ["items"], snapshot_chunk_size=10, snapshot_lock_timeout_seconds=1
    )
    trigger = PollTrigger(
        name="p", source=source, checkpoint_store=InMemoryCheckpointStore(), batch_size=100
    )
    seen: list[RowChange] = []
    try:
        assert trigger.tick(seen.extend) > 0  # the source has set up; chunks are left
        assert all(e.metadata["snapshot"] for e in seen), seen
        assert len(seen) < 30, len(seen)
        with caplog.at_level(logging.INFO, logger="dbtrigger.cdc"):
            waited = outcome(table_locked(binlog_db, "items"), lambda: trigger.tick(seen.extend))
        assert waited == 0, waited  # not a failed read
        assert any(r.__dict__.get("event") == "cdc_snapshot_lock_wait" for r in caplog.records)
        trigger.drain(seen.extend)  # once it ended, the next reads go on
        assert sorted(e.pk["id"] for e in seen) == list(range(1, 31))
    finally:
        trigger.close()
        source.close()
