"""``ChangeLogSource``: one event per insert, update and delete, from the change log.

The log (see :mod:`dbtrigger.changelog.ddl`) is an ordinary table with a
database-assigned sequence, so it is polled with the keyset machinery of
:class:`~dbtrigger.sources.sqlalchemy.SqlAlchemySource` - same O(batch) fetch,
same visibility guard against late commits, same checkpoint format. This class
only changes what a fetched row *means*: the key columns are the watched
table's key, the cursor is the log's sequence number, and ``op``, ``before``
and ``after`` come from the row the trigger wrote.

The keyset is ``(dbt_seq, pk...)``. The sequence alone is unique, so the key is
only a tiebreaker that never breaks a tie; it is there so an event's position
(``cursor`` plus ``pk``, what the runtime checkpoints) is exactly a keyset
position of the log.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from decimal import Decimal
from types import MappingProxyType
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from dbtrigger._engine import create_engine, parse_database_url
from dbtrigger.changelog.ddl import LOG_COLUMNS, log_table_name
from dbtrigger.changelog.operations import log_table, lowest_checkpoint, prune
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, DbTriggerError, SerializationError
from dbtrigger.events import EventIds, RowChange
from dbtrigger.names import validate_sql_identifier
from dbtrigger.redaction import redact
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.sources.visibility import FetchInfo, VisibilityGuard
from dbtrigger.state import document
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger("dbtrigger.changelog")

_OPS = frozenset({"insert", "update", "delete"})


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
        prune_passed_by / prune_store / prune_every_seconds: automatic pruning.
            Every ``prune_every_seconds`` (at a fetch), log rows at or below the
            lowest checkpoint of the named pollers (their state read from
            ``prune_store``) are deleted in bounded chunks. Name every poller
            that reads this log (usually just this one); a poller without a
            checkpoint yet blocks pruning. A failed prune is logged at WARNING
            and retried at the next interval; fetching is never held up by it.

    Events: ``op`` is ``insert``, ``update`` or ``delete``; ``before``/``after``
    are the row images the trigger wrote (JSON as the database renders it:
    timestamps as text, fractional numbers as ``Decimal``, binary as hex);
    ``cursor`` is the log sequence number; ``metadata`` adds ``txid``
    (PostgreSQL) and ``changed_at``.
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
    ) -> None:
        if url is None and engine is None:
            raise ConfigurationError("ChangeLogSource needs url= or engine=")
        if isinstance(prune_passed_by, str):
            raise ConfigurationError("prune_passed_by must be a list of poller names")
        if prune_passed_by and prune_store is None:
            raise ConfigurationError(
                "prune_passed_by needs prune_store (where those pollers keep state)"
            )
        if prune_every_seconds <= 0:
            raise ConfigurationError("prune_every_seconds must be > 0")
        self._prune_pollers = tuple(prune_passed_by)
        self._prune_store = prune_store
        self._prune_every = prune_every_seconds
        self._next_prune = 0.0
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
        self._inner_source: SqlAlchemySource | None = None
        self._lock = threading.Lock()

    # --- the keyset source over the log -------------------------------------------

    def _inner(self) -> SqlAlchemySource:
        if self._inner_source is not None:
            return self._inner_source
        with self._lock:
            if self._inner_source is None:
                pk = self._pk or self._reflect_pk()
                self._pk = pk
                self._inner_source = SqlAlchemySource(
                    url=self._url,
                    engine=self._engine,
                    engine_kwargs=self._engine_kwargs,
                    table=log_table_name(self._table),
                    schema=self._schema,
                    cursor_column="dbt_seq",
                    pk_columns=pk,
                    visibility=self._visibility,
                )
            return self._inner_source

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
        return self._inner().pk_columns

    @property
    def engine(self) -> Engine:
        return self._inner().engine

    def fingerprint(self) -> str:
        """The log's keyset definition: a different table or key is a different source."""
        return self._inner().fingerprint()

    def describe(self) -> dict[str, Any]:
        info = self._inner().describe()
        info.update(name=self.name, watched_table=self._table, kind="changelog")
        return info

    def close(self) -> None:
        if self._inner_source is not None:
            self._inner_source.close()

    @property
    def last_fetch_info(self) -> FetchInfo | None:
        inner = self._inner_source
        return inner.last_fetch_info if inner is not None else None

    @property
    def visibility_mode(self) -> str:
        return self._inner().visibility_mode

    # --- the port -------------------------------------------------------------------

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        if self._prune_pollers and time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + self._prune_every
            self.prune_passed()
        return self._inner().fetch(after, limit)

    def prune_passed(self) -> int:
        """Delete log rows every ``prune_passed_by`` poller has committed past; how many."""
        store = self._prune_store
        if not self._prune_pollers or store is None:
            return 0
        try:
            cursors: list[object] = []
            for name in self._prune_pollers:
                stored = store.read(name)
                if stored is None:
                    return 0  # a poller that has not started yet still needs every row
                cursors.append(document.loads(stored.data).position.cursor)
            up_to = lowest_checkpoint(cursors)
            if up_to is None:
                return 0
            deleted = prune(self.engine, self._table, schema=self._schema, up_to_seq=up_to)
        except (DbTriggerError, SQLAlchemyError) as exc:
            log.warning(
                "pruning the change log of %s failed (retried in %gs): %s",
                self._table,
                self._prune_every,
                redact(str(exc)),
                extra={"event": "changelog_prune_failed", "source": self.name},
            )
            return 0
        if deleted:
            log.info(
                "pruned %d change log row(s) of %s up to sequence %s",
                deleted,
                self._table,
                up_to,
                extra={"event": "changelog_pruned", "source": self.name, "rows": deleted},
            )
        return deleted

    def count_after(self, after: Position) -> int:
        return self._inner().count_after(after)

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        """One event per log row, with the operation and images the trigger wrote."""
        pk_names = self.pk_columns
        event_id = EventIds(poller, pk_names)
        source = self.name
        events: list[RowChange] = []
        for row in rows:
            try:
                seq = row["dbt_seq"]
                op = row["dbt_op"]
                pk = {c: row[c] for c in pk_names}
                before = _image(row["dbt_before"], "dbt_before", seq)
                after = _image(row["dbt_after"], "dbt_after", seq)
                txid = row["dbt_txid"]
                changed_at = row["dbt_changed_at"]
            except KeyError as exc:
                raise SerializationError(
                    f"change log row of {source} lacks column {exc.args[0]!r}",
                    poller=poller,
                    batch_id=batch_id,
                ) from None
            if op not in _OPS:
                raise SerializationError(
                    f"change log row {seq} of {source} has unknown operation {op!r}",
                    poller=poller,
                    batch_id=batch_id,
                )
            events.append(
                RowChange._unchecked(
                    event_id(pk, seq),
                    op,
                    source,
                    seq,
                    MappingProxyType(pk),
                    None if before is None else MappingProxyType(before),
                    None if after is None else MappingProxyType(after),
                    MappingProxyType(
                        {
                            "poller": poller,
                            "batch_id": batch_id,
                            "txid": txid,
                            "changed_at": changed_at,
                        }
                    ),
                )
            )
        return events


def _image(raw: Any, column: str, seq: Any) -> dict[str, Any] | None:
    """Parse a row image; fractional numbers as ``Decimal`` so none is rounded."""
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw, parse_float=Decimal)
    except (TypeError, ValueError) as exc:
        raise SerializationError(f"change log row {seq}: {column} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SerializationError(f"change log row {seq}: {column} is not a JSON object")
    return value
