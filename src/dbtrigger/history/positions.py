"""Where a poller starts, rewinds to, and the named positions it keeps.

**Start.** ``PollTrigger(start_from=...)`` says where a *new* poller starts:
``"beginning"`` (every row, the default), ``"now"`` (after the last row there
is: only rows written from now on), a timestamp or other cursor value (the
rows whose cursor is at or above it), or a :class:`~dbtrigger.cursor.Position`
(after that exact row). It is resolved once, against the source, when the
poller's state document is created, and recorded in it (``start_from``). A
poller that has a checkpoint ignores it, and says so once in the log: the
checkpoint, not the configuration, is where a running poller is. So does a
document with journal entries and no checkpoint (reset to the beginning by
an operator): start_from never undoes a reset.

**Rewind.** ``dbtrigger rewind`` moves a poller's checkpoint back to where a
recorded batch began (``--to-batch``) or to before the first batch committed
after a time (``--to-time``), so exactly the batches committed since are
delivered again; it refuses what the history cannot vouch for (pruned, or a
gap) and what the source can no longer serve (a change log pruned past it).

**Bookmarks.** Named positions kept in the state document (``bookmarks``):
``dbtrigger bookmark create | list | restore``.
"""

from __future__ import annotations

import datetime as dt
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dbtrigger.cursor import Position
from dbtrigger.errors import (
    CasConflictError,
    ConfigurationError,
    ReplayRefusedError,
    StoreError,
)
from dbtrigger.history import records as rec
from dbtrigger.names import validate_name
from dbtrigger.state import document as docmod
from dbtrigger.state import operations as ops
from dbtrigger.state.document import StateDocument, format_time, position_from_json

#: Named start positions (any other value is a cursor value or a Position).
BEGINNING, NOW = "beginning", "now"
#: Bookmarks one document keeps at most.
MAX_BOOKMARKS = 50


# --- start positions -------------------------------------------------------------------------


def check_start(value: object, source: Any) -> object:
    """``start_from`` as given, checked against what the source can resolve.

    Raises:
        ConfigurationError: a spelling that is none of the forms, or ``"now"`` /
            a cursor value for a source that cannot find its last position.
    """
    if value is None or value == BEGINNING or isinstance(value, Position):
        return value
    if isinstance(value, str) and value.lower() in (BEGINNING, NOW):
        value = value.lower()
    elif isinstance(value, str) and value.strip() == "":
        raise ConfigurationError("start_from is empty: use 'beginning', 'now', a time or a cursor")
    if not callable(getattr(source, "last_position", None)):
        raise ConfigurationError(
            f"start_from={value!r} needs a source that can find its last row "
            f"({type(source).__name__} cannot); use 'beginning' or a Position"
        )
    return value


def spec_of(value: object) -> dict[str, Any]:
    """How ``start_from`` is recorded: ``{"spec": ..., "value": ...}``."""
    if value is None or value == BEGINNING:
        return {"spec": BEGINNING}
    if value == NOW:
        return {"spec": NOW}
    if isinstance(value, Position):
        return {"spec": "position", "value": docmod.position_to_json(value)}
    kind = "time" if isinstance(value, dt.datetime) else "cursor"
    from dbtrigger.cursor import encode_value  # noqa: PLC0415 - kept beside its only use

    return {"spec": kind, "value": list(encode_value(value))}


def resolve(value: object, source: Any) -> Position | None:
    """The position a new poller starts after (None: the beginning), read now."""
    if value is None or value == BEGINNING:
        return None
    if isinstance(value, Position):
        return value
    found = source.last_position(None if value == NOW else value)
    return None if found.is_beginning else found


@dataclass
class StartFrom:
    """A poller's ``start_from``, applied once per process before its first tick."""

    value: object
    done: bool = False

    @classmethod
    def of(cls, value: object, source: Any, *, partitioned: bool) -> StartFrom | None:
        """``PollTrigger(start_from=value)`` checked (None: not given)."""
        if value is None:
            return None
        if partitioned:
            raise ConfigurationError("start_from does not apply to partitioned pollers")
        return cls(check_start(value, source))

    def apply(self, trigger: Any) -> None:
        """Create the poller's document at its start position, or say why not."""
        store, name = trigger.store, trigger.name
        spec = spec_of(self.value)
        stored = store.read(name)
        if stored is not None:
            doc = docmod.loads(stored.data)
            recorded = doc.extra.get("start_from")
            # A journal entry means the document was positioned already: by a
            # commit, or by hand (`reset --to-beginning` leaves no checkpoint, and
            # start_from must not undo it at the next restart).
            if doc.checkpoint is not None or recorded is not None or doc.journal:
                self._ignored(trigger, doc, recorded)
                self.done = True
                return
        else:
            _refuse_if_recorded(trigger, spec["spec"])
        now = trigger.clock()
        position = resolve(self.value, trigger.source)
        created = ops.create(
            name,
            fingerprint=trigger.fingerprint,
            position=position,
            now=now,
            actor=f"poller:{trigger.owner_id}",
            reason=f"start_from={spec['spec']}",
            operation="start",
            details={"start_from": spec},
            journal_limit=max(trigger.journal_limit, 1),
            definition=_definition(trigger.source),
        )
        record = {**spec, "position": ops.position_json(position), "at": format_time(now)}
        created = replace(created, extra={**created.extra, "start_from": record})
        if stored is not None:
            # A document without a checkpoint (a first batch that never committed):
            # its lease and journal are kept, the start recorded.
            old = docmod.loads(stored.data)
            created = replace(created, lease=old.lease, journal=(*old.journal, *created.journal))
        try:
            store.write(name, docmod.dumps(created), if_match=stored.etag if stored else None)
        except CasConflictError:
            return  # another instance created it first: look again at the next tick
        trigger.telemetry.emit(
            "start_position",
            "%s: a new poller starts after %s (start_from=%s)",
            name,
            "the beginning" if position is None else f"{position.cursor} {dict(position.pk)}",
            spec["spec"],
            start_from=spec["spec"],
        )
        self.done = True

    def _ignored(self, trigger: Any, doc: StateDocument, recorded: Any) -> None:
        if doc.checkpoint is not None:
            where = f"a checkpoint ({doc.position.cursor} {dict(doc.position.pk)})"
        elif doc.journal:
            last = doc.journal[-1]
            what = last.get("operation") or last.get("type") or "an entry"
            where = f"a state document at the beginning, put there by {what} ({last.get('at')})"
        else:
            where = "a state document"

        first = (
            f", itself started with start_from={recorded.get('spec')}"
            if isinstance(recorded, Mapping)
            else ""
        )
        trigger.telemetry.emit(
            "start_from_ignored",
            "%s: start_from=%s is ignored: the poller has %s%s; to move it, use "
            "dbtrigger reset or dbtrigger rewind",
            trigger.name,
            spec_of(self.value)["spec"],
            where,
            first,
            start_from=spec_of(self.value)["spec"],
        )


def _refuse_if_recorded(trigger: Any, spec: str) -> None:
    """A poller without a state document whose history records batches is not new:
    its document was deleted or lost. Creating it at ``start_from`` (``"now"``) would
    start after rows it never delivered, so refuse and say how to go on.

    Raises:
        ConfigurationError: naming the history's last record and the ways on.
    """
    history = getattr(trigger, "history", None)
    if history is None:
        return
    try:
        last = history.tail(trigger.name, 1)
    except StoreError as exc:  # the history cannot say: start as configured, said
        trigger.telemetry.emit(
            "start_from_unchecked",
            "%s: start_from=%s applied without looking at the history (%s): if the "
            "poller's state document was deleted, rows after its checkpoint are skipped",
            trigger.name,
            spec,
            exc,
        )
        return
    if not last:
        return
    raise ConfigurationError(
        f"poller {trigger.name!r} has no state document, but its history holds records "
        f"(the last, #{last[-1].get('seq')}, at {last[-1].get('at')}): the document was "
        f"deleted or lost, and start_from={spec} would start it after rows it has not "
        "delivered. Restore the document from a backup and start again, or write it again "
        "at the last position the history recorded: "
        f"{recreate_command(trigger.name, last, trigger.operator_spec() or 'MODULE:ATTR')}; "
        "or remove start_from= to deliver every row again; or, to start at start_from "
        "anyway, delete the poller's history first (docs/history.md, 'Where a new poller "
        "starts')"
    )


def warn_if_recorded(trigger: Any) -> None:
    """Say at WARNING, before its first batch, that a poller without a state document
    whose history holds records is not new: its document was deleted or lost, and it
    starts over from the beginning (every row again: at least once, said), with the
    command that writes the document again at the history's last position instead.

    Returns None: the reader asks once a process.
    """
    history = getattr(trigger, "history", None)
    try:
        last = history.tail(trigger.name, 20) if history is not None else []
    except StoreError:  # the history cannot say now: the poller starts as a new one
        return
    if not last:
        return
    spec = trigger.operator_spec() or "MODULE:ATTR"
    record = last[-1]
    trigger.telemetry.emit(
        "state_missing",
        "%s: the poller has no state document, but its history holds records (the last, "
        "#%s, %s at %s): the document was deleted or lost. The poller starts over from "
        "the beginning and delivers every row again (none is lost). To go on from the "
        "position the history recorded last instead, stop the workers and write the "
        "document again: %s (or put a backup back: dbtrigger reset %s --from-file FILE "
        "--source %s --reason TEXT --yes); dbtrigger history %s --source %s shows the records",
        trigger.name,
        record.get("seq"),
        record.get("operation") or record.get("type"),
        record.get("at"),
        recreate_command(trigger.name, last, spec),
        trigger.name,
        spec,
        trigger.name,
        spec,
        seq=record.get("seq"),
    )


def last_recorded_position(records: Sequence[Mapping[str, Any]]) -> Any:
    """The last position ``records`` hold (a commit's ``to``, an operator's ``after``;
    None: none, the beginning)."""
    return next(
        (r.get("to") or r.get("after") for r in reversed(records) if r.get("to") or r.get("after")),
        None,
    )


def recreate_command(poller: str, records: Sequence[Mapping[str, Any]], spec: str) -> str:
    """The ``dbtrigger reset`` that writes ``poller``'s document again at the last
    position ``records`` hold (it reads the source definition from ``spec``)."""
    where = last_recorded_position(records)
    return _reset_command(poller, where).replace(
        " --reason TEXT",
        f" --source {shlex.quote(spec)} --reason 'state document lost' --yes",
    )


def _definition(source: Any) -> Mapping[str, Any] | None:
    from dbtrigger.sources.base import source_definition  # noqa: PLC0415 - sources import late

    return source_definition(source)


# --- rewind --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rewind:
    """Where a rewind goes and which recorded batches it delivers again."""

    position: Position | None
    batches: list[dict[str, Any]]
    why: str


def _commits(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [dict(r) for r in records if r.get("type") in ("commit", "partial_commit")]


def plan_rewind(
    records: Sequence[Mapping[str, Any]],
    *,
    to_time: dt.datetime | None = None,
    to_batch: str | None = None,
    poller: str = "POLLER",
) -> Rewind:
    """The position before the first batch to deliver again, from the history.

    Raises:
        ReplayRefusedError: the history cannot say (the time is before what it
            keeps, a gap lies in between, the batch is not recorded).
    """
    commits = _commits(records)
    if to_batch is not None:
        from dbtrigger.history.view import find_batch  # noqa: PLC0415

        target = find_batch(records, to_batch)
        after = commits[commits.index(target) :]
        why = f"back to where batch {to_batch} began"
    else:
        assert to_time is not None  # noqa: S101 - one of the two is given
        after = [c for c in commits if (rec.record_time(c) or to_time) > to_time]
        if not after:
            raise ReplayRefusedError(
                f"nothing was committed after {format_time(to_time)}; there is nothing to rewind"
            )
        target = after[0]
        held = [r for r in records if r.get("seq")]
        first_held = held[0] if held else None
        if first_held is not None and target is commits[0] and int(first_held.get("seq") or 0) > 1:
            raise ReplayRefusedError(
                f"the history starts at {first_held.get('at')} (older records were pruned by "
                f"retention), after {format_time(to_time)}: what was committed between them "
                "cannot be known. Rewind --to-batch a recorded batch, or reset --to-cursor"
            )
        why = f"back to before the first batch committed after {format_time(to_time)}"
    ids = [r.get("id") for r in records]
    low = ids.index(target.get("id"))
    if to_time is not None:
        settled = [i for i, r in enumerate(records) if (rec.record_time(r) or to_time) <= to_time]
        low = settled[-1] + 1 if settled else 0
    gaps = [r for r in records[low:] if r.get("type") == rec.GAP]
    if gaps:
        why = (
            str(gaps[0].get("note"))
            if gaps[0].get("missing")
            else "it could not be written for a while"
        )
        raise ReplayRefusedError(
            f"the history has a gap after that point ({why}): batches committed then are not "
            "recorded, so a rewind could not name them all. To go back there all the same, "
            f"reset the checkpoint to where batch {target.get('batch_id')} began: "
            f"{_reset_command(poller, target.get('from'))}"
        )
    raw = target.get("from")
    position = position_from_json(raw, "from") if raw else None
    if position is not None and position.is_beginning:
        position = None
    return Rewind(position, after, why)


def _reset_command(poller: str, where: Any) -> str:
    """The ``dbtrigger reset`` that moves ``poller`` to ``where`` (a record's position)."""
    tiebreaker = where.get("tiebreaker") if isinstance(where, Mapping) else None
    if not isinstance(where, Mapping) or (where.get("value") is None and not tiebreaker):
        to = "--to-beginning"
    else:
        keys = "".join(f" --pk {shlex.quote(f'{k}={v}')}" for k, v in (tiebreaker or {}).items())
        to = f"--to-cursor {shlex.quote(str(where.get('value')))}{keys}"
    return f"dbtrigger reset {shlex.quote(poller)} {to} --reason TEXT"


# --- bookmarks -------------------------------------------------------------------------------


def bookmarks_of(doc: StateDocument) -> dict[str, dict[str, Any]]:
    raw = doc.extra.get("bookmarks")
    if not isinstance(raw, Mapping):
        return {}
    return {str(k): dict(v) for k, v in raw.items() if isinstance(v, Mapping)}


def with_bookmark(
    doc: StateDocument,
    label: str,
    *,
    now: dt.datetime,
    actor: str,
    reason: str,
) -> StateDocument:
    """``doc`` with its current checkpoint bookmarked as ``label`` (journaled).

    Raises:
        ConfigurationError: the label is taken, or there are too many.
    """
    validate_name(label, "bookmark name")
    marks = bookmarks_of(doc)
    if label in marks:
        raise ConfigurationError(
            f"bookmark {label!r} exists already (at {marks[label].get('at')}); pick another name"
        )
    if len(marks) >= MAX_BOOKMARKS:
        raise ConfigurationError(
            f"poller {doc.poller_name!r} keeps {MAX_BOOKMARKS} bookmarks already; "
            "remove one (dbtrigger bookmark delete) first"
        )
    position = doc.position if doc.checkpoint is not None else None
    marks[label] = {
        "position": ops.position_json(position),
        "batch_id": doc.checkpoint.last_successful_batch_id if doc.checkpoint else None,
        "at": format_time(now),
        "actor": actor,
        "reason": reason,
    }
    return _with_bookmarks(doc, marks, "bookmark", label, now=now, actor=actor, reason=reason)


def without_bookmark(
    doc: StateDocument, label: str, *, now: dt.datetime, actor: str, reason: str
) -> StateDocument:
    marks = bookmarks_of(doc)
    bookmark_position(doc, label)
    del marks[label]
    return _with_bookmarks(
        doc, marks, "bookmark_delete", label, now=now, actor=actor, reason=reason
    )


def _with_bookmarks(
    doc: StateDocument,
    marks: dict[str, dict[str, Any]],
    operation: str,
    label: str,
    *,
    now: dt.datetime,
    actor: str,
    reason: str,
) -> StateDocument:
    """``doc`` keeping ``marks``, the change journaled as ``operation`` on ``label``:
    a bookmark moves no checkpoint, so the entry's before and after are both the
    current position."""
    position = doc.position if doc.checkpoint is not None else None
    entry = ops.manual_entry(
        operation,
        actor=actor,
        reason=reason,
        now=now,
        before=position,
        after=position,
        details={"bookmark": label},
    )
    return replace(doc, extra={**doc.extra, "bookmarks": marks}).with_journal_entry(
        entry, ops.JOURNAL_LIMIT
    )


def bookmark_position(doc: StateDocument, label: str) -> Position | None:
    """The position bookmark ``label`` names (None: the beginning).

    Raises:
        ConfigurationError: no such bookmark, naming those there are.
    """
    marks = bookmarks_of(doc)
    if label not in marks:
        known = ", ".join(sorted(marks)) or "none"
        raise ConfigurationError(
            f"poller {doc.poller_name!r} has no bookmark {label!r} (it has: {known})"
        )
    raw = marks[label].get("position")
    return position_from_json(raw, f"bookmarks.{label}.position") if raw else None


def update_with_retry(
    read: Callable[[], tuple[StateDocument, str]],
    write: Callable[[StateDocument, str], None],
    change: Callable[[StateDocument], StateDocument],
    *,
    rounds: int = 5,
) -> StateDocument:
    """Apply ``change`` by CAS, again on a conflict (a poller committing meanwhile)."""
    for _ in range(rounds):
        doc, etag = read()
        new = change(doc)
        try:
            write(new, etag)
        except CasConflictError:
            continue
        return new
    raise CasConflictError("the state document kept changing; run the command again")


__all__ = [
    "BEGINNING",
    "MAX_BOOKMARKS",
    "NOW",
    "Rewind",
    "StartFrom",
    "bookmark_position",
    "bookmarks_of",
    "check_start",
    "last_recorded_position",
    "plan_rewind",
    "recreate_command",
    "resolve",
    "spec_of",
    "update_with_retry",
    "warn_if_recorded",
    "with_bookmark",
    "without_bookmark",
]
