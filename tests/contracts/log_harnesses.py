"""Harnesses that drive log-based sources through the log-source contract."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import psycopg

from dbtrigger.cdc import PgLogicalSource
from dbtrigger.cursor import BEGINNING
from dbtrigger.sources.base import SourceAdapter
from dbtrigger.testing import LogOp, MemoryLogSource
from tests.cdc_servers import BinlogDatabase, CdcDatabase


class MemoryLogHarness:
    """The in-memory log: a dict for the table, one log transaction per commit."""

    secrets: Sequence[str] = ()

    def __init__(self, source: MemoryLogSource | None = None) -> None:
        self.source = source or MemoryLogSource("memory:t")
        self.rows: dict[int, str] = {}

    def open(self) -> SourceAdapter:
        return self.source

    def reopen(self, source: SourceAdapter) -> SourceAdapter:
        assert isinstance(source, MemoryLogSource)
        return source.share()

    def open_changed(self) -> SourceAdapter:
        return MemoryLogSource("memory:other")

    def changes(self, ops: Sequence[LogOp]) -> list[dict[str, Any]]:
        out = []
        for op in ops:
            before = {"id": op.id, "note": self.rows[op.id]} if op.id in self.rows else None
            if op.op == "delete":
                del self.rows[op.id]
                after = None
            else:
                self.rows[op.id] = op.note
                after = {"id": op.id, "note": op.note}
            out.append({"op": op.op, "pk": {"id": op.id}, "before": before, "after": after})
        return out

    def commit(self, ops: Sequence[LogOp]) -> None:
        self.source.commit(self.changes(ops))

    def rollback(self, ops: Sequence[LogOp]) -> None:
        saved = dict(self.rows)
        self.changes(ops)
        self.rows = saved

    def commit_crossed(self, first: Sequence[LogOp], second: Sequence[LogOp]) -> None:
        self.commit(second)
        self.commit(first)


class PgLogHarness:
    """PgLogicalSource on a private wal_level=logical server, table ``t (id, note)``."""

    password = "s3cret-cdc-harness"  # noqa: S105 - trust auth ignores it; it must never show

    def __init__(self, db: CdcDatabase, mode: str = "poll") -> None:
        self.db = db
        self.mode = mode
        self.table = f"t_{uuid.uuid4().hex[:8]}"
        self.slot = f"contract_{uuid.uuid4().hex[:10]}"
        db.execute(f"CREATE TABLE {self.table} (id integer PRIMARY KEY, note text)")

    @property
    def secrets(self) -> Sequence[str]:
        return (self.password,)

    @property
    def url(self) -> str:
        return self.db.url.replace("postgres@", f"postgres:{self.password}@")

    def _source(self, table: str, slot: str) -> PgLogicalSource:
        return PgLogicalSource(self.url, [table], slot=slot, snapshot="never", mode=self.mode)

    def open(self) -> SourceAdapter:
        source = self._source(self.table, self.slot)
        assert (
            list(source.fetch(BEGINNING, 1)) == []
        )  # creates publication and slot: the log starts
        return source

    def reopen(self, source: SourceAdapter) -> SourceAdapter:
        return self._source(self.table, self.slot)

    def open_changed(self) -> SourceAdapter:
        other = f"o_{uuid.uuid4().hex[:8]}"
        self.db.execute(f"CREATE TABLE {other} (id integer PRIMARY KEY, note text)")
        return self._source(other, f"contract_{uuid.uuid4().hex[:10]}")

    def _apply(self, conn: psycopg.Connection[Any], ops: Sequence[LogOp]) -> None:
        for op in ops:
            if op.op == "insert":
                conn.execute(
                    f"INSERT INTO {self.table} (id, note) VALUES (%s, %s)", (op.id, op.note)
                )
            elif op.op == "update":
                conn.execute(f"UPDATE {self.table} SET note = %s WHERE id = %s", (op.note, op.id))
            else:
                conn.execute(f"DELETE FROM {self.table} WHERE id = %s", (op.id,))

    def commit(self, ops: Sequence[LogOp]) -> None:
        with self.db.connect() as conn, conn.transaction():
            self._apply(conn, ops)

    def rollback(self, ops: Sequence[LogOp]) -> None:
        with self.db.connect() as conn:
            conn.autocommit = False
            self._apply(conn, ops)
            conn.rollback()

    def commit_crossed(self, first: Sequence[LogOp], second: Sequence[LogOp]) -> None:
        with self.db.connect() as one, self.db.connect() as two:
            one.autocommit = False
            self._apply(one, first)
            with two.transaction():
                self._apply(two, second)
            one.commit()


class BinlogLogHarness:
    """BinlogSource on a private MariaDB with a ROW binary log, table ``t (id, note)``."""

    password = "s3cret-binlog-harness"  # noqa: S105 - a test user's; it must never show
    user = "binlog_harness"

    def __init__(self, db: BinlogDatabase) -> None:
        self.db = db
        db.server.execute(
            f"CREATE USER IF NOT EXISTS '{self.user}'@'127.0.0.1' IDENTIFIED BY '{self.password}'"
        )
        db.server.execute(f"GRANT ALL PRIVILEGES ON *.* TO '{self.user}'@'127.0.0.1'")
        self.table = f"t_{uuid.uuid4().hex[:8]}"
        self.reader = f"contract_{uuid.uuid4().hex[:10]}"
        db.execute(f"CREATE TABLE {self.table} (id integer PRIMARY KEY, note text)")

    @property
    def secrets(self) -> Sequence[str]:
        return (self.password,)

    @property
    def url(self) -> str:
        return self.db.server.url(self.db.name, self.user, self.password)

    def _source(self, table: str, reader: str) -> SourceAdapter:
        from dbtrigger.cdc import BinlogSource  # noqa: PLC0415

        return BinlogSource(self.url, [table], reader=reader, snapshot="never")

    def open(self) -> SourceAdapter:
        source = self._source(self.table, self.reader)
        assert list(source.fetch(BEGINNING, 1)) == []  # creates the reader: the log starts
        return source

    def reopen(self, source: SourceAdapter) -> SourceAdapter:
        return self._source(self.table, self.reader)

    def open_changed(self) -> SourceAdapter:
        other = f"o_{uuid.uuid4().hex[:8]}"
        self.db.execute(f"CREATE TABLE {other} (id integer PRIMARY KEY, note text)")
        return self._source(other, f"contract_{uuid.uuid4().hex[:10]}")

    def _apply(self, cur: Any, ops: Sequence[LogOp]) -> None:
        for op in ops:
            if op.op == "insert":
                cur.execute(
                    f"INSERT INTO {self.table} (id, note) VALUES (%s, %s)", (op.id, op.note)
                )
            elif op.op == "update":
                cur.execute(f"UPDATE {self.table} SET note = %s WHERE id = %s", (op.note, op.id))
            else:
                cur.execute(f"DELETE FROM {self.table} WHERE id = %s", (op.id,))

    def commit(self, ops: Sequence[LogOp]) -> None:
        conn = self.db.connect(autocommit=False)
        try:
            with conn.cursor() as cur:
                self._apply(cur, ops)
            conn.commit()
        finally:
            conn.close()

    def rollback(self, ops: Sequence[LogOp]) -> None:
        conn = self.db.connect(autocommit=False)
        try:
            with conn.cursor() as cur:
                self._apply(cur, ops)
            conn.rollback()
        finally:
            conn.close()

    def commit_crossed(self, first: Sequence[LogOp], second: Sequence[LogOp]) -> None:
        one = self.db.connect(autocommit=False)
        two = self.db.connect(autocommit=False)
        try:
            with one.cursor() as cur:
                self._apply(cur, first)
            with two.cursor() as cur:
                self._apply(cur, second)
            two.commit()
            one.commit()
        finally:
            one.close()
            two.close()


class ChangeLogHarness:
    """ChangeLogSource: the trigger-maintained change log of ``t (id, note)``.

    A sequence log: SQLite serialises writers, so there ``commit_crossed``
    commits the two transactions one after the other (no crossing exists to
    test); PostgreSQL and MariaDB really cross them. On MariaDB the source runs
    without its guard: the server-wide horizon waits for every session's open
    writer on the shared server, so "visible when ``commit`` returns" would
    depend on other test sessions (the guard has its own tests).
    """

    def __init__(self, db: Any) -> None:
        from dbtrigger.changelog import install  # noqa: PLC0415

        self.db = db
        self.table = f"t_{uuid.uuid4().hex[:8]}"
        for name in (self.table, f"{self.table}_other"):
            db.execute(f"CREATE TABLE {db.qualified(name)} (id integer PRIMARY KEY, note text)")
            with db.engine.begin() as conn:
                install(conn, name, schema=db.schema)
        self.secrets: Sequence[str] = ()

    def _source(self, table: str) -> SourceAdapter:
        from dbtrigger.changelog import ChangeLogSource  # noqa: PLC0415

        visibility = "none" if self.db.kind == "mariadb" else "auto"
        return ChangeLogSource(
            url=self.db.url, table=table, schema=self.db.schema, visibility=visibility
        )

    def open(self) -> SourceAdapter:
        return self._source(self.table)

    def reopen(self, source: SourceAdapter) -> SourceAdapter:
        del source
        return self.open()

    def open_changed(self) -> SourceAdapter:
        return self._source(f"{self.table}_other")

    def _apply(self, conn: Any, ops: Sequence[LogOp]) -> None:
        import sqlalchemy as sa  # noqa: PLC0415

        table = self.db.qualified(self.table)
        for op in ops:
            if op.op == "insert":
                sql = f"INSERT INTO {table} (id, note) VALUES (:id, :note)"
            elif op.op == "update":
                sql = f"UPDATE {table} SET note = :note WHERE id = :id"
            else:
                sql = f"DELETE FROM {table} WHERE id = :id"
            conn.execute(sa.text(sql), {"id": op.id, "note": op.note})

    def commit(self, ops: Sequence[LogOp]) -> None:
        with self.db.engine.begin() as conn:
            self._apply(conn, ops)

    def rollback(self, ops: Sequence[LogOp]) -> None:
        with self.db.engine.connect() as conn, conn.begin() as tx:
            self._apply(conn, ops)
            tx.rollback()

    def commit_crossed(self, first: Sequence[LogOp], second: Sequence[LogOp]) -> None:
        if self.db.kind == "sqlite":
            self.commit(first)
            self.commit(second)
            return
        from dbtrigger.testing.contracts.log_source import crossed  # noqa: PLC0415

        conn = self.db.engine.connect()
        tx = conn.begin()
        try:
            crossed(lambda: self._apply(conn, first), lambda: self.commit(second), tx.commit)
        finally:
            conn.close()
