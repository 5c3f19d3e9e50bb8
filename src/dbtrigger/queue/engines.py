"""How a claim queue connects, per dialect.

Every claim, extension and settlement is one short unit of work
(:meth:`ClaimSource.transaction <dbtrigger.queue.source.ClaimSource.transaction>`):

* PostgreSQL: autocommit (each statement stands alone, fenced per row), which
  saves the ``BEGIN`` and ``COMMIT`` round trips;
* SQLite: every transaction takes the write lock up front (``BEGIN
  IMMEDIATE``), or two claimers could read the same rows before either
  writes; claimers queue on the lock for up to :data:`LOCK_WAIT_SECONDS`
  instead of failing;
* PostgreSQL and MariaDB/MySQL: a statement waits at most
  :data:`LOCK_WAIT_SECONDS` for a row lock another transaction holds (an
  application's transaction left open on a job row): at the databases'
  defaults a settlement waited for ever on PostgreSQL and 50 s on MariaDB,
  the tick hung with its claim. It now fails (``CommitError``), the claim
  expires and the rows are claimed again. Set at connect time, so it costs no
  round trip; a shared engine (below) keeps its own settings;
* no pre-ping anywhere: it would add a round trip to every claim and
  settlement. A connection the server dropped fails one operation (FetchError
  or CommitError, retried by the next tick; SQLAlchemy discards the pool).

A shared engine (the caller's) is used through a view that shares its pool
but keeps these options and events to itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

#: How long a claim, extension or settlement on a queue's own engine waits for a
#: lock another transaction holds (see the module doc). Read when the engine's
#: options are made (tests lower it to see a give-up in seconds).
LOCK_WAIT_SECONDS = 30


def engine_options(dialect: str, engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``create_engine`` options for a queue's own engine (``engine_kwargs`` win)."""
    kwargs: dict[str, Any] = {"pool_pre_ping": False}
    if dialect == "postgresql":
        kwargs["isolation_level"] = "AUTOCOMMIT"
        kwargs["connect_args"] = {"options": f"-c lock_timeout={LOCK_WAIT_SECONDS * 1000}"}
    elif dialect == "mysql":
        wait = LOCK_WAIT_SECONDS
        kwargs["connect_args"] = {
            "init_command": f"SET SESSION innodb_lock_wait_timeout = {wait}, "
            f"SESSION lock_wait_timeout = {wait}"
        }
    kwargs.update(engine_kwargs)
    if dialect == "sqlite":
        kwargs.setdefault("connect_args", {"timeout": LOCK_WAIT_SECONDS})
    return kwargs


def claim_view(shared: Engine, dialect: str) -> Engine:
    """A shared engine as the claim needs it, without changing it for its other
    users: an ``execution_options`` copy shares the pool, and the options and
    events set on it are its own."""
    if dialect == "postgresql":
        return shared.execution_options(isolation_level="AUTOCOMMIT")
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
        conn.exec_driver_sql("BEGIN IMMEDIATE")


__all__ = ["LOCK_WAIT_SECONDS", "begin_immediate", "claim_view", "engine_options"]
