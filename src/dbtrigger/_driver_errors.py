"""A driver error in one line, and the one driver failure outside the DB-API tree.

Every SQL adapter (the source, the SQL checkpoint store, the output binding,
the claim queue) names a failed statement in its own error message. The
driver's text can carry the SQL and its bound values, so an adapter shows
:func:`short_error` instead: the exception's class and the first line of its
message. :func:`encoding_problem` recognises a failure SQLAlchemy raises
*before* any statement runs (a PostgreSQL database in ``SQL_ASCII``) and says
what to fix. :func:`failed_as` is the one ``except`` an adapter without a
finer error map puts around its statements. Below every wing: it imports
nothing of dbtrigger.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator

from sqlalchemy.exc import NoSuchTableError, SQLAlchemyError


def short_error(exc: BaseException, limit: int | None = 300) -> str:
    """One line naming a driver error, without the SQL text or bound values: its
    class and the first line of its message, cut at ``limit`` characters (None: whole,
    for a caller that masks secrets first and then cuts, so none is cut in half)."""
    orig = getattr(exc, "orig", None) or exc
    first = (str(orig).strip().splitlines() or [""])[0]
    return f"{type(orig).__name__}: {first}"[:limit]


#: Another transaction won (deadlock victim, serialization failure): the database
#: rolled the whole transaction back, so running it again can succeed.
PG_CONFLICT_SQLSTATES = frozenset({"40001", "40P01"})
MYSQL_CONFLICT_CODES = frozenset({1213})


def lost_to_another_transaction(exc: BaseException) -> bool:
    """True for a deadlock victim or a serialization failure (PostgreSQL, MariaDB/MySQL):
    the database rolled the transaction back, and the same transaction may run again."""
    orig = getattr(exc, "orig", None) or exc
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    args = getattr(orig, "args", ())
    code = args[0] if args and isinstance(args[0], int) else None
    return sqlstate in PG_CONFLICT_SQLSTATES or code in MYSQL_CONFLICT_CODES


#: The table or a column a statement names is not there (any more).
PG_MISSING_SQLSTATES = frozenset({"42P01", "42703"})
MYSQL_MISSING_CODES = frozenset({1146, 1054})
SQLITE_MISSING = ("no such table", "no such column", "has no column named")


def names_a_missing_object(exc: BaseException) -> bool:
    """True when a statement failed because its table or one of its columns is not
    there (dropped or renamed since it was read): PostgreSQL, MariaDB/MySQL, SQLite,
    or SQLAlchemy's catalogue reads (``NoSuchTableError``)."""
    if isinstance(exc, NoSuchTableError):
        return True
    orig = getattr(exc, "orig", None) or exc
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    args = getattr(orig, "args", ())
    code = args[0] if args and isinstance(args[0], int) else None
    if sqlstate in PG_MISSING_SQLSTATES or code in MYSQL_MISSING_CODES:
        return True
    return type(orig).__module__.startswith("sqlite3") and any(
        text in str(orig) for text in SQLITE_MISSING
    )


@contextlib.contextmanager
def failed_as(error: Callable[[str], Exception], what: str, then: str = "") -> Iterator[None]:
    """A SQLAlchemy error raised inside becomes ``error("<what>: <short_error><then>")``,
    cause chained.

    ``what`` says what failed, in the adapter's words ("claim on q failed");
    ``then`` what happens next or what was left unchanged ("; nothing was
    inserted"). Anything else (dbtrigger's own errors included) passes through.
    """
    try:
        yield
    except SQLAlchemyError as exc:
        raise error(f"{what}: {short_error(exc)}{then}") from exc


def encoding_problem(exc: BaseException) -> str | None:
    """What is wrong, for a driver failure raised *outside* the DB-API error tree (None: unknown).

    SQLAlchemy's PostgreSQL dialect reads ``version()`` on an engine's first
    connection. On a database whose encoding is ``SQL_ASCII`` psycopg returns
    text as bytes, and the dialect fails with a bare ``TypeError`` before any
    statement of ours ran: it would escape a tick as a raw exception, or look
    like a hiccup if it were retried. The same happens on every connection, so
    it is an operator error, with the fix.
    """
    if not isinstance(exc, TypeError) or "bytes-like object" not in str(exc):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if not any("postgresql" in f.filename and f.name == "initialize" for f in frames):
        return None
    return (
        "the database sends its text as bytes, which SQLAlchemy cannot read: its encoding "
        "is SQL_ASCII (psycopg then decodes nothing). Add client_encoding=utf8 to the URL "
        "(postgresql+psycopg://...?client_encoding=utf8) when its text is UTF-8 (a row "
        "holding other bytes is then refused, naming it), or move the data to a UTF8 "
        f"database; retrying cannot help ({type(exc).__name__}: {exc})"
    )


#: SQLSTATEs of a character the database's encoding lacks (22P05) or bytes invalid in it.
UNENCODABLE_SQLSTATES = frozenset({"22P05", "22021"})
#: MariaDB/MySQL's "Incorrect ... value" (a string: a character the column's charset lacks).
MYSQL_INCORRECT_VALUE = 1366


def unencodable(exc: BaseException) -> bool:
    """A value holding a character the database's encoding lacks (a LATIN1
    PostgreSQL database): psycopg encodes text for that encoding on the client
    and raises a bare ``UnicodeEncodeError``; with ``client_encoding=utf8`` the
    server refuses it (22P05). Either way every retry is refused the same."""
    if isinstance(exc, UnicodeEncodeError):
        return True
    return getattr(getattr(exc, "orig", None), "sqlstate", None) in UNENCODABLE_SQLSTATES


def cannot_hold(exc: BaseException) -> bool:
    """:func:`unencodable`, or MariaDB/MySQL refusing a character a LATIN1 table or
    column lacks (1366 "Incorrect string value", in a strict sql_mode, the default)."""
    args = getattr(getattr(exc, "orig", None), "args", ())
    if args and args[0] == MYSQL_INCORRECT_VALUE and "Incorrect string value" in str(args[-1]):
        return True
    return unencodable(exc)


def ascii_text(text: str) -> str:
    """``text`` with every character past ASCII written as a backslash escape
    (``\\u6f22``): what any database encoding can hold, and readable back."""
    return text.encode("ascii", "backslashreplace").decode("ascii")


def not_encodable(what: str, detail: str, kept: str, option: str) -> str:
    """The words for :func:`unencodable`: a character of ``what`` could not be
    stored; keep ``kept`` in a UTF8 database (``option`` points there) instead."""
    return (
        f"the database's encoding cannot hold a character of {what} ({detail}); "
        f"nothing was changed. Keep {kept} in a UTF8 database ({option} of another "
        "database) or in another store"
    )


__all__ = [
    "MYSQL_CONFLICT_CODES",
    "MYSQL_INCORRECT_VALUE",
    "PG_CONFLICT_SQLSTATES",
    "UNENCODABLE_SQLSTATES",
    "ascii_text",
    "cannot_hold",
    "encoding_problem",
    "failed_as",
    "lost_to_another_transaction",
    "not_encodable",
    "short_error",
    "unencodable",
]
