"""Connections for PostgreSQL logical decoding, and the errors they raise, translated.

The slot functions are called over plain psycopg (3) connections rather than
SQLAlchemy: the reads are binary, bounded by a per-statement timeout, streamed
row by row, and the errors that matter are told apart by SQLSTATE. Every
session is set up the same way, because the *session's* settings decide how
``pgoutput`` writes values as text: UTC timestamps, ISO dates, hex bytea.

:func:`translated` maps driver errors onto dbtrigger's tree at this edge
(the general rules of :mod:`dbtrigger.sources.errors_map`, plus what is
special to slots: a slot in use by another session is a retry, a statement
timeout is the caller's to name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from sqlalchemy.engine import URL, make_url

from dbtrigger._driver_errors import short_error
from dbtrigger._lock_wait import (
    DEFAULT_WRITE_LOCK_TIMEOUT,
    PG_HOLDERS,
    lock_timed_out,
    pg_holders_words,
    pg_lock_timeout,
)
from dbtrigger.errors import (
    ConfigurationError,
    DbTriggerError,
    FetchError,
    RetryableError,
    SlotLostError,
    SourcePermissionError,
)
from dbtrigger.sources.errors_map import PERMISSION, classify, driver_mapped

#: Session settings every connection runs with: they decide pgoutput's text output.
SESSION_OPTIONS = "-c TimeZone=UTC -c DateStyle=ISO -c bytea_output=hex -c extra_float_digits=3"

#: libpq parameters a URL query may carry through (everything else is SQLAlchemy's).
_PASSED_QUERY = (
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslcrl",
    "connect_timeout",
    "application_name",
    "target_session_attrs",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "options",
    "channel_binding",
    "gssencmode",
)


def connect_kwargs(url: URL, *, application_name: str = "dbtrigger-cdc") -> dict[str, Any]:
    """psycopg ``connect()`` keywords for a SQLAlchemy PostgreSQL URL.

    Raises:
        ConfigurationError: not a PostgreSQL URL.
    """
    if url.get_backend_name() != "postgresql":
        raise ConfigurationError(
            f"PgLogicalSource needs a PostgreSQL URL (postgresql://...), got a "
            f"{url.get_backend_name()!r} one"
        )
    kwargs: dict[str, Any] = {
        "host": url.host or None,
        "port": url.port,
        "user": url.username,
        "password": url.password,
        "dbname": url.database,
        "application_name": application_name,
    }
    for key in _PASSED_QUERY:
        value = url.query.get(key)
        if value is not None:
            kwargs[key] = value if isinstance(value, str) else value[-1]
    options = kwargs.get("options")
    kwargs["options"] = f"{options} {SESSION_OPTIONS}" if options else SESSION_OPTIONS
    return {k: v for k, v in kwargs.items() if v is not None}


def connect(url: URL, **extra: Any) -> psycopg.Connection[Any]:
    """An autocommit session set up for decoding.

    Raises:
        SourcePermissionError / SourceDefinitionError / FetchError: as classified.
    """
    with translated("connecting to the source database"):
        return psycopg.connect(autocommit=True, **connect_kwargs(url), **extra)


def translated(what: str, *, refused: str | None = None) -> contextlib.AbstractContextManager[None]:
    """Map psycopg errors raised inside onto dbtrigger errors (cause chained).

    ``refused``: what a role refused here needs (the GRANT, the owner), said after
    the server's reason instead of the general advice for a refused read (CONNECT,
    USAGE, SELECT), which names the wrong privileges for a write or DDL.
    """
    if refused is None:
        return driver_mapped(what, psycopg.Error, _slot_error)

    def special(exc: BaseException, doing: str) -> DbTriggerError | None:
        if classify(exc) != PERMISSION:
            return _slot_error(exc, doing)
        return SourcePermissionError(
            f"{doing} failed: {short_error(exc)}; {refused}", sqlstate=sqlstate(exc)
        )

    return driver_mapped(what, psycopg.Error, special)


#: How long DDL run by :func:`execute_or_explain` (the control table, the publication)
#: waits for a lock another transaction holds before it gives up (read at each call).
DDL_LOCK_TIMEOUT = DEFAULT_WRITE_LOCK_TIMEOUT


def execute_or_explain(
    conn: psycopg.Connection[Any],
    statements: Sequence[sql.Composed],
    *,
    doing: str,
    refused: str,
    advice: str,
    tables: Sequence[str] = (),
) -> None:
    """Run ``statements`` (DDL this role may lack the rights for), in order, in one
    transaction that waits at most :data:`DDL_LOCK_TIMEOUT` for a lock.

    A refusal is raised again as ``"{refused}: {the server's reason}. {advice}:
    {the statements}"``: what could not be done and why it is needed, then who
    may run the quoted SQL instead (never the general advice for a refused read).

    The lock bound: ``CREATE PUBLICATION ... FOR TABLE`` waits behind a ``CREATE
    INDEX``, a ``VACUUM`` or an ``ALTER TABLE`` of a watched table, ``ALTER TABLE``
    of the control table behind any transaction open on it; with ``lock_timeout =
    0`` (PostgreSQL's default) ``dbtrigger cdc install`` waited for ever there and
    said nothing. ``tables`` (schema-qualified) are where the holders are looked for.

    Raises:
        SourcePermissionError: the role may not run them (with the SQL to run).
        FetchError: a lock was not granted in time; nothing changed. The source's
            own objects are made at its first read, so this is the contract's
            failed read (a :class:`~dbtrigger.errors.RetryableError`), as on MariaDB
            (:mod:`dbtrigger.cdc.binlog_control`).
    """
    try:
        with ddl_lock_bounded(
            conn,
            DDL_LOCK_TIMEOUT,
            doing,
            "nothing changed. It is tried again (the next read, or the command run again) "
            "and goes on once that transaction ends, or end it",
            tables=tables,
            unknown="a CREATE INDEX, VACUUM or ALTER TABLE of the table, or a transaction "
            "left open on it",
            error=FetchError,
        ):
            for statement in statements:
                conn.execute(statement)
    except SourcePermissionError as exc:
        # The server's reason alone: the general advice of a refused read (CONNECT,
        # USAGE, SELECT) names the wrong privileges for DDL; ``advice`` names the right.
        texts = "; ".join(s.as_string(conn) for s in statements)
        reason = short_error(exc.__cause__ or exc)
        raise SourcePermissionError(
            f"{refused}: {reason}. {advice}: {texts}", **exc.fields
        ) from exc


@contextlib.contextmanager
def ddl_lock_bounded(
    conn: psycopg.Connection[Any],
    seconds: float,
    doing: str,
    then: str,
    *,
    tables: Sequence[str] = (),
    unknown: str = "",
    error: type[RetryableError] = RetryableError,
) -> Iterator[None]:
    """One transaction on ``conn`` (its errors translated as ``doing``) whose statements
    wait at most ``seconds`` for a lock. One that gave up is an ``error`` (a
    :class:`~dbtrigger.errors.RetryableError`): ``{doing} waited {seconds} s for a lock
    another transaction holds and gave up: {who holds locks on tables, else unknown};
    {then}`` (what was left as it was, and what to do)."""
    try:
        with translated(doing), conn.transaction():
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (pg_lock_timeout(seconds),))
            yield
    except DbTriggerError as exc:
        if exc.__cause__ is None or not lock_timed_out(exc.__cause__):
            raise
        holders = _holders(conn, tables) or unknown
        raise error(
            f"{doing} waited {seconds:g} s for a lock another transaction holds and gave up"
            + (f": {holders}" if holders else "")
            + f"; {then}"
        ) from exc


#: :data:`~dbtrigger._lock_wait.PG_HOLDERS` as psycopg takes it (``%(names)s``).
_HOLDERS_SQL = str(PG_HOLDERS.compile(dialect=make_url("postgresql+psycopg://").get_dialect()()))


def _holders(conn: psycopg.Connection[Any], tables: Sequence[str]) -> str:
    """Who holds locks on ``tables``, in a few words ("" when it cannot be told);
    never their SQL, which can carry values. Best effort, never raises."""
    if not tables:
        return ""
    try:
        rows = conn.execute(_HOLDERS_SQL, {"names": list(tables)}).fetchall()
    except psycopg.Error:
        return ""
    return pg_holders_words(rows, name_table=True)


def _slot_error(exc: BaseException, what: str) -> DbTriggerError | None:
    """What is special to slots; None: the general rules apply."""
    if isinstance(exc, pg_errors.ObjectInUse):
        return FetchError(
            f"{what} failed: the replication slot is in use by another session (another "
            "worker of this poller, or a `dbtrigger cdc status` run); the next tick retries",
            sqlstate=exc.sqlstate,
        )
    if isinstance(exc, pg_errors.ObjectNotInPrerequisiteState):
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if "can no longer get changes" in text or "invalidated" in text:
            return SlotLostError(
                f"{what} failed: {text}: the slot was invalidated (the server removed WAL it "
                "still needed, max_slot_wal_keep_size), so the changes since the checkpoint are "
                "gone. Recreate it and read the tables again: dbtrigger cdc recreate "
                "MODULE:TRIGGER --snapshot --yes",
                sqlstate=exc.sqlstate,
            )
    return None


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a psycopg error anywhere in a cause chain."""
    seen: BaseException | None = exc
    while seen is not None:
        state = getattr(seen, "sqlstate", None)
        if isinstance(state, str):
            return state
        seen = seen.__cause__
    return None


__all__ = [
    "DDL_LOCK_TIMEOUT",
    "SESSION_OPTIONS",
    "connect",
    "connect_kwargs",
    "ddl_lock_bounded",
    "execute_or_explain",
    "sqlstate",
    "translated",
]
