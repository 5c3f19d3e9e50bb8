"""PostgreSQL change-log triggers that look installed but do not fire.

* ``session_replication_role = replica`` (a logical-replication subscriber's
  apply worker, ``pg_restore --disable-triggers``, bulk loaders that skip
  foreign keys) silences every ordinary trigger: the writes of such a session
  were never logged. The triggers are now installed ``ENABLE ALWAYS``.
* ``ALTER TABLE ... DISABLE TRIGGER`` (``ALL`` / ``USER`` around a bulk load)
  left the triggers in place but off: no drift was reported and every change
  went unlogged. The drift check now names them and the statements that enable
  them again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange
from dbtrigger.changelog import ChangeLogSource, install
from dbtrigger.cli import main
from dbtrigger.errors import ChangeLogDriftError
from tests.databases import TestDatabase


def orders(db: TestDatabase) -> str:
    table = db.qualified("orders")
    db.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, status text)")
    install(db.engine, "orders", schema=db.schema)
    return table


def poller(db: TestDatabase, tmp_path: Path) -> PollTrigger:
    source = ChangeLogSource(url=db.url, table="orders", schema=db.schema)
    return PollTrigger(
        name="orders", source=source, checkpoint_store=FileCheckpointStore(tmp_path / "state")
    )


@pytest.mark.postgresql
def test_a_replica_role_session_is_logged(pg: TestDatabase, tmp_path: Path) -> None:
    table = orders(pg)
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
        conn.exec_driver_sql(f"INSERT INTO {table} VALUES (1, 'restored')")
    trigger = poller(pg, tmp_path)
    got: list[int] = []
    try:
        trigger.drain(lambda events: got.extend(e.pk["id"] for e in events))
        assert got == [1]
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


@pytest.mark.postgresql
def test_disabled_triggers_are_drift_naming_the_statements_that_enable_them(
    pg: TestDatabase, tmp_path: Path
) -> None:
    table = orders(pg)
    pg.execute(f"ALTER TABLE {table} DISABLE TRIGGER USER")
    trigger = poller(pg, tmp_path)
    try:
        with pytest.raises(ChangeLogDriftError) as caught:
            trigger.drain(lambda events: None)
        message = str(caught.value)
        assert "dbt_cl_orders, dbt_cl_orders_trunc disabled" in message
        assert f"ALTER TABLE {pg.schema}.orders ENABLE ALWAYS TRIGGER dbt_cl_orders;" in message
        for statement in message.split("`")[1].split("; "):
            pg.execute(statement)
        pg.execute(f"INSERT INTO {table} VALUES (1, 'new')")
        trigger.source.close()  # type: ignore[attr-defined]
        trigger = poller(pg, tmp_path)
        assert trigger.drain(lambda events: None) == 1
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


@pytest.mark.postgresql
def test_rows_leaving_with_a_partition_are_reported_naming_the_partition(
    pg: TestDatabase, tmp_path: Path
) -> None:
    """A partition's own TRUNCATE and a DETACH PARTITION remove rows from the
    partitioned table without firing any of its triggers. The vanished check found
    them but blamed triggers "missing or disabled"; it now names the partition."""
    table = pg.qualified("orders")
    pg.execute(
        f"CREATE TABLE {table} (id int, region text, PRIMARY KEY (id, region)) "
        "PARTITION BY LIST (region)"
    )
    for region in ("eu", "us"):
        pg.execute(
            f"CREATE TABLE {pg.qualified('orders_' + region)} PARTITION OF {table} "
            f"FOR VALUES IN ('{region.upper()}')"
        )
    install(pg.engine, "orders", schema=pg.schema)
    pg.execute(f"INSERT INTO {table} VALUES (1, 'EU'), (2, 'US')")
    pg.execute(f"TRUNCATE {pg.qualified('orders_eu')}")
    pg.execute(f"ALTER TABLE {table} DETACH PARTITION {pg.qualified('orders_us')}")
    trigger = poller(pg, tmp_path)
    try:
        with pytest.raises(ChangeLogDriftError) as caught:
            trigger.drain(lambda events: None)
        message = str(caught.value)
        assert "(1, EU)" in message
        assert "(2, US)" in message
        assert "a TRUNCATE of one partition, or a partition detached or dropped" in message
    finally:
        trigger.source.close()  # type: ignore[attr-defined]


def test_a_dropped_trigger_names_the_resync_that_sends_what_it_missed(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """A migration dropped the insert trigger (a rebuild, a DROP TRIGGER): the drift
    error named only the install, after which the poller went on and the rows
    inserted meanwhile never reached it, with nothing more said. It now names the
    resync too, and following it delivers them."""
    table = orders(sqlite_db)
    sqlite_db.execute(f"INSERT INTO {table} VALUES (1, 'new')")
    trigger = poller(sqlite_db, tmp_path)
    rows: dict[int, str] = {}

    def replica(events: list[RowChange]) -> None:
        for e in events:
            if e.op == "truncate":
                rows.clear()
            elif e.after is not None:
                rows[e.pk["id"]] = e.after["status"]

    assert trigger.drain(replica) == 1
    sqlite_db.execute("DROP TRIGGER dbt_cl_orders_ins")
    sqlite_db.execute(f"INSERT INTO {table} VALUES (2, 'unlogged')")
    with pytest.raises(ChangeLogDriftError) as refused:
        poller(sqlite_db, tmp_path).tick(replica)
    message = str(refused.value)
    assert "changelog install" in message
    assert "dbtrigger changelog resync --url URL --table orders --yes" in message, message
    install(sqlite_db.engine, "orders")
    assert main(["changelog", "resync", "--url", sqlite_db.url, "--table", "orders", "--yes"]) == 0
    poller(sqlite_db, tmp_path).drain(replica)
    assert rows == {1: "new", 2: "unlogged"}


@pytest.mark.postgresql
def test_triggers_enabled_again_for_ordinary_sessions_only_are_drift(
    pg: TestDatabase, tmp_path: Path
) -> None:
    """``DISABLE TRIGGER ALL`` then ``ENABLE TRIGGER ALL`` around a bulk load (what
    ``pg_restore --disable-triggers`` runs) leaves the triggers firing in ordinary
    sessions only, no longer ``ALWAYS``: a replica-role session's writes (a logical
    replication subscriber) went unlogged again, and the drift check said nothing.
    It now names the statements that make them ``ALWAYS`` again."""
    table = orders(pg)
    pg.execute(f"ALTER TABLE {table} DISABLE TRIGGER ALL")
    pg.execute(f"ALTER TABLE {table} ENABLE TRIGGER ALL")
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
        conn.exec_driver_sql(f"INSERT INTO {table} VALUES (1, 'replicated')")
    log = pg.qualified("dbt_changelog_orders")
    assert pg.scalar(f"SELECT count(*) FROM {log}") == 0  # what it costs: not logged
    trigger = poller(pg, tmp_path)
    try:
        with pytest.raises(ChangeLogDriftError) as caught:
            trigger.drain(lambda events: None)
        message = str(caught.value)
        assert "ordinary sessions only" in message, message
        assert "dbtrigger changelog resync" in message, message
        assert f"ALTER TABLE {pg.schema}.orders ENABLE ALWAYS TRIGGER dbt_cl_orders;" in message
        for statement in message.split("`")[1].split("; "):
            pg.execute(statement)
        with pg.engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
            conn.exec_driver_sql(f"INSERT INTO {table} VALUES (2, 'replicated')")
        trigger.source.close()  # type: ignore[attr-defined]
        trigger = poller(pg, tmp_path)
        got: list[int] = []
        trigger.drain(lambda events: got.extend(e.pk["id"] for e in events))
        assert got == [2]  # row 1 comes with the resync the message names
    finally:
        trigger.source.close()  # type: ignore[attr-defined]
