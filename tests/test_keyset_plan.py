"""The keyset fetch is an index range scan on MariaDB too (a plan property, not a timing)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from dbtrigger import SqlAlchemySource
from dbtrigger.cursor import Position
from tests.databases import TestDatabase

pytestmark = pytest.mark.mariadb


def test_mariadb_keyset_fetch_is_a_range_scan(mariadb: TestDatabase) -> None:
    table = mariadb.qualified("kx")
    mariadb.execute(
        f"CREATE TABLE {table} (id INT PRIMARY KEY, seq INT NOT NULL, note VARCHAR(20), "
        "INDEX ix_seq_id (seq, id))"
    )
    with mariadb.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} VALUES (:id, :seq, 'x')"),
            [{"id": i, "seq": i} for i in range(1, 3001)],
        )
        conn.exec_driver_sql(f"ANALYZE TABLE {table}")
    source = SqlAlchemySource(
        url=mariadb.url,
        table="kx",
        schema=mariadb.schema,
        cursor_column="seq",
        pk_columns=["id"],
        visibility="none",
    )
    rows = source.fetch(Position(cursor=1500, pk={"id": 1500}), 100)  # resolves the shape
    assert [r["id"] for r in rows][:2] == [1501, 1502]
    stmt = source._keyset.statement(Position(cursor=1500, pk={"id": 1500}), 100)
    sql = str(stmt.compile(dialect=mariadb.engine.dialect, compile_kwargs={"literal_binds": True}))
    with mariadb.engine.connect() as conn:
        plan = conn.exec_driver_sql("EXPLAIN " + sql).mappings().all()
    assert plan[0]["type"] == "range", plan
    assert plan[0]["key"] == "ix_seq_id", plan
    source.close()
