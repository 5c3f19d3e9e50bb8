"""Never publish a table whose updates and deletes PostgreSQL would then refuse.

A table in a publication that publishes updates and deletes must have a replica
identity: a primary key (``DEFAULT``), an index (``USING INDEX``) or ``FULL``.
One without (no primary key under ``DEFAULT``, or ``NOTHING``) is published all
the same, and from then on every ``UPDATE`` and ``DELETE`` of it fails in the
application with "cannot update table ... because it does not have a replica
identity and publishes updates", until someone takes it out again. The source
created the publication at its first read (or at ``dbtrigger cdc install``) and
its own read then failed on the same table: an outage of the application's
writes, caused by starting a reader. So such a table is refused before anything
is published, naming the statement that makes it publishable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from dbtrigger.cdc.pg_connection import translated
from dbtrigger.errors import SourceDefinitionError

if TYPE_CHECKING:
    from dbtrigger.cdc.pg_names import TableName

_IDENTITY = """
SELECT c.relreplident::text,
  EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid
          AND (i.indisprimary OR (c.relreplident = 'i' AND i.indisreplident)))
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s
"""


def refuse_without_identity(conn: psycopg.Connection[Any], tables: Sequence[TableName]) -> None:
    """Raise before publishing ``tables`` when one has no replica identity.

    Raises:
        SourceDefinitionError: naming each such table and the ``ALTER TABLE`` to run.
    """
    lacking: list[str] = []
    with translated("reading the watched tables' replica identity"):
        for table in tables:
            row = conn.execute(_IDENTITY, (table.schema, table.name)).fetchone()
            if row is None:
                continue  # not there: the catalog read names it
            identity, keyed = row
            if identity == "n" or (identity in ("d", "i") and not keyed):
                why = "REPLICA IDENTITY NOTHING" if identity == "n" else "no primary key"
                lacking.append(
                    f"{table.qualified} ({why}): add a primary key, or run ALTER TABLE "
                    f"{table.identifier().as_string(conn)} REPLICA IDENTITY FULL"
                )
    if lacking:
        raise SourceDefinitionError(
            "nothing was published: PostgreSQL refuses every UPDATE and DELETE of a "
            "published table without a replica identity, so publishing these would make "
            f"the application's writes fail: {'; '.join(lacking)}; then start again"
        )


__all__ = ["refuse_without_identity"]
