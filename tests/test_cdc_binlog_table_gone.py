"""BinlogSource when a watched table is renamed away, dropped or replaced under a poller.

The binary log names tables, and the source reads the changes of the names it
watches. After ``RENAME TABLE items TO gone`` the application's writes carry
the new name; a ``DROP TABLE`` removes every row without a delete event; a
``RENAME TABLE items TO old, new TO items`` (gh-ost's and pt-osc's cut-over)
puts under the watched name rows that were never read as its. Before, each was
a WARNING (``cdc_table_gone``) and the reader read on past it: the changes
under the new name were never delivered and the checkpoint moved past the
statement. Now delivery stops before the statement with a
``SourceDefinitionError`` saying what to run (tables= the new name and
``reset --accept-source``, as on PostgreSQL; ``cdc snapshot`` to read the name
on), and each way forward delivers the rest, none skipped. Statements that lose
nothing watched (a swap of two watched tables, a table of the same name in
another database, ``DROP TABLE IF EXISTS`` of another table) do not stop.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RetryPolicy, RowChange
from dbtrigger.cdc import BinlogSource
from dbtrigger.errors import SourceDefinitionError
from dbtrigger.state import document
from dbtrigger.state import operations as state_ops
from tests.cdc_servers import BinlogDatabase
from tests.test_cdc_binlog import make_table

pytestmark = [pytest.mark.binlog, pytest.mark.timeout(180)]


def poller(db: BinlogDatabase, tables: list[str], store: InMemoryCheckpointStore, name: str):  # type: ignore[no-untyped-def]
    source = BinlogSource(db.url, tables, snapshot="never")
    return PollTrigger(name=name, source=source, checkpoint_store=store, retry=RetryPolicy.none())


def watching(
    db: BinlogDatabase, tables: list[str]
) -> tuple[PollTrigger, InMemoryCheckpointStore, str, list[RowChange]]:
    """A poller on ``tables`` that has read the log once (its start before the test's
    statements); its store, its name and the list its deliveries are gathered in."""
    store, name = InMemoryCheckpointStore(), f"p_{uuid.uuid4().hex[:8]}"
    got: list[RowChange] = []
    trigger = poller(db, tables, store, name)
    trigger.drain(got.extend)
    return trigger, store, name, got


def accept(store: InMemoryCheckpointStore, name: str, trigger: PollTrigger) -> None:
    """What ``dbtrigger reset NAME --accept-source MODULE:TRIGGER --yes`` does."""
    stored = store.read(name)
    assert stored is not None
    accepted = state_ops.accept_source(
        document.loads(stored.data),
        fingerprint=trigger.source.fingerprint(),  # type: ignore[attr-defined]
        now=dt.datetime.now(dt.timezone.utc),
        actor="test",
        reason="table renamed",
    )
    store.write(name, document.dumps(accepted), if_match=stored.etag)


def checkpoint(store: InMemoryCheckpointStore, name: str) -> str:
    stored = store.read(name)
    assert stored is not None
    return str(document.loads(stored.data).position.cursor)


def stopped(trigger: PollTrigger, handler: Callable[[list[RowChange]], None]) -> str:
    """Tick until the poller stops with SourceDefinitionError (a read-ahead may deliver
    first); its message."""
    for _ in range(10):
        try:
            trigger.tick(handler)
        except SourceDefinitionError as exc:
            return str(exc)
    pytest.fail("the poller did not stop with SourceDefinitionError in 10 ticks")


def seen(got: list[RowChange]) -> list[tuple[str, object, str]]:
    return [(e.op, e.pk.get("id"), e.metadata["table"]) for e in got]


@pytest.mark.parametrize("ddl", ["RENAME TABLE items TO gone", "ALTER TABLE items RENAME TO gone"])
def test_a_rename_stops_before_it_and_the_source_pointed_at_the_new_name_reads_on(
    binlog_db: BinlogDatabase, ddl: str
) -> None:
    make_table(binlog_db)
    db = binlog_db.name
    before, store, name, got = watching(binlog_db, ["items"])
    binlog_db.execute("INSERT INTO items VALUES (1, 'a', 1)")
    before.drain(got.extend)
    binlog_db.execute("INSERT INTO items VALUES (2, 'b', 2)")
    binlog_db.execute(ddl)
    binlog_db.execute("INSERT INTO gone VALUES (3, 'c', 3)")
    said = stopped(before, got.extend)
    assert f"watched table {db}.items was renamed to {db}.gone" in said
    assert f"point tables= at {db}.gone" in said
    assert f"dbtrigger reset {name} --accept-source MODULE:TRIGGER" in said
    # every change before the rename was delivered; the checkpoint stays before it
    assert seen(got) == [("insert", 1, f"{db}.items"), ("insert", 2, f"{db}.items")]
    assert checkpoint(store, name) == str(got[-1].cursor)
    assert stopped(before, got.extend) == said
    assert len(got) == 2

    source = before.source
    assert isinstance(source, BinlogSource)
    status = source.admin().status()  # cdc status and check say why, and what to run
    assert f"delivery is held: {said}" in status["warnings"]
    assert status["healthy"] is False
    [finding] = [f for f in source.self_check() if f.check == "delivery"]
    assert finding.message == said
    assert finding.severity == "error"
    source.close()

    after = poller(binlog_db, ["gone"], store, name)  # what the error asks for
    accept(store, name, after)
    after.drain(got.extend)
    assert seen(got)[2:] == [("insert", 3, f"{db}.gone")]
    binlog_db.execute("INSERT INTO gone VALUES (4, 'd', 4)")
    after.drain(got.extend)
    assert seen(got)[3:] == [("insert", 4, f"{db}.gone")]
    assert after.source.admin().status()["warnings"] == []  # type: ignore[attr-defined]
    after.source.close()  # type: ignore[attr-defined]


def test_a_drop_stops_while_nothing_is_under_the_name_then_reads_on_as_a_truncate(
    binlog_db: BinlogDatabase,
) -> None:
    make_table(binlog_db)
    db = binlog_db.name
    t, store, name, got = watching(binlog_db, ["items"])
    binlog_db.execute("INSERT INTO items VALUES (1, 'a', 1), (2, 'b', 2)")
    binlog_db.execute("DROP TABLE items")
    said = stopped(t, got.extend)
    assert f"watched table {db}.items was dropped" in said
    assert "no table is under that name now" in said
    assert "--reason 'table dropped'" in said
    assert [e.pk["id"] for e in got] == [1, 2]
    assert checkpoint(store, name) == str(got[-1].cursor)

    make_table(binlog_db)  # created again: the drop's rows leave as a truncate, then on
    binlog_db.execute("INSERT INTO items VALUES (5, 'e', 5)")
    t.drain(got.extend)
    assert seen(got)[2:] == [("truncate", None, f"{db}.items"), ("insert", 5, f"{db}.items")]
    t.source.close()  # type: ignore[attr-defined]


def test_create_or_replace_table_is_a_truncate_and_reads_on(binlog_db: BinlogDatabase) -> None:
    make_table(binlog_db)
    db = binlog_db.name
    t, _, _, got = watching(binlog_db, ["items"])
    binlog_db.execute("INSERT INTO items VALUES (1, 'a', 1)")
    binlog_db.execute(
        "CREATE OR REPLACE TABLE items (id INT PRIMARY KEY, note VARCHAR(100), n INT)"
    )
    binlog_db.execute("INSERT INTO items VALUES (2, 'b', 2)")
    t.drain(got.extend)  # before: no event, row 1 gone without a word
    assert seen(got) == [
        ("insert", 1, f"{db}.items"),
        ("truncate", None, f"{db}.items"),
        ("insert", 2, f"{db}.items"),
    ]
    t.source.close()  # type: ignore[attr-defined]


def test_a_cut_over_renaming_another_table_to_the_watched_name_stops_until_its_snapshot(
    binlog_db: BinlogDatabase,
) -> None:
    make_table(binlog_db)
    db = binlog_db.name
    t, _, _, got = watching(binlog_db, ["items"])
    binlog_db.execute("INSERT INTO items VALUES (1, 'a', 1)")
    make_table(binlog_db, "items_new")  # an online schema change's copy, not watched
    binlog_db.execute("INSERT INTO items_new VALUES (1, 'a', 1), (2, 'b', 2)")
    binlog_db.execute("RENAME TABLE items TO items_old, items_new TO items")
    binlog_db.execute("UPDATE items SET n = 20 WHERE id = 2")
    said = stopped(t, got.extend)
    assert (
        f"{db}.items was renamed to {db}.items_old, and its name given to the table that was "
        f"{db}.items_new"
    ) in said
    assert f"never read as {db}.items's" in said
    assert f"dbtrigger cdc snapshot MODULE:TRIGGER --table {db}.items --yes" in said
    assert [e.pk["id"] for e in got] == [1]

    source = t.source
    assert isinstance(source, BinlogSource)
    source.admin().request_snapshot("items", where="id = 1")  # some rows: not enough
    assert stopped(t, got.extend) == said
    source.admin().request_snapshot("items")  # what the error asks for: read the name on
    t.drain(got.extend)
    assert seen(got)[1:3] == [("truncate", None, f"{db}.items"), ("update", 2, f"{db}.items")]
    snapshot = {e.pk["id"]: dict(e.after or {}) for e in got[3:] if e.op == "upsert"}
    assert snapshot == {1: {"id": 1, "note": "a", "n": 1}, 2: {"id": 2, "note": "b", "n": 20}}
    source.close()


def test_statements_that_move_nothing_watched_do_not_stop(
    binlog_db: BinlogDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    make_table(binlog_db, "a")
    make_table(binlog_db, "b")
    make_table(binlog_db, "items")
    db = binlog_db.name
    other = binlog_db.server.create_database()  # a table of the same name elsewhere
    binlog_db.server.execute("CREATE TABLE items (id INT PRIMARY KEY)", None, other)
    t, _, _, got = watching(binlog_db, ["a", "b", "items"])
    binlog_db.execute("INSERT INTO a VALUES (1, 'a', 1)")
    binlog_db.execute("INSERT INTO b VALUES (2, 'b', 2)")
    binlog_db.execute("RENAME TABLE a TO tmp, b TO a, tmp TO b")  # a swap of two watched
    binlog_db.execute("RENAME TABLE items TO tmp, tmp TO items")  # there and back
    binlog_db.server.execute("RENAME TABLE items TO gone", None, other)  # not the watched
    binlog_db.server.execute("DROP TABLE gone", None, other)
    binlog_db.execute("CREATE TABLE unwatched (id INT)")
    binlog_db.execute("DROP TABLE IF EXISTS unwatched, never_was")
    binlog_db.execute("CREATE TEMPORARY TABLE items (id INT)")
    binlog_db.execute("DROP TEMPORARY TABLE IF EXISTS items")
    binlog_db.execute("UPDATE a SET n = 20")  # the table that was b
    binlog_db.execute("INSERT INTO items VALUES (3, 'c', 3)")
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        t.drain(got.extend)
    assert seen(got) == [
        ("insert", 1, f"{db}.a"),
        ("insert", 2, f"{db}.b"),
        ("update", 2, f"{db}.a"),  # read on under the name it has now, as PostgreSQL does
        ("insert", 3, f"{db}.items"),
    ]
    assert [r for r in caplog.records if getattr(r, "event", "") == "cdc_table_gone"] == []
    t.source.close()  # type: ignore[attr-defined]


def test_changes_before_a_rename_the_reader_had_not_reached_are_read_under_the_new_name(
    binlog_db: BinlogDatabase,
) -> None:
    # The migration and the new tables= deployed together: the poller never read up to
    # the rename, and its checkpoint is before changes the log names by the old name.
    # Before, those were skipped without a word once the source watched the new name.
    make_table(binlog_db)
    make_table(binlog_db, "other")  # a watched table that lives on, in the same transaction
    db = binlog_db.name
    before, store, name, got = watching(binlog_db, ["items", "other"])
    binlog_db.execute("INSERT INTO items VALUES (1, 'a', 1)")
    before.drain(got.extend)
    before.source.close()  # type: ignore[attr-defined]
    binlog_db.execute("INSERT INTO items VALUES (2, 'b', 2)")
    binlog_db.execute(
        "BEGIN NOT ATOMIC START TRANSACTION; UPDATE items SET n = 20 WHERE id = 2; "
        "INSERT INTO other VALUES (7, 'o', 7); COMMIT; END"
    )
    binlog_db.execute("RENAME TABLE items TO gone")
    binlog_db.execute("INSERT INTO gone VALUES (3, 'c', 3)")

    restarted = poller(binlog_db, ["items", "other"], store, name)  # a worker restarted
    said = stopped(restarted, got.extend)
    assert f"table {db}.items does not exist" in said
    assert "point tables= at its new name" in said
    restarted.source.close()  # type: ignore[attr-defined]

    after = poller(binlog_db, ["gone", "other"], store, name)
    accept(store, name, after)
    after.drain(got.extend)
    assert seen(got) == [
        ("insert", 1, f"{db}.items"),
        ("insert", 2, f"{db}.gone"),  # before the fix: skipped, and the update too
        ("update", 2, f"{db}.gone"),
        ("insert", 7, f"{db}.other"),
        ("insert", 3, f"{db}.gone"),
    ]
    after.source.close()  # type: ignore[attr-defined]
