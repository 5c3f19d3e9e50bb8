"""The binary log, read: events in, whole committed transactions out, changes on demand.

A binlog is the server's commit log: transactions are written to it whole, at
commit, in commit order. So a reader sees no transaction before it committed,
never a rolled-back one, and never a late commit behind an earlier position
(the failure a fixed visibility window has on a polled cursor column).

**Positions.** A transaction's commit token is where it starts in the log,
fixed width so that text order is log order::

    1764162000123456.0000000003:000000012345:0-1-4711
    generation       file index  byte offset  GTID (MariaDB domain-server-seq,
                                              MySQL uuid:n; absent when MySQL
                                              runs without GTIDs)

The generation is the reader's (set by ``cdc install`` and ``cdc recreate``,
increasing): after ``RESET MASTER`` the new log numbers files, offsets and
MariaDB GTID sequence numbers from the start again, so the rest of a token of
the old log can name a transaction of the new one exactly. A reader made
before generations existed writes tokens without one (they sort before every
token with one).

The file index is the binlog file's numeric suffix, the offset that of the
transaction's first event (its GTID event), where a reader resumes to finish a
transaction a checkpoint is inside of. The GTID is checked on that resume: a
log that was reset (``RESET MASTER``) or another server's log holding other
transactions at that offset is refused, never read as if it were the same.

**Reads.** :class:`Assembler` turns one read's events into
:class:`~dbtrigger.cdc.buffer.Transaction` objects holding, per change, its
table's shape and value tuples (the dicts of a
:class:`~dbtrigger.cdc.changes.Change` are built only when a batch is handed
out). Snapshot chunks (rows of ``dbtrigger_cdc_chunks``, see
:mod:`dbtrigger.cdc.binlog_snapshot`) become ``upsert`` changes at their
transaction's place in the log.

**Columns.** From the table map's metadata (``binlog_row_metadata=FULL``),
else from ``information_schema`` checked against the table map (column count) and
looked ahead for a later change of the table (:mod:`~dbtrigger.cdc.binlog_lookahead`).
:class:`~dbtrigger.cdc.assembly.SchemaGuard` holds the accepted column types per table: a new column
just appears, a changed type stops the read before the transaction that first
has it (:attr:`Assembler.schema_break`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dbtrigger.cdc import binlog_ddl as ddl
from dbtrigger.cdc import binlog_lookahead as lookahead
from dbtrigger.cdc import binlog_values
from dbtrigger.cdc.assembly import Assembly, SchemaBreak, SchemaGuard, keyless
from dbtrigger.cdc.binlog_setup import TableInfo
from dbtrigger.cdc.binlog_tokens import GENERATION_DIGITS, Where, commit_token
from dbtrigger.cdc.buffer import Transaction
from dbtrigger.cdc.changes import Change, truncate_change
from dbtrigger.cdc.position import LogPosition

log = logging.getLogger("dbtrigger.cdc")

_OPS = {"I": "insert", "U": "update", "D": "delete", "S": "upsert"}


# --- shapes and schema ------------------------------------------------------------------------


@dataclass(frozen=True)
class RowShape:
    """A watched table's columns as one table map (or snapshot chunk) named them."""

    table: str
    names: tuple[str, ...]
    keys: tuple[str, ...]

    def image(self, values: Sequence[Any]) -> dict[str, Any]:
        return dict(zip(self.names, values, strict=False))

    def pk(self, image: Mapping[str, Any]) -> dict[str, Any]:
        if not self.keys:
            return dict(image)  # no primary key: the whole row names it
        return {k: image[k] for k in self.keys if k in image}


def log_keys(event: Any, names: Sequence[str]) -> tuple[str, ...]:
    """The primary key of a table map that carries its column names (``binlog_row_metadata
    = FULL``, which writes the key too), in key order: the key of the table as that change
    was written, where the catalog read at the start may hold an older one."""
    meta = getattr(event, "optional_metadata", None)
    simple = list(getattr(meta, "simple_primary_key_list", None) or [])
    prefixed = list(dict(getattr(meta, "primary_keys_with_prefix", None) or {}))
    return tuple(names[i] for i in (simple or prefixed) if 0 <= i < len(names))


def type_name(signature: str) -> str:
    """``3u`` -> ``LONG UNSIGNED`` (binlog field type names)."""
    from pymysqlreplication.constants import FIELD_TYPE  # noqa: PLC0415

    code = int(signature.rstrip("u"))
    names = {v: k for k, v in vars(FIELD_TYPE).items() if isinstance(v, int) and k.isupper()}
    name = str(names.get(code, code))
    return name + (" UNSIGNED" if signature.endswith("u") else "")


# --- assembling transactions --------------------------------------------------------------


_TRUNCATE = re.compile(r"^\s*truncate\s+(?:table\s+)?[`\"]?(\w+)[`\"]?(?:\.[`\"]?(\w+))?", re.I)


class Assembler(Assembly[TableInfo, str]):
    """Turns the events of one read into committed transactions of watched changes."""

    def __init__(
        self,
        watched: Mapping[str, TableInfo],
        guard: SchemaGuard[str],
        *,
        chunks_table: str,
        reader: str,
        names_from_log: bool,
        column_types: Callable[[str], Mapping[str, str] | None] | None = None,
        poller: str | None = None,
        followed: Collection[str] = (),
        exists: Callable[[str], bool] = lambda table: True,
        acked: Callable[[str, str], bool] = lambda table, commit: False,
        ahead: lookahead.Lookahead | None = None,
    ) -> None:
        super().__init__(watched, guard)
        #: For the statements that move a watched table off its name (see
        #: :mod:`dbtrigger.cdc.binlog_ddl`): the poller (named in the error), the tables
        #: this reader watched before (a table renamed from one is the table it read),
        #: whether a table is under a name now, and whether its snapshot was asked for
        #: after the statement at a commit token.
        self.poller = poller
        self.followed = followed
        self.renames = ddl.Followed(followed, list(watched))
        self._followed_ids: dict[int, str] = {}
        self.exists = exists
        self.acked = acked
        #: A table's column types read again (a column added since ``watched`` was read).
        self.column_types = column_types
        self._catalogs: dict[str, Mapping[str, str]] = {}
        #: Without names in the log: which reading of the catalog names a table map id
        #: (:mod:`~dbtrigger.cdc.binlog_lookahead`); without a look-ahead, a table map id ->
        #: (its table, the names it was given) and each table's latest id.
        self.ahead = ahead if ahead is not None else lookahead.Lookahead(None)
        self._names_by_id: dict[int, tuple[str, tuple[str, ...]]] = {}
        self._last_id: dict[str, int] = {}
        self._asked: dict[str, set[str]] = {}
        self.chunks_table = chunks_table
        self.reader = reader
        self.names_from_log = names_from_log
        self.shapes: dict[int, RowShape | None] = {}
        self._signatures: dict[int, list[tuple[str, str]]] = {}
        self._converters: dict[int, tuple[binlog_values.Converter | None, ...] | None] = {}
        self._checked: set[int] = set()
        self._explicit = False
        self.first_commit: str | None = None

    def start(self, room: int) -> None:
        self.restart(room)
        self.renames.restart()
        self._explicit = False
        self.first_commit = None

    # -- transaction boundaries --

    def begin(
        self, token: str, gtid: str | None, when: int, after: LogPosition | None, *, explicit: bool
    ) -> None:
        if self.first_commit is None:
            self.first_commit = token
        self._explicit = explicit
        self.ahead.truncated.clear()
        self.open(token, 0, _utc(when), gtid, after)

    def commit(self, when: int) -> Transaction[Any] | None:
        self._explicit = False
        txn = self.close()
        if self.renames.scanning is not None:
            return None  # read again once the scan ends
        if txn is not None:
            txn.commit_time = _utc(when)
        return txn

    @property
    def explicit(self) -> bool:
        return self._explicit

    @property
    def stopped(self) -> bool:
        """The read stops before the open transaction: a type change, a watched table
        moved off its name, or a scan ended (:class:`~dbtrigger.cdc.binlog_ddl.Followed`)."""
        return self.schema_break is not None or self.renames.found

    def commits(self, word: str) -> bool:
        """Does the statement just read (its first word ``word``) commit its transaction?
        A ``COMMIT`` does, and a statement outside ``BEGIN`` (DDL) - unless it stopped the
        read (a watched table moved off its name): its transaction stays open, unread."""
        if self.stopped:
            return False
        return word == "COMMIT" or (self.current is not None and not self._explicit)

    # -- events --

    def table_map(self, event: Any, where: tuple[str, int] | None = None) -> None:
        table = f"{event.schema}.{event.table}"
        info = self.watched.get(table)
        alias = None if self.current is None else self.renames.alias(table, self.current.commit)
        if info is None and alias is not None:  # before its rename to a watched name
            table, info = alias, self.watched[alias]
        if info is None:
            self.shapes[event.table_id] = None
            self._followed_ids[event.table_id] = table
            return
        columns = event.columns
        keys = info.key_columns
        if self.names_from_log and all(c.name for c in columns):
            names = tuple(str(c.name) for c in columns)
            keys = log_keys(event, names)
            problem = None
            self.ahead.named_by_log(event.table_id)
        elif len(columns) == len(
            catalog := self._catalog_names(event.table_id, info, where, columns)
        ):
            names = catalog
            problem = None
        else:
            names = tuple(f"col{i}" for i in range(len(columns)))
            problem = (
                f"{table} has {len(columns)} columns in the binary log but "
                f"{len(catalog)} in information_schema, and the log carries no column "
                "names (binlog_row_metadata is not FULL), so they cannot be told apart"
            )
        reading = self.ahead.named(event.table_id, table)
        if reading is not None:
            keys = reading.keys
            if reading.replayed:
                log.info(
                    "%s: a table map written before %d statement(s) that changed its columns "
                    "is named by them replayed on the catalog (%s)",
                    table,
                    reading.replayed,
                    ", ".join(names),
                    extra={"event": "cdc_columns_replayed", "table": table, "poller": self.poller},
                )
        if not keys:  # written while the table had no primary key: the start's, as before
            keys = info.key_columns
        gone = [k for k in keys if k not in names]
        if gone and problem is None:  # changes would come without a key
            problem = keyless(table, gone)
        self.shapes[event.table_id] = RowShape(table, names, keys)
        types = reading.types if reading is not None else self._catalog(table, info, names)
        self._converters[event.table_id] = binlog_values.converters(columns, names, types)
        self._signatures[event.table_id] = [
            (n, f"{c.type}{'u' if getattr(c, 'unsigned', False) else ''}")
            for n, c in zip(names, columns, strict=True)
        ]
        self._checked.discard(event.table_id)
        self.note_problem(event.table_id, problem)

    def _catalog_names(
        self,
        table_id: int,
        info: TableInfo,
        where: tuple[str, int] | None,
        columns: Sequence[Any] = (),
    ) -> tuple[str, ...]:
        """The column names of a table map without them (``binlog_row_metadata`` not FULL),
        at ``where`` in the log: from the reading of the catalog that fits it, and whether
        one does (:meth:`~dbtrigger.cdc.binlog_lookahead.Lookahead.reading`).

        Without a look-ahead: the first id met is named by the catalog read at the start,
        each later one (the server gives a table a new id when it loads its definition
        again, as after every ``ALTER TABLE``) by the catalog read when it first appears."""
        table = info.table.qualified
        if where is not None and self.ahead.statements is not None:
            reading = self.ahead.reading(table_id, table, where, columns)
            if reading is not None:
                return reading.names
        known = self._names_by_id.get(table_id)
        if known is not None and known[0] == table:
            return known[1]
        names = info.names
        if table in self._last_id and self.column_types is not None:
            names = tuple(self.column_types(table) or names)
        self._names_by_id[table_id] = (table, names)
        self._last_id[table] = table_id
        return names

    def _catalog(self, table: str, info: TableInfo, names: Sequence[str]) -> Mapping[str, str]:
        """Each column's ``DATA_TYPE``, read again when the log has a column the last
        reading lacked (its values need the type: ``UUID``, binary)."""
        known = self._catalogs.get(table) or dict(info.columns)
        new = {n for n in names if n not in known} - self._asked.get(table, set())
        if self.column_types is not None and new:  # once per name: a dropped one stays unknown
            known = self.column_types(table) or known
            self._asked.setdefault(table, set()).update(new)
        self._catalogs[table] = known
        return known

    def _problem(self, table_id: int, table: str) -> str | None:
        """The type change this table map shows, checked when its first row is kept (a
        table map of a transaction delivered already must not accept its old types again)."""
        if table_id not in self._checked:
            self._checked.add(table_id)
            if table_id not in self._problems:
                problem = self.guard.check(table, self._signatures.get(table_id, []))
                if problem is not None:
                    self._problems[table_id] = problem
        return self._problems.get(table_id)

    def rows(self, event: Any, kind: str) -> None:
        """A rows event: keep its watched rows (or expand our snapshot chunk)."""
        current = self.delivering
        if current is None or self.schema_break is not None or self.renames.scanning:
            return
        table = f"{event.schema}.{event.table}"
        if table == self.chunks_table:
            self._chunk(event, kind)
            return
        shape = self.shapes.get(event.table_id)
        if shape is None:
            self.renames.rows_of(self._followed_ids.get(event.table_id, ""))
            return
        later = self.ahead.later(event.table_id)
        if later is not None:
            self._unnamed(later, current)
            return
        for row in event.rows:
            if self.delivered_already():  # the read started inside this transaction
                continue
            problem = self._problem(event.table_id, table)
            if problem is not None:
                self.schema_break = SchemaBreak(current.commit, problem)
                return
            convert = self._converters.get(event.table_id)
            if kind == "U":
                before = binlog_values.values(
                    row["before_values"], row.get("before_none_sources"), convert
                )
                after = binlog_values.values(
                    row["after_values"], row.get("after_none_sources"), convert
                )
                self.keep((shape, "U", before, after))
            else:
                image = binlog_values.values(row["values"], row.get("none_sources"), convert)
                if kind == "I":
                    self.keep((shape, "I", None, image))
                else:
                    self.keep((shape, "D", image, None))

    def _unnamed(self, later: lookahead.Later, current: Transaction[Any]) -> None:
        """Changes whose names are not knowable: stop before them, or once a snapshot was
        asked for after ``later`` (or passed before: resumed inside) pass them as a truncate."""
        if not self.resumed_inside and not self.ahead.passes(later, current.commit, self.acked):
            problem = lookahead.refusal(later, current.commit, self.poller)
            self.schema_break = SchemaBreak(current.commit, problem, table_gone=True)
        elif later.table not in self.ahead.truncated:
            self.ahead.truncated.add(later.table)
            info = self.watched[later.table]
            self.keep((RowShape(later.table, info.names, info.key_columns), "T", None, None))

    def _chunk(self, event: Any, kind: str) -> None:
        for row in event.rows:
            values = row["after_values"] if kind == "U" else row.get("values")
            reader, payload = chunk_row(values)
            if kind == "D" or reader != self.reader or payload is None:
                continue
            chunk = json.loads(payload)
            info = self.watched.get(chunk["table"])
            if info is None:
                continue
            # the key the chunk was read by (an earlier version's chunk names none)
            keys = tuple(chunk["keys"]) if "keys" in chunk else info.key_columns
            shape = RowShape(chunk["table"], tuple(chunk["columns"]), keys)
            for encoded in chunk["rows"]:
                self.keep((shape, "S", None, tuple(binlog_values.decode_value(v) for v in encoded)))

    def query(self, text: str, schema: str | bytes | None = None) -> None:
        """A statement in the log: a ``TRUNCATE`` of a watched table is kept as its
        ``truncate`` change (an unqualified name is in ``schema``, the statement's
        default database, when the log says which); one that moves a watched table off
        its name stops the read before it, or is kept as its ``truncate`` (:meth:`_moved`)."""
        current = self.delivering
        if current is None or self.schema_break is not None:
            return
        if self.renames.scanning is not None:
            self.renames.statement(text, schema, current.commit)
            return
        self._moved(text, schema, current)
        match = _TRUNCATE.match(text)
        if match is None or self.schema_break is not None:
            return
        first, second = match.groups()
        if isinstance(schema, bytes):
            schema = schema.decode(errors="replace")
        name = f"{first}.{second}" if second else f"{schema}.{first}" if schema else first
        for table, info in self.watched.items():
            if table == name or (not second and not schema and table.endswith("." + name)):
                self.keep((RowShape(table, info.names, info.key_columns), "T", None, None))

    def _moved(self, text: str, schema: str | bytes | None, current: Transaction[Any]) -> None:
        """A statement that renames a watched table away, drops it, or puts another table
        under its name: read on only when that loses no row (:func:`binlog_ddl.passes`),
        the watched table's leaving kept as a ``truncate`` of its name; else stop before
        the statement (:attr:`schema_break`, ``table_gone``) with what to run."""
        found = ddl.effects(text, schema, list(self.watched), self.followed)
        if not found:
            return
        if not self.resumed_inside:  # passed before: its truncate was delivered
            stops = [
                e
                for e in found
                if not ddl.passes(e, self.exists, lambda t: self.acked(t, current.commit))
            ]
            if stops:
                problem = "; ".join(ddl.refusal(e, current.commit, self.poller) for e in stops)
                self.schema_break = SchemaBreak(current.commit, problem, table_gone=True)
                return
        for effect in found:
            log.info(
                "watched table %s was %s: read on (%s)",
                effect.table,
                ddl.statement_words(effect),
                "delivered as a truncate event" if effect.left else "its snapshot was asked for",
                extra={"event": "cdc_table_gone", "table": effect.table, "poller": self.poller},
            )
            if effect.left:
                info = self.watched[effect.table]
                self.keep((RowShape(effect.table, info.names, info.key_columns), "T", None, None))


def chunk_row(values: Mapping[str, Any] | None) -> tuple[Any, Any]:
    """A ``dbtrigger_cdc_chunks`` row's reader and payload. Without column names in the
    log (``binlog_row_metadata`` not FULL) the replication package names its values
    ``UNKNOWN_COL0``...: they are then taken by place, as the table was created
    (``reader, seq, payload``). Read by name only, every chunk was passed over as
    another reader's, and a snapshot delivered nothing."""
    if values is None:
        return None, None
    if "reader" in values:
        return values.get("reader"), values.get("payload")
    ordered = list(values.values())
    if len(ordered) == 3 and all(str(k).startswith("UNKNOWN_COL") for k in values):
        return ordered[0], ordered[2]
    return None, None


def _utc(seconds: int) -> dt.datetime | None:
    if not seconds:
        return None
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc)


def materialise(txn: Transaction[Any], ordinal: int, raw: tuple[Any, ...]) -> Change:
    """The change at ``ordinal`` of ``txn`` (raw: shape, kind, before and after values)."""
    shape, kind, before_values, after_values = raw
    if kind == "T":
        return truncate_change(
            LogPosition(txn.commit, ordinal),
            shape.table,
            shape.keys,
            commit_time=txn.commit_time,
            transaction_id=txn.transaction_id,
            last_in_transaction=txn.whole and ordinal == txn.last_ordinal,
        )
    before = None if before_values is None else shape.image(before_values)
    after = None if after_values is None else shape.image(after_values)
    keyed = after if after is not None else before
    return Change(
        position=LogPosition(txn.commit, ordinal),
        op=_OPS[kind],
        table=shape.table,
        pk=shape.pk(keyed or {}),
        before=before,
        after=after,
        commit_time=txn.commit_time,
        transaction_id=txn.transaction_id,
        last_in_transaction=txn.whole and ordinal == txn.last_ordinal,
        before_image=None if before is None else "full",
        snapshot=kind == "S",
    )


__all__ = [
    "GENERATION_DIGITS",
    "Assembler",
    "RowShape",
    "Where",
    "commit_token",
    "materialise",
    "type_name",
]
