"""PgLogicalSource: a first start that failed between creating the slot and writing
its control row (a crash, a lost connection, a lock wait) still reads the rows the
table already had.

The slot cannot be created in the transaction that writes the control row, so a
failure between the two left a slot without a row. The next start took such a slot
as one made elsewhere and queued no snapshot: the backlog, the reason for
``snapshot="initial"``, was never delivered, and nothing said so.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RetryPolicy, RowChange
from dbtrigger.cdc import PgLogicalSource
from tests.cdc_servers import CdcDatabase

pytestmark = pytest.mark.timeout(120)


def test_a_slot_whose_control_row_was_never_written_still_gets_the_initial_snapshot(
    cdc_db: CdcDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    cdc_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t SELECT generate_series(1, 5)"
    )
    source = PgLogicalSource(cdc_db.url, ["t"])
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        retry=RetryPolicy.none(),
    )
    write = source.write_control
    failed: list[bool] = []

    def fails_once(conn: psycopg.Connection[Any], row: Any) -> None:
        if not failed:
            failed.append(True)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        write(conn, row)

    monkeypatch.setattr(source, "write_control", fails_once)
    got: list[RowChange] = []
    with pytest.raises(Exception, match="server closed the connection"):
        trigger.tick(got.extend)
    assert failed
    assert cdc_db.scalar(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (source.slot,)
    )  # the slot was created before the failure
    trigger.drain(got.extend)
    source.close()
    assert sorted(e.pk["id"] for e in got if e.op == "upsert") == [1, 2, 3, 4, 5]
