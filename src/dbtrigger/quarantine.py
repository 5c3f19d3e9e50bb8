"""Poison rows: finding them in a failing batch and setting them aside.

A batch that fails the same way on every delivery blocks its poller for good:
the checkpoint cannot move past a row the handler never accepts. The seed's
answer is "an operator advances the checkpoint by hand". dbtrigger can do the
narrow version of that itself, when (and only when) a quarantine sink is
configured:

1. A batch has failed ``max_attempts`` times in a row (the count lives in the
   state document, so every instance agrees on it).
2. On the next failure the batch is *bisected*: the handler is called on each
   half, halves that fail are split again, until single rows fail alone. Rows
   in halves that pass were processed normally. A handler that raises
   :class:`~dbtrigger.errors.PartialBatchError` names its failed rows itself
   and needs no bisection.
3. Each row that fails alone is written to the quarantine sink - its data,
   the error, the attempt count, the poller, the checkpoint its batch started
   from - and only then does the checkpoint move past it. A row that cannot be
   recorded is never skipped.

Guard rail: poison is a row that fails while its neighbours pass. If no row of
a multi-row batch passes (now or on an earlier delivery), or more than
``quarantine_limit`` rows fail alone, the failure looks like an outage (a
downstream that is down fails every row), and nothing is quarantined; the
batch stays failed and is retried. A batch of a single row cannot tell the two
apart and is quarantined after ``max_attempts``.

Sinks implement :class:`QuarantineSink` (``put`` a list of records). Two ship
here: :class:`SqlQuarantineSink` (a table, via SQLAlchemy Core) and
:class:`JsonLinesQuarantineSink` (an append-only file). Row values that JSON
cannot hold (timestamps, decimals, uuids, bytes) are written as
``{"$type": kind, "value": text}`` with the same encoding the state document
uses for cursors, so they read back exactly.

A quarantined row is *data set aside*, not data dropped: it is logged at
WARNING (event ``row_quarantined``), counted in ``quarantined_total``, and
stays in the sink until someone replays or discards it (``dbtrigger
dead-letter``, :mod:`dbtrigger.replay.dead_letters`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from dbtrigger._driver_errors import (
    MYSQL_INCORRECT_VALUE,
    ascii_text,
    cannot_hold,
    not_encodable,
    short_error,
)
from dbtrigger._engine import LazyEngine, TableOnce, parse_database_url
from dbtrigger._files import locked_lines, write_synced
from dbtrigger._lock_wait import (
    DEFAULT_STORE_LOCK_TIMEOUT,
    bounded_transaction,
    check_lock_timeout,
    gave_up_waiting,
    lock_timed_out,
)
from dbtrigger._once import Once
from dbtrigger._quarantine_table import SUBSCRIBERS_COLUMN, add_column, quarantine_table
from dbtrigger.cursor import Position, canonical_json, encode_value
from dbtrigger.errors import (
    ConfigurationError,
    DbTriggerError,
    QuarantineError,
    SerializationError,
)
from dbtrigger.events import RowChange
from dbtrigger.redaction import redact
from dbtrigger.settings import references_setting
from dbtrigger.state.document import format_time, parse_time, position_to_json

log = logging.getLogger("dbtrigger")

# --- row encoding ---------------------------------------------------------------


def encode_json_value(value: Any) -> Any:
    """``value`` as plain JSON; non-JSON types become ``{"$type": kind, "value": ...}``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$type": "float", "value": repr(value)}
    if isinstance(value, Mapping):
        return {str(k): encode_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_json_value(v) for v in value]
    try:
        kind, encoded = encode_value(value)
    except SerializationError:
        return {"$type": "repr", "value": repr(value)[:1000]}
    return {"$type": kind, "value": encoded}


# --- records --------------------------------------------------------------------


@dataclass(frozen=True)
class QuarantineRecord:
    """One row set aside, with everything needed to understand and replay it.

    ``pk``, ``cursor`` and ``row`` are already JSON-encoded (see
    :func:`encode_json_value`); ``checkpoint`` is the position the failing
    batch started from, in the state document's format (a claim queue has no
    checkpoint: its claim token).
    """

    poller: str
    event_id: str
    source: str
    pk: Mapping[str, Any]
    cursor: Any
    row: Mapping[str, Any] | None
    error: str
    attempts: int
    checkpoint: Mapping[str, Any]
    batch_id: str
    fencing_token: int
    owner_id: str
    quarantined_at: dt.datetime
    #: Fan-out: the subscribers that did not take the event (rejected it, gave up
    #: on it, still owed it), each with its reason - the ones a replay is for.
    #: None: a single handler's record, or one written before this field.
    subscribers: Mapping[str, str] | None = None

    @classmethod
    def from_event(
        cls,
        event: RowChange,
        *,
        poller: str,
        error: BaseException | str,
        attempts: int,
        checkpoint: Position | Mapping[str, Any],
        batch_id: str,
        fencing_token: int,
        owner_id: str,
        now: dt.datetime,
        subscribers: Mapping[str, str] | None = None,
    ) -> QuarantineRecord:
        return cls(
            poller=poller,
            event_id=event.event_id,
            source=event.source,
            pk=encode_json_value(dict(event.pk)),
            cursor=encode_json_value(event.cursor),
            row=encode_json_value(dict(event.after)) if event.after is not None else None,
            error=error
            if isinstance(error, str)
            else redact(f"{type(error).__name__}: {error}"[:8000])[:2000],
            attempts=attempts,
            checkpoint=position_to_json(checkpoint)
            if isinstance(checkpoint, Position)
            else dict(checkpoint),
            batch_id=batch_id,
            fencing_token=fencing_token,
            owner_id=owner_id,
            quarantined_at=now,
            subscribers=dict(subscribers) if subscribers is not None else None,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "poller": self.poller,
            "event_id": self.event_id,
            "source": self.source,
            "pk": dict(self.pk),
            "cursor": self.cursor,
            "row": dict(self.row) if self.row is not None else None,
            "error": self.error,
            "attempts": self.attempts,
            "checkpoint": dict(self.checkpoint),
            "batch_id": self.batch_id,
            "fencing_token": self.fencing_token,
            "owner_id": self.owner_id,
            "quarantined_at": format_time(self.quarantined_at),
        } | ({"subscribers": dict(self.subscribers)} if self.subscribers is not None else {})

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> QuarantineRecord:
        return cls(
            poller=str(raw["poller"]),
            event_id=str(raw["event_id"]),
            source=str(raw.get("source", "")),
            pk=dict(raw["pk"]),
            cursor=raw.get("cursor"),
            row=dict(raw["row"]) if raw.get("row") is not None else None,
            error=str(raw.get("error", "")),
            attempts=int(raw.get("attempts", 0)),
            checkpoint=dict(raw.get("checkpoint") or {}),
            batch_id=str(raw.get("batch_id", "")),
            fencing_token=int(raw.get("fencing_token", 0)),
            owner_id=str(raw.get("owner_id", "")),
            quarantined_at=parse_time(raw.get("quarantined_at"), "quarantined_at"),
            subscribers=subscribers_from(raw.get("subscribers")),
        )


def subscribers_from(raw: Any) -> dict[str, str] | None:
    """A record's ``subscribers`` as read (None: absent, an older record)."""
    if raw is None:
        return None
    if isinstance(raw, str):  # the SQL sink's column holds it as JSON text
        raw = json.loads(raw)
    if not isinstance(raw, Mapping):
        raise QuarantineError(f"a dead letter's subscribers must be an object, got {raw!r}")
    return {str(name): str(why) for name, why in raw.items()}


@runtime_checkable
class QuarantineSink(Protocol):
    """Where poison rows go. ``put`` must be durable when it returns: the
    checkpoint moves past the rows right after. It may be called again with
    the same records (a commit that failed after ``put``); storing them once
    is best, storing them twice is acceptable, losing them is not."""

    def put(self, records: Sequence[QuarantineRecord]) -> None: ...

    def describe(self) -> str: ...


def put_records(sink: QuarantineSink, records: Sequence[QuarantineRecord]) -> None:
    """``sink.put(records)``, with anything but a dbtrigger error turned into
    :class:`~dbtrigger.errors.QuarantineError`.

    A dead-letter sink may be the user's own class; whatever it raises (a
    ``TypeError``, an HTTP client's exception) must reach the tick as "the
    rows could not be set aside" - retried, nothing skipped, the checkpoint
    held - and never escape it raw. dbtrigger's own errors (a missing app
    setting in a sink's URL) keep their meaning.
    """
    try:
        sink.put(records)
    except DbTriggerError:
        raise
    except Exception as exc:
        raise QuarantineError(
            f"the dead-letter sink {redact(sink.describe())} failed to store "
            f"{len(records)} record(s): {_short(exc)}; nothing was set aside, the rows "
            "stay where they are and are tried again"
        ) from exc


# --- SQL table ------------------------------------------------------------------


class _Replaced(Exception):
    """MariaDB/MySQL replaced characters a column lacks with '?' (a warning, 1366)."""


def _lacks(exc: BaseException) -> bool:
    """The table cannot hold a character of the rows (refused, or replaced by '?')."""
    return isinstance(exc, _Replaced) or cannot_hold(exc)


def _short(exc: BaseException) -> str:
    """:func:`short_error`, masked before it is cut (a secret at the cut is masked whole)."""
    return redact(short_error(exc, limit=None))[:300]


class SqlQuarantineSink:
    """Quarantined rows in a database table (PostgreSQL, MariaDB/MySQL, SQLite, ...).

    The table is created on first use unless ``create_table=False``. A record
    already present for (poller, event_id) is left as it is, so a ``put``
    repeated after a failed commit stores each row once. A ``put`` waits at most
    ``lock_timeout_seconds`` for a lock another transaction holds (another
    instance's uncommitted record of the same event, a transaction left open on
    the table), then fails as :class:`~dbtrigger.errors.QuarantineError`: nothing
    was set aside, nothing skipped.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        engine: sa.Engine | None = None,
        table: str = "dbtrigger_quarantine",
        schema: str | None = None,
        create_table: bool = True,
        lock_timeout_seconds: float = DEFAULT_STORE_LOCK_TIMEOUT,
    ) -> None:
        if (url is None) == (engine is None):
            raise ConfigurationError("SqlQuarantineSink needs exactly one of url= or engine=")
        self.lock_timeout = check_lock_timeout(lock_timeout_seconds)
        self._url_spec = url
        if engine is None and references_setting(url):
            # An app setting is read at first use: in a Function App a missing
            # one fails the functions quarantining here, not the app's indexing.
            self._engines = LazyEngine(lambda: parse_database_url(url or "", "quarantine url"))
        else:
            where = engine.url if engine is not None else None
            self._engines = LazyEngine(
                where or parse_database_url(url or "", "quarantine url"), engine=engine
            )
            self._engines.engine  # noqa: B018 - created now: a bad URL fails here
        self.table = quarantine_table(table, schema)
        self._creation = (
            TableOnce(self.table, lambda: self._engine, self.lock_timeout) if create_table else None
        )
        #: Has the table the subscribers column (checked at first use, added if it may)?
        self._subscribers = True
        self._columns = Once(self._check_columns)

    @property
    def _engine(self) -> sa.Engine:
        """The engine (created at first use when the URL is an app setting)."""
        return self._engines.engine

    def describe(self) -> str:
        name = f"{self.table.schema}.{self.table.name}" if self.table.schema else self.table.name
        try:
            dialect = self._engine.dialect.name
        except ConfigurationError:
            dialect = f"({self._url_spec}, unresolved)"
        return f"sql:{dialect}:{name}"

    def close(self) -> None:
        """Dispose of the connection pool if this sink created the engine."""
        self._engines.dispose()

    def _ensure_table(self) -> None:
        if self._creation is not None:
            self._creation.ensure()
        self._columns.ensure()

    def _check_columns(self) -> None:
        """A table from before the subscribers column gets it when this sink may
        create tables; otherwise, or if that is refused, records are written and
        read without it (a fan-out record then names its subscribers in its error
        text only), said once at WARNING."""
        self._subscribers, ddl = add_column(
            self._engine,
            self.table,
            SUBSCRIBERS_COLUMN,
            self.lock_timeout,
            may_alter=self._creation is not None,
        )
        if not self._subscribers:
            log.warning(
                "dead-letter sink %s has no %s column: fan-out dead letters name their "
                "subscribers in their error text only (dbtrigger dead-letter --subscriber "
                "reads them from there). Add it: %s",
                self.describe(),
                SUBSCRIBERS_COLUMN,
                redact(ddl),
                extra={"event": "dead_letter_sink_old_table", "sink": self.describe()},
            )

    @staticmethod
    def _row(record: QuarantineRecord, *, escaped: bool = False) -> dict[str, Any]:
        """The table row; ``escaped``: its text past ASCII as backslash escapes (the
        JSON columns are ASCII already)."""
        text = ascii_text if escaped else str
        return {
            "poller": record.poller,
            "event_id": record.event_id,
            "source": text(record.source)[:255],
            "pk_json": canonical_json(dict(record.pk)),
            "cursor_json": canonical_json(record.cursor),
            "row_json": canonical_json(dict(record.row)) if record.row is not None else None,
            "error": text(record.error),
            "attempts": record.attempts,
            "checkpoint_json": canonical_json(dict(record.checkpoint)),
            "batch_id": text(record.batch_id)[:128],
            "fencing_token": record.fencing_token,
            "owner_id": text(record.owner_id)[:255],
            "quarantined_at": record.quarantined_at.astimezone(dt.timezone.utc).replace(
                tzinfo=None
            ),
            SUBSCRIBERS_COLUMN: canonical_json(dict(record.subscribers))
            if record.subscribers is not None
            else None,
        }

    def _insert_ignoring_duplicates(self, conn: sa.Connection, rows: list[dict[str, Any]]) -> None:
        dialect = conn.dialect.name
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert  # noqa: PLC0415

            conn.execute(pg_insert(self.table).on_conflict_do_nothing(), rows)
        elif dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert  # noqa: PLC0415

            conn.execute(sqlite_insert(self.table).on_conflict_do_nothing(), rows)
        elif dialect in ("mysql", "mariadb"):
            from sqlalchemy.dialects.mysql import insert as mysql_insert  # noqa: PLC0415

            stmt = mysql_insert(self.table)
            conn.execute(stmt.on_duplicate_key_update(poller=stmt.inserted.poller), rows)
            # Not strict, the server stores '?' for what a column lacks: undone, escaped.
            warned = conn.exec_driver_sql("SHOW WARNINGS").all()
            if any(w[1] == MYSQL_INCORRECT_VALUE for w in warned):
                raise _Replaced(next(str(w[2]) for w in warned if w[1] == MYSQL_INCORRECT_VALUE))
        else:
            for row in rows:
                try:
                    with conn.begin_nested():
                        conn.execute(self.table.insert(), row)
                except IntegrityError:
                    continue

    def put(self, records: Sequence[QuarantineRecord]) -> None:
        if not records:
            return
        rows = [self._row(r) for r in records]
        try:
            self._insert(rows)
        except (SQLAlchemyError, UnicodeEncodeError, _Replaced) as exc:
            if not _lacks(exc):
                raise self._failed(len(records), exc) from exc
            # A LATIN1 database or column: every retry would be refused the same (a
            # stall), so the characters it cannot hold are written as escapes, said.
            escaped = [self._row(r, escaped=True) for r in records]
            try:
                self._insert(escaped)
            except (SQLAlchemyError, UnicodeEncodeError, _Replaced) as again:
                raise self._failed(len(records), again) from again
            changed = sorted(
                {k for a, b in zip(rows, escaped, strict=True) for k in a if a[k] != b[k]}
            )
            log.warning(
                "%d dead letter(s) written to %s with the characters its encoding cannot "
                "hold (in %s) as backslash escapes (\\uXXXX): keep the quarantine in a UTF8 "
                "database (or utf8mb4 table) to store them as they are",
                len(records),
                self.describe(),
                ", ".join(changed),
                extra={"event": "dead_letter_escaped", "sink": self.describe(), "fields": changed},
            )

    def _insert(self, rows: list[dict[str, Any]]) -> None:
        self._ensure_table()
        if not self._subscribers:  # a table from before the column
            rows = [{k: v for k, v in row.items() if k != SUBSCRIBERS_COLUMN} for row in rows]
        with bounded_transaction(self._engine, self.lock_timeout) as conn:
            self._insert_ignoring_duplicates(conn, rows)

    def _failed(self, count: int, exc: BaseException) -> QuarantineError:
        """The typed error for a failed ``put`` (raise it from ``exc``)."""
        what = f"could not write {count} row(s) to quarantine {self.describe()}: "
        if _lacks(exc):
            return QuarantineError(
                what + not_encodable("these rows", _short(exc), "the quarantine", "url=")
            )
        if lock_timed_out(exc):
            text, _ = gave_up_waiting(
                self._engine,
                self.table.name,
                self.table.schema,
                self.lock_timeout,
                exc,
                "nothing was written. End the transaction left open there",
            )
            return QuarantineError(what + text)
        return QuarantineError(what + _short(exc))

    def records(self, poller: str | None = None) -> list[QuarantineRecord]:
        """Read quarantined rows back (oldest first), e.g. to replay them."""
        try:
            self._ensure_table()
            t = self.table
            cols = [c for c in t.c if self._subscribers or c.name != SUBSCRIBERS_COLUMN]
            stmt = sa.select(*cols).order_by(t.c.quarantined_at, t.c.poller, t.c.event_id)
            if poller is not None:
                stmt = stmt.where(t.c.poller == poller)
            with self._engine.connect() as conn:
                rows = conn.execute(stmt).mappings().all()
        except SQLAlchemyError as exc:
            raise QuarantineError(
                f"could not read quarantine {self.describe()}: {_short(exc)}"
            ) from exc
        return [
            QuarantineRecord(
                poller=r["poller"],
                event_id=r["event_id"],
                source=r["source"],
                pk=json.loads(r["pk_json"]),
                cursor=json.loads(r["cursor_json"]),
                row=json.loads(r["row_json"]) if r["row_json"] is not None else None,
                error=r["error"],
                attempts=r["attempts"],
                checkpoint=json.loads(r["checkpoint_json"]),
                batch_id=r["batch_id"],
                fencing_token=int(r["fencing_token"]),
                owner_id=r["owner_id"],
                quarantined_at=r["quarantined_at"].replace(tzinfo=dt.timezone.utc),
                subscribers=subscribers_from(r.get(SUBSCRIBERS_COLUMN)),
            )
            for r in rows
        ]


# --- JSON lines file ------------------------------------------------------------


class JsonLinesQuarantineSink:
    """Quarantined rows appended to a file, one JSON object per line.

    Appends hold an exclusive ``flock`` and are fsynced, so several processes
    can share one file and a record is on disk before the checkpoint moves.
    The file is created with mode 0600 (whole rows are in it); an existing
    file keeps the mode it has.
    A ``put`` repeated after a failed commit appends the records again;
    readers should key on (poller, event_id).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def describe(self) -> str:
        return f"file:{Path(self.path).absolute()}"

    def put(self, records: Sequence[QuarantineRecord]) -> None:
        if not records:
            return
        lines = "".join(
            json.dumps(r.to_json(), sort_keys=True, ensure_ascii=True) + "\n" for r in records
        )
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with locked_lines(self.path, append=True) as fh:
                write_synced(fh, lines)
        except OSError as exc:
            raise QuarantineError(
                f"could not append {len(records)} row(s) to quarantine {self.path}: {exc.strerror}"
            ) from exc

    def records(self, poller: str | None = None) -> list[QuarantineRecord]:
        if not self.path.exists():
            return []
        with locked_lines(self.path, append=False) as fh:
            out = [QuarantineRecord.from_json(json.loads(line)) for line in fh if line.strip()]
        return [r for r in out if poller is None or r.poller == poller]
