"""Who holds the lock a MariaDB/MySQL statement gave up waiting for, in a few words (internal).

A statement waits for a row lock (InnoDB) or for a table's metadata lock (the
server's MDL): a DDL statement waits for every transaction that has used the
table, even one that only read it, and every later statement on the table
queues behind that waiting DDL. Both waits end in the same error (1205), so
the words name the candidates for both:

* ``information_schema.METADATA_LOCK_INFO`` (MariaDB's ``metadata_lock_info``
  plugin, where an administrator installed it) names the sessions holding a
  metadata lock on the table, exactly;
* otherwise no view of the server says who holds a metadata lock:
  ``INNODB_TRX`` lists every open transaction, the ones that only read as well
  (they hold the metadata locks of what they read until they end, yet lock no
  row), so those are named as the possible holders, the ones holding row locks
  first, and the words say that which of them holds the table's metadata lock
  cannot be told; sessions that wait for the table's metadata lock themselves
  (``PROCESSLIST``: a DDL queued ahead) are named as such. A ``LOCK TABLES``,
  ``FLUSH TABLES WITH READ LOCK`` or ``BACKUP STAGE`` of a session without a
  transaction appears in neither list: the words then say the holder cannot be
  named.

Ids, states and ages only, never SQL (which can carry values). The statements
are driver SQL in the ``pyformat`` style, run through a callable, so that a
SQLAlchemy connection and a bare PyMySQL one (the binlog source's) share them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: Runs one driver statement with ``pyformat`` parameters and returns its rows.
Run = Callable[[str, Mapping[str, Any]], Sequence[Sequence[Any]]]

#: Shown at most; the rest are counted.
SHOWN = 5

#: The sessions holding a metadata lock on the table (the plugin's view).
METADATA_LOCK_HOLDERS = (
    "SELECT DISTINCT m.THREAD_ID, p.COMMAND, "
    "TIMESTAMPDIFF(SECOND, t.trx_started, NOW()) AS open_for, COALESCE(t.trx_rows_locked, 0) "
    "FROM information_schema.METADATA_LOCK_INFO m "
    "LEFT JOIN information_schema.PROCESSLIST p ON p.ID = m.THREAD_ID "
    "LEFT JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = m.THREAD_ID "
    "WHERE m.TABLE_SCHEMA = COALESCE(%(schema)s, DATABASE()) AND m.TABLE_NAME = %(table)s "
    "AND m.THREAD_ID <> CONNECTION_ID() "
    "AND NOT (p.STATE <=> 'Waiting for table metadata lock') "
    "ORDER BY open_for IS NULL, open_for DESC"
)

#: Every other session's open transaction, those holding row locks first, then the
#: oldest: the possible holders when the plugin is not there. Sessions waiting for a
#: metadata lock themselves are left to :data:`METADATA_LOCK_WAITERS`.
OPEN_TRANSACTIONS = (
    "SELECT t.trx_mysql_thread_id, p.COMMAND, TIMESTAMPDIFF(SECOND, t.trx_started, NOW()), "
    "t.trx_rows_locked FROM information_schema.INNODB_TRX t "
    "LEFT JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id "
    "WHERE t.trx_mysql_thread_id <> CONNECTION_ID() "
    "AND NOT (p.STATE <=> 'Waiting for table metadata lock') "
    "ORDER BY (t.trx_rows_locked > 0 OR t.trx_tables_locked > 0) DESC, t.trx_started"
)

#: Other sessions waiting for a metadata lock with a statement on the table (a DDL
#: queued ahead of the statement that gave up holds it back too). The statement's
#: text is only matched, never shown.
METADATA_LOCK_WAITERS = (
    "SELECT p.ID, p.TIME FROM information_schema.PROCESSLIST p "
    "WHERE p.ID <> CONNECTION_ID() AND p.STATE = 'Waiting for table metadata lock' "
    "AND LOCATE(%(table)s, p.INFO) > 0 ORDER BY p.TIME DESC"
)


def mysql_holders_words(run: Run, table: str, schema: str | None) -> str:
    """Who holds locks ``table`` may wait for, in a few words ("" only when nothing
    could be read). ``run`` may raise; a view this account cannot read is left out."""
    params = {"table": table, "schema": schema}
    exact = _rows(run, METADATA_LOCK_HOLDERS, params)
    waiters = _rows(run, METADATA_LOCK_WAITERS, params) or []
    if exact is not None:
        if not exact:
            return _with_waiters("no other session holds a metadata lock on it", waiters)
        return _with_waiters("held by " + _listed(exact), waiters) + _KILL
    candidates = _rows(run, OPEN_TRANSACTIONS, params)
    if candidates is None:
        return ""
    if not candidates:
        text = (
            "the holder cannot be named: no other session has an open transaction (a LOCK "
            "TABLES, FLUSH TABLES WITH READ LOCK or BACKUP STAGE needs none; "
            "information_schema.METADATA_LOCK_INFO, the metadata_lock_info plugin, would name it)"
        )
        return _with_waiters(text, waiters)
    text = (
        "probably held by "
        + _listed(candidates)
        + " (which of them holds the table's metadata lock, if that is the lock, cannot be "
        "told without information_schema.METADATA_LOCK_INFO, the metadata_lock_info plugin: "
        "an open transaction holds the metadata locks of every table it used, read or written)"
    )
    return _with_waiters(text, waiters) + _KILL


_KILL = " (KILL <connection> ends one)"


def _rows(run: Run, sql: str, params: Mapping[str, Any]) -> Sequence[Sequence[Any]] | None:
    try:
        return run(sql, params)
    except Exception:  # noqa: BLE001 - best effort: a view missing or refused is left out
        return None


def _listed(rows: Sequence[Sequence[Any]]) -> str:
    parts = []
    for thread, command, age, locked in rows[:SHOWN]:
        opened = f"transaction open for {age} s" if age is not None else "no transaction"
        held = f"{locked} row(s) locked" if locked else "no row locked"
        parts.append(f"connection {thread} ({command or 'unknown'}, {opened}, {held})")
    more = len(rows) - SHOWN
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _with_waiters(text: str, waiters: Sequence[Sequence[Any]]) -> str:
    if not waiters:
        return text
    queued = ", ".join(f"connection {thread} for {age} s" for thread, age in waiters[:SHOWN])
    return f"{text}; waiting for the table's metadata lock too (a DDL queued ahead): {queued}"


__all__ = [
    "METADATA_LOCK_HOLDERS",
    "METADATA_LOCK_WAITERS",
    "OPEN_TRANSACTIONS",
    "mysql_holders_words",
]
