"""Statements in the binary log that move a watched table off its name, and what they mean.

The binary log names a change's table as it is named when the change is
written. So a statement that gives a watched table another name, drops it, or
puts another table under a watched name changes what the log's changes of
that name are, without a row event to say so:

* ``RENAME TABLE a TO b[, c TO d ...]`` (read as one move: ``a TO tmp, b TO a,
  tmp TO b`` swaps ``a`` and ``b``, ``a TO tmp, tmp TO a`` moves nothing);
* ``ALTER TABLE a ... RENAME [TO|AS] b``;
* ``DROP TABLE [IF EXISTS] a[, b ...]`` (not ``DROP TEMPORARY TABLE``: a
  temporary table of that name hides the watched one for its session only);
* ``DROP DATABASE|SCHEMA d``: every table of ``d``;
* ``CREATE OR REPLACE TABLE a ...`` (MariaDB): ``a`` dropped, a new table under
  its name.

An unqualified name is in the statement's default database (the log says
which), as for ``TRUNCATE``: a table of the same name in another database is
not the watched one. :func:`moves` reads a statement; :func:`effects` says,
per watched name, what it did (:class:`Effect`); the reader decides what is
delivered (:mod:`dbtrigger.cdc.binlog_reader`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from dbtrigger.cdc import binlog_alter

_NAME = r"[`\"]?(?:\w+[`\"]?\.[`\"]?)?\w+[`\"]?"
_COMMENTS = re.compile(r"/\*.*?\*/|--[^\n]*|#[^\n]*", re.S)
_STARTS = re.compile(r"^\s*(?:/\*.*?\*/\s*)*(rename|alter|drop|create)\b", re.I | re.S)
_RENAMED = re.compile(rf"({_NAME})\s+to\s+({_NAME})", re.I)
_ALTER_RENAME = re.compile(
    rf"^alter\s+(?:online\s+|ignore\s+)*table\s+(?:if\s+exists\s+)?({_NAME})\s.*?"
    rf"\brename\s+(?:to\s+|as\s+)?({_NAME})\s*$",
    re.I | re.S,
)
_DROP = re.compile(
    r"^drop\s+tables?\s+(?:if\s+exists\s+)?(.*?)(?:\s+(?:restrict|cascade))?$", re.I | re.S
)
_DROP_DATABASE = re.compile(r"^drop\s+(?:database|schema)\s+(?:if\s+exists\s+)?(\S+)$", re.I)
_REPLACE = re.compile(rf"^create\s+or\s+replace\s+table\s+({_NAME})", re.I)
_WAIT = re.compile(r"\s+(?:wait\s+\d+|nowait)\b", re.I)

#: ``moves`` of ``DROP DATABASE d``: every table of ``d`` (``d.*``) is dropped.
EVERY = "*"


def _bare(name: str) -> str:
    return name.replace("`", "").replace('"', "")


def _qualified(name: str, schema: str | None) -> str:
    """``name`` with its database: the statement's default one when it names none (no
    default known: left as written, matched by its last part)."""
    name = _bare(name.strip())
    return name if "." in name or not schema else f"{schema}.{name}"


def moves(text: str, schema: str | bytes | None = None) -> dict[str, str | None]:
    """What a statement does to table names: old name -> new name (None: dropped; a
    key ``d.*``: every table of database ``d`` dropped). Names are qualified with
    ``schema`` (the statement's default database) when they name no database. Empty
    for any other statement, and for renames that end where they began."""
    if not _STARTS.match(text):
        return {}
    if isinstance(schema, bytes):
        schema = schema.decode(errors="replace")
    sql = _WAIT.sub(" ", _COMMENTS.sub(" ", text)).strip().rstrip(";").strip()
    if re.match(r"^rename\s+tables?\s", sql, re.I):
        return _net(
            (_qualified(a, schema), _qualified(b, schema)) for a, b in _RENAMED.findall(sql)
        )
    moved = _ALTER_RENAME.match(sql)
    if moved is not None and not re.search(r"\brename\s+(column|index|key)\b", sql, re.I):
        return _net([(_qualified(moved.group(1), schema), _qualified(moved.group(2), schema))])
    dropped = _DROP.match(sql)
    if dropped is not None:
        names = [n for n in dropped.group(1).split(",") if n.strip()]
        return {_qualified(n, schema): None for n in names}
    database = _DROP_DATABASE.match(sql)
    if database is not None:
        return {f"{_bare(database.group(1))}.{EVERY}": None}
    replaced = _REPLACE.match(sql)
    if replaced is not None:
        return {_qualified(replaced.group(1), schema): None}
    return {}


def redefines(text: str, schema: str | bytes | None, table: str) -> bool:
    """Does the statement ``text`` change what the table ``table`` (qualified) names its
    values by: an ``ALTER TABLE`` of it that may change its column list
    (:func:`~dbtrigger.cdc.binlog_alter.altered`: not one of indexes, constraints,
    table options, defaults or partitions only), or one that moves it off its name or
    puts another table under it (:func:`effects`)?
    """
    if not _STARTS.match(text):
        return False
    if isinstance(schema, bytes):
        schema = schema.decode(errors="replace")
    alter = binlog_alter.altered(text)
    if alter is not None and alter[1] and _matches(_qualified(alter[0], schema), table):
        return True
    return bool(effects(text, schema, [table]))


def _net(pairs: Iterable[tuple[str, str]]) -> dict[str, str | None]:
    """Renames done in order, as one move: each table's first name -> its last."""
    holder: dict[str, str] = {}  # name now -> the name its table had before the statement
    for old, new in pairs:
        holder[new] = holder.pop(old, old)
    return {first: now for now, first in holder.items() if first != now}


@dataclass(frozen=True)
class Effect:
    """What one statement did to a watched name.

    ``left``: the watched table left the name, to ``renamed_to`` (an unwatched name)
    or dropped (``renamed_to`` None). ``arrived_from``: a table from an unwatched name
    now has the watched name (its rows were never read as this name's).
    ``replaced``: ``CREATE OR REPLACE TABLE`` (dropped, and a new table at once).
    """

    table: str
    left: bool
    renamed_to: str | None = None
    arrived_from: str | None = None
    replaced: bool = False

    @property
    def dropped(self) -> bool:
        return self.left and self.renamed_to is None


def _matches(written: str, watched: str) -> bool:
    """Is ``written`` (qualified, or bare when the statement had no default database)
    the watched table ``watched`` (qualified)?"""
    if written == watched:
        return True
    if written.endswith("." + EVERY):
        return watched.startswith(written[: -len(EVERY)])
    return "." not in written and watched.endswith("." + written)


def effects(
    text: str,
    schema: str | bytes | None,
    watched: Collection[str],
    followed: Collection[str] = (),
) -> list[Effect]:
    """Per watched name, what the statement ``text`` did to it (nothing: not listed).

    A table moved between two watched names is read on under its new name, as the log
    names it (nothing lost). One that arrives from a name in ``followed`` (a table this
    reader watched before ``tables=`` was pointed at its new name) is the table whose
    changes were read under that name: nothing is lost either.
    """
    moved = moves(text, schema)
    if not moved:
        return []
    replaced = _REPLACE.match(_COMMENTS.sub(" ", text).strip()) is not None

    def watched_name(written: str | None) -> str | None:
        if written is None:
            return None
        return next((w for w in watched if _matches(written, w)), None)

    out: dict[str, Effect] = {}
    for old, new in moved.items():
        if old.endswith("." + EVERY):
            for w in watched:
                if _matches(old, w):
                    out[w] = Effect(w, left=True)
            continue
        source, target = watched_name(old), watched_name(new)
        if source is not None and target is None:
            out[source] = Effect(
                source, left=True, renamed_to=new, replaced=replaced,
                arrived_from=out[source].arrived_from if source in out else None,
            )  # fmt: skip
        if target is not None and source is None and new is not None:
            if any(_matches(old, f) for f in followed):
                continue
            before = out.get(target)
            out[target] = Effect(
                target,
                left=before is not None and before.left,
                renamed_to=None if before is None else before.renamed_to,
                arrived_from=old,
            )
    return list(out.values())


def statement_words(effect: Effect) -> str:
    """What happened to the name, in words (for the error and the log)."""
    if effect.replaced:
        return "replaced by CREATE OR REPLACE TABLE"
    if effect.dropped and effect.arrived_from is None:
        return "dropped"
    parts = []
    if effect.left:
        parts.append(f"renamed to {effect.renamed_to}" if effect.renamed_to else "dropped")
    if effect.arrived_from is not None:
        parts.append(f"given to the table that was {effect.arrived_from}")
    return ", and its name ".join(parts) if len(parts) > 1 else parts[0]


class Followed:
    """Tables this reader watched before ``tables=`` was pointed elsewhere, and where
    their changes went.

    A source pointed at a renamed table's new name (``reset --accept-source``) reads
    from a checkpoint that may be before the rename: the log names the changes made
    before it by the old name, which is not watched any more. Rows of such a table
    after the checkpoint start a **scan** (:meth:`rows_of`): the read goes on keeping
    nothing until the statement that moved the table (:meth:`statement`), then is read
    again from the checkpoint with the old name read as the watched one up to that
    statement (:meth:`alias`), as PostgreSQL's OIDs give them; none is skipped. No
    such statement (a table taken out of ``tables=`` while it lives on): it is
    cleared, and the read again keeps what it kept before.
    """

    def __init__(self, followed: Collection[str], watched: Collection[str]) -> None:
        self.unwatched = frozenset(followed) - frozenset(watched)
        self.watched = list(watched)
        #: old name -> (watched name, commit token of the statement that moved it)
        self.aliases: dict[str, tuple[str, str]] = {}
        self.cleared: set[str] = set()
        self.scanning: str | None = None
        #: The scan ended: the read stops, and is made again from the checkpoint.
        self.found = False

    def restart(self) -> None:
        self.scanning, self.found = None, False

    def alias(self, table: str, commit: str) -> str | None:
        """The watched name a change of ``table`` in the transaction at ``commit`` has."""
        hit = self.aliases.get(table)
        return hit[0] if hit is not None and commit < hit[1] else None

    def rows_of(self, table: str) -> None:
        """Rows of ``table`` (not watched) after the checkpoint: scan when it was followed."""
        if (
            self.scanning is None
            and table in self.unwatched
            and table not in self.cleared
            and table not in self.aliases
        ):
            self.scanning = table

    def statement(self, text: str, schema: str | bytes | None, commit: str) -> None:
        """A statement read while scanning: the one that moved the scanned table ends it."""
        scanned = self.scanning
        if scanned is None:
            return
        for old, new in moves(text, schema).items():
            if _matches(old, scanned):
                to = next((w for w in self.watched if new is not None and _matches(new, w)), None)
                if to is not None:
                    self.aliases[scanned] = (to, commit)
                else:
                    self.cleared.add(scanned)
                self.scanning, self.found = None, True
                return

    def read_ended(self) -> bool:
        """The read ended: must it be made again from the checkpoint (a scan ended)?"""
        if self.scanning is not None:  # the log says nothing of where it went
            self.cleared.add(self.scanning)
            self.scanning, self.found = None, True
        return self.found


def passes(effect: Effect, exists: Callable[[str], bool], acked: Callable[[str], bool]) -> bool:
    """May the reader read on past ``effect`` without losing a row?

    * ``CREATE OR REPLACE TABLE``: the name has a new table at once, whose rows are
      written into the log as it gets them; the old rows' removal is the truncate.
    * a drop: once a table is under the name again (created again: its rows come as
      it gets them; one renamed to it is an effect of its own, read on its own);
    * a table renamed away, or one renamed to the name: once the person chose to read
      the name on by asking for its snapshot after the statement was written to the
      log (``acked``; decided by log positions, never clocks: see
      :func:`dbtrigger.cdc.binlog_snapshot.asked_after`).
    """
    if effect.replaced:
        return True
    if effect.dropped and effect.arrived_from is None:
        return exists(effect.table)
    return acked(effect.table)


def refusal(effect: Effect, commit: str, poller: str | None) -> str:
    """The error that stops delivery before the statement: what happened, what to run."""
    w = effect.table
    head = (
        f"watched table {w} was {statement_words(effect)} (the statement at {commit} in the "
        "binary log); every change before it was delivered and delivery stops before it"
    )
    accept = (
        f"accept the changed source: dbtrigger reset {poller or 'POLLER'} --accept-source "
        "MODULE:TRIGGER --reason '{why}' --yes"
    )
    snapshot = (
        f"dbtrigger cdc snapshot MODULE:TRIGGER --table {w} --yes (a request made before "
        "the statement was written does not count, nor one recorded by an earlier version "
        "without the log's position: ask again)"
    )
    if effect.dropped and effect.arrived_from is None:
        return (
            f"{head}. Its rows are gone without a delete event each, and no table is under "
            f"that name now. Once a table is created again under it, reading goes on by "
            f"itself: the drop is delivered as a truncate event of {w}, then the new table's "
            "rows as they are written. If it is gone for good, take it out of tables= and "
            + accept.format(why="table dropped")
        )
    if effect.arrived_from is None:
        return (
            f"{head}. The log names tables, so its changes under the new name are not read "
            f"while the source watches {w}. To follow the table, point tables= at "
            f"{effect.renamed_to} and {accept.format(why='table renamed')}. Its changes after "
            "the rename are read then, none skipped. To read the name on instead (a table "
            f"created under it), ask for its rows: {snapshot}; the rename is then delivered "
            f"as a truncate event of {w}, and the rows under the name are read again"
        )
    follow = (
        f" To follow the table that was {w}, point tables= at {effect.renamed_to} and "
        + accept.format(why="table renamed")
        + "."
        if effect.renamed_to
        else ""
    )
    return (
        f"{head}. The table under that name now holds rows whose changes were written under "
        f"{effect.arrived_from} and never read as {w}'s.{follow} To read {w} on as it is now, "
        f"ask for its rows: {snapshot}; the statement is then passed"
        + (f" (delivered as a truncate event of {w})" if effect.left else "")
        + " and the rows under the name are read again"
    )


__all__ = [
    "EVERY",
    "Effect",
    "Followed",
    "effects",
    "moves",
    "passes",
    "redefines",
    "refusal",
    "statement_words",
]
