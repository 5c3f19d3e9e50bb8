"""A claim queue's status and dead-row reads wait for a lock boundedly, and say so.

A read of the queue table waits for a lock like any reader: on PostgreSQL an
``ALTER TABLE`` of it that waits for an application's open transaction queues
every reader behind it, and MariaDB's metadata locks do the same. A queue's
own engine bounds that wait at connect time (:mod:`dbtrigger.queue.engines`);
an application's engine (``ClaimSource(engine=...)``) keeps its sessions'
settings, so there ``dbtrigger queue status``, ``dbtrigger dead-letter list``
(:meth:`~dbtrigger.queue.source.ClaimSource.counts`,
:meth:`~dbtrigger.queue.source.ClaimSource.dead_rows`) and the first check of
the table's shape waited for ever on PostgreSQL (a day on MariaDB), saying
nothing. :func:`reads` bounds them to :data:`~dbtrigger.queue.engines.LOCK_WAIT_SECONDS`
there too: ``SET LOCAL`` in a transaction of its own on PostgreSQL (the
claim's view autocommits; a pooler's session is left as it was), the
session's bounds set and set back on MariaDB/MySQL, as a claim on a shared
engine does (:func:`~dbtrigger.queue.engines.unit_of_work`). SQLite's readers
do not queue behind a writer.

On any engine, a statement that gives up (:func:`gives_up`) is a typed
error, a :class:`~dbtrigger.errors.FetchError` for a read and a
:class:`~dbtrigger.errors.CommitError` for a re-drive or discard of dead rows,
in :func:`~dbtrigger._lock_wait.gave_up_waiting`'s words: how long it waited,
on which table, who holds locks there (ids and ages, never SQL), why a read
waits at all and what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from dbtrigger._lock_wait import gave_up_waiting, lock_timed_out, lock_wait_bounded
from dbtrigger.errors import CommitError, FetchError
from dbtrigger.queue import engines
from dbtrigger.sources.lock_waits import WHY


class Claims(Protocol):
    """What these reads ask of a claim source (:class:`~dbtrigger.queue.source.ClaimSource`)."""

    shared_engine: Engine | None

    @property
    def engine(self) -> Engine: ...
    @property
    def dialect_name(self) -> str: ...
    def sets_own_lock_bound(self) -> bool:
        """Does the source's own engine get its lock bound from the user's settings?"""
        ...


#: What a read that gave up left, and what to do.
READ_THEN = f"{WHY}; nothing was read: try again once that transaction and the DDL end, or end them"
#: What a re-drive or discard that gave up left, and what to do.
WRITE_THEN = "nothing was changed: run the command again once the transaction ends, or end it"


@contextlib.contextmanager
def reads(
    source: Claims, what: str | None = None, table: sa.TableClause | None = None
) -> Iterator[Connection]:
    """A connection of ``source``'s engine for reads (the table's shape, status, dead
    rows), its lock waits bounded on a shared engine too. With ``what`` (``status of
    postgresql:app.jobs``), a read that gave up waiting for a lock on ``table`` is a
    :class:`FetchError` saying so (:func:`gives_up`)."""
    engine, dialect = source.engine, source.dialect_name
    mapped = gives_up(source, what, table) if what else contextlib.nullcontext()
    with mapped, engines.reading(engine) as conn:
        if source.shared_engine is None or dialect not in ("postgresql", "mysql"):
            yield conn
            return
        if dialect == "postgresql":  # SET LOCAL needs a transaction (the view autocommits)
            conn.execution_options(isolation_level="READ COMMITTED").begin()
        with lock_wait_bounded(conn, engines.LOCK_WAIT_SECONDS):
            yield conn


@contextlib.contextmanager
def gives_up(
    source: Claims,
    what: str | None,
    table: sa.TableClause | None,
    error: Callable[[str], Exception] = FetchError,
    then: str = READ_THEN,
) -> Iterator[None]:
    """A statement inside that gave up waiting for a lock on ``table`` becomes
    ``error("<what> waited 30 s for a lock on the table <schema.table> and gave up:
    <holders>; <then> (<driver error>)")``, cause chained; anything else passes."""
    try:
        yield
    except DBAPIError as exc:
        if not lock_timed_out(exc) or table is None:
            raise
        name = f"{table.schema}.{table.name}" if table.schema else table.name
        text, _ = gave_up_waiting(
            source.engine,
            table.name,
            table.schema,
            _bound(source),
            exc,
            then,
            lock=f"a lock on the table {name}",
        )
        raise error(f"{what} {text}") from exc


def change_gives_up(
    source: Claims, what: str, table: sa.TableClause
) -> contextlib.AbstractContextManager[None]:
    """:func:`gives_up` for a re-drive or discard of dead rows: a :class:`CommitError`."""
    return gives_up(source, what, table, CommitError, WRITE_THEN)


def _bound(source: Claims) -> float | None:
    """The lock bound in force on ``source``'s connections (None: the user's own)."""
    if source.shared_engine is None:
        if source.sets_own_lock_bound():
            return None
    elif source.dialect_name == "sqlite":
        return None  # the application's busy timeout
    return float(engines.LOCK_WAIT_SECONDS)


__all__ = ["READ_THEN", "WRITE_THEN", "Claims", "change_gives_up", "gives_up", "reads"]
