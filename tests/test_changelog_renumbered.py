"""A change log numbered again below a running poller's checkpoint, on every database.

``changelog uninstall --drop-log`` and ``install`` (docs/changes.md's way out
when a key's columns change), or a ``TRUNCATE`` of the log on MariaDB (which
restarts AUTO_INCREMENT), start the log's numbers again at 1. The poller read
after its old checkpoint: the new log's first changes were never delivered and
nothing was said (0 delivered, no warning). Now it refuses before reading, at
its first fetch and at every drift check, with the checkpoint unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore, PollTrigger
from dbtrigger.changelog import ChangeLogSource, install, log_table_name, uninstall
from dbtrigger.errors import SourceDefinitionError
from dbtrigger.state import document as docmod
from tests.databases import TestDatabase
from tests.test_changelog_ddl import Replica, make_orders, poller


def stored_seq(trigger: PollTrigger) -> object:
    stored = trigger.store.read(trigger.name)
    assert stored is not None
    return docmod.loads(stored.data).position.cursor


def add(db: TestDatabase, keys: range) -> None:
    for key in keys:
        db.execute(f"INSERT INTO {db.qualified('orders')} (id, status) VALUES ({key}, 'new')")


@pytest.mark.parametrize("how", ["reinstall", "truncate"])
def test_a_log_numbered_again_is_refused_not_read_past(
    db: TestDatabase, tmp_path: Path, how: str
) -> None:
    make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    add(db, range(1, 6))
    trigger = poller(db, tmp_path)  # drift checked at every fetch
    replica = Replica()
    assert trigger.drain(replica) == 5
    checkpoint = stored_seq(trigger)
    if how == "reinstall":
        uninstall(db.engine, "orders", schema=db.schema, drop_log=True)
        install(db.engine, "orders", schema=db.schema)
    else:
        log = db.qualified(log_table_name("orders"))
        db.execute(f"DELETE FROM {log}" if db.kind == "sqlite" else f"TRUNCATE TABLE {log}")
    add(db, range(6, 8))  # two changes: numbers 1 and 2 in a log numbered again
    renumbered = how == "reinstall" or db.kind == "mariadb"
    if not renumbered:  # PostgreSQL's sequence and SQLite's AUTOINCREMENT go on
        assert trigger.drain(replica) == 2
        assert sorted(k[0] for k in replica.rows) == [1, 2, 3, 4, 5, 6, 7]
        return
    with pytest.raises(SourceDefinitionError) as refused:
        trigger.tick(replica)  # before: delivered 0, no error
    assert stored_seq(trigger) == checkpoint
    message = str(refused.value)
    assert f"before this poller's checkpoint at {checkpoint}" in message
    assert "--to-beginning" in message
    # A worker started now, at default settings, refuses at its first fetch.
    restarted = PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=db.url, table="orders", schema=db.schema),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    )
    with pytest.raises(SourceDefinitionError, match="dropped and installed again"):
        restarted.tick(replica)
    assert stored_seq(trigger) == checkpoint
    # From the beginning (what the reset leaves), both changes are delivered.
    visibility = "none" if db.kind == "mariadb" else "auto"  # (as poller(): every write committed)
    fresh = PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=db.url, table="orders", schema=db.schema, visibility=visibility),
        checkpoint_store=InMemoryCheckpointStore(),
    )
    assert fresh.drain(replica) == 2
    assert sorted(k[0] for k in replica.rows) == [1, 2, 3, 4, 5, 6, 7]


def test_a_log_numbered_again_past_the_checkpoint_is_refused_by_its_keys(
    db: TestDatabase, tmp_path: Path
) -> None:
    """The new log's numbers passed the old checkpoint before any poller looked (the
    workers were stopped while the log was installed again and written to). Its
    highest number says nothing then, and a restarted worker delivered the changes
    after the checkpoint's number and skipped those before it, without a word. The
    row at the checkpoint's number now names another key than the checkpoint does:
    refused, checkpoint unchanged."""
    make_orders(db)
    install(db.engine, "orders", schema=db.schema)
    add(db, range(1, 6))
    replica = Replica()
    assert poller(db, tmp_path).drain(replica) == 5
    checkpoint = stored_seq(poller(db, tmp_path))
    uninstall(db.engine, "orders", schema=db.schema, drop_log=True)
    install(db.engine, "orders", schema=db.schema)
    add(db, range(6, 14))  # eight changes, numbered 1 to 8: past the checkpoint at 5
    restarted = PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=db.url, table="orders", schema=db.schema),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
    )
    with pytest.raises(SourceDefinitionError, match="--to-beginning"):
        restarted.tick(replica)  # before: delivered keys 11 to 13, never 6 to 10
    assert stored_seq(restarted) == checkpoint
    assert sorted(k[0] for k in replica.rows) == [1, 2, 3, 4, 5]
