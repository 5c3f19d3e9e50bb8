"""A poller's history as rows of a table beside the SQL state table.

One row per record, in ``{state table}_history`` (``dbtrigger_state_history``)
of the same database, schema and namespace::

    namespace    VARCHAR(128)   -- as the state table
    poller_name  VARCHAR(128)
    seq          BIGINT         -- the record's number; primary key (namespace, poller_name, seq)
    record_id    VARCHAR(64)    -- the journal entry's digest (readers keep one copy)
    at           TIMESTAMP      -- the record's time, UTC (retention by age)
    type         VARCHAR(32)    -- commit, partial_commit, manual, gap
    batch_id     VARCHAR(128)   -- for lookups by batch
    size         INTEGER        -- bytes of the record's JSON (retention by size)
    record       TEXT           -- the record, JSON

An append inserts its rows in one transaction after checking the last number;
the primary key turns a second writer of the same number into a conflict, so
records are numbered without a gap or a repeat. The table is created on first
use when the state store creates its table; a read of a history whose table
does not exist is an empty history (the CLI never creates tables).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from dbtrigger._driver_errors import not_encodable, short_error, unencodable
from dbtrigger._lock_wait import (
    DEFAULT_STORE_LOCK_TIMEOUT,
    bounded_transaction,
    create_if_missing,
    lock_timed_out,
    table_exists,
)
from dbtrigger.errors import (
    CasConflictError,
    DbTriggerError,
    StoreAuthError,
    StoreRefusedError,
    StoreUnavailableError,
)
from dbtrigger.history.records import record_time
from dbtrigger.history.store import (
    DEFAULT_RETENTION,
    Retention,
    decoded_row,
    expect_end,
    pruned_while_read,
    row_texts,
)
from dbtrigger.names import validate_name, validate_sql_identifier
from dbtrigger.state.stores.sql import (
    classify_driver_error,
    describe_table,
    is_duplicate_key,
    lock_timeout_error,
    table_name,
)

_KEY = sa.String(128).with_variant(
    mysql.VARCHAR(128, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
)
_TEXT = sa.Text().with_variant(mysql.LONGTEXT(charset="utf8mb4"), "mysql", "mariadb")

#: Rows one prune statement deletes at most (short transactions).
_PRUNE_CHUNK = 5000


def history_table(name: str, schema: str | None) -> sa.Table:
    return sa.Table(
        validate_sql_identifier(name, "history table"),
        sa.MetaData(),
        sa.Column("namespace", _KEY, primary_key=True),
        sa.Column("poller_name", _KEY, primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("record_id", sa.String(64), nullable=False),
        sa.Column("at", sa.DateTime, nullable=True),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("batch_id", sa.String(128), nullable=True),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("record", _TEXT, nullable=False),
        schema=validate_sql_identifier(schema, "schema") if schema else None,
    )


def _unencodable(where: str, exc: BaseException) -> StoreRefusedError:
    """A record holding a character the database's encoding lacks (a LATIN1
    PostgreSQL database): every retry is refused the same, so not an outage."""
    words = not_encodable(
        "these records", short_error(exc), "the history", "PollTrigger(history=SqlHistory(...))"
    )
    return StoreRefusedError(f"{where} was refused: {words}")


class SqlHistory:
    """History rows in ``table`` (default: the state table's name + ``_history``).

    Appends and prunes wait at most ``lock_timeout_seconds`` (the state store's) for
    a lock another transaction holds (an append of the same record number not yet
    committed, a transaction left open on the table), then fail as
    :class:`~dbtrigger.errors.StoreUnavailableError`: nothing was written.
    """

    def __init__(
        self,
        engine: sa.Engine | Callable[[], sa.Engine],
        *,
        table: str = "dbtrigger_state_history",
        schema: str | None = None,
        namespace: str = "default",
        create_table: bool = True,
        retention: Retention = DEFAULT_RETENTION,
        lock_timeout_seconds: float = DEFAULT_STORE_LOCK_TIMEOUT,
    ) -> None:
        self.lock_timeout = lock_timeout_seconds
        #: How long the runtime keeps records here (it prunes after its appends).
        self.retention = retention
        self._engine = engine
        self.table = history_table(table, schema)
        self.namespace = validate_name(namespace, "namespace")
        self._create = create_table
        self._ready = False
        self._lock = threading.Lock()

    @property
    def engine(self) -> sa.Engine:
        """The engine (a state store's, resolved at first use)."""
        value = self._engine
        return value if isinstance(value, sa.Engine) else value()

    @property
    def table_name(self) -> str:
        return table_name(self.table)

    def describe(self) -> str:
        return describe_table(
            lambda: self.engine, self.table, self.namespace, unresolved="(unresolved)"
        )

    # --- edges -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _edge(self, action: str, poller: str) -> Iterator[None]:
        where = f"{action} of the history of {poller!r} in {self.table_name}"
        try:
            yield
        except DbTriggerError:
            raise
        except sa.exc.IntegrityError as exc:
            if is_duplicate_key(exc):
                raise CasConflictError(f"{where}: another writer appended first") from exc
            raise StoreUnavailableError(f"{where} failed: {short_error(exc)}") from exc
        except UnicodeEncodeError as exc:  # psycopg encodes for the database's encoding
            raise _unencodable(where, exc) from exc
        except sa.exc.DBAPIError as exc:
            if unencodable(exc):  # the server's 22P05, with client_encoding=utf8
                raise _unencodable(where, exc) from exc
            if lock_timed_out(exc):
                raise lock_timeout_error(
                    where, self.engine, self.table, self.lock_timeout, exc, "nothing was written"
                ) from exc
            if classify_driver_error(exc) == "auth":
                raise StoreAuthError(f"{where} was refused: {short_error(exc)}") from exc
            if classify_driver_error(exc) == "conflict":
                raise CasConflictError(f"{where} lost to another writer") from exc
            raise StoreUnavailableError(f"{where} failed: {short_error(exc)}") from exc
        except sa.exc.SQLAlchemyError as exc:
            raise StoreUnavailableError(f"{where} failed: {short_error(exc)}") from exc

    def _ensure(self, *, writing: bool = True) -> bool:
        """Is the table there? Created now when allowed and about to be written:
        a read (``history tail`` on a mistyped URL or schema) must not leave an
        empty history table behind in somebody's database."""
        if self._ready:
            return True
        with self._lock:
            if self._ready:
                return True
            exists = table_exists(self.engine, self.table, self.lock_timeout)
            if not exists and self._create and writing:
                try:
                    create_if_missing(self.engine, self.table, self.lock_timeout)
                except sa.exc.DBAPIError as exc:
                    if lock_timed_out(exc) or not table_exists(
                        self.engine, self.table, self.lock_timeout
                    ):
                        raise
                exists = True
            self._ready = exists
            return exists

    def _of(self, poller: str) -> sa.ColumnElement[bool]:
        t = self.table
        return sa.and_(t.c.namespace == self.namespace, t.c.poller_name == poller)

    # --- the port ----------------------------------------------------------------------

    def append(self, poller: str, records: Sequence[Mapping[str, Any]], *, after_seq: int) -> None:
        if not records:
            return
        validate_name(poller, "poller name")
        t = self.table
        rows = []
        for record, text in row_texts(records, after_seq):
            when = record_time(record)
            rows.append(
                {
                    "namespace": self.namespace,
                    "poller_name": poller,
                    "seq": record["seq"],
                    "record_id": str(record.get("id"))[:64],
                    "at": when.replace(tzinfo=None) if when is not None else None,
                    "type": str(record.get("type"))[:32],
                    "batch_id": (str(record["batch_id"])[:128] if record.get("batch_id") else None),
                    "size": len(text),
                    "record": text,
                }
            )
        with self._edge("append", poller):
            self._ensure()
            with bounded_transaction(self.engine, self.lock_timeout) as conn:
                last = conn.execute(
                    sa.select(sa.func.max(t.c.seq)).where(self._of(poller))
                ).scalar()
                expect_end(poller, int(last or 0), after_seq)
                conn.execute(t.insert(), rows)

    def tail(self, poller: str, count: int) -> list[dict[str, Any]]:
        if count <= 0:
            return []
        t = self.table
        with self._edge("read", poller):
            if not self._ensure(writing=False):
                return []
            stmt = (
                sa.select(t.c.seq, t.c.record)
                .where(self._of(poller))
                .order_by(t.c.seq.desc())
                .limit(count)
            )
            with self.engine.connect() as conn:
                rows = list(conn.execute(stmt))
        return [decoded_row(text, int(seq), self.describe) for seq, text in reversed(rows)]

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        t = self.table
        last = since_seq
        while True:
            with self._edge("read", poller):
                if not self._ensure(writing=False):
                    return
                stmt = (
                    sa.select(t.c.seq, t.c.record)
                    .where(self._of(poller), t.c.seq > last)
                    .order_by(t.c.seq)
                    .limit(1000)
                )
                with self.engine.connect() as conn:
                    page = list(conn.execute(stmt))
                    if last > since_seq and page and int(page[0][0]) > last + 1:
                        self._not_pruned_since(conn, poller, last)
            for seq, text in page:
                last = int(seq)
                yield decoded_row(text, last, self.describe)
            if len(page) < 1000:
                return

    def _not_pruned_since(self, conn: sa.Connection, poller: str, last: int) -> None:
        """Between two pages of a read, a hole after ``last``: retention pruned the
        records the read had not reached when ``last`` (given already) went too.

        Raises:
            HistoryPrunedError: so; the read stops rather than go on past the hole.
        """
        t = self.table
        held = conn.execute(
            sa.select(sa.func.count()).where(self._of(poller), t.c.seq == last)
        ).scalar_one()
        if not held:
            raise pruned_while_read(poller, last)

    def prune(self, poller: str, retention: Retention, now: dt.datetime) -> int:
        t = self.table
        removed = 0
        with self._edge("prune", poller):
            if not self._ensure(writing=False):
                return 0
            with self.engine.connect() as conn:
                last = conn.execute(
                    sa.select(sa.func.max(t.c.seq)).where(self._of(poller))
                ).scalar()
                if last is None:
                    return 0
                keep_from = int(last)  # the last record always stays
                cutoff = retention.cutoff(now)
                if cutoff is not None:
                    newest_old = conn.execute(
                        sa.select(sa.func.max(t.c.seq)).where(
                            self._of(poller), t.c.at <= cutoff.replace(tzinfo=None)
                        )
                    ).scalar()
                    below = int(newest_old) + 1 if newest_old is not None else None
                else:
                    below = None
                if retention.max_bytes is not None:
                    total = 0
                    sized = conn.execute(
                        sa.select(t.c.seq, t.c.size)
                        .where(self._of(poller))
                        .order_by(t.c.seq.desc())
                    )
                    # Closed, not left half-read: on SQLite an unfinished statement keeps
                    # its read lock until it is collected, through the deletes below, and
                    # every append's commit waited behind it for its whole lock timeout.
                    with sized:
                        for seq, size in sized:
                            total += int(size)
                            if total > retention.max_bytes:
                                below = max(below or 0, int(seq) + 1)
                                break
            if below is None:
                return 0
            below = min(below, keep_from)
            while True:
                with bounded_transaction(self.engine, self.lock_timeout) as conn:
                    low = conn.execute(
                        sa.select(sa.func.min(t.c.seq)).where(self._of(poller))
                    ).scalar()
                    if low is None or int(low) >= below:
                        return removed
                    upper = min(below, int(low) + _PRUNE_CHUNK)
                    deleted = conn.execute(
                        sa.delete(t).where(self._of(poller), t.c.seq < upper)
                    ).rowcount
                removed += int(deleted or 0)


__all__ = ["SqlHistory", "history_table"]
