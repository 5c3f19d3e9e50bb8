"""Dead letters: list, show, replay and discard what a poller set aside.

A dead-lettered event (``ctx.reject``, retries used up, a poison row) is a
:class:`~dbtrigger.quarantine.QuarantineRecord` in the poller's sink. The
sink is append-only evidence, so what an operator does with a record is not
written into it but beside it, as *marks*:

* JSON-lines sink ``dead.jsonl``: ``dead.jsonl.marks`` (JSON lines, 0600, flock);
* SQL sink table ``dbtrigger_quarantine``: table ``dbtrigger_quarantine_marks``.

A mark says who did what when and why: ``replayed`` (the handler took the
event: settled), ``replay_rejected`` (it rejected it again), ``replay_failed``
(it raised or asked for a retry), ``discarded`` (an operator let it go). A
record's state is its last mark; without one it is ``dead``. Records are
only deleted when told (``discard --delete``).

A fan-out dead letter names the subscribers that did not take its event
(the record's ``subscribers``; for a record written before that field, the
names its error text starts segments with, given the trigger's subscribers).
A replay to one subscriber marks the letter for that subscriber only
(``Mark.subscriber``): the letter is settled once every subscriber it names
took it, so replaying it to one never lets the others' share go unseen.

A replay rebuilds the event from the record - the same event id, key, cursor
and row image (``op`` is ``upsert``, or ``delete`` when the record holds no
row, or ``truncate`` when it holds neither a row nor a key value: a change log's
truncate, the one event whose key values are all None) - and hands it to the
handler with ``ctx.replay`` True and ``ctx.now`` the time it was dead-lettered.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import sqlalchemy as sa

from dbtrigger._engine import TableOnce
from dbtrigger._files import locked_lines, write_synced
from dbtrigger._lock_wait import bounded_transaction, gave_up_waiting, lock_timed_out
from dbtrigger._quarantine_table import add_column
from dbtrigger.cursor import Position, decode_value
from dbtrigger.errors import ConfigurationError, DbTriggerError, QuarantineError, SerializationError
from dbtrigger.events import RowChange
from dbtrigger.quarantine import JsonLinesQuarantineSink, QuarantineRecord, SqlQuarantineSink
from dbtrigger.runtime.context import BatchContext, EventMarks
from dbtrigger.runtime.tick import wants_context
from dbtrigger.state.document import format_time, parse_time

SETTLED = "replayed"
ACTIONS = ("replayed", "replay_rejected", "replay_failed", "discarded")


@dataclass(frozen=True)
class Mark:
    poller: str
    event_id: str
    action: str
    at: dt.datetime
    actor: str
    reason: str
    detail: str = ""
    #: Fan-out: the subscriber a replay was for ("": the whole letter).
    subscriber: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "at": format_time(self.at)}


@dataclass(frozen=True)
class DeadLetter:
    """A record and what was done with it (its marks, oldest first); ``owed``:
    the fan-out subscribers it names (None: a single handler's, or not known)."""

    record: QuarantineRecord
    marks: tuple[Mark, ...] = ()
    owed: tuple[str, ...] | None = None

    def _last(self, subscriber: str) -> str | None:
        mine = [m.action for m in self.marks if m.subscriber == subscriber]
        return mine[-1] if mine else None

    def waiting_for(self) -> tuple[str, ...]:
        """The subscribers it names that have not taken it in a replay yet."""
        if not self.owed or self._last("") in (SETTLED, "discarded"):
            return ()
        return tuple(name for name in self.owed if self._last(name) != SETTLED)

    def settled_for(self, subscriber: str) -> bool:
        """Nothing more to replay to ``subscriber``: it took it, it is not named, or
        the whole letter is settled."""
        if self.owed is None:
            return self.settled
        return self.settled or subscriber not in self.waiting_for()

    @property
    def state(self) -> str:
        whole = self._last("")
        if self.owed and whole not in (SETTLED, "discarded"):
            waiting = self.waiting_for()
            if not waiting:
                return SETTLED
            later = [m.action for m in self.marks if m.subscriber in waiting]
            return later[-1] if later else (whole or "dead")
        return self.marks[-1].action if self.marks else "dead"

    @property
    def settled(self) -> bool:
        return self.state in (SETTLED, "discarded")

    def to_json(self) -> dict[str, Any]:
        """The record with its state (``list --json``) and, for a fan-out letter,
        the subscribers still to take it."""
        waiting = {"waiting_for": list(self.waiting_for())} if self.owed else {}
        return {**self.record.to_json(), "state": self.state, **waiting}


def subscribers_of(record: QuarantineRecord, known: Collection[str] = ()) -> tuple[str, ...] | None:
    """The fan-out subscribers a dead letter names: its ``subscribers`` field, or,
    for a record from before it, those of ``known`` its error text gives a reason
    for (``EventRejected: billing: ...; search: ...``). None: neither says."""
    if record.subscribers is not None:
        return tuple(sorted(record.subscribers))
    segments = record.error.partition(": ")[2].split("; ")
    named = [n for n in known if any(seg.startswith(f"{n}: ") for seg in segments)]
    return tuple(sorted(named)) or None


# --- values -----------------------------------------------------------------------------


def decode_json_value(value: Any) -> Any:
    """The inverse of :func:`dbtrigger.quarantine.encode_json_value`."""
    if isinstance(value, Mapping):
        if set(value) == {"$type", "value"}:
            kind, raw = str(value["$type"]), value["value"]
            if kind == "float":
                return float(raw)
            if kind == "repr":
                return raw
            try:
                return decode_value(kind, raw)
            except Exception:  # noqa: BLE001 - an unknown kind stays as written
                return raw
        return {str(k): decode_json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_json_value(v) for v in value]
    return value


def event_of(record: QuarantineRecord) -> RowChange:
    """The dead-lettered event again: same id, key, cursor and row image."""
    row = decode_json_value(dict(record.row)) if record.row is not None else None
    pk = decode_json_value(dict(record.pk))
    op = "upsert" if row is not None else "delete"
    if row is None and pk and all(value is None for value in pk.values()):
        op = "truncate"  # a record holds no op; only a truncate has a key of Nones
    return RowChange(
        event_id=record.event_id,
        op=op,
        source=record.source,
        cursor=decode_json_value(record.cursor),
        pk=pk,
        before=None,
        after=row,
        metadata={"poller": record.poller, "batch_id": record.batch_id, "dead_letter": True},
    )


# --- marks beside each sink ------------------------------------------------------------------


class FileMarks:
    """Marks in ``<sink file>.marks``: one JSON object a line, appended under ``flock``."""

    def __init__(self, sink: JsonLinesQuarantineSink) -> None:
        self.sink = sink
        self.path = Path(str(sink.path) + ".marks")

    def read(self) -> list[Mark]:
        if not self.path.exists():
            return []
        with locked_lines(self.path, append=False) as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
        return [_mark(raw) for raw in lines]

    def add(self, marks: Sequence[Mark]) -> None:
        text = "".join(json.dumps(m.to_json(), sort_keys=True) + "\n" for m in marks)
        try:
            with locked_lines(self.path, append=True) as fh:
                write_synced(fh, text)
        except OSError as exc:
            raise QuarantineError(f"could not write marks to {self.path}: {exc.strerror}") from exc

    def delete_records(self, poller: str, event_ids: set[str]) -> int:
        """Remove these records from the sink file (rewritten whole under its lock)."""
        path = self.sink.path
        if not path.exists():
            return 0
        fd = os.open(path, os.O_RDWR)
        with os.fdopen(fd, "r+", encoding="utf-8") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            lines = fh.readlines()
            keep = []
            for line in lines:
                raw = json.loads(line) if line.strip() else None
                if raw and raw.get("poller") == poller and raw.get("event_id") in event_ids:
                    continue
                keep.append(line)
            tmp = path.with_name(f".{path.name}.rewrite")
            tmp_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(tmp_fd, "w", encoding="utf-8") as out:
                write_synced(out, "".join(keep))
            os.replace(tmp, path)
        return len(lines) - len(keep)


class SqlMarks:
    """Marks in ``<sink table>_marks`` beside a SQL sink's table."""

    def __init__(self, sink: SqlQuarantineSink) -> None:
        self.sink = sink
        base = sink.table
        self.table = sa.Table(
            f"{base.name}_marks",
            sa.MetaData(),
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("poller", sa.String(128), nullable=False),
            sa.Column("event_id", sa.String(64), nullable=False),
            sa.Column("action", sa.String(32), nullable=False),
            sa.Column("at", sa.DateTime, nullable=False),
            sa.Column("actor", sa.String(255), nullable=False),
            sa.Column("reason", sa.Text, nullable=False),
            sa.Column("detail", sa.Text, nullable=False),
            sa.Column("subscriber", sa.String(128), nullable=True),  # added later
            schema=base.schema,
        )
        self._creation = TableOnce(self.table, lambda: self.engine, sink.lock_timeout)
        #: Has the marks table the subscriber column (it is dbtrigger's: added at first use)?
        self._subscriber: bool | None = None
        self._adds = ""  # the ALTER TABLE that adds it, when it could not be added

    def _has_subscriber(self) -> bool:
        if self._subscriber is None:
            self._subscriber, self._adds = add_column(
                self.engine, self.table, "subscriber", self.sink.lock_timeout, may_alter=True
            )
        return self._subscriber

    @property
    def engine(self) -> sa.Engine:
        return self.sink._engine

    def read(self) -> list[Mark]:
        try:
            with self.engine.connect() as conn:
                if not sa.inspect(conn).has_table(self.table.name, schema=self.table.schema):
                    return []
            t = self.table
            cols = [c for c in t.c if c.name != "subscriber" or self._has_subscriber()]
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(*cols).order_by(t.c.id)).mappings().all()
        except sa.exc.SQLAlchemyError as exc:
            raise QuarantineError(f"could not read marks of {self.sink.describe()}: {exc}") from exc
        return [
            Mark(
                r["poller"],
                r["event_id"],
                r["action"],
                r["at"].replace(tzinfo=dt.timezone.utc),
                r["actor"],
                r["reason"],
                r["detail"],
                r.get("subscriber") or "",
            )
            for r in rows
        ]

    def add(self, marks: Sequence[Mark]) -> None:
        rows = [
            {**m.to_json(), "at": m.at.astimezone(dt.timezone.utc).replace(tzinfo=None)}
            for m in marks
        ]
        try:
            self._creation.ensure()
            if not self._has_subscriber():
                if any(m.subscriber for m in marks):  # a whole mark would settle the others'
                    raise QuarantineError(
                        f"the marks table of {self.sink.describe()} has no subscriber column, "
                        "so a replay to one subscriber cannot be marked as its alone (the "
                        "letters stay dead; what was replayed comes again next time): run "
                        f"{self._adds}"
                    )
                rows = [{k: v for k, v in r.items() if k != "subscriber"} for r in rows]
            with bounded_transaction(self.engine, self.sink.lock_timeout) as conn:
                conn.execute(self.table.insert(), rows)
        except sa.exc.SQLAlchemyError as exc:
            why = self._why(exc, self.table, "no mark was written")
            raise QuarantineError(
                f"could not write marks of {self.sink.describe()} to {self.table.name}: {why}"
            ) from exc

    def delete_records(self, poller: str, event_ids: set[str]) -> int:
        t = self.sink.table
        try:
            with bounded_transaction(self.engine, self.sink.lock_timeout) as conn:
                return int(
                    conn.execute(
                        sa.delete(t).where(
                            t.c.poller == poller, t.c.event_id.in_(sorted(event_ids))
                        )
                    ).rowcount
                )
        except sa.exc.SQLAlchemyError as exc:
            why = self._why(exc, t, "no record was deleted")
            raise QuarantineError(
                f"could not delete records of {self.sink.describe()}: {why}"
            ) from exc

    def _why(self, exc: sa.exc.SQLAlchemyError, table: sa.Table, unchanged: str) -> str:
        """A failed write in words: for one that gave up waiting for a lock (at most
        the sink's ``lock_timeout_seconds``; a command must not hang behind a
        transaction left open), how long it waited and who holds locks there."""
        if not lock_timed_out(exc):
            return str(exc)
        return gave_up_waiting(
            self.engine,
            table.name,
            table.schema,
            self.sink.lock_timeout,
            exc,
            f"{unchanged}. Run the command again once it ends, or end it",
        )[0]


def _mark(raw: Mapping[str, Any]) -> Mark:
    return Mark(
        str(raw["poller"]),
        str(raw["event_id"]),
        str(raw["action"]),
        parse_time(raw["at"], "at"),
        str(raw.get("actor", "")),
        str(raw.get("reason", "")),
        str(raw.get("detail", "")),
        str(raw.get("subscriber") or ""),
    )


Marks = FileMarks | SqlMarks


def marks_for(sink: Any) -> Marks:
    if isinstance(sink, JsonLinesQuarantineSink):
        return FileMarks(sink)
    if isinstance(sink, SqlQuarantineSink):
        return SqlMarks(sink)
    raise ConfigurationError(
        f"the dead-letter sink {type(sink).__name__} is neither the JSON-lines nor the SQL "
        "sink; list, replay and discard work on those two (and on a claim queue's dead rows)"
    )


# --- reading ----------------------------------------------------------------------------------


def dead_letters(
    sink: Any,
    poller: str,
    *,
    ids: Sequence[str] = (),
    since: dt.datetime | None = None,
    include_settled: bool = False,
    known: Collection[str] = (),
    subscriber: str | None = None,
    renames: Mapping[str, str] | None = None,
) -> list[DeadLetter]:
    """The poller's records, each with its marks, filtered.

    ``ids`` match an event id or its first 8+ characters; ``since`` keeps
    records dead-lettered at or after it; ``known``: the fan-out trigger's
    subscribers (to read older records' errors); ``subscriber``: only the
    letters naming it (and, unless ``include_settled``, not yet replayed to it);
    ``renames``: former subscriber name -> the one that took it over
    (``renamed(formerly=)``): a letter naming the former names the new one.
    """
    records = sorted(sink.records(poller), key=_order)
    marks: dict[str, list[Mark]] = {}
    for mark in marks_for(sink).read():
        if mark.poller == poller:
            marks.setdefault(mark.event_id, []).append(mark)
    out = []
    seen: set[str] = set()
    for record in records:
        if record.event_id in seen:
            continue  # a put repeated after a failed commit stored it twice
        seen.add(record.event_id)
        if ids and not any(_matches(record.event_id, i) for i in ids):
            continue
        if since is not None and record.quarantined_at < since:
            continue
        owed = subscribers_of(record, [*known, *(renames or {})])
        if owed is not None and renames:
            owed = tuple(sorted({renames.get(name, name) for name in owed}))
        letter = DeadLetter(record, tuple(marks.get(record.event_id, ())), owed)
        if subscriber is not None:
            if owed is not None and subscriber not in owed:
                continue  # it took the event: nothing of it is this subscriber's
            if letter.settled_for(subscriber) and not include_settled and not ids:
                continue
        elif letter.settled and not include_settled and not ids:
            continue
        out.append(letter)
    return out


def _order(record: QuarantineRecord) -> tuple[Any, ...]:
    """Oldest first, then in cursor order (a batch's records share their time)."""
    cursor = decode_json_value(record.cursor)
    numeric = isinstance(cursor, (int, float)) and not isinstance(cursor, bool)
    return (record.quarantined_at, 0 if numeric else 1, cursor if numeric else str(cursor))


def _matches(event_id: str, wanted: str) -> bool:
    if len(wanted) < 8:
        raise ConfigurationError(f"--id {wanted!r}: give at least 8 characters of the event id")
    return event_id == wanted or event_id.startswith(wanted)


# --- replaying ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayOutcome:
    event_id: str
    result: str  # settled, rejected, failed
    detail: str = ""


def blamed(letters: Sequence[DeadLetter], subscribers: Collection[str]) -> dict[str, int]:
    """Subscriber -> how many of ``letters`` it rejected or gave up on, as their
    errors name it (a fan-out dead letter's ``EventRejected: billing: ...; search:
    ...`` or ``RetriesExhausted: search: ...``): which ``--subscriber`` a replay is for."""
    out: dict[str, int] = {}
    for letter in letters:
        for name in letter.waiting_for() or subscribers_of(letter.record, subscribers) or ():
            if name in subscribers:
                out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def replay_one(
    letter: DeadLetter,
    handler: Callable[..., Any],
    *,
    subscriber: str | None,
    token: int,
    owner: str,
    now: dt.datetime,
) -> ReplayOutcome:
    """Hand one dead-lettered event to ``handler``; what became of it."""
    record = letter.record
    try:
        event = event_of(record)
    except (SerializationError, ValueError, TypeError) as exc:
        return ReplayOutcome(record.event_id, "failed", f"the record cannot be read back: {exc}")
    marks = EventMarks([event], can_reject=True)
    position = Position(cursor=event.cursor, pk=dict(event.pk))
    ctx = BatchContext(
        poller_name=record.poller,
        batch_id=record.batch_id or f"dead_letter_{record.event_id[:12]}",
        batch_index=0,
        fencing_token=token,
        owner_id=owner,
        source_name=record.source,
        checkpoint_before=position,
        checkpoint_after=position,
        tick_started_at=now,
        marks=marks,
        subscriber=subscriber,
        replay=True,
        recorded_at=record.quarantined_at,
    )
    try:
        result = handler([event], ctx) if wants_context(handler) else handler([event])
        if hasattr(result, "__await__"):
            import asyncio  # noqa: PLC0415 - async handlers only

            async def wait() -> Any:
                return await result

            asyncio.run(wait())
    except DbTriggerError as exc:
        return ReplayOutcome(record.event_id, "failed", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - the handler's failure is the outcome
        return ReplayOutcome(record.event_id, "failed", f"{type(exc).__name__}: {exc}")
    finally:
        marks.close()
    rejected, retried = marks.snapshot()
    if record.event_id in rejected:
        return ReplayOutcome(record.event_id, "rejected", rejected[record.event_id])
    if record.event_id in retried:
        return ReplayOutcome(
            record.event_id, "failed", f"asked for a retry: {retried[record.event_id]}"
        )
    return ReplayOutcome(record.event_id, "settled")


ACTION_OF = {"settled": "replayed", "rejected": "replay_rejected", "failed": "replay_failed"}


def replay_report(
    outcomes: Sequence[ReplayOutcome],
    letters: Sequence[DeadLetter],
    subscriber: str | None,
    counts: Mapping[str, int],
) -> list[str]:
    """What ``dead-letter replay`` prints: a line per event, then the counts. A fan-out
    letter ``subscriber`` took is settled for it alone: the line names who still owes
    it (it stays dead, listed, for them), rather than "settled" as if it were gone."""
    lines, owed = [], 0
    for o, letter in zip(outcomes, letters, strict=True):
        others = [n for n in letter.waiting_for() if n != subscriber] if subscriber else []
        result = o.result
        if o.result == "settled" and others:
            owed += 1
            result = f"settled for {subscriber}; still dead for {', '.join(others)}"
        lines.append(f"  {o.event_id}  {result}{': ' + o.detail if o.detail else ''}")
    still = (
        " (still dead; replay again once fixed)" if counts["rejected"] + counts["failed"] else ""
    )
    lines.append(
        f"{counts['settled']} settled{f' for {subscriber}' if subscriber else ''}, "
        f"{counts['rejected']} rejected again, {counts['failed']} failed{still}"
        + (f"; {owed} of them still dead for other subscribers (replay to each)" if owed else "")
    )
    return lines


def record_proxy(record: QuarantineRecord) -> Mapping[str, Any]:
    """A record as JSON for ``show``, values decoded for reading."""
    return MappingProxyType(record.to_json())


__all__ = [
    "ACTIONS",
    "ACTION_OF",
    "DeadLetter",
    "FileMarks",
    "Mark",
    "ReplayOutcome",
    "SqlMarks",
    "blamed",
    "dead_letters",
    "decode_json_value",
    "event_of",
    "marks_for",
    "record_proxy",
    "replay_one",
    "subscribers_of",
]
