"""Source harnesses: the contract table on each database, and in memory.

A harness puts :class:`~dbtrigger.testing.ContractRow` values where a source
reads them and builds the sources under test. The SQL variants cover both
cursor kinds the visibility guards treat differently (integers and
timestamps), table and query mode, and the guard ``auto`` picks as well as
``visibility="none"``. Timestamps are 2020 values, long past every safety
window, and each ``put`` commits before it returns, so a guard never holds a
contract row back once it has a bound: the results are deterministic. (The
MariaDB horizon has none until an observation of the server's writers shows
when each of them began; ``open`` waits for it, see :meth:`SqlHarness.open`.)
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from dbtrigger import SqlAlchemySource
from dbtrigger.cursor import BEGINNING
from dbtrigger.faults import FaultySource
from dbtrigger.sources.base import SourceAdapter
from dbtrigger.testing import ContractRow, MemorySource
from tests.databases import TestDatabase

EPOCH = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
#: How long ``open`` waits for the MariaDB horizon's first bound.
FIRST_BOUND_SECONDS = 60.0
#: More rows than any contract table holds.
ALL = 1_000
INT_BASE = 3_000_000
#: A made-up password the sources are configured with; it must never show.
SECRET = "c0ntract-Secr3t"  # noqa: S105
TABLE = "contract_rows"


class MemoryHarness:
    """The contract table as a :class:`MemorySource`.

    A memory source *is* its data, so ``open`` hands out the one instance
    (``close`` keeps the rows); ``wrap`` lets a wrapper such as
    :class:`~dbtrigger.faults.FaultySource` stand in front of it.
    """

    secrets: Sequence[str] = ()

    def __init__(self, wrap: Any = None) -> None:
        self.memory = MemorySource(cursor_column="seq", pk_columns=["tenant", "id"], name=TABLE)
        self._wrap = wrap

    def put(self, rows: Sequence[ContractRow]) -> None:
        self.memory.put(
            *({"seq": r.seq, "tenant": r.tenant, "id": r.id, "note": r.note} for r in rows)
        )

    def open(self) -> SourceAdapter:
        return self._wrap(self.memory) if self._wrap else self.memory

    def open_changed(self) -> SourceAdapter:
        return MemorySource(cursor_column="seq", pk_columns=["tenant", "id"], name="other")

    def cursor_value(self, seq: int) -> Any:
        return seq


def faulty_memory_harness() -> MemoryHarness:
    """FaultySource with no plan in front of a MemorySource: it must be transparent."""
    return MemoryHarness(wrap=FaultySource)


class SqlHarness:
    """The contract table on one test database, polled by :class:`SqlAlchemySource`.

    Args:
        cursor: ``int`` (BIGINT) or ``timestamp`` (timestamptz on PostgreSQL,
            DATETIME(6) on MariaDB, DATETIME on SQLite).
        visibility: passed to the source.
        query_mode: poll ``SELECT ... FROM contract_rows`` instead of the table.
    """

    def __init__(
        self, db: TestDatabase, *, cursor: str, visibility: str = "auto", query_mode: bool = False
    ) -> None:
        self.db = db
        self.cursor_kind = cursor
        self.visibility = visibility
        self.query_mode = query_mode
        if cursor == "int":
            cursor_type: Any = sa.BigInteger()
        elif db.kind == "postgresql":
            cursor_type = sa.DateTime(timezone=True)
        elif db.kind == "mariadb":
            cursor_type = mysql.DATETIME(fsp=6)
        else:
            cursor_type = sa.DateTime()
        self.table = sa.Table(
            TABLE,
            sa.MetaData(),
            sa.Column("seq", cursor_type, nullable=False),
            sa.Column("tenant", sa.String(8), primary_key=True),
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("note", sa.String(200), nullable=False),
            sa.Index("ix_contract_rows_seq", "seq", "tenant", "id"),
            schema=db.schema,
        )
        self.table.create(db.engine)
        # Sources get a URL carrying a password (only their name and fingerprint
        # see it) and share the test's engine, which needs none.
        url = sa.make_url(db.url)
        self.url = url if db.kind == "sqlite" else url.set(password=SECRET)
        self.secrets: Sequence[str] = () if db.kind == "sqlite" else (SECRET,)

    def _value(self, seq: int) -> Any:
        if self.cursor_kind == "int":
            # Millions, like real sequence values, and a number SQLite's
            # julianday() reads as a day in the future: a source that took the
            # integers for timestamps would hold every row back.
            return INT_BASE + seq
        value = EPOCH + dt.timedelta(seconds=seq)
        return value if self.db.kind == "postgresql" else value.replace(tzinfo=None)

    def cursor_value(self, seq: int) -> Any:
        value = self._value(seq)
        if self.db.kind == "sqlite" and self.cursor_kind == "timestamp":
            # SQLite keeps timestamps as text; the source hands them back verbatim.
            return value.strftime("%Y-%m-%d %H:%M:%S.%f")
        return value

    def put(self, rows: Sequence[ContractRow]) -> None:
        t = self.table
        with self.db.engine.begin() as conn:
            for r in rows:
                conn.execute(t.delete().where(t.c.tenant == r.tenant, t.c.id == r.id))
            if rows:
                conn.execute(
                    t.insert(),
                    [
                        {"seq": self._value(r.seq), "tenant": r.tenant, "id": r.id, "note": r.note}
                        for r in rows
                    ],
                )

    def _source(self, **overrides: Any) -> SqlAlchemySource:
        where: dict[str, Any] = {}
        if self.query_mode:
            where["query"] = f"SELECT seq, tenant, id, note FROM {self.db.qualified(TABLE)}"
        else:
            where["table"] = TABLE
            where["schema"] = self.db.schema
        return SqlAlchemySource(
            url=self.url.render_as_string(hide_password=False),
            engine=self.db.engine,
            cursor_column="seq",
            pk_columns=["tenant", "id"],
            visibility=self.visibility,
            **{**where, **overrides},
        )

    def open(self) -> SqlAlchemySource:
        """A source whose guard has a bound: every row put is visible to it.

        The MariaDB transaction horizon consumes nothing until one observation
        proved ``INNODB_TRX`` fresh and found no write transaction open whose
        start it cannot know (it reads the whole server). On the shared test
        server other tests hold such writers open, or read the cache without
        taking turns, for seconds at a time: the contract tests' first fetch
        came back empty under load. Once there is a bound it only moves forward
        and lies past every 2020 row, so the harness waits for it here (bounded).
        """
        source = self._source()
        if self.db.kind == "mariadb" and self.visibility != "none":
            deadline = time.monotonic() + FIRST_BOUND_SECONDS
            # Never a full batch: a fetch that fills its limit keeps the last info.
            source.fetch(BEGINNING, ALL)
            while (info := source.last_fetch_info) is None or info.horizon is None:
                if time.monotonic() > deadline:
                    source.close()
                    raise AssertionError(f"no bound within {FIRST_BOUND_SECONDS:.0f}s: {info}")
                time.sleep(0.05)
                source.fetch(BEGINNING, ALL)
        return source

    def open_changed(self) -> SqlAlchemySource:
        return self._source(where="id >= 0")


class PartitionHarness:
    """The contract table through a :class:`~dbtrigger.partitions.PartitionSource`.

    ``open`` covers every bucket, so the partition must deliver exactly what
    its base source does, through the bucket condition and its row check;
    ``open_changed`` is another bucket range (another definition).
    """

    def __init__(self, sql: SqlHarness) -> None:
        self.sql = sql
        self.secrets = sql.secrets

    def put(self, rows: Sequence[ContractRow]) -> None:
        self.sql.put(rows)

    def cursor_value(self, seq: int) -> Any:
        return self.sql.cursor_value(seq)

    def _partition(self, lo: int, hi: int) -> SourceAdapter:
        from dbtrigger.partitions import BUCKETS, Partition, PartitionSource  # noqa: PLC0415

        return PartitionSource(self.sql.open(), Partition(lo, min(hi, BUCKETS)), poller="contract")

    def open(self) -> SourceAdapter:
        return self._partition(0, 1 << 30)

    def open_changed(self) -> SourceAdapter:
        return self._partition(0, 128)
