"""The sidecar feeder's insert into the claims table waits a bounded time and says why.

The feeder wrote with no lock bound (PostgreSQL's queue engine is in autocommit,
and an insert behind another session's conflicting insert waited for ever there;
MariaDB 50 s behind a gap lock) and turned every failure into a plain
``OutputWriteError``, where ``db.output`` and ``DbWriter`` give
``OutputLockTimeoutError`` (naming who holds the lock) and
``OutputConstraintError``. Now the insert runs in a transaction bounded like theirs
(30 s, at most a quarter of the feeder's lease) and fails with the same errors.
A thread runs the feeder's handler; the test waits for its outcome with a bound and ends the
holder's transaction in any case.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, HandlerError, RowChange
from dbtrigger.cli import main
from dbtrigger.errors import OutputConstraintError, OutputLockTimeoutError
from dbtrigger.queue import SidecarFeeder
from dbtrigger.state.stores.memory import InMemoryCheckpointStore
from tests.databases import TestDatabase
from tests.test_output_locks import outcome_of
from tests.test_queue_sidecar import args, claims

#: Liveness bound of one tick here, past the insert's 2 s bound (on SQLite the first
#: read of the table's shape took the write lock and waited 30 s more behind the
#: holder; reads no longer take it: tests/test_queue_sqlite_reads.py).
TICK_WITHIN = 20.0


@pytest.fixture
def items(db: TestDatabase) -> Iterator[ClaimSource]:
    db.execute(
        f"CREATE TABLE {db.qualified('items')} "
        "(id integer PRIMARY KEY, version bigint NOT NULL, payload varchar(40))"
    )
    db.execute(f"INSERT INTO {db.qualified('items')} VALUES (1, 1, 'a'), (2, 2, 'b')")
    assert main(["queue", "install", *args(db), "--yes"]) == 0
    src = ClaimSource(
        url=db.url,
        table="items",
        schema=db.schema,
        pk_columns=["id"],
        mode="sidecar",
        cursor_column="version",
    )
    yield src
    src.close()


def feeder(items: ClaimSource) -> SidecarFeeder:
    return SidecarFeeder(
        name="items-feeder",
        source=items,
        checkpoint_store=InMemoryCheckpointStore(),
        lease_ttl_seconds=8,  # the insert's bound becomes 2 s
    )


def test_a_feed_behind_a_lock_gives_up_typed(db: TestDatabase, items: ClaimSource) -> None:
    claims_table = db.qualified("dbtrigger_claims")
    holder = db.engine.connect()
    holder.begin()
    if db.kind == "postgresql":  # the same job, inserted and not committed
        holder.exec_driver_sql(
            f"INSERT INTO {claims_table} (queue, item_key, item_cursor) "
            "SELECT queue, item_key, item_cursor FROM "
            f"(SELECT 'items' AS queue, '{{\"id\": [\"int\", 1]}}' AS item_key, "
            "'1' AS item_cursor) AS j"
        )
        holder.exec_driver_sql(f"LOCK TABLE {claims_table} IN EXCLUSIVE MODE")
    elif db.kind == "mariadb":  # next-key locks up to the end of the table
        holder.exec_driver_sql(f"SELECT * FROM {claims_table} FOR UPDATE")
    else:  # the file's write lock
        holder.exec_driver_sql(f"UPDATE {db.qualified('items')} SET payload = 'x' WHERE id = 9")
    made = feeder(items)

    def release() -> None:
        if not holder.closed:
            holder.rollback()
            holder.close()

    events = [
        RowChange(
            event_id=f"e{i}", op="upsert", source="s", cursor=i, pk={"id": i},
            before=None, after={"id": i},
        )
        for i in (1, 2)
    ]  # fmt: skip
    try:
        # the handler itself: a PostgreSQL poller would not read past the open holder
        thread, outcome, _ = outcome_of(lambda: made.handle(events))
        thread.join(TICK_WITHIN)
        alive = thread.is_alive()
        release()
        thread.join(90)
        assert not alive, f"the feeder still waited for the lock after {TICK_WITHIN} s"
        [cause] = outcome
        assert isinstance(cause, OutputLockTimeoutError), repr(cause)
        assert "dbtrigger_claims" in str(cause), cause
        assert "gave up" in str(cause), cause
        assert claims(db) == []
        made.handle(events)  # the lock gone, the same rows are fed
        assert len(claims(db)) == 2
    finally:
        release()
        made.close()


def test_a_feed_refused_by_the_table_is_a_constraint_error(
    db: TestDatabase, items: ClaimSource
) -> None:
    claims_table = db.qualified("dbtrigger_claims")
    with db.engine.begin() as conn:  # a rule someone added to the claims table
        if db.kind == "sqlite":
            conn.exec_driver_sql(
                "CREATE TRIGGER no_two BEFORE INSERT ON dbtrigger_claims "
                "WHEN NEW.item_key LIKE '%2]%' BEGIN SELECT RAISE(ABORT, "
                "'CHECK constraint failed: no_two'); END"
            )
        else:
            conn.execute(
                sa.text(
                    f"ALTER TABLE {claims_table} "
                    "ADD CONSTRAINT no_two CHECK (item_key NOT LIKE '%2]%')"
                )
            )
    made = feeder(items)
    try:
        with pytest.raises(HandlerError) as caught:
            made.tick()
        cause = caught.value.__cause__
        assert isinstance(cause, OutputConstraintError), repr(cause)
        assert "no_two" in str(cause), cause
        assert claims(db) == []
    finally:
        made.close()
    with db.engine.connect() as conn:
        assert conn.execute(sa.text(f"SELECT count(*) FROM {claims_table}")).scalar() == 0
