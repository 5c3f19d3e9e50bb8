"""``ChangeLogSource``: one event per insert, update and delete, from the change log.

The log (see :mod:`dbtrigger.changelog.ddl`) is an ordinary table with a
database-assigned sequence, so it is polled with the keyset machinery of
:class:`~dbtrigger.sources.sqlalchemy.SqlAlchemySource` - same O(batch) fetch,
same visibility guard against late commits, same checkpoint format. This class
only changes what a fetched row *means*: the key columns are the watched
table's key, the cursor is the log's sequence number, and ``op``, ``before``
and ``after`` come from the row the trigger wrote.

The log is read by ``dbt_seq`` alone (unique: it is the log's primary key),
and a position handed to :meth:`ChangeLogSource.fetch` is read by its cursor
alone. An event's ``pk`` is the watched table's key, and the position the
runtime checkpoints is ``(dbt_seq, that key)``: the key is never needed to
resume, so a checkpoint stays valid when the key column is renamed (the
change log is then installed again and the poller accepts the renamed key).
The fingerprint is still that of the keyset ``(dbt_seq, key...)``, as it
always was: a different table or key is a different source.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from dbtrigger import options as opt
from dbtrigger._engine import create_engine, parse_database_url
from dbtrigger.changelog.ddl import LOG_COLUMNS, log_table_name
from dbtrigger.changelog.drift import Drift, find_drift, install_command, resync_command
from dbtrigger.changelog.events import log_events
from dbtrigger.changelog.operations import log_table
from dbtrigger.changelog.pruning import ChangeLogPruner
from dbtrigger.changelog.registration import Registration
from dbtrigger.changelog.renumbered import refuse_renumbered
from dbtrigger.changelog.vanished import AT_ONCE_ROWS, WHOLE_LOG_SHARE, log_span
from dbtrigger.cursor import Position
from dbtrigger.errors import (
    ChangeLogDriftError,
    ChangeLogGapError,
    ConfigurationError,
    DbTriggerError,
    SourceDefinitionError,
)
from dbtrigger.events import RowChange
from dbtrigger.names import validate_sql_identifier
from dbtrigger.sources.base import SourceFinding
from dbtrigger.sources.errors_map import source_error
from dbtrigger.sources.rows import Rows
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.sources.visibility import FetchInfo, VisibilityGuard
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger("dbtrigger.changelog")


class ChangeLogSource:
    """Poll the trigger-maintained change log of ``table``.

    Args:
        url / engine: the database (as for ``SqlAlchemySource``).
        table / schema: the *watched* table (``orders``), not the log.
        pk_columns: the watched table's key columns; read from the log table
            at the first use when omitted.
        visibility: as for ``SqlAlchemySource``; ``auto`` protects the log's
            sequence against late commits (PostgreSQL transaction horizon,
            see docs/visibility.md).
        engine_kwargs: passed to :func:`sqlalchemy.create_engine`.
        prune_passed_by / prune_store / prune_every_seconds: automatic pruning
            (a :class:`~dbtrigger.changelog.pruning.ChangeLogPruner`). At most
            every ``prune_every_seconds``, when the runtime reports this
            poller's checkpoint durable (after a commit, on an idle tick), log
            rows at or below the lowest checkpoint of the named pollers (their
            state read from ``prune_store``) are deleted in bounded chunks.
            Name every poller that reads this log (usually just this one); a
            poller without a checkpoint yet blocks pruning. A failed prune is
            logged at WARNING and retried at the next interval; it never fails
            a tick, and a fetch never prunes. ``prune_keep_seconds`` keeps rows
            that every reader passed that much longer (by ``dbt_changed_at``): the
            window in which ``dbtrigger replay`` and ``rewind`` stay exact.
        drift_check_seconds: how often (at a fetch, the first fetch included)
            the installed triggers are compared with the watched table; a
            migration that left them behind stops the poller with
            :class:`~dbtrigger.errors.ChangeLogDriftError`, naming the install
            command that repairs it (docs/changes.md, "When the table changes").

    Events: ``op`` is ``insert``, ``update`` or ``delete`` (``upsert`` for a row
    ``dbtrigger changelog snapshot`` wrote, with ``metadata["snapshot"]``
    True); ``before``/``after``
    are the row images the trigger wrote (JSON as the database renders it:
    timestamps as text, fractional numbers as ``Decimal``, binary as hex);
    ``cursor`` is the log sequence number; ``metadata`` adds ``txid``
    (PostgreSQL) and ``changed_at``. A key change arrives as a ``delete`` of
    the old key then an ``insert`` of the new one, so every event concerns its
    own key only.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        table: str,
        schema: str | None = None,
        pk_columns: Sequence[str] | None = None,
        engine: Engine | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        visibility: str | VisibilityGuard = "auto",
        prune_passed_by: Sequence[str] = (),
        prune_store: CheckpointStore | None = None,
        prune_every_seconds: float = 300.0,
        drift_check_seconds: float = 60.0,
        prune_keep_seconds: float = 0.0,
    ) -> None:
        if url is None and engine is None:
            raise ConfigurationError("ChangeLogSource needs url= or engine=")
        if isinstance(prune_passed_by, str):
            raise ConfigurationError("prune_passed_by must be a list of poller names")
        if prune_passed_by and prune_store is None:
            raise ConfigurationError(
                "prune_passed_by needs prune_store (where those pollers keep state)"
            )
        prune_every_seconds = opt.seconds("prune_every_seconds", prune_every_seconds)
        prune_keep_seconds = opt.seconds("prune_keep_seconds", prune_keep_seconds, inclusive=True)
        drift_check_seconds = opt.seconds("drift_check_seconds", drift_check_seconds)
        #: Prunes what every reader passed (None: pruning is left to the operator).
        self.pruner = (
            ChangeLogPruner(
                passed_by=prune_passed_by,
                store=prune_store,
                every_seconds=prune_every_seconds,
                keep_seconds=prune_keep_seconds,
            )
            if prune_passed_by and prune_store is not None
            else None
        )
        self._drift_every = drift_check_seconds
        self._next_drift_check = 0.0
        #: When the drift check next compares every key of the log with the table.
        self._next_whole_check: float | None = None
        self._table = validate_sql_identifier(table, "table")
        self._schema = validate_sql_identifier(schema, "schema") if schema else None
        if isinstance(pk_columns, str):
            raise ConfigurationError("pk_columns must be a list of column names, not a string")
        self._pk = (
            tuple(validate_sql_identifier(c, "pk column") for c in pk_columns)
            if pk_columns
            else None
        )
        self._url = url
        self._engine = engine
        self._engine_kwargs = engine_kwargs
        self._visibility = visibility
        #: The poller this source serves (``bind_poller``), as a reader in the registry.
        self._registration = Registration(self._table, self._schema)
        #: The last fetch came back short: caught up, so a position is recorded at once.
        self._caught_up = True
        self._inner_source: SqlAlchemySource | None = None
        self._identity: SqlAlchemySource | None = None
        self._lock = threading.Lock()

    # --- the keyset source over the log -------------------------------------------

    def _inner(self) -> SqlAlchemySource:
        if self._inner_source is not None:
            return self._inner_source
        with self._lock:
            if self._inner_source is None:
                pk = self._pk or self._reflect_pk()
                self._pk = pk
                common: dict[str, Any] = {
                    "url": self._url,
                    "engine": self._engine,
                    "engine_kwargs": self._engine_kwargs,
                    "table": log_table_name(self._table),
                    "schema": self._schema,
                    "cursor_column": "dbt_seq",
                }
                # What a position means (and has always meant): the keyset
                # (dbt_seq, key...). Never connects: only its fingerprint is used.
                self._identity = SqlAlchemySource(**common, pk_columns=pk)
                self._inner_source = SqlAlchemySource(
                    **common, pk_columns=("dbt_seq",), visibility=self._visibility
                )
            return self._inner_source

    @staticmethod
    def _log_position(after: Position) -> Position:
        """``after`` as a position of the log, read by its sequence number alone."""
        if after.is_beginning:
            return after
        return Position(cursor=after.cursor, pk={"dbt_seq": after.cursor})

    def _reflect_pk(self) -> tuple[str, ...]:
        engine = self._engine
        owned = engine is None
        if engine is None:
            engine = create_engine(
                parse_database_url(self._url or ""), **(self._engine_kwargs or {})
            )
        try:
            log = log_table(engine, self._table, self._schema)
        finally:
            if owned:
                engine.dispose()
        keys = tuple(c.name for c in log.columns if c.name not in LOG_COLUMNS)
        if not keys:
            raise ConfigurationError(f"the change log of {self._table!r} has no key columns")
        return keys

    def log_source(self) -> SqlAlchemySource:
        """The keyset source over the log table (``dbtrigger check`` checks it as a table).

        Raises:
            ConfigurationError: the change log is not installed (names the command).
        """
        return self._inner()

    def validate(self, position: Position | None = None) -> None:
        """What the first fetch checks, fetching nothing: the log, the checkpoint, the triggers."""
        self._inner().validate(None if position is None else self._log_position(position))
        self.check_drift()

    # --- identity -------------------------------------------------------------------

    @property
    def name(self) -> str:
        dialect = (
            self._engine.dialect.name
            if self._engine is not None
            else parse_database_url(self._url or "").get_backend_name()
        )
        target = f"{self._schema}.{self._table}" if self._schema else self._table
        return f"{dialect}:{target}+changelog"

    @property
    def cursor_column(self) -> str:
        return "dbt_seq"

    @property
    def pk_columns(self) -> tuple[str, ...]:
        """The watched table's key (as the log's key columns name it)."""
        self._inner()
        assert self._pk is not None  # noqa: S101 - set by _inner()
        return self._pk

    @property
    def engine(self) -> Engine:
        return self._inner().engine

    def _identity_source(self) -> SqlAlchemySource:
        self._inner()
        assert self._identity is not None  # noqa: S101 - set by _inner()
        return self._identity

    def fingerprint(self) -> str:
        """The log's keyset definition: a different table or key is a different source."""
        return self._identity_source().fingerprint()

    def accepted_fingerprints(self) -> tuple[str, ...]:
        """This definition's fingerprint, then what the earlier algorithm gave it."""
        return self._identity_source().accepted_fingerprints()

    def describe(self) -> dict[str, Any]:
        info = self._inner().describe()
        info.update(
            name=self.name,
            watched_table=self._table,
            kind="changelog",
            pk_columns=list(self.pk_columns),
        )
        return info

    def close(self) -> None:
        if self._inner_source is not None:
            self._inner_source.close()
        if self._identity is not None:
            self._identity.close()

    @property
    def last_fetch_info(self) -> FetchInfo | None:
        inner = self._inner_source
        return inner.last_fetch_info if inner is not None else None

    @property
    def visibility_mode(self) -> str:
        return self._inner().visibility_mode

    # --- the port -------------------------------------------------------------------

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        """The log rows after ``after``; the triggers checked against the table first.

        Raises:
            ChangeLogDriftError: a migration left the triggers behind the table
                (at the first fetch, every ``drift_check_seconds``, and whenever
                a row was logged without its key).
            ChangeLogGapError: rows record a change to a row the trigger could
                not name, and re-installing cannot name it either.

        A ``truncate`` row comes in a batch of its own (:func:`_truncate_alone`).
        """
        inner = self._inner()
        if time.monotonic() >= self._next_drift_check:
            self.check_drift()
            key = list(after.pk.values()) if after.pk else []
            refuse_renumbered(
                self.engine, self._table, self._schema, _seq(after), key, self.pk_columns
            )
        try:
            fetched = inner.fetch(self._log_position(after), limit)
        except SourceDefinitionError as exc:
            raise self._explained(exc) from exc
        self._caught_up = len(fetched) < limit
        rows = _truncate_alone(fetched)
        if self._registration.recorded is None and self._registration.reader is not None:
            # The first fetch starts from the checkpoint just loaded: durable.
            self._register(_seq(after), first=True)
        unkeyed = _unkeyed(rows, self.pk_columns)
        if unkeyed:
            self.check_drift()  # the likely cause; raises naming the fix
            raise self._gap(unkeyed)
        return rows

    def check_drift(self) -> Drift:
        """Compare the installed triggers with the watched table now; raise on drift.

        Returns the (empty) drift, whose ``notes`` say what could not be
        compared (MariaDB/MySQL triggers are invisible without the TRIGGER
        privilege).

        Rows gone with no delete logged are looked for among the newest log rows at
        every check, and among all of them at the first and then as often as
        :data:`~dbtrigger.changelog.vanished.WHOLE_LOG_SHARE` of the time allows.

        Raises:
            ChangeLogDriftError: what differs and the install command that repairs it.
        """
        started = time.monotonic()
        self._next_drift_check = started + self._drift_every
        try:
            with self.engine.connect() as conn:
                whole = self._whole_log_due(conn, started)
                found = find_drift(conn, self._table, self._schema, whole_log=whole)
        except SQLAlchemyError as exc:
            raise source_error(exc, f"checking the change log triggers of {self.name}") from exc
        if found:
            raise found.error()
        if whole:
            ended = time.monotonic()
            self._next_whole_check = ended + max(
                self._drift_every, (ended - started) / WHOLE_LOG_SHARE
            )
        return found

    def _whole_log_due(self, conn: Any, now: float) -> bool:
        """Is the whole-log check due? At the first drift check when the log is small
        enough to pass over at once (:data:`~dbtrigger.changelog.vanished.AT_ONCE_ROWS`:
        a cold start stays quick), else one drift interval later; then as the share allows."""
        if self._next_whole_check is None:
            rows = log_span(conn, self._table, self._schema)
            self._next_whole_check = now if rows <= AT_ONCE_ROWS else now + self._drift_every
        return now >= self._next_whole_check

    def self_check(self) -> list[SourceFinding]:
        """The drift check as findings, for ``dbtrigger status --source``: triggers of an
        older release (naming the upgrade), rows gone with no delete logged (naming
        ``changelog resync``), what this account cannot see."""
        try:
            found = self.check_drift()
        except ChangeLogDriftError as exc:
            fix = exc.fields.get("fix")
            return [SourceFinding("changelog_triggers", "error", str(exc), fix)]
        except DbTriggerError as exc:
            return [SourceFinding("changelog_triggers", "warning", f"could not be checked: {exc}")]
        notes = [SourceFinding("changelog_triggers", "warning", note) for note in found.notes]
        ok = SourceFinding("changelog_triggers", "ok", "the change log's triggers match the table")
        return notes or [ok]

    def _explained(self, exc: SourceDefinitionError) -> SourceDefinitionError:
        """A fetch refused as a source definition error, said in change log terms when
        the log or its triggers are the reason (dropped while the poller ran)."""
        try:
            with self.engine.connect() as conn:
                found = find_drift(conn, self._table, self._schema, whole_log=False)
        except SQLAlchemyError:
            return exc
        if found:
            return found.error()
        if not found.missing:
            return exc
        return SourceDefinitionError(
            f"the change log of {self._table} is gone (table {log_table_name(self._table)} "
            "does not exist: uninstalled with --drop-log, or dropped) while this poller was "
            "reading it; changes made since were not logged. Install it again: "
            f"`{install_command(self._table, self._schema)}`, and resync what the poller "
            "feeds from the table (`dbtrigger changelog snapshot`)"
        )

    def _gap(self, seqs: Sequence[Any]) -> ChangeLogGapError:
        log_name = log_table_name(self._table)
        nulls = " OR ".join(f"{c} IS NULL" for c in self.pk_columns)
        shown = ", ".join(str(s) for s in seqs[:10]) + (", ..." if len(seqs) > 10 else "")
        # Advice; names validated. A truncate row has no key by design: it stays.
        delete = f"DELETE FROM {log_name} WHERE ({nulls}) AND dbt_op <> 'truncate'"  # noqa: S608
        return ChangeLogGapError(
            f"change log row(s) {shown} of {self._table} record a change whose key the trigger "
            "could not read (the key column was renamed or dropped, or could not be stored) "
            "and whose row image does not hold it either: they cannot be delivered as row "
            "changes. Have every reader of the log re-sent the table: "
            f"`{resync_command(self._table, self._schema)}` (a truncate, then every row), "
            f"then delete them: {delete}; the poller "
            "then goes on (docs/changes.md, 'When the table changes')",
            seqs=list(seqs),
        )

    def acknowledge(self, position: Position) -> None:
        """The runtime's word that this poller's checkpoint is durable up to ``position``:
        the moment to record it in the readers' registry, and to prune what every
        reader passed, when due (``prune_passed_by``)."""
        if self._registration.reader is not None:
            self._register(_seq(position))
        if self.pruner is not None and self.pruner.due():
            self.prune_passed()

    def bind_poller(self, name: str, metrics: Any = None) -> None:
        """The poller this source serves: it registers under this name as a reader of the
        log (:mod:`dbtrigger.changelog.readers`), so that no prune takes its unread rows."""
        del metrics
        self._registration.reader = name

    def _register(self, seq: int, *, first: bool = False) -> None:
        """Record this reader's durable position when due; never raises, never waits in
        silence (:mod:`dbtrigger.changelog.registration`)."""
        if self._registration.due(seq, first=first, caught_up=self._caught_up):
            self._registration.write(self.engine, seq, first=first)

    def prune_passed(self) -> int:
        """Delete log rows every ``prune_passed_by`` poller has committed past; how many."""
        if self.pruner is None:
            return 0
        return self.pruner.run(self.engine, self._table, schema=self._schema, source=self.name)

    def count_after(self, after: Position) -> int:
        return self._inner().count_after(self._log_position(after))

    #: The log's rows never change: a recorded range reads back as it was, for
    #: as long as the log keeps it (dbtrigger.replay.batches).
    keeps_images = True

    def last_position(self, before: Any = None) -> Position:
        """After the last change logged (``before``: the last whose sequence number is
        below it) - where ``start_from="now"`` starts; the beginning for an empty log.

        Raises:
            ConfigurationError: ``before`` is not a sequence number (the log is
                ordered by its sequence; a time would need its clock).
        """
        if before is not None and (not isinstance(before, int) or isinstance(before, bool)):
            raise ConfigurationError(
                f"a change log starts at a sequence number, not {before!r}: use "
                "start_from='now', 'beginning' or a dbt_seq value"
            )
        inner = self._inner()
        found = inner.last_position(before)
        if found.is_beginning:
            return found
        [row] = inner.rows_with_keys([{"dbt_seq": found.cursor}])
        return Position(cursor=found.cursor, pk={c: row[c] for c in self.pk_columns})

    def present(self, positions: Sequence[Position]) -> list[Position]:
        """Which of ``positions`` (an event's: sequence and the watched key, a truncate's
        key all None) still hold a log row: pruning removes them. Returned as given, so
        their window keys are the events'; a log row never changes, and its sequence
        alone names it."""
        log = self._inner().present([self._log_position(p) for p in positions])
        there = {p.cursor for p in log}
        return [p for p in positions if p.cursor in there]

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        """One event per log row, with the operation and images the trigger wrote
        (:mod:`dbtrigger.changelog.events`: checked and parsed before any handler
        runs; the id and ``metadata`` made when first read)."""
        return log_events(
            rows, pk_columns=self.pk_columns, source=self.name, poller=poller, batch_id=batch_id
        )


def _truncate_alone(rows: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """The rows up to the first ``truncate``, or that ``truncate`` alone when it is first.

    A truncate concerns every key: in a batch of its own it is handled after
    every change before it and before every change after it, whatever the
    handler does with keys (lanes run the keys of one batch side by side).
    """
    columns = getattr(rows, "columns", None)
    tuples = getattr(rows, "tuples", None)
    if columns is not None and tuples is not None:
        op = columns.index("dbt_op")
        at = next((i for i, t in enumerate(tuples) if t[op] == "truncate"), None)
        if at is None:
            return rows
        return Rows(columns, tuples[: max(at, 1)], plain=bool(getattr(rows, "plain", False)))
    at = next((i for i, r in enumerate(rows) if r.get("dbt_op") == "truncate"), None)
    return rows if at is None else list(rows)[: max(at, 1)]


def _seq(position: Position) -> int:
    """The log sequence a checkpoint has passed (0 at the beginning)."""
    cursor = position.cursor
    if position.is_beginning or not isinstance(cursor, int) or isinstance(cursor, bool):
        return 0
    return cursor


def _unkeyed(rows: Sequence[Mapping[str, Any]], pk: Sequence[str]) -> list[Any]:
    """Sequence numbers of the rows logged without a (complete) key (a ``truncate`` has
    none by design)."""
    columns = getattr(rows, "columns", None)
    tuples = getattr(rows, "tuples", None)
    if columns is not None and tuples is not None:  # Rows: look at the tuples as they are
        at = [columns.index(c) for c in pk]
        seq = columns.index("dbt_seq")
        op = columns.index("dbt_op")
        if len(at) == 1:  # the usual key: no generator per row
            key = at[0]
            return [t[seq] for t in tuples if t[key] is None and t[op] != "truncate"]
        return [t[seq] for t in tuples if t[op] != "truncate" and any(t[i] is None for i in at)]
    return [
        r["dbt_seq"]
        for r in rows
        if r.get("dbt_op") != "truncate" and any(r.get(c) is None for c in pk)
    ]
