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

from dbtrigger.cdc.changes import UNCHANGED, Change, Unchanged, transactions
from dbtrigger.cdc.position import LogPosition

if TYPE_CHECKING:
    from dbtrigger.cdc.binlog_source import BinlogSource
    from dbtrigger.cdc.pg_source import PgLogicalSource


def __getattr__(name: str) -> Any:
    # psycopg is imported only when a PostgreSQL source is asked for.
    if name == "PgLogicalSource":
        from dbtrigger.cdc.pg_source import PgLogicalSource  # noqa: PLC0415

        return PgLogicalSource
    if name == "BinlogSource":  # pymysql and mysql-replication likewise
        from dbtrigger.cdc.binlog_source import BinlogSource  # noqa: PLC0415

        return BinlogSource
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
