"""``dbtrigger rewind`` and ``dbtrigger bookmark``: move a poller back, by the record.

``rewind --to-batch ID`` sets the checkpoint to where a recorded batch began;
``rewind --to-time T`` to before the first batch committed after ``T``: the
batches committed since are delivered again, exactly those. Both refuse what
the history cannot vouch for and, with ``--trigger``, what the source can no
longer serve (see :mod:`dbtrigger.history.positions`). Bookmarks name the
current checkpoint; ``bookmark restore`` moves back to one. Moves follow the
state commands' guardrails (dry run, ``--reason``, backup, fencing).
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from dbtrigger._argparse import add_json_option
from dbtrigger.cli.common import (
    Console,
    actor_from_args,
    add_change_options,
    add_poller_argument,
    add_store_options,
    by_hand,
    own_source,
    parse_value,
    read_state,
    show_position,
    source_from_args,
    state_store,
    utc_now,
)
from dbtrigger.cli.history import history_of
from dbtrigger.cli.plan import note_history
from dbtrigger.cli.state_change import _apply_change
from dbtrigger.errors import ConfigurationError, ReplayRefusedError
from dbtrigger.history import positions as pos
from dbtrigger.history import view
from dbtrigger.replay.batches import keeps_images, plan
from dbtrigger.sources.base import accepted_fingerprints
from dbtrigger.state import document as docmod
from dbtrigger.state import operations as ops
from dbtrigger.state.document import StateDocument


def _check_source(args: argparse.Namespace, doc: StateDocument, first: dict[str, Any]) -> str:
    """Refuse a rewind the source cannot serve; say what the replayed rows will be."""
    loaded = source_from_args(args)
    if loaded is None or (loaded.trigger is None and loaded.group is None):
        return "the source was not checked (name the trigger with --trigger to check it)"
    # A partitioned poller's partition: its own bucket range, which its fingerprint names.
    source = loaded.trigger.source if loaded.trigger is not None else own_source(args, loaded)
    if doc.source_fingerprint not in accepted_fingerprints(source):
        raise ConfigurationError(
            "the --trigger source differs from this poller's (fingerprint): name the trigger "
            "as the poller runs now; if the change is meant, the poller adopts it with "
            f"dbtrigger reset {args.poller} --accept-source {args.source} --reason TEXT"
        )
    if not keeps_images(source):
        return "a polled table: the rows are delivered again as they are now"
    trigger = loaded.trigger
    assert trigger is not None  # noqa: S101 - a partitioned poller polls a table
    replayed = plan(trigger, [first])
    refusals = replayed.refusals()
    if refusals:
        raise ReplayRefusedError("the source cannot serve this rewind: " + "; ".join(refusals))
    return "the log still holds the first batch to deliver again, as recorded"


def cmd_rewind(args: argparse.Namespace) -> int:
    if bool(args.to_time) == bool(args.to_batch):
        raise ConfigurationError("rewind needs one of --to-time TIME or --to-batch BATCH_ID")
    to_time: dt.datetime | None = None
    if args.to_time:
        value = parse_value(args.to_time, "timestamp")
        assert isinstance(value, dt.datetime)  # noqa: S101 - parse_value of a timestamp
        to_time = value
    with state_store(args) as store:
        doc, _, _ = read_state(store, args.poller)
        history = history_of(args, store)
        # The ranges only (a long history's details are most of its memory), and the
        # first batch's detail, which a log-based source's check compares.
        records = view.load(history, args.poller, doc, details=False)
        rewind = pos.plan_rewind(
            records, to_time=to_time, to_batch=args.to_batch, poller=args.poller
        )
        first = view.with_detail(history, args.poller, rewind.batches[0])
    note = _check_source(args, doc, first)
    console = Console()
    console.print(
        f"rewind {args.poller!r} {rewind.why}: {len(rewind.batches)} recorded batch(es) "
        f"({sum(int(b.get('rows') or 0) for b in rewind.batches)} rows) are delivered again, "
        f"from {rewind.batches[0].get('batch_id')} to {rewind.batches[-1].get('batch_id')}; "
        f"{note}"
    )

    def decide(current: StateDocument, now: dt.datetime, details: dict[str, Any]) -> StateDocument:
        details.update(
            {
                "to_time": args.to_time,
                "to_batch": args.to_batch,
                "batches": len(rewind.batches),
                "first_batch": rewind.batches[0].get("batch_id"),
            }
        )
        known = {k: v for k, v in details.items() if v is not None}
        return ops.rewind(current, position=rewind.position, **by_hand(args, now, known))

    return _apply_change(args, "rewind", decide)


# --- bookmarks -------------------------------------------------------------------------------


def cmd_bookmark(args: argparse.Namespace) -> int:
    console = Console()
    if args.verb == "restore":
        return _restore(args)
    with state_store(args) as store:
        if args.verb == "list":
            doc, _, _ = read_state(store, args.poller)
            marks = pos.bookmarks_of(doc)
            if args.json:
                console.json(marks)
            elif not marks:
                console.print(f"poller {args.poller!r} has no bookmarks")
            for label, mark in sorted(marks.items()):
                if not args.json:
                    console.print(
                        f"{label:<20} {show_position(mark.get('position'))}  at {mark.get('at')} "
                        f"by {mark.get('actor')}: {mark.get('reason')}"
                    )
            return 0
        if not args.reason:
            raise ConfigurationError(f"bookmark {args.verb} needs --reason")

        def read() -> tuple[StateDocument, str]:
            doc, etag, _ = read_state(store, args.poller)
            return doc, etag

        def write(doc: StateDocument, etag: str) -> None:
            store.write(args.poller, docmod.dumps(doc), if_match=etag)

        common = {"now": utc_now(), "actor": actor_from_args(args), "reason": args.reason}
        if args.verb == "create":
            written = pos.update_with_retry(
                read, write, lambda d: pos.with_bookmark(d, args.label, **common)
            )
            mark = pos.bookmarks_of(written)[args.label]
            console.print(
                f"bookmark {args.label!r} of {args.poller!r} at {show_position(mark['position'])}"
            )
        else:
            written = pos.update_with_retry(
                read, write, lambda d: pos.without_bookmark(d, args.label, **common)
            )
            console.print(f"bookmark {args.label!r} of {args.poller!r} deleted")
        note_history(console, store, written, args)
    return 0


def _restore(args: argparse.Namespace) -> int:
    def decide(doc: StateDocument, now: dt.datetime, details: dict[str, Any]) -> StateDocument:
        position = pos.bookmark_position(doc, args.label)
        details["bookmark"] = args.label
        return ops.rewind(
            doc, position=position, operation="bookmark_restore", **by_hand(args, now, details)
        )

    return _apply_change(args, "bookmark-restore", decide)


def add_position_commands(sub: Any) -> None:
    rewind = sub.add_parser(
        "rewind",
        help="deliver again what was committed after a time or batch (dry run unless --yes)",
    )
    add_poller_argument(rewind)
    rewind.add_argument(
        "--to-time", metavar="TIME", help="before the first batch committed after TIME"
    )
    rewind.add_argument("--to-batch", metavar="BATCH_ID", help="where this recorded batch began")
    add_store_options(rewind)
    add_change_options(rewind)
    rewind.set_defaults(func=cmd_rewind)

    bookmark = sub.add_parser("bookmark", help="named positions: create, list, restore, delete")
    verbs = bookmark.add_subparsers(dest="verb", required=True)
    for verb, text in (
        ("create", "name the current checkpoint"),
        ("list", "the bookmarks"),
        ("restore", "move the checkpoint back to a bookmark (dry run unless --yes)"),
        ("delete", "forget a bookmark"),
    ):
        parser = verbs.add_parser(verb, help=text)
        add_poller_argument(parser)
        if verb != "list":
            parser.add_argument("label", help="the bookmark's name")
        if verb == "list":
            add_json_option(parser, "print the bookmarks as JSON")
        add_store_options(parser)
        if verb == "restore":
            add_change_options(parser)
        elif verb != "list":
            parser.add_argument("--reason", required=True, help="why: journaled")
            parser.add_argument("--actor", help="who (default user@host)")
        parser.set_defaults(func=cmd_bookmark)


__all__ = ["add_position_commands", "cmd_bookmark", "cmd_rewind"]
