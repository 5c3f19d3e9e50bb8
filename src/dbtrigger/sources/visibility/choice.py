"""``visibility=``: validating the argument and choosing the guard for ``auto``."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dbtrigger.errors import ConfigurationError
from dbtrigger.sources.visibility.base import XID_COLUMN_MARKER, NoGuard, VisibilityGuard
from dbtrigger.sources.visibility.horizons import SnapshotHorizon, TransactionHorizon
from dbtrigger.sources.visibility.mariadb import (
    MYSQL_DIALECTS,
    MariaDbHorizon,
    can_read_transactions,
)
from dbtrigger.sources.visibility.privileges import NO_PROCESS as _NO_PROCESS
from dbtrigger.sources.visibility.window import WINDOW_DIALECTS, SafetyWindow


def parse_visibility(value: str | VisibilityGuard | None) -> str | VisibilityGuard:
    """Validate the ``visibility=`` argument: ``"auto"``, ``"none"`` or a guard."""
    if value is None or value == "auto":
        return "auto"
    if value == "none":
        return NoGuard()
    if isinstance(value, VisibilityGuard):
        return value
    raise ConfigurationError(
        f"visibility must be 'auto', 'none' or a guard (SnapshotHorizon(), "
        f"TransactionHorizon(), MariaDbHorizon(), SafetyWindow(seconds)), got {value!r}"
    )


def is_timestamp_type(type_: sa.types.TypeEngine[Any] | None) -> bool:
    return isinstance(type_, sa.DateTime)


def choose(
    dialect: str,
    *,
    cursor_type: sa.types.TypeEngine[Any] | None,
    cursor_comment: str | None,
    sample_is_timestamp: bool | None,
    conn: Connection | None = None,
    auto_increment: bool = False,
) -> VisibilityGuard:
    """The guard ``auto`` picks: the strongest the dialect and cursor support.

    ``sample_is_timestamp`` is the answer of a one-row probe in query mode
    (where no declared type is known); None when no row exists yet. On
    MariaDB/MySQL ``conn`` lets it check the PROCESS privilege (without a
    connection it assumes the privilege is missing); ``auto_increment`` says
    the reflected integer cursor is ``AUTO_INCREMENT``.
    """
    if dialect == "postgresql":
        if (cursor_comment or "").startswith(XID_COLUMN_MARKER):
            return SnapshotHorizon()
        return TransactionHorizon()
    timestamp = is_timestamp_type(cursor_type) if cursor_type is not None else sample_is_timestamp
    if dialect in MYSQL_DIALECTS and (timestamp or auto_increment):
        if conn is not None and can_read_transactions(conn):
            return MariaDbHorizon()
        if timestamp:
            return SafetyWindow(reason=_NO_PROCESS)
        return NoGuard(
            reason=f"{_NO_PROCESS}, and an AUTO_INCREMENT cursor has no clock for a window; "
            "GRANT PROCESS, or use SafetyWindow(time_column=...) with a timestamp set on write"
        )
    if dialect in WINDOW_DIALECTS and timestamp:
        return SafetyWindow()
    if dialect == "sqlite":
        return NoGuard(
            reason="SQLite runs one writer at a time, so values assigned inside the write "
            "transaction become visible in order; application-assigned non-timestamp "
            "cursors are not protected"
        )
    if dialect in WINDOW_DIALECTS:
        return NoGuard(
            reason=f"a non-timestamp cursor on {dialect} has no clock to wait on; use "
            "SafetyWindow(time_column=...) with a timestamp set on write"
            + (" (or an AUTO_INCREMENT cursor)" if dialect in MYSQL_DIALECTS else "")
        )
    return NoGuard(reason=f"no visibility guard for dialect {dialect!r}; see docs/visibility.md")
