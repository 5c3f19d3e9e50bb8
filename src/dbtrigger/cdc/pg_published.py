"""Each read of a PgLogicalSource checks that its tables are still published.

``DROP TABLE`` takes a table out of its publications (a table created again under
its name is in none), and ``ALTER TABLE ... RENAME`` keeps it in them under the new
name, while the poller watches the old one: either way ``pgoutput`` sends nothing
more for the watched name, and a poller that read on would move the slot past
those changes without a word. So the read is refused, naming what to run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import psycopg

from dbtrigger.cdc.pg_connection import translated
from dbtrigger.cdc.pg_setup import TableName, publication_tables
from dbtrigger.errors import SourceDefinitionError


def check_still_published(
    conn: psycopg.Connection[Any],
    name: str,
    tables: Sequence[TableName],
    *,
    poller: str | None,
    oids: Mapping[str, int] | None = None,
    unfinished: Callable[[], Collection[str]] = frozenset,
) -> None:
    """Refuse to read on when a watched table is no longer in the publication.

    ``DROP TABLE`` takes a table out of its publications, and a table created
    again under its name is in none: ``pgoutput`` then sends nothing for it, so
    a poller that read on would advance the slot past its changes without a word.
    A renamed table stays published under its new name (found by ``oids``): named,
    with the snapshot to run again when one of it was ``unfinished`` (by old name).

    Raises:
        SourceDefinitionError: naming the tables and what to run.
    """
    listed = publication_tables(conn, name)
    missing = [t.qualified for t in tables if listed is None or t.qualified not in listed]
    if not missing:
        return
    renamed = {t: _name_of(conn, oids[t]) for t in missing if oids and t in oids}
    renamed = {t: now for t, now in renamed.items() if now is not None and now in (listed or ())}
    if renamed:
        moves = ", ".join(f"{t} was renamed to {now}" for t, now in renamed.items())
        again = [now for t, now in renamed.items() if t in unfinished()]
        raise SourceDefinitionError(
            f"watched table {moves} (ALTER TABLE ... RENAME); publication "
            f"{name} follows it under the new name, and the slot holds its changes. Point "
            "tables= at the new name and accept the changed source: dbtrigger reset "
            f"{poller or 'POLLER'} --accept-source MODULE:TRIGGER --reason 'table renamed' "
            "--yes; the changes from before the rename are read then, none skipped"
            + "".join(
                f". Its snapshot was not finished: then read it again, dbtrigger cdc snapshot "
                f"MODULE:TRIGGER --table {t} --yes"
                for t in again
            ),
            poller=poller,
        )
    what = ", ".join(missing)
    raise SourceDefinitionError(
        f"watched table {what} is no longer in publication {name} (dropped and created "
        "again, or removed from it): the log carries none of its changes since then for "
        "this poller. Publish it again: dbtrigger cdc install MODULE:TRIGGER --yes, then read "
        "its rows again: "
        + "; ".join(f"dbtrigger cdc snapshot MODULE:TRIGGER --table {t} --yes" for t in missing),
        poller=poller,
    )


def _name_of(conn: psycopg.Connection[Any], oid: int) -> str | None:
    """The qualified name the table with ``oid`` has now (None: there is none)."""
    with translated("reading the catalog"):
        row = conn.execute(
            "SELECT n.nspname || '.' || c.relname FROM pg_class c, pg_namespace n "
            "WHERE c.oid = %s AND n.oid = c.relnamespace",
            (oid,),
        ).fetchone()
    return None if row is None else str(row[0])


__all__ = ["check_still_published"]
