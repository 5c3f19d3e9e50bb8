"""A source's statement that gave up waiting for a lock, in words an operator can act on.

A read waits for a lock too: on PostgreSQL an ``ALTER TABLE`` (``DROP``,
``TRUNCATE``, ``VACUUM FULL``, ``LOCK TABLE``) of the watched table that is
itself waiting for an application's open transaction queues every reader of the
table behind it, and MariaDB's metadata locks do the same. At the databases'
defaults the fetch waited there for ever (a day on MariaDB) while the heartbeat
kept the lease, and nothing was logged. A source's own engine bounds that wait
(``lock_wait_seconds``, :class:`~dbtrigger._engine.LazyEngine`); when it runs
out, the driver's error becomes a retryable :class:`~dbtrigger.errors.FetchError`
saying how long it waited, who holds locks on the table when that is cheap to
know (ids and ages, never SQL), why a read waits at all, and that the next tick
tries again: :func:`~dbtrigger._lock_wait.gave_up_waiting`'s words, as every
writer's, with the lock a read waits for.
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError

from dbtrigger._engine import LazyEngine
from dbtrigger._lock_wait import gave_up_waiting, lock_timed_out
from dbtrigger.errors import FetchError
from dbtrigger.sources.shape import SourceSpec

#: What the message says about why a read waits for a lock at all.
WHY = (
    "DDL on the table (ALTER TABLE, DROP, TRUNCATE, VACUUM FULL, LOCK TABLE) that "
    "waits for a lock itself, e.g. behind an open transaction, queues every reader "
    "behind it"
)

#: Why a read waits on SQLite: no DDL queue there, but in the rollback-journal mode
#: (SQLite's default) a writer holds the file's exclusive lock while it commits, and
#: from the moment its transaction outgrows the page cache until it ends.
SQLITE_WHY = (
    "in SQLite's default rollback-journal mode a writer whose transaction outgrew its "
    "page cache (a bulk load, a long batch) shuts every reader out until it commits; "
    "in WAL mode reads go on beside a writer: run PRAGMA journal_mode=WAL once on the "
    "database file (it stays set)"
)


def lock_wait_error(
    exc: BaseException, what: str, engines: LazyEngine, spec: SourceSpec
) -> FetchError | None:
    """The :class:`FetchError` for ``exc``, raised while ``what`` (``fetch from
    postgresql:app.orders``) on a connection of ``engines``, when it is a statement
    that gave up waiting for a lock; else None. The bound in force is the one
    ``engines`` set (unknown on a shared engine, or one whose driver arguments set
    their own); no holders are looked up in query mode (which tables?)."""
    if not isinstance(exc, DBAPIError) or not lock_timed_out(exc):
        return None
    table = spec.table
    engine = engines.engine
    why = SQLITE_WHY if engine.dialect.name == "sqlite" else WHY
    text, _ = gave_up_waiting(
        engine,
        table,
        spec.schema,
        engines.lock_wait,
        exc,
        f"{why}; nothing was read, and the next tick tries again",
        lock="a lock on the table" if table else "a lock on a table its query reads",
    )
    return FetchError(f"{what} {text}", driver_error=type(exc.orig).__name__)


__all__ = ["lock_wait_error"]
