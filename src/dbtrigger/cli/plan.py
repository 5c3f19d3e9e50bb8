"""What a change to a poller's state document will do, printed before it is done,
and the note of it in the poller's history after.

Shared by every command that writes a document (``reset``, ``skip``, ``release``,
``clone``, ``backfill``, a recreated document): one plan format, one place that
records the change.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from dbtrigger.cli.common import Console, dry_run_note, show_position
from dbtrigger.cli.history import history_to_record, named_trigger
from dbtrigger.errors import CasConflictError
from dbtrigger.history.wiring import record_write
from dbtrigger.state import document as docmod
from dbtrigger.state.definition import definition_changes
from dbtrigger.state.document import StateDocument, known_definition
from dbtrigger.state.lease import describe_lease
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.factory import describe_store


def _lease_text(doc: StateDocument | None, now: dt.datetime) -> str:
    return describe_lease(doc.lease, now) if doc is not None else "-"


def _failure_text(doc: StateDocument | None) -> str:
    if doc is None or doc.failure is None:
        return "none"
    return f"batch {doc.failure.batch_id} failed {doc.failure.attempts} time(s)"


def print_plan(
    console: Console,
    operation: str,
    store: CheckpointStore,
    before: StateDocument | None,
    after: StateDocument,
    now: dt.datetime,
) -> None:
    console.print(f"{operation} poller {after.poller_name!r} in {describe_store(store)}")
    pairs = [
        (
            "checkpoint",
            show_position(before.position) if before else "(no document)",
            show_position(after.position),
        ),
        ("lease", _lease_text(before, now), _lease_text(after, now)),
        ("failing", _failure_text(before), _failure_text(after)),
        (
            "fingerprint",
            before.source_fingerprint if before else "-",
            after.source_fingerprint,
        ),
    ]
    for name, old, new in pairs:
        if old == new:
            console.print(f"  {name:<12} {old}  (unchanged)")
        else:
            console.print(f"  {name:<12} {old}\n  {'':<12} -> {new}")
    if before is not None and before.source_fingerprint != after.source_fingerprint:
        for line in definition_lines(before, after):
            console.print(line)
    entry = after.journal[-1] if after.journal else {}
    extras = {
        k: v
        for k, v in entry.items()
        if k not in ("type", "operation", "actor", "reason", "at", "before", "after")
    }
    console.print(
        f"  {'journal':<12} + {entry.get('operation')} by {entry.get('actor')}: "
        f"{entry.get('reason')!r} {json.dumps(extras, sort_keys=True, default=str)}"
    )


def planned(
    console: Console,
    args: argparse.Namespace,
    operation: str,
    store: CheckpointStore,
    before: StateDocument | None,
    after: StateDocument,
    now: dt.datetime,
) -> bool:
    """Print the plan (:func:`print_plan`) and say whether to carry it out: only
    with ``--yes``; without it the dry run's last line says how to apply it."""
    print_plan(console, operation, store, before, after, now)
    if not args.yes:
        console.print(dry_run_note(args))
    return bool(args.yes)


def write_planned(
    store: CheckpointStore, poller: str, doc: StateDocument, etag: str | None, conflict: str
) -> None:
    """Write the planned document ``doc`` of ``poller`` over the one read as ``etag``
    (None: where there is none).

    Raises:
        CasConflictError: saying ``conflict``: the document was written meanwhile.
    """
    try:
        store.write(poller, docmod.dumps(doc), if_match=etag)
    except CasConflictError as exc:
        raise CasConflictError(conflict, poller=poller) from exc


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 100 else text[:97] + "..."


def _where(definition: Mapping[str, Any]) -> str:
    port = f":{definition['port']}" if definition.get("port") else ""
    schema = f"{definition['schema']}." if definition.get("schema") else ""
    what = definition.get("table") or "(query)"
    return (
        f"{schema}{what} at {definition.get('dialect')}://{definition.get('host') or ''}{port}/"
        f"{definition.get('database') or ''}, cursor {definition.get('cursor_column')}, "
        f"key ({', '.join(definition.get('pk_columns') or [])})"
    )


def definition_lines(before: StateDocument, after: StateDocument) -> list[str]:
    """What changed in the source definition between two documents, one line per field.

    A fingerprint is a hash: the lines say what it stands for (table, columns,
    key, cursor, database and how it is reached). A document written before
    definitions were recorded (or by a source that cannot describe itself)
    only has its hash; the lines then say so and show the new definition.
    """
    old, new = known_definition(before), known_definition(after)
    label = f"  {'definition':<12}"
    if new is None:
        return [f"{label} not described by this source (only the fingerprints can be compared)"]
    if old is None:
        return [
            f"{label} the stored document does not record which definition its fingerprint "
            "stands for (written before dbtrigger recorded it); the new one:",
            f"  {'':<12} {_where(new)}",
        ]
    changes = definition_changes(old, new)
    if not changes:
        return [f"{label} the same fields (only the fingerprint algorithm differs)"]
    lines = [f"{label} {len(changes)} field(s) changed:"]
    lines += [f"  {'':<12} {name}: {_show(was)} -> {_show(now)}" for name, was, now in changes]
    return lines


def note_history(
    console: Console, store: CheckpointStore, doc: StateDocument, args: argparse.Namespace
) -> None:
    """Append the change to the poller's own history (the named trigger's; see
    :func:`~dbtrigger.cli.history.history_to_record`); say so if that failed or
    it is recorded in none (the change stands)."""
    history, note = history_to_record(store, doc.poller_name, named_trigger(args))
    if note is not None:
        console.warn(note)
    problem = record_write(store, doc, history=history)
    if problem is not None:
        console.warn(f"warning: {problem}")


__all__ = ["definition_lines", "note_history", "planned", "print_plan", "write_planned"]
