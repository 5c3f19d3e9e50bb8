"""``dbtrigger reset | clone | release-lease | skip-batch``: operator changes to state.

Each command reads the document with its etag, lets a pure transition of
:mod:`dbtrigger.state.operations` decide the new one, prints the before/after,
and only with ``--yes`` saves a backup of the old document and writes the new
one conditionally on the etag it read (see :mod:`dbtrigger.cli.state` for the
guardrails).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dbtrigger._argparse import read_file_option
from dbtrigger._files import write_synced
from dbtrigger._paste import pasteable
from dbtrigger.cli.common import (
    ENV_STORE,
    Console,
    actor_from_args,
    add_change_options,
    add_cursor_options,
    add_poller_argument,
    add_store_options,
    backup_dir,
    by_hand,
    load_source,
    own_source,
    parse_position,
    read_state,
    reason_from_args,
    show_position,
    source_from_args,
    source_kinds,
    state_store,
    stored_key_fits,
    utc_now,
)
from dbtrigger.cli.plan import note_history, planned, write_planned
from dbtrigger.cli.recreate import recreate_lost
from dbtrigger.cursor import Position, encode_value
from dbtrigger.errors import ConfigurationError, CorruptStateError
from dbtrigger.partitions.floors import drop_floors
from dbtrigger.sources.base import (
    SourceAdapter,
    ValidatesDefinition,
    accepted_fingerprints,
    check_reachable,
    position_of,
    source_definition,
)
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state import operations as ops
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.factory import redact

# --- changes: plan, backup, write ----------------------------------------------------------


def _backup_path(args: argparse.Namespace, poller: str, operation: str, now: dt.datetime) -> Path:
    directory = backup_dir(args).expanduser()
    stamp = now.strftime("%Y%m%dT%H%M%S%fZ")
    return directory / f"{poller}.{stamp}.{operation}.json"


def _write_backup(path: Path, data: bytes) -> None:
    """Save the previous document, readable by its owner only (like the state files:
    a document can hold handler error text and row keys)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            write_synced(fh, data)
    except OSError as exc:
        raise ConfigurationError(
            f"could not write the backup {path} ({exc.strerror}); nothing was changed. "
            "Choose another --backup-dir."
        ) from exc


#: Operations that move a checkpoint back (a merged partition's floors are dropped first).
MOVES_BACK = frozenset({"reset", "rewind", "bookmark-restore"})


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
    unreadable: CorruptStateError | None = None
    try:
        before, etag, raw = read_state(store, args.poller)
    except CorruptStateError as exc:
        replacement = getattr(args, "replacement", None)
        if replacement is None or not args.force or args.poller.endswith(".members"):
            raise  # (a membership document: dbtrigger partitions reset-layout, as it says)
        unreadable = exc
        # Only a whole backup can stand in for a document nobody can read; its
        # lease is fenced (--force) and the unreadable bytes are backed up first.
        if replacement.poller_name != args.poller:
            raise ConfigurationError(
                f"the backup is of poller {replacement.poller_name!r}, not {args.poller!r}"
            ) from None
        # The unreadable bytes and their etag, from the store (an entity it cannot
        # decode) or from read_state (a document that does not parse).
        stored = getattr(exc, "stored", None)
        if stored is None:
            raise
        before, etag, raw = replacement, stored.etag, stored.data
    backup = _backup_path(args, args.poller, operation, now)
    after = decide(before, now, {"backup": backup.name})
    if unreadable is not None:
        console.print(f"replacing an unreadable state document ({unreadable.__cause__})")
    if not planned(console, args, operation, store, before, after, now):
        return 0
    _write_backup(backup, raw)
    if operation in MOVES_BACK:
        # A merged partition's floors would skip what this asks to deliver again.
        entry = {"actor": actor_from_args(args), "reason": args.reason, "at": now.isoformat()}
        if dropped := drop_floors(store, args.poller, {**entry, "by": operation}):
            console.print(f"dropped the {dropped} merge floor(s) of {args.poller}")
    write_planned(
        store,
        args.poller,
        after,
        etag,
        f"the state of {args.poller!r} changed while this command ran; nothing was written. "
        "Run it again to see the new state.",
    )
    console.print(f"applied. previous document saved to {backup.resolve()}")
    if unreadable is None:  # an unreadable document cannot be restored
        console.print(f"to undo: {undo_command(args, backup, operation, now)}")
    note_history(console, store, after, args)
    return 0


def _store_arguments(args: argparse.Namespace) -> list[str]:
    """The options that name this command's store again, for a command to paste.

    A store given with a secret in it (an account key in a connection string)
    is not repeated: the command then reads it from ``$DBTRIGGER_STORE``, and
    says so.
    """
    out: list[str] = []
    if args.store:
        if redact(args.store) != args.store:
            out += ["--store", f"${ENV_STORE}"]
        else:
            out += ["--store", _absolute_file_store(args.store)]
    elif getattr(args, "source", None):
        out += ["--source", args.source]
    elif getattr(args, "accept_source", None):
        out += ["--source", args.accept_source]  # the store came from that trigger
    named = (("--app", args.app), ("--container", args.container), ("--table", args.table))
    for flag, value in named:
        if value:
            out += [flag, value]
    return out


def _absolute_file_store(value: str) -> str:
    """``./state`` or ``file:state`` as an absolute path: the command may be pasted elsewhere."""
    path = value[len("file:") :] if value.startswith("file:") else value
    if ":" in path or path.startswith("%") or os.path.isabs(path):
        return value  # a URL, a connection string, a setting reference, or absolute already
    return ("file:" if value.startswith("file:") else "") + os.path.abspath(path)


def undo_command(args: argparse.Namespace, backup: Path, operation: str, now: dt.datetime) -> str:
    """A ``dbtrigger reset --from-file`` that restores ``backup``, ready to paste."""
    parts = ["dbtrigger", "reset", args.poller, "--from-file", str(backup.resolve())]
    parts += _store_arguments(args)
    parts += ["--reason", f"undo {operation} of {now:%Y-%m-%dT%H:%M:%SZ}", "--yes"]
    text = pasteable(  # cd to where --source imports from, when it is here
        " ".join(
            f'"${ENV_STORE}"' if part == f"${ENV_STORE}" else shlex.quote(part) for part in parts
        )
    )
    if f"${ENV_STORE}" in parts:
        text += f"   (with {ENV_STORE} set to the store's connection string)"
    return text


def cmd_reset(args: argparse.Namespace) -> int:
    moves = (args.to_beginning, args.to_cursor, args.from_file, args.to_batch)
    if not any(moves) and not args.accept_source:
        raise ConfigurationError(
            "reset needs one of --to-beginning, --to-cursor, --from-file, --to-batch, "
            "or --accept-source MODULE:TRIGGER (keeps the checkpoint)"
        )
    if args.from_file and args.accept_source:
        raise ConfigurationError(
            "--from-file restores the backup's own source definition; "
            "restore first, then --accept-source"
        )
    fingerprint: str | None = None
    definition: dict[str, Any] | None = None
    named = source_from_args(args)
    typed_by = own_source(args, named) if named is not None else None  # --to-cursor's types
    if args.accept_source:
        accepted = own_source(args, load_source(args.accept_source))  # a partition's own
        typed_by = accepted
        # Never tie a checkpoint to an endpoint that does not answer: a typo'd
        # port or host changes the fingerprint just like a deliberate move.
        check_reachable(
            accepted,
            poller=args.poller,
            then="refusing to accept a definition that cannot be read: fix the connection "
            "(host, port, database, credentials) first and run this again",
        )
        fingerprint = accepted.fingerprint()
        definition = source_definition(accepted)
    backup_doc: StateDocument | None = None
    if args.from_file:
        data = read_file_option(args.from_file)
        try:
            backup_doc = docmod.loads(data)
        except CorruptStateError as exc:
            raise CorruptStateError(f"{args.from_file} is not a usable backup: {exc}") from exc
        args.replacement = backup_doc  # stands in for a corrupt stored document (--force)
    elif (args.to_beginning or args.to_cursor) and typed_by is not None:
        # With the trigger named, a new document can stand in for a corrupt one (--force).
        args.replacement = StateDocument(
            poller_name=args.poller,
            source_fingerprint=fingerprint or typed_by.fingerprint(),
            source_definition=definition if fingerprint else source_definition(typed_by),
        )

    def decide(doc: StateDocument, now: dt.datetime, details: dict[str, Any]) -> StateDocument:
        who = by_hand(args, now, details)
        accepted: dict[str, Any] = {}
        if fingerprint is not None:
            details["accept_source"] = args.accept_source
            if not any(moves):
                return ops.accept_source(doc, fingerprint=fingerprint, definition=definition, **who)
            accepted = {"fingerprint": fingerprint, "definition": definition}
        if backup_doc is not None:
            details["from_file"] = Path(args.from_file).name
            return ops.restore(doc, backup_doc, **who)
        if args.to_beginning:
            details["mode"] = "to_beginning"
            return ops.reset(doc, position=None, **accepted, **who)
        if args.to_batch:
            details["mode"] = "to_batch"
            details["batch_id"] = args.to_batch
            details["redeliver"] = args.redeliver
            position = ops.batch_position(doc, args.to_batch, redeliver=args.redeliver)
            return ops.reset(doc, position=position, **accepted, **who)
        details["mode"] = "to_cursor"
        position = parse_position(
            args.to_cursor,
            args.pk,
            kind=args.kind,
            # accepted, or a key edited by hand: the source's key and types
            like=doc if fingerprint is None and stored_key_fits(doc, typed_by) else None,
            kinds=lambda: source_kinds(typed_by) if typed_by is not None else None,
        )
        if isinstance(typed_by, ValidatesDefinition):
            typed_by.validate(position)  # a value its column cannot hold is refused now
        return ops.reset(doc, position=position, **accepted, **who)

    lost = recreate_lost(args, lambda: getattr(args, "replacement", None), decide)
    return lost if lost is not None else _apply_change(args, "reset", decide)


def cmd_release(args: argparse.Namespace) -> int:
    def decide(doc: StateDocument, now: dt.datetime, details: dict[str, Any]) -> StateDocument:
        return ops.release_lease(doc, **by_hand(args, now, details))

    return _apply_change(args, "release-lease", decide)


def cmd_skip(args: argparse.Namespace) -> int:
    loaded = source_from_args(args)
    if args.to_cursor is None and loaded is None:
        raise ConfigurationError(
            "skip-batch needs --source MODULE:ATTR to check that the source still holds "
            "exactly the failed batch, or --to-cursor VALUE --pk NAME=VALUE to say where "
            "to resume"
        )

    def decide(doc: StateDocument, now: dt.datetime, details: dict[str, Any]) -> StateDocument:
        keys: list[dict[str, Any]] | None = None
        count: int | None = None
        if args.to_cursor is not None:
            position = parse_position(
                args.to_cursor,
                args.pk,
                kind=args.kind,
                like=doc,
                kinds=lambda: source_kinds(loaded.source) if loaded is not None else None,
            )
            if loaded is not None and isinstance(loaded.source, ValidatesDefinition):
                loaded.source.validate(position)
        else:
            assert loaded is not None  # noqa: S101 - checked above
            position, count, digest = _failed_batch(doc)
            source = own_source(args, loaded)  # a partition is checked on its own range
            keys = _check_failed_batch(source, doc, position, count, digest)
        return ops.skip_batch(
            doc,
            position=position,
            skipped_rows=count,
            skipped_keys=keys,
            **by_hand(args, now, details),
        )

    return _apply_change(args, "skip-batch", decide)


def _failed_batch(doc: StateDocument) -> tuple[Position, int, str | None]:
    """Where the failing batch ended, how many rows it had and their digest,
    from its failure record.

    Raises:
        ConfigurationError: there is no failing batch at the checkpoint, or its
            record does not say where the batch ended: skipping "the next
            batch_size rows as they are now" would skip rows no handler saw.
    """
    failure = leasemod.failure_at(doc, doc.position)
    if failure is None:
        raise ConfigurationError(
            f"poller {doc.poller_name!r} has no failing batch at its checkpoint, so there is "
            "no batch to skip; to move the checkpoint anyway, give --to-cursor VALUE --pk ..."
        )
    if failure.batch_end is None or failure.batch_rows is None:
        raise ConfigurationError(
            f"the failure record of {doc.poller_name!r} does not say where the failing batch "
            "ended (an older dbtrigger wrote it), so which rows a skip would drop cannot be "
            "known. Let one more tick fail with this version (it records the batch), or give "
            "--to-cursor VALUE --pk NAME=VALUE to choose the position yourself"
        )
    return failure.batch_end, failure.batch_rows, failure.batch_digest


def _check_failed_batch(
    source: SourceAdapter, doc: StateDocument, end: Position, count: int, digest: str | None
) -> list[dict[str, Any]]:
    """Re-read the failed batch's rows; refuse if the source no longer holds exactly them
    (same count, same last row, and - when recorded - the same event ids).

    Returns the keys of (at most 20 of) the rows that will be skipped, for the journal.
    """
    if doc.source_fingerprint not in accepted_fingerprints(source):
        raise ConfigurationError(
            "the --source definition differs from this poller's (fingerprint); "
            "refusing to check a skip against a different source"
        )
    rows = source.fetch(doc.position, count) if count else []
    events = source.to_events(rows, poller=doc.poller_name, batch_id="skip")
    same = (
        len(events) == count
        and bool(events)
        and position_of(events[-1]) == end
        and (digest is None or docmod.digest_event_ids(e.event_id for e in events) == digest)
    )
    if not same:
        raise ConfigurationError(
            f"the source no longer holds exactly the failed batch: it had {count} row(s) up to "
            f"{show_position(end)}; reading {count} row(s) after the checkpoint now ends at "
            f"{show_position(position_of(events[-1])) if events else '(no rows)'}"
            f"{'' if len(events) == count else f' after {len(events)} row(s)'}. Rows were "
            "added, removed or changed in that range since the batch failed, and a skip "
            "would drop rows no handler saw. Give --to-cursor VALUE --pk ... to choose "
            "deliberately"
        )
    return [{k: encode_value(v)[1] for k, v in e.pk.items()} for e in events[:20]]


def cmd_clone(args: argparse.Namespace) -> int:
    with state_store(args) as store:
        return _clone(args, store)


def _clone(args: argparse.Namespace, store: CheckpointStore) -> int:
    console = Console()
    now = utc_now()
    doc, _, _ = read_state(store, args.poller)
    new = ops.clone(
        doc,
        new_poller=args.new_poller,
        now=now,
        actor=actor_from_args(args),
        reason=reason_from_args(args),
    )
    if store.read(args.new_poller) is not None:
        raise ConfigurationError(
            f"poller {args.new_poller!r} already exists; pick another name, "
            f"or `reset {args.new_poller} --from-file` to overwrite it deliberately"
        )
    if not planned(console, args, "clone", store, None, new, now):
        return 0
    write_planned(
        store,
        args.new_poller,
        new,
        None,
        f"poller {args.new_poller!r} was created by someone else meanwhile; nothing written",
    )
    console.print(f"applied: {args.new_poller!r} starts at {show_position(new.position)}")
    note_history(console, store, new, args)
    return 0


# --- parser --------------------------------------------------------------------------------


def _add_reset(sub: Any) -> None:
    reset = sub.add_parser("reset", help="move a poller's checkpoint (dry run unless --yes)")
    add_poller_argument(reset)
    target = reset.add_mutually_exclusive_group()
    target.add_argument("--to-beginning", action="store_true", help="deliver everything again")
    target.add_argument("--to-cursor", metavar="VALUE", help="resume after (VALUE, --pk)")
    target.add_argument("--from-file", metavar="FILE", help="restore a backup document")
    target.add_argument("--to-batch", metavar="BATCH_ID", help="where a journal batch ended")
    reset.add_argument(
        "--redeliver", action="store_true", help="with --to-batch: where it began instead"
    )
    reset.add_argument(
        "--accept-source",
        metavar="MODULE:TRIGGER",
        help="adopt this trigger's (changed) source definition; keeps the checkpoint "
        "unless another option above moves it",
    )
    add_cursor_options(reset, "--to-cursor")
    add_store_options(reset)
    add_change_options(reset)
    reset.set_defaults(func=cmd_reset)


def _add_other_changes(sub: Any) -> None:
    clone = sub.add_parser("clone", help="copy a poller's checkpoint to a new poller name")
    clone.add_argument("poller", help="the poller whose checkpoint is copied")
    clone.add_argument("new_poller", help="the new poller name (must not exist yet)")
    add_store_options(clone)
    add_change_options(clone, lease=False)
    clone.set_defaults(func=cmd_clone)

    release = sub.add_parser("release-lease", help="free a lease left by a crashed instance")
    add_poller_argument(release)
    add_store_options(release)
    add_change_options(release)
    release.set_defaults(func=cmd_release)

    skip = sub.add_parser(
        "skip-batch", help="advance past a poison batch (data loss: it is journaled)"
    )
    add_poller_argument(skip)
    skip.add_argument("--to-cursor", metavar="VALUE", help="resume after (VALUE, --pk) instead")
    add_cursor_options(skip, "--to-cursor")
    add_store_options(skip)
    add_change_options(skip)
    skip.set_defaults(func=cmd_skip)


def add_change_commands(sub: Any) -> None:
    """Register reset, clone, release-lease and skip-batch."""
    _add_reset(sub)
    _add_other_changes(sub)
