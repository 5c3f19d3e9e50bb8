"""The horizons' bound is cached until a fetch reaches it, and stays lossless.

A bound is only ever replaced by a larger one, and a bound stays valid once
computed: every value at or below it belongs to a transaction that has ended
(PostgreSQL: all transactions open at the probe ended; MariaDB: every writer
that could still commit below it was accounted for). So a catch-up of full
batches reads the transaction list once, and a writer that starts while the
cached bound is in use is still waited for at the next refresh.
(The MariaDB version of this test is in test_visibility_mariadb.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import SqlAlchemySource
from dbtrigger.cursor import BEGINNING, Position
from dbtrigger.sources.visibility import (
    ActiveGuard,
    GuardTarget,
    TransactionHorizon,
    VisibilityGuard,
)
from tests.databases import TestDatabase
from tests.test_visibility import wait_until


@pytest.mark.postgresql
@pytest.mark.timeout(30)
def test_postgresql_bound_is_cached_until_a_fetch_reaches_it_and_stays_lossless(
    pg: TestDatabase,
) -> None:
    table = pg.qualified("events")
    pg.execute(
        f"CREATE TABLE {table} (id bigserial PRIMARY KEY, "
        "updated_at timestamptz NOT NULL DEFAULT now(), note text)"
    )
    pg.execute(
        f"INSERT INTO {table} (updated_at, note) "
        "SELECT now() - interval '1 hour' + i * interval '1 ms', 'old' "
        "FROM generate_series(1, 95) AS i"
    )
    src = SqlAlchemySource(
        url=pg.url,
        table="events",
        schema=pg.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility=TransactionHorizon(settle_seconds=0),
    )
    statements: list[str] = []
    sa.event.listen(src.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))

    def activity_reads() -> int:
        return sum("pg_stat_activity" in s for s in statements)

    rows = src.fetch(BEGINNING, 10)
    writer = pg.engine.connect()
    try:
        writer.begin()
        pending = writer.execute(
            sa.text(f"INSERT INTO {table} (note) VALUES ('pending') RETURNING id")
        ).scalar_one()
        newer = pg.engine.connect()
        newer_id = newer.execute(
            sa.text(f"INSERT INTO {table} (note) VALUES ('newer') RETURNING id")
        ).scalar_one()
        newer.commit()
        newer.close()
        seen: list[Any] = []
        while True:
            seen.extend(rows)
            position = Position(cursor=rows[-1]["updated_at"], pk={"id": rows[-1]["id"]})
            if len(rows) < 10:
                break
            rows = src.fetch(position, 10)
        assert [r["note"] for r in seen] == ["old"] * 95
        assert activity_reads() == 1, "full batches must reuse the bound"
        # The drain reached the bound: the next fetch probes again, and the
        # open writer (started after the cached bound) holds it below 'pending'.
        assert src.fetch(position, 10) == []
        assert activity_reads() == 2
        info = src.last_fetch_info
        assert info is not None
        assert info.held_back
        writer.commit()
        assert wait_until(lambda: len(src.fetch(position, 10)) == 2, timeout=10)
        assert {r["id"] for r in src.fetch(position, 10)} == {pending, newer_id}
    finally:
        writer.close()
        src.close()


@pytest.mark.postgresql
@pytest.mark.timeout(120)
def test_postgresql_guarded_fetches_reuse_one_statement_and_read_in_autocommit(
    pg: TestDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cached bound goes to the same statement as a parameter (built, compiled
    # and prepared once, then read through the driver's cursor), and the reads
    # run in autocommit: a guarded catch-up costs what an unguarded one does.
    # The bound still moves: rows committed later are read up to the new one.
    import psycopg  # noqa: PLC0415 - the PostgreSQL driver, only for this test

    table = pg.qualified("events")
    pg.execute(
        f"CREATE TABLE {table} (id bigserial PRIMARY KEY, "
        "updated_at timestamptz NOT NULL DEFAULT now(), note text)"
    )
    pg.execute(
        f"INSERT INTO {table} (updated_at, note) "
        "SELECT now() - interval '1 hour' + i * interval '1 ms', 'old' "
        "FROM generate_series(1, 40) AS i"
    )
    src = SqlAlchemySource(
        url=pg.url,
        table="events",
        schema=pg.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility=TransactionHorizon(settle_seconds=0),
    )
    reads: list[bool] = []
    real_execute = psycopg.Cursor.execute

    def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if isinstance(query, str) and "ORDER BY" in query:
            reads.append(self.connection.autocommit)
        return real_execute(self, query, params, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", execute)
    try:
        seen: list[Any] = []
        # Another session's open transaction may hold the horizon for a moment.
        assert wait_until(lambda: bool(seen.extend(src.fetch(BEGINNING, 5)) or seen), timeout=30)
        while True:
            position = Position(cursor=seen[-1]["updated_at"], pk={"id": seen[-1]["id"]})
            rows = src.fetch(position, 5)
            seen.extend(rows)
            if len(rows) < 5:
                break
        assert [r["id"] for r in seen] == list(range(1, 41))
        assert reads[-8:] == [True] * 8, "a guarded read after the first runs in autocommit"
        statements = [entry[2] for entry in src._keyset._guarded.values()]
        assert len(statements) == 2  # from the beginning, and after a position
        assert any(plan.stmt is statements[1] for plan in src._processors._direct.values())
        pg.execute(f"INSERT INTO {table} (note) SELECT 'new' FROM generate_series(1, 3)")
        assert wait_until(lambda: len(src.fetch(position, 5)) == 3, timeout=30)
        assert [r["note"] for r in src.fetch(position, 5)] == ["new"] * 3
        assert len(src._keyset._guarded) == 2
    finally:
        src.close()


def test_a_guard_that_returns_a_bare_predicate_still_guards(tmp_path: Any) -> None:
    # The condition a guard returns is a FetchCondition (predicate + the values
    # of its parameters); a guard written to return the bare predicate works too.
    url = f"sqlite:///{tmp_path / 'bare.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE events (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)"))
        conn.execute(sa.text("INSERT INTO events (id, seq) VALUES (1, 1), (2, 2), (3, 3), (4, 4)"))
    engine.dispose()

    class UpToTwo(VisibilityGuard):
        def guarantee(self, dialect: str) -> str:
            del dialect
            return "rows up to seq 2"

        def activate(self, target: GuardTarget) -> ActiveGuard:
            class Active(ActiveGuard):
                def before_fetch(self, conn: Any, after: Position) -> Any:
                    del conn, after
                    return target.cursor <= 2

            return Active(self, target)

    src = SqlAlchemySource(
        url=url, table="events", cursor_column="seq", pk_columns=["id"], visibility=UpToTwo()
    )
    try:
        for _ in range(3):  # the statement is reused from the second fetch on
            assert [r["id"] for r in src.fetch(BEGINNING, 10)] == [1, 2]
    finally:
        src.close()
