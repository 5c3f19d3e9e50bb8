"""BinlogSource without column names in the log (``binlog_row_metadata`` not FULL,
MariaDB's default): a column change that keeps the count, read while it happens.

Names came from the catalog read when the source started, checked by count only:
after ``DROP COLUMN b, ADD COLUMN c INT`` every change carried ``b`` for ``c`` until
a restart. The server gives the table a new map id when it loads the changed
definition, and each new id is now named by the catalog read then (right for a
reader that keeps up). A reader behind a later ``ALTER`` named the changes written
before it by the catalog as it is now (``b``'s values as ``c``): it now looks ahead
in the log from each new id for a statement that changed the table, and stops
before that id's changes (their names are not knowable) until a snapshot of the
table is asked for after the statement (:mod:`dbtrigger.cdc.binlog_lookahead`).
"""

from __future__ import annotations

import uuid

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import BinlogSource, binlog_ddl, binlog_setup
from dbtrigger.errors import SourceDefinitionError
from tests import test_cdc_binlog_table_gone as gone
from tests.cdc_servers import BinlogDatabase
from tests.test_cdc_binlog_table_gone import seen

pytestmark = pytest.mark.timeout(120)


def watching(db: BinlogDatabase, got: list[RowChange]) -> PollTrigger:
    """A poller on ``t`` that has read the log once (its start before the test's changes)."""
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=BinlogSource(db.url, ["t"], snapshot="never"),
        checkpoint_store=InMemoryCheckpointStore(),
    )
    trigger.drain(got.extend)
    return trigger


def test_a_column_dropped_and_another_added_names_the_changes_after_it(
    binlog_db: BinlogDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The private server logs names (FULL); the source is made to read the catalog's.
    monkeypatch.setattr(binlog_setup.ServerFacts, "names_from_log", property(lambda _: False))
    binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT, b INT)")
    got: list[RowChange] = []
    trigger = watching(binlog_db, got)
    binlog_db.execute("INSERT INTO t VALUES (1, 10, 20)")
    trigger.drain(got.extend)
    binlog_db.execute("ALTER TABLE t DROP COLUMN b, ADD COLUMN c INT")
    binlog_db.execute("INSERT INTO t VALUES (2, 11, 30)")
    trigger.drain(got.extend)  # read before the next ALTER runs: the catalog fits it
    binlog_db.execute("ALTER TABLE t CHANGE a renamed INT")
    binlog_db.execute("UPDATE t SET c = 31 WHERE id = 2")
    trigger.drain(got.extend)
    trigger.source.close()
    assert [dict(e.after or {}) for e in got] == [
        {"id": 1, "a": 10, "b": 20},
        {"id": 2, "a": 11, "c": 30},
        {"id": 2, "renamed": 11, "c": 31},
    ]


def test_a_reader_behind_an_alter_stops_before_the_changes_it_cannot_name(
    binlog_db: BinlogDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(binlog_setup.ServerFacts, "names_from_log", property(lambda _: False))
    binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT, b INT)")
    first, store, name, got = gone.watching(binlog_db, ["t"])
    first.source.close()  # the worker stops, its checkpoint before what follows
    t = f"{binlog_db.name}.t"
    binlog_db.execute("INSERT INTO t VALUES (1, 10, 20)")
    binlog_db.execute("ALTER TABLE t DROP COLUMN b, ADD COLUMN c INT")
    binlog_db.execute("INSERT INTO t VALUES (2, 11, 30)")
    trigger = gone.poller(binlog_db, ["t"], store, name)  # started again, behind the ALTER

    said = ""
    for _ in range(10):  # a bound: the stop comes at the first read, or never
        try:
            trigger.tick(got.extend)
        except SourceDefinitionError as exc:
            said = str(exc)
            break
    assert [dict(e.after or {}) for e in got] == []  # was {"id": 1, "a": 10, "c": 20}, ...
    assert f"watched table {t} was changed by a statement" in said
    assert "DROP COLUMN b, ADD COLUMN c INT" in said
    assert "SET GLOBAL binlog_row_metadata = 'FULL'" in said
    assert f"dbtrigger cdc snapshot MODULE:TRIGGER --table {t} --yes" in said
    source = trigger.source
    assert isinstance(source, BinlogSource)
    assert f"delivery is held: {said}" in source.admin().status()["warnings"]
    [finding] = [f for f in source.self_check() if f.check == "delivery"]
    assert (finding.severity, finding.message) == ("error", said)

    source.admin().request_snapshot("t")  # the way on the error names
    trigger.drain(got.extend)
    assert seen(got)[:2] == [("truncate", None, t), ("insert", 2, t)]
    assert dict(got[1].after or {}) == {"id": 2, "a": 11, "c": 30}  # named by its own id
    snapshot = {e.pk["id"]: dict(e.after or {}) for e in got if e.op == "upsert"}
    assert snapshot == {1: {"id": 1, "a": 10, "c": None}, 2: {"id": 2, "a": 11, "c": 30}}
    assert "delivery is held" not in str(source.admin().status()["warnings"])
    binlog_db.execute("UPDATE t SET c = 31 WHERE id = 1")
    del got[:]
    trigger.drain(got.extend)
    assert [dict(e.after or {}) for e in got] == [{"id": 1, "a": 10, "c": 31}]
    source.close()


@pytest.mark.parametrize(
    ("text", "schema", "changes"),
    [
        ("ALTER TABLE t DROP COLUMN b, ADD COLUMN c INT", "db", True),
        ("alter online table `db`.`t` add index (a)", None, False),
        ("ALTER TABLE IF EXISTS t CHANGE a b INT", b"db", True),
        ("ALTER TABLE t2 ADD COLUMN c INT", "db", False),
        ("ALTER TABLE t ADD COLUMN c INT", "other", False),
        ("RENAME TABLE t TO t_old, t_new TO t", "db", True),
        ("CREATE OR REPLACE TABLE t (id INT PRIMARY KEY)", "db", True),
        ("DROP TABLE IF EXISTS `t` /* generated by server */", "db", True),
        ("TRUNCATE TABLE t", "db", False),
        ("INSERT INTO t VALUES (1)", "db", False),
    ],
)
def test_which_statements_change_a_watched_table(
    text: str, schema: str | bytes | None, changes: bool
) -> None:
    assert binlog_ddl.redefines(text, schema, "db.t") is changes


def test_the_way_on_works_in_the_worker_that_was_running_before_the_alter(
    binlog_db: BinlogDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker read the table's definition when it started, before both ALTERs; its
    # snapshot read the dropped column ("Unknown column 'b'") until it was restarted.
    monkeypatch.setattr(binlog_setup.ServerFacts, "names_from_log", property(lambda _: False))
    binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT, b INT)")
    trigger, _store, _name, got = gone.watching(binlog_db, ["t"])
    t = f"{binlog_db.name}.t"
    binlog_db.execute("INSERT INTO t VALUES (1, 10, 20)")
    # c a string: how its values read depends on its type, which the statement gives
    # but the catalog no longer has (an INT c is named by replaying the first ALTER on
    # the start's reading: tests/test_cdc_binlog_replay.py)
    binlog_db.execute("ALTER TABLE t DROP COLUMN b, ADD COLUMN c VARCHAR(10)")
    binlog_db.execute("INSERT INTO t VALUES (2, 11, 'x')")  # named by neither reading
    binlog_db.execute("ALTER TABLE t DROP COLUMN c, ADD COLUMN d INT")
    binlog_db.execute("INSERT INTO t VALUES (3, 12, 40)")
    with pytest.raises(SourceDefinitionError, match="DROP COLUMN c, ADD COLUMN d INT"):
        trigger.drain(got.extend)
    assert [dict(e.after or {}) for e in got] == [{"id": 1, "a": 10, "b": 20}]  # its reading
    source = trigger.source
    assert isinstance(source, BinlogSource)
    source.admin().request_snapshot("t")  # the way on, in the same process
    del got[:]
    trigger.drain(got.extend)
    assert seen(got)[:2] == [("truncate", None, t), ("insert", 3, t)]
    assert dict(got[1].after or {}) == {"id": 3, "a": 12, "d": 40}
    snapshot = {e.pk["id"]: dict(e.after or {}) for e in got if e.op == "upsert"}
    assert snapshot == {
        1: {"id": 1, "a": 10, "d": None},
        2: {"id": 2, "a": 11, "d": None},
        3: {"id": 3, "a": 12, "d": 40},
    }
    source.close()
