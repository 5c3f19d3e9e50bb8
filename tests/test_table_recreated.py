"""A polled table dropped and created again under a running poller, at default settings.

The checkpoint is a position in the old table. A new table with the same name
starts its sequence (or its timestamps, copied over) again below it, and the
keyset read ``(cursor, pk) > checkpoint`` went past every such row without a
word: of a backlog of three new rows only the one above the old checkpoint was
delivered. On PostgreSQL every statement of the source now reads only the table
it first read (its oid), and when the table is looked at again (the column
check's interval) another one is refused typed, with the checkpoint unchanged
and the two ways on in the message.
"""

from __future__ import annotations

from typing import Any

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.errors import SourceDefinitionError
from dbtrigger.state import document as docmod
from tests.databases import TestDatabase
from tests.reliability_support import add_items, items_table


class Keys:
    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, events: list[RowChange]) -> None:
        self.ids.extend(int(e.pk["id"]) for e in events)


def stored_position(trigger: PollTrigger) -> Any:
    stored = trigger.store.read(trigger.name)
    assert stored is not None
    return docmod.loads(stored.data).position


def test_a_table_dropped_and_created_again_is_refused_not_skipped(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = items_table(pg)
    add_items(pg, table, [1, 2, 3])
    source = SqlAlchemySource(
        url=pg.url, table="items", schema=pg.schema, cursor_column="version", pk_columns=["id"]
    )
    trigger = PollTrigger(name="items", source=source, checkpoint_store=InMemoryCheckpointStore())
    seen = Keys()
    try:
        assert trigger.drain(seen) == 3
        checkpoint = stored_position(trigger)
        table.drop(pg.engine)
        add_items(pg, items_table(pg), [1, 2, 4])  # versions 10, 20 below the checkpoint's 30
        # Until the table is looked at again (CHECK_SECONDS) nothing of it is read.
        assert trigger.drain(seen) == 0  # before: 1 (row 4; rows 1 and 2 never)
        assert stored_position(trigger) == checkpoint
        monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 3600.0)
        assert trigger.drain(seen) == 0
        monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 0.0)  # the look is due
        for _ in range(2):  # refused every time, not once
            with pytest.raises(SourceDefinitionError) as refused:
                trigger.tick(seen)
        monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 3600.0)
        with pytest.raises(SourceDefinitionError):
            trigger.tick(seen)  # once refused, every fetch until one may go on
        assert stored_position(trigger) == checkpoint
        assert seen.ids == [1, 2, 3]
        message = str(refused.value)
        assert "dropped and created again" in message
        assert "--to-beginning" in message
        assert "restart" in message
        # Read from the beginning (what `dbtrigger reset --to-beginning` leaves): the
        # new table's rows are all delivered.
        fresh = PollTrigger(name="again", source=source, checkpoint_store=InMemoryCheckpointStore())
        assert fresh.drain(seen) == 3
        fresh.close()
        # A restarted worker goes on from the checkpoint: past it, row 4 only.
        restarted = SqlAlchemySource(
            url=pg.url, table="items", schema=pg.schema, cursor_column="version", pk_columns=["id"]
        )
        again = PollTrigger(name="items", source=restarted, checkpoint_store=trigger.store)
        assert again.drain(seen) == 1
        again.close()
        restarted.close()
    finally:
        trigger.close()
        source.close()
    assert seen.ids == [1, 2, 3, 1, 2, 4, 4]


def test_a_column_change_that_comes_with_the_new_table_is_still_refused(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new table has one more column: the source reads its columns again, and the
    table it learns them from is still not the one the checkpoint was read from."""
    monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 0.0)
    table = items_table(pg)
    add_items(pg, table, [1, 2, 3])
    source = SqlAlchemySource(
        url=pg.url, table="items", schema=pg.schema, cursor_column="version", pk_columns=["id"]
    )
    trigger = PollTrigger(name="items", source=source, checkpoint_store=InMemoryCheckpointStore())
    try:
        assert trigger.drain(Keys()) == 3
        table.drop(pg.engine)
        add_items(pg, items_table(pg), [1, 4])
        pg.execute(f"ALTER TABLE {pg.qualified('items')} ADD COLUMN note text")
        with pytest.raises(SourceDefinitionError, match="dropped and created again"):
            trigger.tick(Keys())
    finally:
        trigger.close()
        source.close()


def test_ddl_that_keeps_the_table_is_not_a_new_table(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite (a column retyped, VACUUM FULL) keeps the table's oid: no refusal."""
    monkeypatch.setattr("dbtrigger._columns.CHECK_SECONDS", 0.0)
    table = items_table(pg)
    add_items(pg, table, [1, 2])
    source = SqlAlchemySource(
        url=pg.url, table="items", schema=pg.schema, cursor_column="version", pk_columns=["id"]
    )
    trigger = PollTrigger(name="items", source=source, checkpoint_store=InMemoryCheckpointStore())
    seen = Keys()
    try:
        assert trigger.drain(seen) == 2
        q = pg.qualified("items")
        pg.execute(f"ALTER TABLE {q} ALTER COLUMN payload TYPE text")
        with pg.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f"VACUUM FULL {q}")
        add_items(pg, table, [3])
        assert trigger.drain(seen) == 1
    finally:
        trigger.close()
        source.close()
    assert seen.ids == [1, 2, 3]
