"""PgLogicalSource while a watched table's columns and primary key change under a running
poller (pgoutput sends a Relation message before the first change of the new shape).

Added, dropped and renamed columns were named right. The primary key was the one
read when the source started: after ``DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (a,
id)`` every change came keyed ``{"id": ...}`` (lanes and key order by the old key)
until a restart. The Relation message flags the replica identity's columns as the
table was when the change was written; under ``REPLICA IDENTITY DEFAULT`` and
``USING INDEX`` those are the key now taken.
"""

from __future__ import annotations

import pytest

from dbtrigger.cdc import pgoutput as po
from tests.cdc_servers import CdcDatabase
from tests.test_cdc_pg import drain, poller

pytestmark = pytest.mark.timeout(120)


def test_columns_added_dropped_and_renamed_under_a_running_poller(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, a int, b int)")
    trigger, source = poller(cdc_db, ["t"])
    drain(trigger)
    got = []
    for statement in (
        "INSERT INTO t VALUES (1, 10, 20)",
        "ALTER TABLE t ADD COLUMN c int",
        "INSERT INTO t VALUES (2, 11, 21, 31)",
        "ALTER TABLE t DROP COLUMN b",
        "INSERT INTO t VALUES (3, 12, 32)",
        "ALTER TABLE t RENAME COLUMN a TO a2",
        "UPDATE t SET c = 33 WHERE id = 3",
    ):
        cdc_db.execute(statement)
        got += drain(trigger)  # the worker ticks between the statements
    assert [dict(e.after or {}) for e in got] == [
        {"id": 1, "a": 10, "b": 20},
        {"id": 2, "a": 11, "b": 21, "c": 31},
        {"id": 3, "a": 12, "c": 32},
        {"id": 3, "a2": 12, "c": 33},
    ]
    trigger.close()
    source.close()


@pytest.mark.parametrize(
    ("ticks_between", "mode"), [(True, "poll"), (False, "poll"), (True, "stream")]
)
def test_a_primary_key_changed_under_a_running_poller_keys_the_changes_after_it_anew(
    cdc_db: CdcDatabase, ticks_between: bool, mode: str
) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, a int NOT NULL, b int)")
    trigger, source = poller(cdc_db, ["t"], mode=mode, stream_wait_seconds=0)
    drain(trigger)
    got = []
    cdc_db.execute("INSERT INTO t VALUES (1, 10, 20)")
    if ticks_between:
        got += drain(trigger)
    cdc_db.execute("ALTER TABLE t DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (a, id)")
    cdc_db.execute("INSERT INTO t VALUES (2, 11, 21)")
    cdc_db.execute("UPDATE t SET b = 22 WHERE id = 2")
    cdc_db.execute("DELETE FROM t WHERE id = 1")
    got += drain(trigger)
    # before: {"id": 2} for each change after the ALTER
    assert [(e.op, dict(e.pk)) for e in got] == [
        ("insert", {"id": 1}),
        ("insert", {"a": 11, "id": 2}),
        ("update", {"a": 11, "id": 2}),
        ("delete", {"a": 10, "id": 1}),
    ]
    trigger.close()
    source.close()


def relation(identity: str, *flags: tuple[str, bool]) -> po.Relation:
    columns = tuple(po.Column(int(flag), name, 23, -1) for name, flag in flags)
    return po.Relation(1, "public", "t", identity, columns)


def test_the_key_a_relation_message_gives() -> None:
    from dbtrigger.cdc.pg_reader import relation_keys as keys  # noqa: PLC0415

    assert keys(relation("d", ("id", True), ("a", True)), ["a", "id"]) == ("a", "id")
    assert keys(relation("d", ("id", True), ("a", True)), ["id"]) == ("id", "a")  # anew
    assert keys(relation("d", ("id", False), ("k", True)), ["id"]) == ("k",)  # renamed
    assert keys(relation("f", ("id", True), ("a", True)), ["id"]) == ("id",)  # all flagged
    assert keys(relation("d", ("id", False)), ["id"]) == ("id",)  # none then: the start's
