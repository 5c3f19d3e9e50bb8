"""Driver errors of a source, sorted by what a person (or the next tick) can do about them.

Only failures of the *connection* are worth retrying: a lost socket, a server
restarting, a deadlock, a statement timeout. A table that does not exist, a
privilege that was not granted, a timestamp the driver cannot load
(``'infinity'``, a BC date) or a checkpoint of the wrong type fails the same way
on every tick; retrying it forever is a stall that looks like a hiccup. Those
become operator errors that stop ``dbtrigger run`` with the reason:

* :class:`~dbtrigger.errors.SourceDefinitionError`: a missing database, schema,
  table, column or function, SQL the database rejects, a type that does not fit;
* :class:`~dbtrigger.errors.SourcePermissionError`: credentials or privileges;
* :class:`~dbtrigger.errors.SerializationError`: a value in the source (or the
  checkpoint) that cannot be converted.

Everything else, including any error not recognised here, stays a retryable
:class:`~dbtrigger.errors.FetchError`: calling a transient failure permanent
would stop a healthy worker, which is the worse mistake.

The evidence, strongest first: the SQLSTATE (psycopg), the server's error code
(MySQL/MariaDB), SQLite's primary result code, the server's message for
PostgreSQL connection failures (libpq reports no SQLSTATE for those), and last
the DB-API exception class.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import exc as sa_exc

from dbtrigger._driver_errors import encoding_problem, short_error
from dbtrigger.errors import (
    ConfigurationError,
    DbTriggerError,
    FetchError,
    SerializationError,
    SourceDefinitionError,
    SourcePermissionError,
)

RETRY = "retry"
DEFINITION = "definition"
PERMISSION = "permission"
DATA = "data"

#: PostgreSQL SQLSTATEs (exact codes first, then two-character classes).
_PG_CODES = {
    "42501": PERMISSION,  # insufficient_privilege
    "3D000": DEFINITION,  # invalid_catalog_name: the database does not exist
    "3F000": DEFINITION,  # invalid_schema_name
    "0A000": RETRY,  # feature_not_supported: also "cached plan must not change result type"
}
_PG_CLASSES = {
    "22": DATA,  # data exception: a value that cannot be converted or compared
    "23": DEFINITION,  # integrity constraint (not expected from a read)
    "28": PERMISSION,  # invalid authorization specification
    "42": DEFINITION,  # syntax error or access rule: undefined table/column/function
    "2F": DEFINITION,  # SQL routine exception (a function in where=/query=)
    "39": DEFINITION,  # external routine invocation exception
}

#: MySQL/MariaDB server error codes (client codes 2xxx are connection failures).
_MYSQL_CODES = {
    **dict.fromkeys((1044, 1045, 1142, 1143, 1227, 1370, 1698), PERMISSION),
    **dict.fromkeys((1049, 1054, 1064, 1109, 1146, 1247, 1305, 1356, 1630), DEFINITION),
    **dict.fromkeys((1292, 1366, 1367, 1411, 1525, 3024), DATA),
}

#: SQLite primary result codes (extended codes carry them in the low byte).
_SQLITE_CODES = {
    1: DEFINITION,  # SQLITE_ERROR: SQL error, e.g. no such table / column
    3: PERMISSION,  # SQLITE_PERM
    8: PERMISSION,  # SQLITE_READONLY
    11: DEFINITION,  # SQLITE_CORRUPT
    14: DEFINITION,  # SQLITE_CANTOPEN: the file or its directory is not there
    20: DATA,  # SQLITE_MISMATCH
    23: PERMISSION,  # SQLITE_AUTH
    26: DEFINITION,  # SQLITE_NOTADB
}

#: PostgreSQL refusals at connect time, as the server words them (no SQLSTATE there).
_PG_CONNECT_MESSAGES = (
    (re.compile(r'database "[^"]*" does not exist'), DEFINITION),
    (re.compile(r'role "[^"]*" does not exist'), PERMISSION),
    (re.compile(r"password authentication failed"), PERMISSION),
    (re.compile(r"no pg_hba\.conf entry"), PERMISSION),
    (re.compile(r"permission denied for database"), PERMISSION),
    (re.compile(r"is not permitted to log in"), PERMISSION),
)

#: SQLite failures that carry no result code but are a value, not the connection.
_SQLITE_DATA_MESSAGES = (re.compile(r"Could not decode to UTF-8"),)

_CLASS_DEFAULTS: tuple[tuple[type[sa_exc.DBAPIError], str], ...] = (
    (sa_exc.DataError, DATA),
    (sa_exc.ProgrammingError, DEFINITION),
    (sa_exc.NotSupportedError, DEFINITION),
    (sa_exc.IntegrityError, DEFINITION),
)

_FIXES = {
    DEFINITION: "fix the source definition (database, schema, table, columns, where=/query=) "
    "or the table; retrying cannot help",
    PERMISSION: "grant this user what it needs (CONNECT, USAGE on the schema, SELECT on the "
    "table) or fix the credentials; retrying cannot help",
    DATA: "a value in the source (or the checkpoint) cannot be converted: fix or exclude the "
    "row (where=), or re-enter the checkpoint in the column's type; retrying cannot help",
}


def _sqlstate(orig: BaseException) -> str | None:
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code if isinstance(code, str) and len(code) == 5 else None


def classify(exc: BaseException) -> str:
    """``retry``, ``definition``, ``permission`` or ``data`` for a driver error."""
    orig: Any = getattr(exc, "orig", None) or exc
    module = type(orig).__module__
    if module.startswith(("psycopg", "psycopg2", "asyncpg", "pg8000")):
        state = _sqlstate(orig)
        if state is not None:
            return _PG_CODES.get(state) or _PG_CLASSES.get(state[:2], RETRY)
        text = str(orig)
        for pattern, verdict in _PG_CONNECT_MESSAGES:
            if pattern.search(text):
                return verdict
    elif module.startswith(("pymysql", "MySQLdb", "mysql", "mariadb")):
        code = orig.args[0] if orig.args and isinstance(orig.args[0], int) else None
        if code is not None:
            if code in _MYSQL_CODES:
                return _MYSQL_CODES[code]
            if code >= 2000:  # client-side: could not connect, lost the connection
                return RETRY
    elif module.startswith("sqlite3"):
        # Text that is not UTF-8 in a TEXT column: the same row fails every time.
        if any(p.search(str(orig)) for p in _SQLITE_DATA_MESSAGES):
            return DATA
        code = getattr(orig, "sqlite_errorcode", None)
        if isinstance(code, int):
            return _SQLITE_CODES.get(code & 0xFF, RETRY)
    if isinstance(exc, sa_exc.DBAPIError) and not exc.connection_invalidated:
        for cls, verdict in _CLASS_DEFAULTS:
            if isinstance(exc, cls):
                return verdict
    return RETRY


#: Driver error codes that no retry fixes: wrong database, unknown role or
#: refused password, a type mismatch between the checkpoint and the column.
#: (PostgreSQL SQLSTATE, MySQL/MariaDB error numbers; connection failures of
#: psycopg carry no SQLSTATE, so their server message is matched.) A missing
#: table or column is deliberately *not* here: a migration that renames a
#: table for a moment must be waited out (runtime contract 5.3), and a table
#: missing at the first fetch is already a ConfigurationError.
_PERMANENT_SQLSTATES = {
    "3D000": "the database does not exist",
    "28000": "the server refused the login",
    "28P01": "the server refused the password",
    "42883": (
        "no operator or function for the cursor or key column's type: it cannot be "
        "ordered (json, jsonb, boolean, bytea, point...: poll a timestamp, number or "
        "text column), or the checkpoint's value is of another type than the column"
    ),
    "22P02": "a checkpoint value does not fit the column's type",
    "42804": "the checkpoint's cursor type does not match the column",
}
_PERMANENT_MYSQL = {
    1044: "access to the database is denied",
    1045: "the server refused the login",
    1049: "the database does not exist",
}
_PERMANENT_MESSAGES = (
    (re.compile(r'database ".*" does not exist'), "the database does not exist"),
    (re.compile(r'role ".*" does not exist'), "the login role does not exist"),
    (re.compile(r"password authentication failed"), "the server refused the password"),
    (re.compile(r"no pg_hba\.conf entry"), "the server does not accept this login from here"),
)


def permanent_problem(exc: BaseException) -> str | None:
    """What a driver error says a person must fix, or None if a retry may help."""
    orig = getattr(exc, "orig", None) or exc
    state = getattr(orig, "sqlstate", None)
    if isinstance(state, str) and state in _PERMANENT_SQLSTATES:
        return _PERMANENT_SQLSTATES[state]
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int) and args[0] in _PERMANENT_MYSQL:
        return _PERMANENT_MYSQL[args[0]]
    text = str(orig)
    for pattern, problem in _PERMANENT_MESSAGES:
        if pattern.search(text):
            return problem
    return None


def source_error(exc: BaseException, what: str, problem: str | None = None) -> DbTriggerError:
    """The dbtrigger error for a driver error raised while ``what`` (chain it: ``from exc``).

    ``problem`` is a plain-words diagnosis (e.g. "the database does not exist")
    put in front of the driver's own text.
    """
    verdict = classify(exc)
    orig = getattr(exc, "orig", None) or exc
    fields: dict[str, Any] = {"driver_error": type(orig).__name__}
    state = _sqlstate(orig)
    if state is not None:
        fields["sqlstate"] = state
    text = f"{what} failed: {short_error(exc)}"
    if problem is not None:
        text = f"{what} failed: {problem} ({short_error(exc)})"
    if verdict == RETRY:
        return FetchError(text, **fields)
    message = f"{text}; {_FIXES[verdict]}"
    if verdict == PERMISSION:
        return SourcePermissionError(message, **fields)
    if verdict == DATA:
        return SerializationError(message, **fields)
    return SourceDefinitionError(message, **fields)


@contextlib.contextmanager
def mapped(what: str, *, diagnose: bool = False) -> Iterator[None]:
    """Raise what the driver raises while ``what`` as the dbtrigger error for it, cause chained.

    Every statement a source runs is inside one of these, so a driver error
    leaves the source only as :func:`source_error` sorted it. ``diagnose``
    (fetch and start-up checks, where an operator reads the message first)
    puts :func:`permanent_problem`'s plain-words diagnosis in front, and makes
    a failure otherwise retried a :class:`~dbtrigger.errors.ConfigurationError`
    when that diagnosis says no retry can fix it (a database that does not
    exist, a refused login).
    """
    try:
        yield
    except sa_exc.SQLAlchemyError as exc:
        raise mapped_error(exc, what, diagnose=diagnose) from exc


def mapped_error(exc: BaseException, what: str, *, diagnose: bool = False) -> DbTriggerError:
    """What :func:`mapped` raises for ``exc`` (for a per-batch path that catches
    ``SQLAlchemyError`` itself rather than enter a context manager)."""
    problem = permanent_problem(exc) if diagnose else None
    error = source_error(exc, what, problem)
    if problem is not None and isinstance(error, FetchError):
        return ConfigurationError(
            f"{what} failed: {problem} ({short_error(exc)}); fix the source configuration"
        )
    return error


@contextlib.contextmanager
def driver_mapped(
    what: str,
    errors: type[BaseException] | tuple[type[BaseException], ...],
    special: Callable[[BaseException, str], DbTriggerError | None] | None = None,
) -> Iterator[None]:
    """:func:`mapped` for an edge that calls a driver directly (no SQLAlchemy around it).

    ``errors`` (the driver's) raised while ``what`` become :func:`source_error`'s
    dbtrigger error, cause chained, unless ``special`` names a better one for
    what only this edge knows (it returns None for the rest). dbtrigger's own
    errors pass through unchanged.
    """
    try:
        yield
    except DbTriggerError:
        raise
    except errors as exc:
        error = special(exc, what) if special is not None else None
        raise (error if error is not None else source_error(exc, what)) from exc


__all__ = [
    "classify",
    "driver_mapped",
    "encoding_problem",
    "mapped",
    "permanent_problem",
    "short_error",
    "source_error",
]
