"""``dbtrigger history``: what a poller committed and what was done to it, for as long
as its history keeps it.

Reads the durable history beside the state document (:mod:`dbtrigger.history`)
and the document's journal (entries not appended yet show as ``pending``). By
default the last 20 records; ``--all``, ``--since`` and ``--batch`` choose
others. A commit shows its per-event outcomes; ``--batch`` shows one batch in
full (digests, every event, the retries waiting after it). Retries waiting
now (count, oldest due time, owed subscribers) close the listing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
from collections.abc import Mapping
from typing import Any, Literal

from dbtrigger._argparse import add_json_option
from dbtrigger._paste import pasteable
from dbtrigger.cli.common import (
    Console,
    add_poller_argument,
    add_store_options,
    load_source,
    parse_value,
    read_state,
    show_position,
    source_from_args,
    state_store,
    text_table,
)
from dbtrigger.errors import ConfigurationError, CorruptStateError
from dbtrigger.history import view
from dbtrigger.history.derive import history_for
from dbtrigger.history.records import detail_lines, waiting_of
from dbtrigger.history.store import HistoryStore
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore

#: Records shown without --all / --limit.
DEFAULT_SHOWN = 20


def history_of(args: argparse.Namespace, store: CheckpointStore) -> HistoryStore | None:
    """The history the command reads: the ``--source`` trigger's own (it may have been
    given one), unless an explicit ``--store`` says where; else the one beside the store."""
    loaded = source_from_args(args) if not getattr(args, "store", None) else None
    trigger = loaded.trigger if loaded is not None else None
    if trigger is not None and trigger.store is store:
        return trigger.history
    return history_for(store)


def history_to_record(
    store: CheckpointStore, poller: str, trigger: Any
) -> tuple[HistoryStore | Literal[False], str | None]:
    """Where an operator's write to ``poller``'s document in ``store`` is recorded, and
    a note for the command to print when it is recorded in none.

    ``trigger`` (the PollTrigger the command was given, or None) decides when
    ``store`` is its own: its own history, or none with ``history=False``. Without
    it the command cannot know where the poller keeps its history: the one beside
    the store is used only when it already holds records of ``poller`` (the
    default's); otherwise none is started there (the poller's next commit records
    the journaled entry in its own history), and the note says so."""
    if trigger is not None and getattr(trigger, "store", None) is store:
        own = getattr(trigger, "history", None)
        return (own if own is not None else False), None
    beside = history_for(store)
    if beside is None:
        return False, None
    try:
        kept = bool(beside.tail(poller, 1))
    except Exception:  # noqa: BLE001 - unreadable: not started here either, and said
        kept = False
    if kept:
        return beside, None
    return False, (
        f"note: not recorded in a history: {beside.describe()} holds none of {poller!r} "
        "and no trigger was named to say where it keeps one; the journal holds the entry, "
        "and the poller's next commit records it in its own history (name the trigger "
        "with --trigger MODULE:TRIGGER to record it now)"
    )


def named_trigger(args: argparse.Namespace) -> Any:
    """The PollTrigger the command names (``--source``/``--trigger``, or the
    ``--accept-source`` of a reset), or None."""
    loaded = source_from_args(args)
    if (loaded is None or loaded.trigger is None) and getattr(args, "accept_source", None):
        loaded = load_source(args.accept_source)
    return loaded.trigger if loaded is not None else None


def outcomes_text(record: Mapping[str, Any]) -> str:
    """``10 accepted`` or ``8 accepted, 1 rejected, 1 retried; billing 9/1/0``."""
    outcomes = record.get("outcomes")
    rows = record.get("rows")
    if not isinstance(outcomes, Mapping):
        return f"{rows} accepted" if rows else ""
    parts = [f"{outcomes.get('accepted', 0)} accepted"]
    if outcomes.get("rejected"):
        parts.append(f"{outcomes['rejected']} rejected")
    if outcomes.get("failed"):
        parts.append(f"{outcomes['failed']} retried")
    text = ", ".join(parts)
    subscribers = outcomes.get("subscribers")
    if isinstance(subscribers, Mapping) and subscribers:
        text += "; " + ", ".join(
            f"{name} {c.get('accepted', 0)}/{c.get('rejected', 0)}/{c.get('failed', 0)}"
            for name, c in subscribers.items()
            if isinstance(c, Mapping)
        )
    return text


def waiting_text(waiting: Mapping[str, Any] | None) -> str:
    if not waiting:
        return "none"
    text = f"{waiting['count']} event(s), the oldest due {waiting.get('oldest_due') or '?'}"
    owed = waiting.get("owed")
    if owed:
        text += "; owed to " + ", ".join(f"{name} ({n})" for name, n in owed.items())
    return text


def _moved(record: Mapping[str, Any], seq: str, kind: str, keys: tuple[str, ...]) -> list[str]:
    """The columns every kind of record fills: record number, when, kind, which batch
    or operation, and the checkpoint it moved from and to (``keys`` name the fields
    holding the when, the which, the from and the to)."""
    when, which, before, after = keys
    return [
        seq,
        str(record.get(when, "")),
        kind,
        str(record.get(which, "")),
        show_position(record.get(before)),
        show_position(record.get(after)),
    ]


def _row(record: Mapping[str, Any]) -> list[str]:
    seq = "-" if record.get("pending") else str(record.get("seq", ""))
    kind = str(record.get("type", ""))
    if kind in ("commit", "partial_commit"):
        note = []
        if record.get("duration_ms") is not None:
            note.append(f"{record['duration_ms']} ms")
        outcome = outcomes_text(record)
        if outcome:
            note.append(outcome)
        if record.get("quarantined"):
            note.append(f"{record['quarantined']} quarantined")
        if record.get("recovered") or (record.get("detail") is None and not record.get("pending")):
            note.append("no event detail (recorded from the journal)")
        return [
            *_moved(record, seq, kind, ("committed_at", "batch_id", "from", "to")),
            str(record.get("rows", "")),
            str(record.get("owner_id", "")),
            str(record.get("fencing_token", "")),
            "; ".join(note),
        ]
    if kind == "gap":
        return [
            seq,
            str(record.get("at", "")),
            "gap",
            "-",
            "",
            "",
            "",
            "",
            "",
            str(record.get("note")),
        ]
    fenced = record.get("fenced") or {}
    count = record.get("skipped_rows", record.get("events", ""))
    return [
        *_moved(record, seq, kind, ("at", "operation", "before", "after")),
        str(count if not isinstance(count, list) else len(count)),
        str(record.get("actor", "")),
        str(fenced.get("new_fencing_token", "")) if isinstance(fenced, Mapping) else "",
        f"reason: {record.get('reason', '')}",
    ]


def _batch_text(record: Mapping[str, Any]) -> str:
    detail = record.get("detail") if isinstance(record.get("detail"), Mapping) else None
    lines = [
        f"batch        {record.get('batch_id')} (record {record.get('seq') or 'pending'})",
        f"committed    {record.get('committed_at')} by {record.get('owner_id')} "
        f"(token {record.get('fencing_token')})",
        f"from         {show_position(record.get('from'))}",
        f"to           {show_position(record.get('to'))}",
        f"rows         {record.get('rows')} ({outcomes_text(record) or 'no outcomes'})",
    ]
    if detail is None:
        lines.append("detail       none (recorded from the journal, or by an older dbtrigger)")
        return "\n".join(lines)
    if "event_ids" in detail:  # the first format
        lines.append(f"event ids    {detail.get('event_ids')}")
        lines.append(f"images       {detail.get('images')}")
    lines.append(f"waiting      {waiting_text(detail.get('waiting'))} (after this commit)")
    events = detail_lines(record)
    if events is not None:
        ids = any(e.event_id for e in events)
        rows = [["EVENT ID", "KEY", "IMAGE", "OUTCOME"] if ids else ["KEY", "IMAGE", "OUTCOME"]]
        for e in events:
            values = {k: v[1] if isinstance(v, list) else v for k, v in e.key.items()}
            pk = ", ".join(f"{k}={v}" for k, v in values.items())
            if values and all(v is None for v in values.values()):
                pk = "(truncate)"  # a change log's truncate: no key, every row
            outcome = e.outcome + (f" ({e.reason})" if e.reason else "")
            rows.append([e.event_id or "", pk, e.image, outcome] if ids else [pk, e.image, outcome])
        lines += ["", text_table(rows)]
    elif detail.get("events_omitted"):
        lines.append(
            f"events       {detail['events_omitted']} (lines not kept: the batch was too large)"
        )
    return "\n".join(lines)


def _since(text: str) -> dt.datetime:
    value = parse_value(text, "timestamp")
    assert isinstance(value, dt.datetime)  # noqa: S101 - parse_value of a timestamp
    return value


def resume_command(
    args: argparse.Namespace, records: list[dict[str, Any]], *, missing: bool = False
) -> str:
    """What replaces an unreadable state document (``missing``: writes a deleted one
    again) without delivering a row twice: a ``reset --to-cursor`` after the last
    position the history recorded (a commit's ``to``, an operator's ``after``), or
    ``--to-beginning`` when it recorded none."""
    spec = getattr(args, "source", None) or "MODULE:ATTR"
    last = next(
        (r.get("to") or r.get("after") for r in reversed(records) if r.get("to") or r.get("after")),
        None,
    )
    tiebreaker = (last or {}).get("tiebreaker") or {}
    if not last or (last.get("value") is None and not tiebreaker):
        where, said = "--to-beginning", "no position recorded: every row is delivered again"
    else:
        keys = " ".join(f"--pk {shlex.quote(f'{k}={v}')}" for k, v in tiebreaker.items())
        where = f"--to-cursor {shlex.quote(str(last.get('value')))} {keys}".rstrip()
        said = f"after {show_position(last)}, the last position recorded"
    then = (
        "--reason 'state document lost'"
        if missing
        else "--force --reason 'state document unreadable'"
    )
    command = pasteable(
        f"dbtrigger reset {shlex.quote(args.poller)} {where} --source {shlex.quote(spec)} "
        f"{then} --yes"
    )
    state = (
        "MISSING (deleted or lost: the poller's next tick starts over from the beginning, "
        "delivering every row again; stop the workers before writing it again)"
        if missing
        else "UNREADABLE (nothing was changed; see dbtrigger status)"
    )
    return (
        f"state        {state}: the records above are what the history holds\n"
        f"resume       {said}:\n  {command}"
    )


def cmd_history(args: argparse.Namespace) -> int:
    console = Console()
    unreadable: CorruptStateError | None = None
    with state_store(args) as store:
        history = history_of(args, store)
        missing = False
        try:
            doc: StateDocument | None = read_state(store, args.poller)[0]
        except CorruptStateError as exc:  # the history is what tells where it stood
            doc, unreadable = None, exc
        except ConfigurationError:  # no document: deleted or lost, if the history has records
            if store.read(args.poller) is not None or history is None:
                raise
            if not history.tail(args.poller, 1):
                raise
            doc, missing = None, True
        earlier = 0
        if args.batch or args.all or args.since:
            records = view.load(history, args.poller, doc)
        else:  # the last N: only the newest records are read
            records, earlier = view.load_last(
                history, args.poller, doc, args.limit or DEFAULT_SHOWN
            )
    if args.batch:
        record = view.find_batch(records, args.batch)
        if args.json:
            console.json(record)
        else:
            console.print(_batch_text(record))
        return 0
    if args.since:
        records = view.since(records, _since(args.since))
    limit = args.limit if args.limit else (0 if args.all or args.since else DEFAULT_SHOWN)
    shown = records[-limit:] if limit else records
    if args.json:
        console.json(shown)
        return 0
    where = history.describe() if history is not None else "no history store (journal only)"
    if not shown:
        console.print(f"poller {args.poller!r} has no history entries yet ({where})")
    else:
        header = [
            "#",
            "AT",
            "TYPE",
            "BATCH / OPERATION",
            "FROM",
            "TO",
            "ROWS",
            "BY",
            "TOKEN",
            "NOTE",
        ]
        console.print(text_table([header, *(_row(r) for r in shown)]))
        if len(shown) < len(records) or earlier:
            count = len(records) - len(shown) + earlier
            console.print(f"({count} earlier record(s): --all, --since T)")
        console.print(f"kept in {where}")
    if doc is None or unreadable is not None:
        console.print(resume_command(args, records, missing=missing))
        console.warn(f"error: {unreadable or f'poller {args.poller!r} has no state document'}")
        return 2
    console.print(f"waiting now: {waiting_text(waiting_of(doc.window))}")
    return 0


def add_history_command(sub: Any) -> None:
    history = sub.add_parser(
        "history", help="a poller's commits and manual changes, from its durable history"
    )
    add_poller_argument(history)
    history.add_argument("--all", action="store_true", help="every record the history keeps")
    history.add_argument("--since", metavar="TIME", help="records at or after TIME (ISO-8601, Z)")
    history.add_argument("--batch", metavar="BATCH_ID", help="one batch in full: digests, events")
    history.add_argument(
        "--limit", type=int, default=0, help=f"the last N records (default {DEFAULT_SHOWN})"
    )
    add_json_option(history)
    add_store_options(history)
    history.set_defaults(func=cmd_history)


__all__ = ["add_history_command", "cmd_history", "history_of", "outcomes_text", "waiting_text"]
