"""``dbtrigger reset`` of a poller whose state document was deleted or lost.

A poller with no state document whose durable history holds records is not new:
its document was deleted by hand, or lost with the store. Its next tick says so
(``state_missing``, WARNING) and starts over from the beginning (every row
again: at least once). Given the poller's trigger (``--source MODULE:ATTR``: the
new document needs its source definition), ``reset --to-cursor ... | --to-beginning``
writes the document again, create-only, where the operator says (the warning and
``dbtrigger history`` print the command for the history's last position);
``reset --from-file`` puts a backup back. Without records in the history the
poller is unknown here, and ``reset`` still refuses (a misspelt name creates no
poller).
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Callable
from typing import Any

from dbtrigger.cli.common import Console, state_store, utc_now
from dbtrigger.cli.history import history_of, resume_command
from dbtrigger.cli.plan import note_history, planned, write_planned
from dbtrigger.errors import (
    ConfigurationError,
    CorruptStateError,
    DbTriggerError,
    StoreError,
    UnsupportedDocumentError,
)
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore

Decide = Callable[[StateDocument, dt.datetime, dict[str, Any]], StateDocument]


def last_record(args: argparse.Namespace, store: CheckpointStore) -> dict[str, Any] | None:
    """The last record of a poller whose document is missing (None: the document
    is there, even unreadable, or the history holds no record of it, or cannot be read).

    A document the store holds but cannot read is there: the usual reset replaces
    it (``--from-file ... --force``), so it is not taken for a missing one."""
    try:
        if store.read(args.poller) is not None or store.read(f"{args.poller}.members") is not None:
            return None
    except (CorruptStateError, UnsupportedDocumentError):
        return None
    history = history_of(args, store)
    try:
        last = history.tail(args.poller, 1) if history is not None else []
    except StoreError:
        return None
    return dict(last[-1]) if last else None


def missing_note(args: argparse.Namespace, store: CheckpointStore) -> str | None:
    """What ``dbtrigger status POLLER`` adds for a poller whose document is missing
    while its history holds records: that it is missing, what its next tick does,
    and the ``reset`` that writes it again at the last position recorded (as
    ``dbtrigger history`` prints it). None: not that case, or the history cannot
    be read."""
    try:  # (status is showing an error: one that reading again would raise is it)
        if last_record(args, store) is None:
            return None
        history = history_of(args, store)
        records = [dict(r) for r in history.tail(args.poller, 20)] if history else []
    except DbTriggerError:
        return None
    return resume_command(args, records, missing=True).replace(
        "the records above are what the history holds",
        "its history holds records (dbtrigger history " + args.poller + ")",
    )


def recreate_lost(
    args: argparse.Namespace,
    blank: Callable[[], StateDocument | None],
    decide: Decide,
) -> int | None:
    """Write the document of a poller whose document is missing and whose history
    holds records (None: not that case; the usual reset runs, and refuses a poller
    it does not know).

    ``blank`` is the empty document to decide on, made from the named trigger (None:
    no trigger named).

    Raises:
        ConfigurationError: no trigger named (the new document needs its source
            definition), or ``--to-batch`` (it reads the journal, gone with the
            document).
        CasConflictError: a document was written meanwhile (a worker started).
    """
    with state_store(args) as store:
        record = last_record(args, store)
        if record is None:
            return None
        said = (
            f"poller {args.poller!r} has no state document, but its history holds records "
            f"(the last, #{record.get('seq')}, at {record.get('at')}): it was deleted or lost"
        )
        if args.to_batch:
            raise ConfigurationError(
                f"{said}. --to-batch reads the document's journal, gone with it: give "
                "--to-cursor VALUE --pk NAME=VALUE (dbtrigger history prints the last "
                "position recorded), or --from-file a backup"
            )
        if not (args.to_cursor or args.to_beginning or args.from_file):
            raise ConfigurationError(
                f"{said}. Say where it goes on: --to-cursor VALUE --pk NAME=VALUE (dbtrigger "
                "history prints the last position recorded), --to-beginning, or --from-file "
                "a backup"
            )
        doc = blank()
        if doc is None:
            raise ConfigurationError(
                f"{said}. To write it again, name the poller's trigger with --source "
                "MODULE:ATTR (the new document holds its source definition)"
            )
        console = Console()
        now = utc_now()
        after = decide(doc, now, {"recreated": f"history #{record.get('seq')}"})
        meanwhile = (
            f"a state document of {args.poller!r} was written while this command ran "
            "(a worker started?); nothing was written. Stop the workers and run it "
            "again to move that one"
        )
        if not planned(console, args, "reset", store, None, after, now):
            return 0
        write_planned(store, args.poller, after, None, meanwhile)
        console.print("applied: the state document is written again (there was none to back up)")
        note_history(console, store, after, args)
        return 0


__all__ = ["last_record", "missing_note", "recreate_lost"]
