"""What a visibility guard lacks for want of a privilege, and the GRANT that fixes it.

Two guards read other sessions' transactions and need a privilege to:

* MariaDB/MySQL's transaction horizon (:class:`MariaDbHorizon`) reads
  ``information_schema.INNODB_TRX`` and ``PROCESSLIST``: the PROCESS
  privilege. Without it ``visibility="auto"`` settles for a bounded safety
  window (a transaction longer than the window can still be skipped), or for
  no guard at all on an ``AUTO_INCREMENT`` cursor;
* PostgreSQL's transaction horizon (:class:`TransactionHorizon`) reads
  ``pg_stat_activity``; without ``pg_read_all_stats`` other roles' sessions
  are hidden and the guard refuses to fetch while one is open.

Both are quiet failures until the day they matter, so the worker logs them
once at WARNING when the guard is chosen, with the exact ``GRANT`` for the
account it runs as, and ``dbtrigger check`` reports them
(``visibility_privilege``) on both databases.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from dbtrigger.sources.visibility.base import NoGuard, VisibilityGuard
from dbtrigger.sources.visibility.horizons import TransactionHorizon
from dbtrigger.sources.visibility.mariadb import (
    MYSQL_DIALECTS,
    MariaDbHorizon,
    can_read_transactions,
)
from dbtrigger.sources.visibility.window import SafetyWindow

#: Why ``auto`` settled for less than the transaction horizon on MariaDB/MySQL.
NO_PROCESS = "the account lacks the PROCESS privilege (information_schema.INNODB_TRX)"


@dataclass(frozen=True)
class PrivilegeGap:
    """What the guard in force gives up for a missing privilege, and the fix."""

    message: str
    grant: str


def fell_back_for_process(guard: VisibilityGuard | None) -> bool:
    """``auto`` chose this guard on MariaDB/MySQL because PROCESS was missing."""
    reason = getattr(guard, "reason", None)
    return isinstance(guard, (SafetyWindow, NoGuard)) and str(reason or "").startswith(NO_PROCESS)


def _current_user(conn: Connection, sql: str) -> str:
    """What ``sql`` says the connection's user is ("": it could not say, the
    failed statement rolled back)."""
    try:
        return str(conn.execute(sa.text(sql)).scalar() or "")
    except DBAPIError:
        conn.rollback()
        return ""


def mysql_account(conn: Connection) -> str:
    """``'user'@'host'`` of the connection's account, as GRANT wants it."""
    user, _, host = _current_user(conn, "SELECT CURRENT_USER()").rpartition("@")
    return f"'{user}'@'{host}'" if user else "<polling account>"


def pg_role(conn: Connection) -> str:
    """The connection's role, quoted as an identifier for GRANT."""
    role = _current_user(conn, "SELECT current_user")
    return conn.dialect.identifier_preparer.quote(role) if role else "<polling role>"


def pg_can_read_all_stats(conn: Connection) -> bool:
    allowed = conn.execute(
        sa.text(
            "SELECT rolsuper OR pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') "
            "FROM pg_roles WHERE rolname = current_user"
        )
    ).scalar()
    return bool(allowed)


def privilege_gap(conn: Connection, dialect: str, guard: VisibilityGuard) -> PrivilegeGap | None:
    """What ``guard`` gives up on this connection's account for a missing privilege.

    None when nothing: the guard needs no privilege, or the account has it.
    Ends the connection's transaction (the checks are reads of catalogs).
    """
    try:
        if dialect == "postgresql" and isinstance(guard, TransactionHorizon):
            if pg_can_read_all_stats(conn):
                return None
            return PrivilegeGap(
                "the transaction-horizon guard cannot see other roles' sessions without "
                "pg_read_all_stats: the poller refuses to fetch whenever another role has a "
                "session open (or poll a transaction-id column: install_visibility_trigger, "
                "no privilege needed)",
                f"GRANT pg_read_all_stats TO {pg_role(conn)}",
            )
        if dialect in MYSQL_DIALECTS:
            lacking = fell_back_for_process(guard) or (
                isinstance(guard, MariaDbHorizon) and not can_read_transactions(conn)
            )
            if not lacking:
                return None
            if isinstance(guard, MariaDbHorizon):
                what = "the transaction-horizon guard cannot read INNODB_TRX: every fetch fails"
            elif isinstance(guard, SafetyWindow):
                what = (
                    f"falls back from the exact transaction horizon to {guard.label()}: a "
                    "transaction open longer than the window can be skipped"
                )
            else:
                what = (
                    "falls back from the exact transaction horizon to no guard (an "
                    "AUTO_INCREMENT cursor has no clock for a window): a transaction that "
                    "commits late can be skipped"
                )
            return PrivilegeGap(
                f"{what}; the account lacks the PROCESS privilege",
                f"GRANT PROCESS ON *.* TO {mysql_account(conn)}",
            )
        return None
    finally:
        if conn.in_transaction():
            conn.rollback()


__all__ = [
    "NO_PROCESS",
    "PrivilegeGap",
    "fell_back_for_process",
    "mysql_account",
    "pg_can_read_all_stats",
    "pg_role",
    "privilege_gap",
]
