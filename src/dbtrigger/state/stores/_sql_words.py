"""What the SQL store says of a state table that is not as it made it (internal).

Someone dropped it, renamed a column, or narrowed the ``document`` column while
pollers ran. Neither is an outage a retry outlives: each is a
:class:`~dbtrigger.errors.StoreRefusedError` saying what a person can do.
"""

from __future__ import annotations

from dbtrigger import _driver_errors


def column_misfit(dialect: str, table: str, column_type: str, what: str) -> str:
    """A document the ``document`` column does not hold as written (``what``: the
    server's words, or the sizes written and kept), and the ALTER that restores it."""
    if dialect in ("mysql", "mariadb"):
        fix = f"ALTER TABLE {table} MODIFY document LONGTEXT CHARACTER SET utf8mb4 "
        fix += "COLLATE utf8mb4_bin NOT NULL"
    else:
        fix = f"ALTER TABLE {table} ALTER COLUMN document TYPE {column_type}"
    return (
        f"the document column of {table} cannot hold this state document ({what}); nothing "
        f"was changed. Was the table altered? Restore the column with `{fix}` "
        "(the store's ddl() shows the table it expects)"
    )


def table_gone(table: str, what: str) -> str:
    """The state table, or a column of it, missing while this store used it."""
    return (
        f"the state table {table} or one of its columns is missing ({what}): was it dropped "
        "or altered while pollers ran? Nothing was changed. Restore it from a backup (its "
        "rows are every poller's checkpoint) or put back the column as the store's ddl() "
        "shows; a table dropped for good is created empty at the next start, and its "
        "pollers then deliver every row again"
    )


def not_encodable(what: str) -> str:
    """A state document holding a character the database's encoding lacks (a text
    key's checkpoint in a LATIN1 PostgreSQL database)."""
    return _driver_errors.not_encodable(
        "this state document", what, "the state", "SqlCheckpointStore(url=...)"
    )
