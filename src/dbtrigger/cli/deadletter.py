"""``dbtrigger dead-letter list|show|replay|discard``: what a poller set aside, re-driven.

The records are read from the poller's dead-letter sink (the ``--trigger``'s
``quarantine=``, or ``--sink``: a JSON-lines file or a SQL URL); what is done
with them is marked beside the sink (:mod:`dbtrigger.replay.dead_letters`),
and journaled in the poller's state document and history. A claim queue
(``--trigger`` naming a ``QueueTrigger``) answers the same verbs with its
dead rows: ``replay`` makes them ready again, ``discard`` settles them done.
A partitioned poller's partitions each dead-letter under their own name
(``orders.p000-064``): given the group's name, the verbs act on every
partition's records (each named), given one partition's name on its own.

Guardrails as for the state commands: ``replay`` and ``discard`` are dry runs
until ``--yes`` and need ``--reason``; nothing is deleted unless ``--delete``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Sequence
from typing import Any

from dbtrigger.cli.common import (
    Console,
    actor_from_args,
    add_change_options,
    add_store_options,
    parse_value,
    reason_from_args,
    state_store,
    text_table,
    utc_now,
)
from dbtrigger.cli.history import history_to_record
from dbtrigger.cli.loading import (
    as_partition,
    as_trigger,
    load_object,
    load_trigger,
    partitioned_of,
)
from dbtrigger.errors import ConfigurationError
from dbtrigger.partitions.balancing import partition_of
from dbtrigger.quarantine import JsonLinesQuarantineSink, SqlQuarantineSink
from dbtrigger.queue.cli import claim_source_of
from dbtrigger.replay import dead_letters as dl
from dbtrigger.replay.batches import ReplayLease, journal_live
from dbtrigger.runtime.poller import PollTrigger, default_owner_id
from dbtrigger.runtime.subscriber_options import renames_of
from dbtrigger.state.document import format_time
from dbtrigger.state.stores.base import CheckpointStore

#: Event ids journaled per entry at most (the count is always there).
_JOURNALED_IDS = 50


def _sink(args: argparse.Namespace, trigger: Any) -> Any:
    if args.sink:
        spec = args.sink
        if spec.startswith("file:"):
            return JsonLinesQuarantineSink(spec[len("file:") :])
        if "://" in spec:
            return SqlQuarantineSink(
                url=spec, table=args.sink_table, schema=args.sink_schema, create_table=False
            )
        return JsonLinesQuarantineSink(spec)
    group = partitioned_of(trigger)
    if group is not None:  # every partition's trigger gets the group's quarantine=
        if group.options.get("quarantine") is None:
            raise ConfigurationError(
                f"partitioned poller {group.name!r} has no dead-letter sink (quarantine=): "
                "nothing was set aside"
            )
        return group.options["quarantine"]
    if trigger is not None and isinstance(trigger, PollTrigger):
        if trigger.quarantine is None:
            raise ConfigurationError(
                f"poller {trigger.name!r} has no dead-letter sink (quarantine=): nothing was "
                "set aside"
            )
        return trigger.quarantine
    raise ConfigurationError("name the poller's trigger (--trigger MODULE:ATTR) or its --sink")


def _since(args: argparse.Namespace) -> dt.datetime | None:
    if not args.since:
        return None
    value = parse_value(args.since, "timestamp")
    assert isinstance(value, dt.datetime)  # noqa: S101 - parse_value of a timestamp
    return value


def _trigger(args: argparse.Namespace, *, handler: bool = False) -> Any:
    """The ``--trigger``: a LoadedTrigger (with its handler for a replay), a
    QueueTrigger, or None."""
    if not args.source:
        return None
    if handler:
        return load_trigger(args.source, args.handler)
    target = load_object(args.source)
    loaded = as_trigger(target, args.source)
    if loaded is None:
        raise ConfigurationError(f"{args.source} is not a PollTrigger, a @db.trigger or a queue")
    return loaded


def _journal(
    args: argparse.Namespace,
    store: CheckpointStore | None,
    trigger: PollTrigger | None,
    operation: str,
    event_ids: Sequence[str],
    details: dict[str, Any],
    console: Console,
) -> dict[str, Any] | None:
    """Journal the operation in the poller's document and its own history (``trigger``'s,
    the ``--trigger`` or its partition's; see
    :func:`~dbtrigger.cli.history.history_to_record`); the entry written."""
    poller = args.poller
    if store is None:
        console.warn(
            "note: not journaled (no state store: give --trigger or --store to journal it)"
        )
        return None
    from dbtrigger.replay.batches import current_position, manual_entry  # noqa: PLC0415

    entry = manual_entry(
        operation,
        doc_position=current_position(store, poller),
        actor=actor_from_args(args),
        reason=args.reason,
        now=utc_now(),
        details={
            "events": len(event_ids),
            "event_ids": list(event_ids[:_JOURNALED_IDS]),
            **details,
        },
    )
    history, note = history_to_record(store, poller, trigger)
    if note is not None:
        console.warn(note)
    problem = journal_live(store, poller, entry, history)
    if problem:
        console.warn(f"warning: {problem}")
    return entry


def _row(letter: dl.DeadLetter) -> list[str]:
    record = letter.record
    pk = ", ".join(f"{k}={dl.decode_json_value(v)}" for k, v in record.pk.items())
    if dl.event_of(record).op == "truncate":
        pk = "(truncate)"  # no key: every row of the table
    return [
        record.event_id[:16],
        pk,
        format_time(record.quarantined_at),
        str(record.attempts),
        letter.state,
        record.error[:60],
    ]


def cmd_dead_letter(args: argparse.Namespace) -> int:
    if args.source:
        named = load_object(args.source)
        queue = claim_source_of(named)
        if queue is not None and type(named).__name__ != "SidecarFeeder":
            return _queue(args, queue)  # a claim queue's dead rows
    target = _trigger(args, handler=args.verb == "replay")
    trigger = getattr(target, "trigger", target)
    group = partitioned_of(trigger)
    if args.verb == "replay" and not isinstance(trigger, PollTrigger) and group is None:
        raise ConfigurationError("dead-letter replay needs --trigger MODULE:ATTR: its handler runs")
    sink = _sink(args, trigger)
    if args.store:
        with state_store(args) as store:
            return _sinked(args, target, sink, store, group)
    own = trigger.store if isinstance(trigger, PollTrigger) else None
    if group is not None:  # its partitions' documents are in the group's store
        own = group.store
    return _sinked(args, target, sink, own, group)


def _partition_pollers(args: argparse.Namespace, group: Any, sink: Any) -> list[str]:
    """The pollers whose dead letters ``args.poller`` names for the partitioned poller
    ``group``: one partition's, or, given the group's name, every partition's that has
    records in the sink (those of an earlier layout too, before a split or merge)."""
    if partition_of(group.name, args.poller) is not None:
        return [args.poller]
    if args.poller != group.name:
        raise ConfigurationError(
            f"{args.poller!r} is not the partitioned poller {group.name!r} the trigger names, "
            f"nor one of its partitions: give {group.name!r} for the dead letters of every "
            f"partition, or one partition's poller name ({group.name}.p000-064 ...; `dbtrigger "
            "partitions show --trigger MODULE:ATTR` lists them)"
        )
    return sorted({r.poller for r in sink.records(None) if partition_of(group.name, r.poller)})


def _sinked(
    args: argparse.Namespace,
    target: Any,
    sink: Any,
    store: CheckpointStore | None,
    group: Any = None,
) -> int:
    """The verb on the dead letters of ``args.poller``, or, for a partitioned poller
    (``group``), of each partition it names: listed together, each record with its
    partition; replayed and discarded partition by partition, each under its own
    replay lease and journaled in its own state document."""
    console = Console()
    ids = list(args.id or [])
    if args.verb == "show" and not ids:
        raise ConfigurationError("show needs --id EVENT_ID (the first 8+ characters will do)")
    again = args.verb == "replay" and args.again
    pollers = [args.poller] if group is None else _partition_pollers(args, group, sink)
    found: dict[str, list[dl.DeadLetter]] = {}
    trigger = getattr(target, "trigger", target)
    known = getattr(trigger, "subscribers", None) or (
        group.subscribers if group is not None else None
    )
    if args.verb == "replay" and args.subscriber and args.subscriber not in (known or {}):
        raise ConfigurationError(
            f"{args.poller!r} has no subscriber {args.subscriber!r} to replay to"
            + (f" (it has {', '.join(known)})" if known else "")
        )
    for poller in pollers:
        letters = dl.dead_letters(
            sink,
            poller,
            ids=ids,
            since=_since(args),
            include_settled=getattr(args, "all", False) or args.verb == "show" or again,
            known=list(known or ()),
            subscriber=getattr(args, "subscriber", None),
            renames=renames_of(known),
        )
        if again and not ids:  # --again brings back the replayed ones, not the discarded
            letters = [letter for letter in letters if letter.state != "discarded"]
        if letters:
            found[poller] = letters
    letters = [letter for each in found.values() for letter in each]
    if args.verb == "list":
        if args.json:
            console.json([letter.to_json() for letter in letters])
        elif not letters:
            console.print(f"no dead letters of {args.poller!r} in {sink.describe()} to show")
        else:
            heading = ["EVENT", "KEY", "DEAD SINCE", "ATTEMPTS", "STATE", "ERROR"]
            fan = any(letter.owed for letter in letters)  # SUBSCRIBERS: those still to take it
            rows = [
                ([letter.record.poller] if group is not None else [])
                + _row(letter)[:-1]
                + ([", ".join(letter.waiting_for()) or "-"] if fan else [])
                + _row(letter)[-1:]
                for letter in letters
            ]
            heading = heading[:-1] + (["SUBSCRIBERS"] if fan else []) + heading[-1:]
            console.print(text_table([(["POLLER"] if group is not None else []) + heading, *rows]))
        return 0
    if args.verb == "show":
        shown = [
            {
                **letter.record.to_json(),
                "state": letter.state,
                "marks": [m.to_json() for m in letter.marks],
            }
            for letter in letters
        ]
        console.print(json.dumps(shown, indent=2, default=str))
        return 0
    if not letters:
        console.print(f"no dead letters of {args.poller!r} match; nothing to do")
        return 0
    args.reason = reason_from_args(args)  # required with --yes only
    code = 0
    for poller, each in found.items():
        one = args if group is None else argparse.Namespace(**{**vars(args), "poller": poller})
        loaded = target if group is None else as_partition(target, poller, "dead-letter replay")
        if args.verb == "replay":
            code = max(code, _replay(one, loaded, sink, store, each, console))
        else:
            trigger = getattr(loaded, "trigger", None)
            own = trigger if isinstance(trigger, PollTrigger) else None
            code = max(code, _discard(one, sink, store, each, console, own))
    return code


def _replay(
    args: argparse.Namespace,
    loaded: Any,
    sink: Any,
    store: CheckpointStore | None,
    letters: list[dl.DeadLetter],
    console: Console,
) -> int:
    trigger: PollTrigger = loaded.trigger
    sub = args.subscriber
    already = [
        letter
        for letter in letters
        if (letter.settled_for(sub) if sub else letter.state == dl.SETTLED)
        and letter.state != "discarded"
    ]
    if already and not args.again:
        console.print(
            f"{len(already)} of them were replayed already (settled); add --again to replay "
            "them once more"
        )
        letters = [letter for letter in letters if letter not in already]
        if not letters:
            return 0
    if args.subscriber:  # (checked by _sinked: one of its subscribers)
        handler = (trigger.subscribers or {})[args.subscriber]
    elif loaded.handler is not None:
        handler = loaded.handler
    else:
        named = dl.blamed(letters, trigger.subscribers or {})
        said = ", ".join(f"--subscriber {name} for {n}" for name, n in named.items())
        said = f"; by their errors, of these {len(letters)} dead letter(s): {said}" if said else ""
        raise ConfigurationError(
            f"{trigger.name!r} fans out: replay to one subscriber (--subscriber NAME), the one "
            "that rejected the event" + said
        )
    heading = f"replay {len(letters)} dead letter(s) of {args.poller!r} from {sink.describe()}"
    if not _listed(args, console, heading, letters, "no handler ran and nothing was marked"):
        return 0
    # Under the replay lease of the poller ({poller}.replay, as dbtrigger replay holds):
    # two operators replaying the same dead letters never both hand them over, and
    # what another replay settled while this one waited is left alone.
    now = utc_now()
    owner = f"dead-letter:{default_owner_id()}"
    lease = ReplayLease.take(store, trigger, owner, now) if store is not None else None
    entry: dict[str, Any] | None = None
    try:
        if not args.again:
            letters = _still_unsettled(sink, args.poller, letters, console, trigger, sub)
            if not letters:
                return 0
        outcomes = [
            dl.replay_one(
                letter,
                handler,
                subscriber=args.subscriber,
                token=lease.token if lease is not None else 0,
                owner=owner,
                now=now,
            )
            for letter in letters
        ]
        actor = actor_from_args(args)
        marks = dl.marks_for(sink)
        marks.add(
            [
                dl.Mark(
                    args.poller,
                    o.event_id,
                    dl.ACTION_OF[o.result],
                    utc_now(),
                    actor,
                    args.reason,
                    o.detail,
                    # Fan-out: this subscriber took (or not) its share; the others' stays.
                    sub if sub and letter.owed else "",
                )
                for o, letter in zip(outcomes, letters, strict=True)
            ]
        )
        counts = {
            r: sum(1 for o in outcomes if o.result == r) for r in ("settled", "rejected", "failed")
        }
        for result, count in counts.items():
            if count:
                trigger.telemetry.emit(
                    "dead_letter_replayed",
                    "replayed %d dead letter(s) of %s: %s",
                    count,
                    args.poller,
                    result,
                    result=result,
                    values={"count": count},
                )
        for line in dl.replay_report(outcomes, letters, sub, counts):
            console.print(line)
        entry = _journal(
            args,
            store,
            trigger,
            "dead_letter_replay",
            [o.event_id for o in outcomes],
            {"outcomes": counts, "sink": sink.describe()},
            console,
        )
    finally:
        if lease is not None:
            lease.release(entry, utc_now())
    return 0 if not counts["failed"] and not counts["rejected"] else 1


def _still_unsettled(
    sink: Any,
    poller: str,
    letters: list[dl.DeadLetter],
    console: Console,
    trigger: PollTrigger,
    subscriber: str | None,
) -> list[dl.DeadLetter]:
    """``letters`` as their marks say now (read under the lease): those another
    replay settled (for ``subscriber``) since they were listed are left out, and
    said so."""
    fresh = {
        letter.record.event_id: letter
        for letter in dl.dead_letters(
            sink,
            poller,
            ids=[x.record.event_id for x in letters],
            include_settled=True,
            known=list(trigger.subscribers or ()),
            renames=renames_of(trigger.subscribers),
        )
    }
    now = [fresh.get(x.record.event_id, x) for x in letters]
    settled = [
        x for x in now if (x.settled_for(subscriber) if subscriber else x.state == dl.SETTLED)
    ]
    if settled:
        console.print(
            f"{len(settled)} of them were settled meanwhile by another replay; left alone"
        )
    return [x for x in now if x not in settled]


def _listed(
    args: argparse.Namespace,
    console: Console,
    heading: str,
    letters: list[dl.DeadLetter],
    dry_run: str,
) -> bool:
    """Show what a replay or a discard would act on, one line a letter; False on a dry
    run (without --yes), whose last line says what it left undone."""
    console.print(heading)
    for letter in letters:
        console.print(f"  {letter.record.event_id}  {letter.state}  {letter.record.error[:80]}")
    if not args.yes:
        console.print(f"dry run: {dry_run}; add --yes")
    return bool(args.yes)


def _discard(
    args: argparse.Namespace,
    sink: Any,
    store: CheckpointStore | None,
    letters: list[dl.DeadLetter],
    console: Console,
    trigger: PollTrigger | None,
) -> int:
    what = "delete" if args.delete else "discard (kept, marked)"
    heading = f"{what} {len(letters)} dead letter(s) of {args.poller!r} in {sink.describe()}"
    if not _listed(args, console, heading, letters, "nothing was marked or deleted"):
        return 0
    ids = [letter.record.event_id for letter in letters]
    marks = dl.marks_for(sink)
    marks.add(
        [
            dl.Mark(args.poller, i, "discarded", utc_now(), actor_from_args(args), args.reason)
            for i in ids
        ]
    )
    deleted = marks.delete_records(args.poller, set(ids)) if args.delete else 0
    console.print(
        f"{len(ids)} discarded"
        + (f"; {deleted} record(s) deleted from the sink" if args.delete else "")
    )
    _journal(
        args,
        store,
        trigger,
        "dead_letter_discard",
        ids,
        {"deleted": bool(args.delete), "sink": sink.describe()},
        console,
    )
    return 0


def _queue(args: argparse.Namespace, queue: Any) -> int:
    """A claim queue's dead rows through the same verbs (``queue``: its ClaimSource)."""
    console = Console()
    source = queue
    rows = source.dead_rows()
    key_names = [c.name for c in source.target.key_columns]
    wanted = {str(i) for i in (args.id or [])}

    def key_text(row: dict[str, Any]) -> str:
        return ",".join(str(row[k]) for k in key_names)

    if wanted:
        rows = [r for r in rows if key_text(r) in wanted]
    if args.verb in ("list", "show"):
        if args.json or args.verb == "show":
            console.print(json.dumps(rows, indent=2, default=str))
        elif not rows:
            console.print(f"no dead rows in queue {source.name}")
        else:
            table = [["KEY", "ATTEMPTS", "DEAD SINCE", "ERROR"]]
            table += [
                [
                    key_text(r),
                    str(r.get("dbt_attempts")),
                    str(r.get("dbt_done_at")),
                    str(r.get("dbt_last_error"))[:60],
                ]
                for r in rows
            ]
            console.print(text_table(table))
        return 0
    keys = [tuple(r[k] for k in key_names) for r in rows]
    args.reason = reason_from_args(args)  # required with --yes only
    verb = (
        "make ready again"
        if args.verb == "replay"
        else ("delete" if args.delete else "settle as done")
    )
    console.print(f"{verb}: {len(keys)} dead row(s) of queue {source.name}")
    if not args.yes or not keys:
        console.print("dry run: nothing changed; add --yes" if not args.yes else "nothing to do")
        return 0
    note = f"{args.verb} by {actor_from_args(args)} ({args.reason}); before: "
    if args.verb == "replay":
        done = source.redrive_dead(note=note, keys=keys, dry_run=False)
        console.print(
            f"{done} dead row(s) are ready again (attempts reset); the workers deliver them"
        )
    else:
        done = source.discard_dead(keys, note=note, delete=args.delete)
        console.print(
            f"{done} dead row(s) " + ("deleted" if args.delete else "settled as done (kept)")
        )
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("poller", help="the poller (or queue) whose dead letters these are")
    parser.add_argument(
        "--id",
        action="append",
        metavar="EVENT_ID",
        help="an event id (8+ characters), or a queue row's key; repeat",
    )
    parser.add_argument("--since", metavar="TIME", help="dead-lettered at or after TIME")
    parser.add_argument("--sink", help="the sink: a JSON-lines file (file:PATH) or a SQL URL")
    parser.add_argument("--sink-table", default="dbtrigger_quarantine", help="SQL sink table")
    parser.add_argument("--sink-schema", help="SQL sink schema")
    add_store_options(parser, default_hint="the trigger's own store")


def add_dead_letter_commands(sub: Any) -> None:
    root = sub.add_parser("dead-letter", help="list, show, replay or discard dead-lettered events")
    verbs = root.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="dead letters not settled yet (--all: every one)")
    _common(listing)
    listing.add_argument("--all", action="store_true", help="replayed and discarded ones too")
    listing.add_argument("--json", action="store_true", help="print the records as JSON")
    listing.add_argument(
        "--subscriber", help="fan-out: only those this subscriber did not take (yet)"
    )
    show = verbs.add_parser("show", help="records in full, with what was done to them")
    _common(show)
    show.add_argument("--json", action="store_true", help="print the record as JSON")
    replay = verbs.add_parser(
        "replay", help="hand them to the handler again (dry run unless --yes)"
    )
    _common(replay)
    replay.add_argument(
        "--handler", metavar="MODULE:FUNCTION", help="another handler than the trigger's"
    )
    replay.add_argument(
        "--subscriber",
        help="fan-out: the one subscriber to replay to; only the dead letters it did not "
        "take, marked for it alone (the others' share stays dead until replayed to them)",
    )
    replay.add_argument("--again", action="store_true", help="also those replayed already")
    discard = verbs.add_parser("discard", help="let them go: marked, kept (dry run unless --yes)")
    _common(discard)
    discard.add_argument("--delete", action="store_true", help="delete the records from the sink")
    for parser in (replay, discard):
        add_change_options(parser, lease=False, reason_help="why: marked and journaled")
    for parser in (listing, show, replay, discard):
        parser.set_defaults(func=cmd_dead_letter)


__all__ = ["add_dead_letter_commands", "cmd_dead_letter"]
