"""How a claim queue connects, per dialect.

Every claim, extension and settlement is one short unit of work
(:meth:`ClaimSource.transaction <dbtrigger.queue.source.ClaimSource.transaction>`):

* PostgreSQL: autocommit (each statement stands alone, fenced per row), which
  saves the ``BEGIN`` and ``COMMIT`` round trips;
* SQLite: every transaction takes the write lock up front (``BEGIN
  IMMEDIATE``), or two claimers could read the same rows before either
  writes; claimers queue on the lock for up to :data:`LOCK_WAIT_SECONDS`
  instead of failing. Reads of the table's shape, status and dead rows
  (:func:`reading`) begin deferred instead, beside a writer;
* PostgreSQL and MariaDB/MySQL: a statement waits at most
  :data:`LOCK_WAIT_SECONDS` for a row lock another transaction holds (an
  application's transaction left open on a job row): at the databases'
  defaults a settlement waited for ever on PostgreSQL and 50 s on MariaDB,
  the tick hung with its claim. It now fails (``CommitError``), the claim
  expires and the rows are claimed again. Set at connect time, so it costs no
  round trip per transaction; merged into the user's ``connect_args`` (and
  the URL's), whose own settings win (:func:`bounded_connect_args`); a shared
  engine (below) keeps its own settings;
* no pre-ping anywhere: it would add a round trip to every claim and
  settlement. A connection the server dropped fails one operation (FetchError
  or CommitError, retried by the next tick; SQLAlchemy discards the pool).

A shared engine (the caller's) is used through a view that shares its pool
but keeps these options and events to itself. Its connections keep the
application's settings, so no bound is set at connect time there: each unit
of work on it is a transaction that bounds its own lock waits
(:func:`unit_of_work`), set back when it ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from dbtrigger import _lock_wait
from dbtrigger._engine import given_connect_args, renew_stale_plans, unbounded_if_refused
from dbtrigger._lock_wait import lock_wait_bounded

#: How long a claim, extension or settlement on a queue's own engine waits for a
#: lock another transaction holds (see the module doc). Read when the engine's
#: options are made (tests lower it to see a give-up in seconds).
LOCK_WAIT_SECONDS = 30


def engine_options(
    dialect: str, engine_kwargs: Mapping[str, Any], query: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``create_engine`` options for a queue's own engine: ``engine_kwargs`` win,
    except that the lock bound is merged into their ``connect_args`` instead of
    being replaced by them (:func:`bounded_connect_args`). ``query``: the URL's
    query string, whose driver arguments count as the user's too."""
    kwargs: dict[str, Any] = {"pool_pre_ping": False}
    if dialect == "postgresql":
        kwargs["isolation_level"] = "AUTOCOMMIT"
    kwargs.update(engine_kwargs)
    given = given_connect_args(engine_kwargs)
    kwargs["connect_args"] = bounded_connect_args(dialect, given, query or {})
    return kwargs


def bounded_connect_args(
    dialect: str, given: Mapping[str, Any], query: Mapping[str, Any]
) -> dict[str, Any]:
    """The user's driver arguments (``given``, then the URL's ``query``) with the
    queue's lock bound (:data:`LOCK_WAIT_SECONDS`, read at each call) added; the
    user's keys, and a bound they set, win
    (:func:`dbtrigger._lock_wait.bounded_connect_args`)."""
    return _lock_wait.bounded_connect_args(dialect, given, query, LOCK_WAIT_SECONDS)


def prepare_own_engine(engine: Engine, dialect: str, engine_kwargs: Mapping[str, Any]) -> None:
    """Events of a queue's own engine, once, before its first connection:
    ``BEGIN IMMEDIATE`` on SQLite; on MariaDB/MySQL with the user's own
    ``init_command``, the lock bound set after it on each new connection
    (:func:`dbtrigger._lock_wait.bound_after_init_command`); on PostgreSQL, behind a
    pooler that refuses the bound in the startup ``options`` (PgBouncer), a
    connection without it and one WARNING instead of every connection failing
    (:func:`dbtrigger._engine.unbounded_if_refused`)."""
    if dialect == "sqlite":
        begin_immediate(engine)
        return
    given = engine_kwargs.get("connect_args") or {}
    _lock_wait.bound_after_init_command(engine, given, LOCK_WAIT_SECONDS)
    if dialect == "postgresql":
        theirs = _lock_wait.user_driver_arg(given, engine.url.query, "options")
        unbounded_if_refused(engine, theirs, _nothing, waits="claims and settlements")


def _nothing() -> None:
    """A refused bound leaves the queue nothing to take back (a source forgets its
    bound, which its lock-wait messages quote)."""


def mysql_lock_bound(variables: Sequence[str]) -> str:
    """``SET SESSION`` of the lock bound for these MariaDB/MySQL variables."""
    return _lock_wait.mysql_lock_bound(variables, LOCK_WAIT_SECONDS)


def claim_view(shared: Engine, dialect: str) -> Engine:
    """A shared engine as the claim needs it, without changing it for its other
    users: an ``execution_options`` copy shares the pool, and the options and
    events set on it are its own."""
    if dialect == "postgresql":
        view = shared.execution_options(isolation_level="AUTOCOMMIT")
        renew_stale_plans(view)
        return view
    view = shared.execution_options()
    if dialect == "sqlite":
        begin_immediate(view, own_connections=False)
    return view


def begin_immediate(engine: Engine, *, own_connections: bool = True) -> None:
    """Make every transaction on this SQLite engine take the write lock up front.

    pysqlite would otherwise start transactions lazily and let two claimers read
    the same rows before either writes; ``BEGIN IMMEDIATE`` serialises them.
    With ``own_connections`` pysqlite's own transaction handling is switched
    off on each new connection; a view of a shared engine leaves the pool's
    connections as they are (pysqlite then sees the explicit ``BEGIN`` and
    does not start a transaction of its own).
    """
    if own_connections:

        @sa.event.listens_for(engine, "connect")
        def _no_pysqlite_begin(dbapi_connection: Any, record: Any) -> None:
            del record
            dbapi_connection.isolation_level = None

    @sa.event.listens_for(engine, "begin")
    def _immediate(conn: Connection) -> None:
        reads = conn.get_execution_options().get(_READS_ONLY, False)
        conn.exec_driver_sql("BEGIN" if reads else "BEGIN IMMEDIATE")


@contextlib.contextmanager
def unit_of_work(
    engine: Engine, dialect: str, *, locking: bool, shared: bool
) -> Iterator[Connection]:
    """One claim, extension or settlement on ``engine`` (see the module doc), committed
    at the end of the block.

    On a shared engine (``ClaimSource(engine=...)``) the connect-time bound is not
    there: a settlement behind an application's row lock waited for ever on
    PostgreSQL and 50 s on MariaDB while the tick held its claim. There every unit
    of work is a real transaction (on PostgreSQL too: ``SET LOCAL`` needs one) whose
    lock waits are bounded to :data:`LOCK_WAIT_SECONDS`, which costs the round trips
    of setting the bound (and, on MariaDB, setting the session's own back).
    SQLite's claimers wait at ``BEGIN IMMEDIATE``, before any bound could be set:
    there the application's busy timeout (pysqlite's 5 s) bounds them.
    """
    bounded = shared and dialect in ("postgresql", "mysql")
    with engine.connect() as conn:
        work = (
            conn.execution_options(isolation_level="READ COMMITTED")
            if dialect == "mysql" or (dialect == "postgresql" and (locking or bounded))
            else conn
        )
        with work.begin():
            if not bounded:
                yield work
                return
            with lock_wait_bounded(work, LOCK_WAIT_SECONDS):
                yield work


def reading(engine: Engine) -> Connection:
    """A connection of a queue's engine for reads only (the table's shape, status,
    dead rows): on SQLite its transactions begin deferred, so they neither take
    the write lock nor wait behind another connection's writer (a reader waits
    only while a commit is being written). Elsewhere a plain connection."""
    return engine.connect().execution_options(**{_READS_ONLY: True})


#: Execution option of a :func:`reading` connection.
_READS_ONLY = "dbtrigger_reads_only"


__all__ = [
    "LOCK_WAIT_SECONDS",
    "begin_immediate",
    "bounded_connect_args",
    "claim_view",
    "engine_options",
    "mysql_lock_bound",
    "prepare_own_engine",
    "reading",
    "unit_of_work",
]
