"""``dbtrigger reset | clone | release-lease | skip-batch``: operator changes to state.

Each command reads the document with its etag, lets a pure transition of
:mod:`dbtrigger.state.operations` decide the new one, prints the before/after,
and only with ``--yes`` saves a backup of the old document and writes the new
one conditionally on the etag it read (see :mod:`dbtrigger.cli_state` for the
guardrails).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dbtrigger.cli_state_common import (
    DEFAULT_BACKUP_DIR,
    ENV_BACKUP_DIR,
    Console,
    actor_from_args,
    add_change_options,
    add_cursor_options,
    add_store_options,
    load_source,
    parse_position,
    read_state,
    show_position,
    state_store,
    utc_now,
)
from dbtrigger.cursor import encode_value
from dbtrigger.errors import CasConflictError, ConfigurationError
from dbtrigger.sources.base import position_of
from dbtrigger.state import document as docmod
from dbtrigger.state import operations as ops
from dbtrigger.state.document import StateDocument
from dbtrigger.state.lease import describe_lease
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.factory import describe_store

# --- changes: plan, backup, write ----------------------------------------------------------


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


def _backup_path(args: argparse.Namespace, poller: str, operation: str, now: dt.datetime) -> Path:
    directory = Path(
        args.backup_dir or os.environ.get(ENV_BACKUP_DIR) or DEFAULT_BACKUP_DIR
    ).expanduser()
    stamp = now.strftime("%Y%m%dT%H%M%S%fZ")
    return directory / f"{poller}.{stamp}.{operation}.json"


def _write_backup(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("xb") as fh:
            fh.write(data)
    except OSError as exc:
        raise ConfigurationError(
            f"could not write the backup {path} ({exc.strerror}); nothing was changed. "
            "Choose another --backup-dir."
        ) from exc


def _apply_change(
    args: argparse.Namespace,
    operation: str,
    decide: Callable[[StateDocument, dt.datetime, dict[str, Any]], StateDocument],
) -> int:
    """Read, decide, show, and (with --yes) back up and CAS-write one poller's state."""
    with state_store(args) as store:
        return _apply_change_on(args, store, operation, decide)


def _apply_change_on(
    args: argparse.Namespace,
    store: CheckpointStore,
    operation: str,
    decide: Callable[[StateDocument, dt.datetime, dict[str, Any]], StateDocument],
) -> int:
    console = Console()
    now = utc_now()
    before, etag, raw = read_state(store, args.poller)
    backup = _backup_path(args, args.poller, operation, now)
    after = decide(before, now, {"backup": backup.name})
    print_plan(console, operation, store, before, after, now)
    if not args.yes:
        console.print("dry run: nothing was written; add --yes to apply")
        return 0
    _write_backup(backup, raw)
    try:
        store.write(args.poller, docmod.dumps(after), if_match=etag)
    except CasConflictError as exc:
        raise CasConflictError(
            f"the state of {args.poller!r} changed while this command ran; nothing was written. "
            "Run it again to see the new state.",
            poller=args.poller,
        ) from exc
    console.print(f"applied. previous document saved to {backup}")
    console.print(
        f"to undo: dbtrigger reset {args.poller} --from-file {backup} --reason '...' --yes"
    )
    return 0


def cmd_reset(args: argparse.Namespace) -> int:
    backup_doc: StateDocument | None = None
    if args.from_file:
        try:
            backup_doc = docmod.loads(Path(args.from_file).read_bytes())
        except OSError as exc:
            raise ConfigurationError(f"cannot read {args.from_file}: {exc.strerror}") from exc

    def decide(doc: StateDocument, now: dt.datetime, details: dict[str, Any]) -> StateDocument:
        common: dict[str, Any] = {
            "now": now,
            "actor": actor_from_args(args),
            "reason": args.reason,
            "force": args.force,
        }
        if backup_doc is not None:
            details["from_file"] = Path(args.from_file).name
            return ops.restore(doc, backup_doc, details=details, **common)
        if args.to_beginning:
            details["mode"] = "to_beginning"
            return ops.reset(doc, position=None, details=details, **common)
        if args.to_batch:
            details["mode"] = "to_batch"
            details["batch_id"] = args.to_batch
            details["redeliver"] = args.redeliver
            position = ops.batch_position(doc, args.to_batch, redeliver=args.redeliver)
            return ops.reset(doc, position=position, details=details, **common)
        details["mode"] = "to_cursor"
        position = parse_position(args.to_cursor, args.pk, kind=args.kind, like=doc)
        return ops.reset(doc, position=position, details=details, **common)

    return _apply_change(args, "reset", decide)


def cmd_release(args: argparse.Namespace) -> int:
    def decide(doc: StateDocument, now: dt.datetime, details: dict[str, Any]) -> StateDocument:
        return ops.release_lease(
            doc,
            now=now,
            actor=actor_from_args(args),
            reason=args.reason,
            force=args.force,
            details=details,
        )

    return _apply_change(args, "release-lease", decide)


def cmd_skip(args: argparse.Namespace) -> int:
    loaded = load_source(args.source) if args.source else None
    if args.to_cursor is None and loaded is None:
        raise ConfigurationError(
            "skip-batch needs --source MODULE:ATTR to find the batch's last row, "
            "or --to-cursor VALUE --pk NAME=VALUE to say where to resume"
        )

    def decide(doc: StateDocument, now: dt.datetime, details: dict[str, Any]) -> StateDocument:
        keys: list[dict[str, Any]] | None = None
        count: int | None = None
        if args.to_cursor is not None:
            position = parse_position(args.to_cursor, args.pk, kind=args.kind, like=doc)
        else:
            assert loaded is not None  # noqa: S101 - checked above
            if loaded.source.fingerprint() != doc.source_fingerprint:
                raise ConfigurationError(
                    "the --source definition differs from this poller's (fingerprint); "
                    "refusing to compute a skip on a different source"
                )
            size = args.batch_size or loaded.batch_size
            if not size:
                raise ConfigurationError("--batch-size is needed when --source is not a trigger")
            rows = loaded.source.fetch(doc.position, size)
            if not rows:
                raise ConfigurationError("no rows after the checkpoint: there is nothing to skip")
            events = loaded.source.to_events(rows, poller=doc.poller_name, batch_id="skip")
            position = position_of(events[-1])
            count = len(events)
            keys = [{k: encode_value(v)[1] for k, v in e.pk.items()} for e in events[:20]]
        return ops.skip_batch(
            doc,
            position=position,
            now=now,
            actor=actor_from_args(args),
            reason=args.reason,
            skipped_rows=count,
            skipped_keys=keys,
            force=args.force,
            details=details,
        )

    return _apply_change(args, "skip-batch", decide)


def cmd_clone(args: argparse.Namespace) -> int:
    with state_store(args) as store:
        return _clone(args, store)


def _clone(args: argparse.Namespace, store: CheckpointStore) -> int:
    console = Console()
    now = utc_now()
    doc, _, _ = read_state(store, args.poller)
    new = ops.clone(
        doc, new_poller=args.new_poller, now=now, actor=actor_from_args(args), reason=args.reason
    )
    if store.read(args.new_poller) is not None:
        raise ConfigurationError(
            f"poller {args.new_poller!r} already exists; pick another name, "
            f"or `reset {args.new_poller} --from-file` to overwrite it deliberately"
        )
    print_plan(console, "clone", store, None, new, now)
    if not args.yes:
        console.print("dry run: nothing was written; add --yes to apply")
        return 0
    try:
        store.write(args.new_poller, docmod.dumps(new), if_match=None)
    except CasConflictError as exc:
        raise CasConflictError(
            f"poller {args.new_poller!r} was created by someone else meanwhile; nothing written",
            poller=args.new_poller,
        ) from exc
    console.print(f"applied: {args.new_poller!r} starts at {show_position(new.position)}")
    return 0


# --- parser --------------------------------------------------------------------------------


def _add_reset(sub: Any) -> None:
    reset = sub.add_parser("reset", help="move a poller's checkpoint (dry run unless --yes)")
    reset.add_argument("poller")
    target = reset.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-beginning", action="store_true", help="deliver everything again")
    target.add_argument("--to-cursor", metavar="VALUE", help="resume after (VALUE, --pk)")
    target.add_argument("--from-file", metavar="FILE", help="restore a backup document")
    target.add_argument("--to-batch", metavar="BATCH_ID", help="where a journal batch ended")
    reset.add_argument(
        "--redeliver", action="store_true", help="with --to-batch: where it began instead"
    )
    add_cursor_options(reset, "--to-cursor")
    add_store_options(reset)
    add_change_options(reset)
    reset.set_defaults(func=cmd_reset)


def _add_other_changes(sub: Any) -> None:
    clone = sub.add_parser("clone", help="copy a poller's checkpoint to a new poller name")
    clone.add_argument("poller")
    clone.add_argument("new_poller")
    add_store_options(clone)
    add_change_options(clone, lease=False)
    clone.set_defaults(func=cmd_clone)

    release = sub.add_parser("release-lease", help="free a lease left by a crashed instance")
    release.add_argument("poller")
    add_store_options(release)
    add_change_options(release)
    release.set_defaults(func=cmd_release)

    skip = sub.add_parser(
        "skip-batch", help="advance past a poison batch (data loss: it is journaled)"
    )
    skip.add_argument("poller")
    skip.add_argument("--source", help="MODULE:ATTR (PollTrigger or source) to find the batch")
    skip.add_argument("--batch-size", type=int, help="rows in the batch (default: the trigger's)")
    skip.add_argument("--to-cursor", metavar="VALUE", help="resume after (VALUE, --pk) instead")
    add_cursor_options(skip, "--to-cursor")
    add_store_options(skip)
    add_change_options(skip)
    skip.set_defaults(func=cmd_skip)


def add_change_commands(sub: Any) -> None:
    """Register reset, clone, release-lease and skip-batch."""
    _add_reset(sub)
    _add_other_changes(sub)
