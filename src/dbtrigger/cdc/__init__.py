"""Log-based change capture: every committed change, in commit order, from the database's log.

:class:`PgLogicalSource` reads PostgreSQL's logical decoding (``pgoutput``),
:class:`BinlogSource` a MariaDB/MySQL binary log.
The shared pieces a log source is built from are database-neutral and live
beside it: :mod:`dbtrigger.cdc.position` (where a change sits: commit and
ordinal), :mod:`dbtrigger.cdc.changes` (the change shape, :data:`UNCHANGED`),
:mod:`dbtrigger.cdc.buffer` (whole transactions read ahead of the checkpoint).
See ``docs/cdc.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dbtrigger._lazy import import_name
from dbtrigger.cdc.changes import UNCHANGED, Change, Unchanged, transactions
from dbtrigger.cdc.position import LogPosition

if TYPE_CHECKING:
    from dbtrigger.cdc.binlog_source import BinlogSource
    from dbtrigger.cdc.pg_source import PgLogicalSource


#: Each source's module, and the extra that installs the drivers it needs.
_SOURCES = {
    "PgLogicalSource": ("dbtrigger.cdc.pg_source", "cdc"),
    "BinlogSource": ("dbtrigger.cdc.binlog_source", "binlog"),
}
_DRIVERS = ("psycopg", "psycopg2", "pymysql", "pymysqlreplication")


def __getattr__(name: str) -> Any:
    # A source's drivers are imported only when it is asked for; without them the
    # error names the extra (a bare "No module named 'psycopg'" did not).
    if name in _SOURCES:
        home, extra = _SOURCES[name]
        return import_name(name, home, dict.fromkeys(_DRIVERS, extra))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "UNCHANGED",
    "BinlogSource",
    "Change",
    "LogPosition",
    "PgLogicalSource",
    "Unchanged",
    "transactions",
]
