"""Bounded lock waits for the writes dbtrigger makes (internal).

A write that meets a row or table lock held by another transaction waits for
it. At the databases' default settings that wait is unbounded on PostgreSQL
(``lock_timeout = 0``), 50 s for a row and a day for a table's metadata lock
on MariaDB (``innodb_lock_wait_timeout``, ``lock_wait_timeout``) and 5 s on
SQLite (pysqlite's busy timeout). A tick whose write waits does nothing and
says nothing; with ``handler_timeout_seconds`` its lease lapses, another
instance delivers the batch again, and the waiting write may still land
afterwards. So every write transaction of the output binding, the writer and
the SQL stores runs under :func:`lock_wait_bounded`:

* PostgreSQL: ``set_config('lock_timeout', ..., true)``, which is ``SET
  LOCAL``: it ends with the transaction, so a shared engine's connections are
  left as they were;
* MariaDB/MySQL: ``innodb_lock_wait_timeout`` and ``lock_wait_timeout`` for
  the session (whole seconds, at least one), set back to the session's own
  values when the transaction ends;
* SQLite: the connection's busy timeout, set back likewise.

Each of them needs a real transaction. An engine in autocommit mode (made with
``isolation_level="AUTOCOMMIT"``, or a driver's own autocommit) begins none:
``SET LOCAL`` then lasts one statement (PostgreSQL says so in a warning and the
write waits for ever), and the write's statements each commit on their own.
:func:`write_connection` takes such a connection out of autocommit for the
write; the pool sets it back when it is returned.

:func:`lock_timed_out` recognises the error each raises when the bound runs
out, and :func:`lock_holders` says, as far as it is cheap to know, which other
sessions hold locks on the table (their ids and how long their transactions
have been open: never their SQL, which can carry values); :func:`gave_up_waiting`
is the one wording of that error for every writer.

An engine dbtrigger makes itself (a claim queue's, a source's) has its lock
waits bounded once, at connect time, instead (:func:`bounded_connect_args`,
:func:`bound_after_init_command`): no statement per transaction, and the bound
holds for its reads too, which queue behind DDL waiting for the table.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from dbtrigger._mysql_holders import mysql_holders_words
from dbtrigger.errors import ConfigurationError, RetryableError

#: How long a db.output / DbWriter write waits for a lock held by another
#: transaction before it gives up (a quarter of the default lease TTL).
DEFAULT_WRITE_LOCK_TIMEOUT = 30.0

#: How long a SQL checkpoint store or history write waits for a lock: below the
#: heartbeat interval at the default lease TTL (120 s / 3).
DEFAULT_STORE_LOCK_TIMEOUT = 10.0

#: PostgreSQL's lock_not_available (lock_timeout, NOWAIT).
_PG_LOCK_SQLSTATES = frozenset({"55P03"})
#: MariaDB/MySQL: lock wait timeout exceeded (row and metadata locks); NOWAIT.
_MYSQL_LOCK_CODES = frozenset({1205, 3572})
#: SQLite: SQLITE_BUSY, SQLITE_LOCKED and their extended codes.
_SQLITE_LOCK_TEXTS = ("database is locked", "database table is locked")


def check_lock_timeout(value: object, option: str = "lock_timeout_seconds") -> float:
    """``value`` as seconds (a positive, finite number), else a ConfigurationError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{option} takes a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(
            f"{option} must be a positive number of seconds, got {value!r}: a write must "
            "give up waiting for a lock at some point (an unbounded wait outlives the lease)"
        )
    return seconds


def pg_lock_timeout(seconds: float) -> str:
    """PostgreSQL's ``lock_timeout`` setting for a bound of ``seconds``: whole
    milliseconds, rounded up, at least one (0 would be no bound at all)."""
    return f"{max(1, math.ceil(seconds * 1000))}ms"


def mysql_whole_seconds(seconds: float) -> int:
    """A MariaDB/MySQL lock bound of ``seconds``: its variables take whole seconds, so
    rounded up, at least one (a bound never shorter than asked)."""
    return max(1, math.ceil(seconds))


def mysql_bound_for_now(seconds: float) -> str:
    """MariaDB/MySQL: the ``SET`` that keeps the session's own row and metadata lock
    bounds aside and bounds both to ``seconds`` (whole seconds, at least one);
    :data:`MYSQL_BOUND_SET_BACK` puts them back. (The number is one we computed,
    written into the text: no driver's parameter style to follow.)"""
    wait = mysql_whole_seconds(seconds)
    return (
        "SET @dbtrigger_row_wait = @@SESSION.innodb_lock_wait_timeout, "
        "@dbtrigger_table_wait = @@SESSION.lock_wait_timeout, "
        f"SESSION innodb_lock_wait_timeout = {wait}, SESSION lock_wait_timeout = {wait}"
    )


#: MariaDB/MySQL: the session's own lock bounds back, as :func:`mysql_bound_for_now` kept them.
MYSQL_BOUND_SET_BACK = (
    "SET SESSION innodb_lock_wait_timeout = @dbtrigger_row_wait, "
    "SESSION lock_wait_timeout = @dbtrigger_table_wait"
)


@contextlib.contextmanager
def lock_wait_bounded(conn: Connection, seconds: float) -> Iterator[None]:
    """Bound the lock waits of the statements run on ``conn`` inside this block,
    which must be inside a transaction begun on ``conn`` (see the module doc)."""
    dialect = conn.dialect.name
    if dialect == "postgresql":
        conn.execute(
            sa.text("SELECT set_config('lock_timeout', :value, true)"),
            {"value": pg_lock_timeout(seconds)},
        )
        yield
    elif dialect in ("mysql", "mariadb"):
        conn.exec_driver_sql(mysql_bound_for_now(seconds))
        try:
            yield
        finally:
            with contextlib.suppress(SQLAlchemyError):  # a lost connection keeps nothing
                conn.exec_driver_sql(MYSQL_BOUND_SET_BACK)
    elif dialect == "sqlite":
        previous = conn.exec_driver_sql("PRAGMA busy_timeout").scalar()
        # PRAGMA takes no bound value; both numbers are integers we made.
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {max(1, math.ceil(seconds * 1000))}")
        try:
            yield
        finally:
            with contextlib.suppress(SQLAlchemyError):
                conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(previous or 0)}")
    else:
        yield


def in_autocommit(conn: Connection) -> bool:
    """Is ``conn``'s driver connection in autocommit mode (no transaction to begin)?
    Read from the driver, without a round trip."""
    raw = conn.connection.dbapi_connection
    getter = getattr(raw, "get_autocommit", None)  # PyMySQL, mysqlclient
    if callable(getter):
        return bool(getter())
    flag = getattr(raw, "autocommit", None)  # psycopg, psycopg2, sqlite3 from 3.12
    if isinstance(flag, bool):
        return flag
    # pysqlite: isolation_level None is its autocommit (SQLAlchemy's "AUTOCOMMIT")
    return conn.dialect.name == "sqlite" and getattr(raw, "isolation_level", "") is None


@contextlib.contextmanager
def write_connection(engine: Engine) -> Iterator[Connection]:
    """A connection of ``engine`` on which ``begin()`` begins a real transaction: one
    in autocommit mode is switched to the dialect's default isolation level for this
    use (the pool sets it back on return), so that a shared autocommit engine's
    writes are still one transaction, bounded by :func:`lock_wait_bounded`."""
    with engine.connect() as conn:
        if in_autocommit(conn):
            level = conn.default_isolation_level
            if not level or level == "AUTOCOMMIT":
                level = "SERIALIZABLE" if conn.dialect.name == "sqlite" else "READ COMMITTED"
            conn.execution_options(isolation_level=level)
        yield conn


@contextlib.contextmanager
def bounded_transaction(engine: Engine, seconds: float) -> Iterator[Connection]:
    """A transaction on a connection of ``engine`` (committed at the end of the block,
    rolled back if it raises) whose lock waits are bounded to ``seconds``: how every
    write of the output binding, the writer, the SQL history and the SQL dead-letter
    sink runs. An engine in autocommit mode gets a real transaction all the same
    (:func:`write_connection`)."""
    with write_connection(engine) as conn, conn.begin(), lock_wait_bounded(conn, seconds):
        yield conn


def create_if_missing(engine: Engine, table: sa.Table, seconds: float) -> None:
    """Create ``table`` (with its indexes) unless it exists, waiting at most ``seconds``
    for a lock; the driver's error is raised when that runs out (:func:`lock_timed_out`).

    The tables dbtrigger creates at their first use (a SQL store's, history's or
    quarantine's) are created inside a tick, and creating one waits for locks as a
    write does: on PostgreSQL behind another transaction creating the same table
    that is still open (for ever, ``lock_timeout = 0``), on MariaDB behind a backup's
    ``BACKUP STAGE BLOCK_DDL`` or a ``FLUSH TABLES WITH READ LOCK`` (a day), on
    SQLite behind another connection's write transaction (its busy timeout)."""
    with bounded_transaction(engine, seconds) as conn:
        table.create(conn, checkfirst=True)


def table_exists(engine: Engine, table: sa.Table, seconds: float) -> bool:
    """Is ``table`` there? Asked waiting at most ``seconds`` for a lock: on MariaDB the
    question (``DESCRIBE``) waits behind another session's exclusive metadata lock on
    the name (a ``CREATE TABLE ... SELECT`` of it still running), a day by default."""
    with bounded_transaction(engine, seconds) as conn:
        return sa.inspect(conn).has_table(table.name, schema=table.schema)


def lock_timed_out(exc: BaseException) -> bool:
    """True when ``exc`` is a statement that gave up waiting for a lock."""
    orig = getattr(exc, "orig", None) or exc
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if sqlstate in _PG_LOCK_SQLSTATES:
        return True
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int) and args[0] in _MYSQL_LOCK_CODES:
        return True
    if type(orig).__module__.startswith("sqlite3"):
        text = str(orig)
        return any(t in text for t in _SQLITE_LOCK_TEXTS)
    return False


def lock_holders(engine: Engine, table: str, schema: str | None) -> str:
    """Who holds locks that a write on ``table`` may wait for, in a few words ("" when
    it cannot be told). Best effort, on a connection of its own, never raises."""
    dialect = engine.dialect.name
    if dialect == "sqlite":
        return (
            "another connection holds the database file's write lock (SQLite locks the "
            "whole file; a transaction left open elsewhere keeps it)"
        )
    try:
        with engine.connect() as conn:
            if dialect == "postgresql":
                return _pg_holders(conn, table, schema)
            if dialect in ("mysql", "mariadb"):
                return _mysql_holders(conn, table, schema)
    except SQLAlchemyError:
        return ""
    return ""


def gave_up_waiting(
    engine: Engine,
    table: str | None,
    schema: str | None,
    seconds: float | None,
    exc: BaseException,
    then: str,
    *,
    lock: str = "a lock another transaction holds on the table",
) -> tuple[str, str]:
    """The words for a statement on ``table`` that gave up waiting for a lock (its
    transaction is rolled back by now), to follow what it was doing, and who holds
    locks there ("" when that cannot be told): ``waited 10 s for a lock another
    transaction holds on the table and gave up: <holders>; <then> (<driver error class>)``.
    ``then`` says what was left unchanged, what happens next and what to do; ``lock``
    which lock it waited for. ``seconds`` None: the bound in force is not known (the
    engine's own); ``table`` None: which table is not known, no holders are looked up."""
    holders = lock_holders(engine, table, schema) if table else ""
    driver_error = type(getattr(exc, "orig", None) or exc).__name__
    waited = (
        f"waited {seconds:g} s"
        if seconds is not None
        else "gave up waiting (the engine's own lock timeout)"
    )
    return (
        f"{waited} for {lock} and gave up"
        + (f": {holders}" if holders else "")
        + f"; {then} ({driver_error})"
    ), holders


@contextlib.contextmanager
def ddl_gives_up(
    engine: Engine,
    table: str,
    schema: str | None,
    seconds: float,
    doing: str,
    then: str = "run the command again once it ends, or end it",
) -> Iterator[None]:
    """For statements on ``table`` run inside (under :func:`lock_wait_bounded`): one
    that gave up waiting for a lock becomes a :class:`~dbtrigger.errors.RetryableError`
    that says ``doing`` (``changing the triggers of orders``), how long it waited, who
    holds locks there and ``then``: what was left as it was and what to do (by
    default, for a command's DDL, to run it again)."""
    try:
        yield
    except DBAPIError as exc:
        if not lock_timed_out(exc):
            raise
        text, _ = gave_up_waiting(engine, table, schema, seconds, exc, then)
        raise RetryableError(f"{doing} {text}") from exc


def bounded_connect_args(
    dialect: str, given: Mapping[str, Any], query: Mapping[str, Any], seconds: float
) -> dict[str, Any]:
    """The user's driver arguments (``given``, then the URL's ``query``) with a lock
    bound of ``seconds`` added, for an engine dbtrigger creates (see the module doc).

    The user's keys win, and a bound the user set is theirs:

    * PostgreSQL: ``-c lock_timeout=...`` is appended to their ``options``
      (``-c search_path=...``) unless those already set ``lock_timeout``;
    * SQLite: ``timeout`` unless they gave one;
    * MariaDB/MySQL: ``init_command`` is the bound, unless they gave one of
      their own: theirs is kept, and :func:`bound_after_init_command` sets the
      bound after it on each new connection (for the variables theirs leaves alone).
    """
    args = dict(given)
    if dialect == "postgresql":
        options = user_driver_arg(args, query, "options")
        if options is None or not _PG_LOCK_TIMEOUT.search(options):
            millis = max(1, math.ceil(seconds * 1000))
            args["options"] = f"{options or ''} -c lock_timeout={millis}".strip()
    elif dialect in ("mysql", "mariadb"):
        if user_driver_arg(args, query, "init_command") is None:
            args["init_command"] = mysql_lock_bound(MYSQL_LOCK_VARIABLES, seconds)
    elif dialect == "sqlite" and user_driver_arg(args, query, "timeout") is None:
        args["timeout"] = seconds
    return args


def bound_after_init_command(engine: Engine, given: Mapping[str, Any], seconds: float) -> None:
    """On MariaDB/MySQL with the user's own ``init_command`` (in ``given``, their
    ``connect_args``, or the URL): set the lock bound after it on each new
    connection, for the variables theirs leaves alone (one statement at connect
    time, none per transaction). Nothing elsewhere, or when the bound is the
    ``init_command`` (:func:`bounded_connect_args`). Call it once, before the
    engine's first connection."""
    if engine.dialect.name not in ("mysql", "mariadb"):
        return
    theirs = user_driver_arg(given, engine.url.query, "init_command")
    if theirs is None:
        return
    left = [v for v in MYSQL_LOCK_VARIABLES if not re.search(rf"\b{v}\b", theirs, re.I)]
    if not left:
        return
    statement = mysql_lock_bound(left, seconds)

    def bound_lock_waits(dbapi_connection: Any, record: Any) -> None:
        del record
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(statement)
        finally:
            cursor.close()

    sa.event.listen(engine, "connect", bound_lock_waits)


def mysql_lock_bound(variables: Sequence[str], seconds: float) -> str:
    """``SET SESSION`` of a lock bound of ``seconds`` (whole, at least one) for these
    MariaDB/MySQL variables."""
    wait = mysql_whole_seconds(seconds)
    return "SET " + ", ".join(f"SESSION {v} = {wait}" for v in variables)


def sets_own_lock_bound(dialect: str, given: Mapping[str, Any], query: Mapping[str, Any]) -> bool:
    """Do the user's driver arguments bound a read's lock wait themselves (so that
    :func:`bounded_connect_args` leaves it theirs)? On MariaDB/MySQL: an
    ``init_command`` that sets ``lock_wait_timeout``, the table's metadata lock."""
    if dialect == "postgresql":
        return bool(_PG_LOCK_TIMEOUT.search(user_driver_arg(given, query, "options") or ""))
    if dialect in ("mysql", "mariadb"):
        theirs = user_driver_arg(given, query, "init_command") or ""
        return re.search(r"\block_wait_timeout\b", theirs, re.I) is not None
    return dialect == "sqlite" and user_driver_arg(given, query, "timeout") is not None


def user_driver_arg(args: Mapping[str, Any], query: Mapping[str, Any], key: str) -> str | None:
    """A driver argument as the user gave it: ``connect_args`` win over the URL's
    query string, as in SQLAlchemy (a repeated query key counts whole)."""
    value = args[key] if key in args else query.get(key)
    if value is None:
        return None
    return " ".join(value) if isinstance(value, tuple | list) else str(value)


#: The MariaDB/MySQL variables bounding row locks (InnoDB) and metadata locks.
MYSQL_LOCK_VARIABLES = ("innodb_lock_wait_timeout", "lock_wait_timeout")
_PG_LOCK_TIMEOUT = re.compile(r"\block_timeout\b", re.I)


#: PostgreSQL: the sessions holding a granted lock on one of the relations named in
#: ``:names`` (a ``text[]`` of qualified, quoted names; one that is not there matches
#: nothing), the longest-open transaction first: ids, states and ages, never their SQL
#: (which can carry values). Read by :func:`lock_holders` and by the log-based
#: source's DDL (:mod:`dbtrigger.cdc.pg_connection`, on a psycopg connection).
PG_HOLDERS = sa.text(
    "SELECT DISTINCT a.pid, a.state, a.application_name, "
    "floor(extract(epoch FROM now() - a.xact_start))::int AS open_for, "
    "l.relation::regclass::text AS relation "
    "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.relation IN (SELECT to_regclass(n) FROM unnest(CAST(:names AS text[])) AS n) "
    "AND l.granted AND l.pid <> pg_backend_pid() ORDER BY open_for DESC NULLS LAST LIMIT 3"
)


def pg_holders_words(rows: Iterable[Sequence[Any]], *, name_table: bool = False) -> str:
    """:data:`PG_HOLDERS`' ``rows`` in a few words ("" for none); ``name_table``: say
    which table each holds a lock on (the words around do not name it)."""
    parts = []
    for pid, state, application, open_for, relation in rows:
        age = f" for {open_for} s" if open_for is not None else ""
        app = f", application {application!r}" if application else ""
        on = f", on {relation}" if name_table else ""
        parts.append(f"backend pid {pid} ({state}{age}{app}{on})")
    if not parts:
        return ""
    return "held by " + "; ".join(parts) + " (pg_terminate_backend(pid) ends one)"


def _pg_holders(conn: Connection, table: str, schema: str | None) -> str:
    conn.execute(sa.text("SELECT set_config('statement_timeout', '2s', true)"))
    name = f'"{schema}"."{table}"' if schema else f'"{table}"'
    rows = conn.execute(PG_HOLDERS, {"names": [name]}).fetchall()
    conn.rollback()
    return pg_holders_words(rows)


def _mysql_holders(conn: Connection, table: str, schema: str | None) -> str:
    def run(sql: str, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]:
        try:
            return conn.exec_driver_sql(sql, dict(params)).fetchall()
        finally:
            conn.rollback()

    return mysql_holders_words(run, table, schema)


__all__ = [
    "DEFAULT_STORE_LOCK_TIMEOUT",
    "DEFAULT_WRITE_LOCK_TIMEOUT",
    "MYSQL_BOUND_SET_BACK",
    "MYSQL_LOCK_VARIABLES",
    "PG_HOLDERS",
    "bound_after_init_command",
    "bounded_connect_args",
    "bounded_transaction",
    "check_lock_timeout",
    "create_if_missing",
    "ddl_gives_up",
    "gave_up_waiting",
    "in_autocommit",
    "lock_holders",
    "lock_timed_out",
    "lock_wait_bounded",
    "mysql_bound_for_now",
    "mysql_lock_bound",
    "mysql_whole_seconds",
    "pg_holders_words",
    "pg_lock_timeout",
    "sets_own_lock_bound",
    "table_exists",
    "user_driver_arg",
    "write_connection",
]
