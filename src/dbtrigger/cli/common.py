"""What the state commands share: output, the store, the source, typed-in positions.

Every command prints through :class:`Console` (which redacts), opens its store
with :func:`state_store` (closed when the command ends), reads a poller's
document with :func:`read_state` (with the etag for the conditional write), and
parses cursor positions typed on the command line with :func:`parse_position`.
The option helpers keep the flags of all commands (``backfill`` included) alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import decimal
import getpass
import json
import socket
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from dbtrigger._argparse import add_apply_option
from dbtrigger.cli.loading import as_trigger, load_object
from dbtrigger.cursor import Position, encode_value
from dbtrigger.errors import ConfigurationError, CorruptStateError, DbTriggerError
from dbtrigger.partitions import layout as membership_layout
from dbtrigger.partitions.member import PartitionedPoller
from dbtrigger.partitions.recovery import unreadable_key
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.queue.cli import claim_source_of
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.settings import variable
from dbtrigger.sources.base import KnowsCursorKind, SourceAdapter
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.state import document as docmod
from dbtrigger.state import operations as ops
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.factory import describe_store, open_store, redact
from dbtrigger.state.unreadable import unreadable_state

if TYPE_CHECKING:
    from dbtrigger.queue.source import ClaimSource
    from dbtrigger.state.operations import Manual

ENV_STORE = "DBTRIGGER_STORE"
#: The application name in shared stores: the same setting the Functions example
#: passes as ``app_name="%DBTRIGGER_APP_NAME%"``, so one name serves both.
ENV_APP = "DBTRIGGER_APP_NAME"
#: The name older versions of the CLI read; still honoured after ENV_APP.
ENV_APP_LEGACY = "DBTRIGGER_APP"
ENV_CONTAINER = "DBTRIGGER_CONTAINER"
ENV_BACKUP_DIR = "DBTRIGGER_BACKUP_DIR"
DEFAULT_BACKUP_DIR = "dbtrigger-backups"


def backup_dir(args: argparse.Namespace) -> Path:
    """Where a changing command saves what it replaces: ``--backup-dir``, else
    ``$DBTRIGGER_BACKUP_DIR``, else :data:`DEFAULT_BACKUP_DIR`."""
    return Path(args.backup_dir or variable(ENV_BACKUP_DIR) or DEFAULT_BACKUP_DIR)


def store_from_environment() -> str | None:
    """The store ``$DBTRIGGER_STORE`` names (None when it is not set)."""
    return variable(ENV_STORE)


#: Kinds a cursor value typed on the command line can be parsed as.
VALUE_KINDS = ("timestamp", "naive_timestamp", "int", "decimal", "uuid", "date", "str", "float")


# --- output ---------------------------------------------------------------------------


class Console:
    """Where the commands print; every line is redacted on the way out."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def print(self, text: str = "") -> None:
        print(redact(text), file=self.out)

    def warn(self, text: str) -> None:
        print(redact(text), file=self.err)

    def json(self, value: Any) -> None:
        self.print(json.dumps(value, indent=2, sort_keys=False, default=str))


def default_actor() -> str:
    """``user@host`` of whoever runs the command, for the journal."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the first one a header, if any) as aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def show_position(raw: Mapping[str, Any] | Position | None) -> str:
    """``2026-01-01T00:00:00.000000Z id=5`` (or ``(beginning)``) from JSON or a Position."""
    if isinstance(raw, Position):
        raw = ops.position_json(raw)
    tiebreaker = (raw or {}).get("tiebreaker") or {}
    if not raw or (raw.get("value") is None and not tiebreaker):
        return "(beginning)"
    parts = [str(raw.get("value"))]
    parts.extend(f"{k}={v}" for k, v in tiebreaker.items())
    return " ".join(parts)


# --- configuration ----------------------------------------------------------------------


def store_from_args(args: argparse.Namespace) -> CheckpointStore:
    """``--store`` (or ``$DBTRIGGER_STORE``), else the store of the ``--source`` trigger."""
    spec = args.store or variable(ENV_STORE)
    if not spec:
        loaded = source_from_args(args)
        if loaded is None and getattr(args, "accept_source", None):
            # `reset --accept-source MODULE:ATTR` names the trigger already:
            # the command the fingerprint error prints needs nothing else.
            loaded = load_source(args.accept_source)
        if loaded is not None and loaded.store is not None:
            return loaded.store
        raise ConfigurationError(
            f"no state store given: pass --store, set {ENV_STORE}, or name the poller's "
            "trigger with --source MODULE:ATTR (its own store is used)"
        )
    return open_store(
        spec,
        app=args.app or variable(ENV_APP) or variable(ENV_APP_LEGACY),
        container=args.container or variable(ENV_CONTAINER),
        table=args.table,
    )


def source_from_args(args: argparse.Namespace) -> LoadedSource | None:
    """The ``--source`` of a command, imported once per command."""
    spec = getattr(args, "source", None)
    if not spec:
        return None
    cached: LoadedSource | None = getattr(args, "_loaded_source", None)
    if cached is None:
        cached = load_source(spec)
        args._loaded_source = cached
    return cached


def close_store(store: CheckpointStore) -> None:
    """Release the store's connections (SQL engines, HTTP sessions) if it has any."""
    close = getattr(store, "close", None)
    if callable(close):
        with contextlib.suppress(DbTriggerError, OSError):
            close()


@contextmanager
def state_store(args: argparse.Namespace) -> Iterator[CheckpointStore]:
    """The store the arguments name, closed when the command is done."""
    store = store_from_args(args)
    try:
        yield store
    finally:
        close_store(store)


@dataclass
class LoadedSource:
    source: SourceAdapter
    trigger: PollTrigger | None
    #: The store of the trigger or partitioned poller named, which the state commands
    #: read when no ``--store`` is given (None for a bare source adapter).
    own_store: CheckpointStore | None = None
    #: The name of the PartitionedPoller named (its partitions are ``<group>.pXXX-YYY``).
    group: str | None = None

    @property
    def store(self) -> CheckpointStore | None:
        return self.trigger.store if self.trigger is not None else self.own_store

    @property
    def batch_size(self) -> int | None:
        return self.trigger.batch_size if self.trigger is not None else None


def load_source(spec: str) -> LoadedSource:
    """``--source MODULE:ATTR``: a PollTrigger or a ``@db.trigger`` Functions function
    (its source and store are used), a PartitionedPoller (its table's source), or a
    SourceAdapter."""
    target = load_object(spec)
    loaded = as_trigger(target, spec)
    if loaded is not None and isinstance(loaded.trigger, PollTrigger):
        return LoadedSource(loaded.trigger.source, loaded.trigger)
    if loaded is not None and isinstance(loaded.trigger, PartitionedPoller):
        poller = loaded.trigger
        return LoadedSource(poller.source, None, own_store=poller.store, group=poller.name)
    if isinstance(target, SourceAdapter):
        return LoadedSource(target, None)
    if claim_source_of(target) is not None:
        raise ConfigurationError(
            f"{spec} is a claim queue: it keeps no state document, checkpoint or journal "
            "(each row carries its own status, attempts and last error). See it with "
            f"`dbtrigger queue status --source {spec}`; `dbtrigger queue retry|cancel|prune` "
            "change it"
        )
    raise ConfigurationError(
        f"{spec} is a {type(target).__name__}, not a PollTrigger, a @db.trigger function "
        "or a source adapter"
    )


def source_for(loaded: LoadedSource, store: CheckpointStore, poller: str) -> SourceAdapter:
    """The source ``poller``'s document was written from: one partition of the
    PartitionedPoller ``--source`` names reads its own bucket range (and its
    fingerprint says so); anything else reads ``loaded.source``."""
    group, _, pid = poller.rpartition(".")
    base = loaded.source
    if loaded.group is None or group != loaded.group or not isinstance(base, SqlAlchemySource):
        return base
    stored = store.read(f"{group}.members")
    try:
        members = membership_layout.loads(stored.data) if stored is not None else None
    except CorruptStateError:
        return base
    part = next((p for p in members.partitions if p.id == pid), None) if members else None
    return base if part is None else PartitionSource(base, part, poller=group)


def own_source(args: argparse.Namespace, loaded: LoadedSource) -> SourceAdapter:
    """``loaded.source``, or, when ``args.poller`` is a partition of the
    PartitionedPoller ``loaded`` names, that partition's own (:func:`source_for`)."""
    if loaded.group is None:
        return loaded.source
    with state_store(args) as store:
        return source_for(loaded, store, args.poller)


def queue_from_args(args: argparse.Namespace) -> ClaimSource | None:
    """The claim queue ``--source`` names (a QueueTrigger, ClaimSource or
    ``@db.queue_trigger`` function), or None; a SidecarFeeder is a poller here."""
    spec = getattr(args, "source", None)
    if not spec:
        return None
    from dbtrigger.queue.sidecar import SidecarFeeder  # noqa: PLC0415 - SQLAlchemy on use

    target = load_object(spec)
    return None if isinstance(target, SidecarFeeder) else claim_source_of(target)


def read_state(
    store: CheckpointStore, poller: str, spec: str | None = None
) -> tuple[StateDocument, str, bytes]:
    """The document, its etag (for the conditional write) and raw bytes (for the backup);
    ``spec``, the poller's ``--source``, fills the commands an unreadable one prints."""
    try:
        stored = store.read(poller)
    except CorruptStateError as exc:  # a store that cannot even decode what it holds
        raise _unreadable(store, poller, exc, getattr(exc, "stored", None), spec) from exc
    if stored is None and store.read(f"{poller}.members") is not None:
        raise ConfigurationError(
            f"{poller!r} is a partitioned poller: it has one state document per partition "
            f"({poller}.p000-064 ...), each changed on its own, e.g. `dbtrigger reset "
            f"{poller}.p000-064 ...`; `dbtrigger partitions show --trigger MODULE:ATTR` lists "
            "them (the retired ones a regroup left are read by nobody)"
        )
    if stored is None:
        raise ConfigurationError(
            f"no state for poller {poller!r} in {describe_store(store)}{_held_by(store)}"
        )
    try:
        doc = docmod.loads(stored.data)
        if doc.poller_name != poller:  # copied under this name: every tick refuses it too
            raise CorruptStateError(f"the document belongs to poller {doc.poller_name!r}")
    except CorruptStateError as exc:
        raise _unreadable(store, poller, exc, stored, spec) from exc
    return doc, stored.etag, stored.data


def _unreadable(
    store: CheckpointStore, key: str, exc: CorruptStateError, stored: object, spec: str | None
) -> CorruptStateError:
    """A state document's way out, or a partitioned poller's membership document's."""
    if key.endswith(".members"):
        return unreadable_key(store, key, exc, stored)
    return unreadable_state(store, key, exc, stored, spec)


def _held_by(store: CheckpointStore) -> str:
    """``; it holds: orders, orders-audit``: a misspelt name is seen at once."""
    try:
        names = sorted(store.list_keys())
    except DbTriggerError:
        return ""  # the listing is a courtesy: the missing document is the error
    groups = [n.removesuffix(".members") for n in names if n.endswith(".members")]
    pollers = [f"{g} (partitioned)" for g in groups] + [
        n
        for n in names
        if not n.endswith(".members") and not n.startswith(tuple(f"{g}." for g in groups))
    ]
    if not pollers:
        return "; it holds no poller"
    shown = ", ".join(pollers[:10]) + (
        f" and {len(pollers) - 10} more" if len(pollers) > 10 else ""
    )
    return f"; it holds: {shown}"


def parse_value(text: str, kind: str) -> Any:
    """A cursor or key value typed on the command line, as the ``kind`` it must be."""
    try:
        if kind == "int":
            return int(text)
        if kind == "decimal":
            value = decimal.Decimal(text)
            if not value.is_finite():
                raise ValueError("not a finite number")
            return value
        if kind == "float":
            return float(text)
        if kind == "uuid":
            return uuid.UUID(text)
        if kind == "date":
            return dt.date.fromisoformat(text)
        if kind in ("timestamp", "naive_timestamp"):
            raw = text.strip().replace(" ", "T", 1)
            parsed = dt.datetime.fromisoformat(raw[:-1] + "+00:00" if raw.endswith("Z") else raw)
            if kind == "naive_timestamp":
                if parsed.tzinfo is not None:
                    raise ValueError("a naive timestamp must not carry a time zone")
                return parsed
            if parsed.tzinfo is None:
                raise ValueError("add a time zone (e.g. Z), or use --kind naive_timestamp")
            return parsed.astimezone(dt.timezone.utc)
        if kind == "str":
            return text
    except (ValueError, ArithmeticError) as exc:
        raise ConfigurationError(f"{text!r} is not a valid {kind}: {exc}") from None
    raise ConfigurationError(f"unknown kind {kind!r}; use one of {', '.join(VALUE_KINDS)}")


#: The kinds a source's columns take: (the cursor's, {key column: kind}); None
#: for a kind it cannot tell (a query-mode source with no row yet).
SourceKinds = tuple[str | None, Mapping[str, str | None]]


def source_kinds(source: Any) -> SourceKinds | None:
    """What the source's column types say the position values are (reflected now)."""
    if not isinstance(source, KnowsCursorKind):
        return None
    kinds = source.column_kinds()
    cursor_column = getattr(source, "cursor_column", None)
    return (kinds.get(cursor_column) if cursor_column else None), kinds


def stored_key_fits(doc: StateDocument, source: Any) -> bool:
    """False when the checkpoint's key columns are not ``source``'s (a tiebreaker edited
    by hand): ``--to-cursor`` then takes its key and types from the source, so the reset
    that repairs such a checkpoint is not refused for naming the source's key."""
    keys = getattr(source, "pk_columns", None)
    if keys is None or doc.checkpoint is None:
        return True
    return set(doc.checkpoint.position.pk) == set(keys)


def parse_position(
    cursor: str,
    pks: Sequence[str],
    *,
    kind: str | None,
    like: StateDocument | None,
    kinds: Callable[[], SourceKinds | None] = lambda: None,
    flag: str = "--to-cursor",
) -> Position:
    """``--to-cursor V --pk K[:KIND]=V...`` as a Position.

    Kinds come from ``--kind`` / ``K:KIND``, else from the stored checkpoint
    (so a timestamp poller's cursor is parsed as a timestamp), else from the
    source's column types (``kinds``, asked only then: it reflects the table).
    Never from the look of the value: a guess ("2026-04-07" is text) wrote a
    checkpoint the next tick refused as a type change.

    Raises:
        ConfigurationError: a kind none of these tells (give ``--kind`` or
            ``--source``), or a value that does not parse as its kind.
    """
    stored = like.checkpoint.position if like is not None and like.checkpoint else None
    learned: list[SourceKinds | None] = []

    def from_source() -> SourceKinds | None:
        if not learned:
            learned.append(kinds())
        return learned[0]

    def unknown(what: str, option: str) -> ConfigurationError:
        return ConfigurationError(
            f"cannot tell which type {what} is: the poller has no checkpoint to take it from "
            "and no source column says it; add --source MODULE:ATTR (the type is read from "
            f"the table) or {option}"
        )

    typed: list[tuple[str, str, str]] = []  # (name, kind or "", value)
    for item in pks:
        spec, sep, value = item.partition("=")
        name, _, written = spec.partition(":")
        if not sep or not name:
            raise ConfigurationError(f"--pk expects NAME=VALUE or NAME:KIND=VALUE, got {item!r}")
        typed.append((name, written, value))
    names = {name for name, _, _ in typed}
    if stored is not None and stored.pk and names != set(stored.pk):
        raise ConfigurationError(
            f"the checkpoint's key is {sorted(stored.pk)}, got --pk for {sorted(names)}; "
            "give a value for every key column"
        )
    if not typed:
        raise ConfigurationError(
            "a cursor position needs the key too: add --pk NAME=VALUE for each key column "
            "(the position is 'after the row with this cursor and key')"
        )
    if kind is None and stored is not None and stored.cursor is not None:
        kind = encode_value(stored.cursor)[0]
    if kind is None:
        known = from_source()
        kind = known[0] if known is not None else None
    if kind is None:
        raise unknown(f"{flag} {cursor!r}", f"--kind {{{','.join(VALUE_KINDS)}}}")
    pk: dict[str, Any] = {}
    for name, given, value in typed:
        pk_kind: str | None = given or None
        stored_value = stored.pk.get(name) if stored is not None else None
        if pk_kind is None and stored_value is not None:
            pk_kind = encode_value(stored_value)[0]
        if pk_kind is None:
            known = from_source()
            pk_kind = known[1].get(name) if known is not None else None
        if pk_kind is None:
            raise unknown(f"--pk {name}={value!r}", f"--pk {name}:KIND={value}")
        pk[name] = parse_value(value, pk_kind)
    return Position(cursor=parse_value(cursor, kind), pk=pk)


#: What a dry run without ``--reason`` shows as the journal entry's reason.
NO_REASON_YET = "<--reason: required with --yes>"


def reason_from_args(args: argparse.Namespace) -> str:
    """``--reason``: required to apply a change (it goes into the journal), not to see
    the plan: a dry run without it shows :data:`NO_REASON_YET` in its place.

    Raises:
        ConfigurationError: ``--yes`` without ``--reason``.
    """
    reason: str | None = getattr(args, "reason", None)
    if reason is not None:
        return reason
    if args.yes:
        raise ConfigurationError(
            "--reason is required with --yes: it goes into the journal with who and when "
            "(the dry run without --yes needs none)"
        )
    return NO_REASON_YET


def dry_run_note(args: argparse.Namespace) -> str:
    """The last line of a dry run: what to add to apply it."""
    if getattr(args, "reason", None) is None:
        return "dry run: nothing was written; add --reason TEXT --yes to apply"
    return "dry run: nothing was written; add --yes to apply"


def actor_from_args(args: argparse.Namespace) -> str:
    return str(args.actor or default_actor())


def by_hand(args: argparse.Namespace, now: dt.datetime, details: dict[str, Any]) -> Manual:
    """Who changes a poller's state from the command line, when and why (``--actor``,
    ``--reason``, ``--force``): the keyword arguments every state operation takes
    (:mod:`dbtrigger.state.operations`). ``details`` is shared, not copied: what
    the command adds to it later is journaled too."""
    return {
        "now": now,
        "actor": actor_from_args(args),
        "reason": reason_from_args(args),
        "force": args.force,
        "details": details,
    }


# --- options ---------------------------------------------------------------------------


def add_store_options(
    parser: argparse.ArgumentParser, *, default_hint: str = "", source: bool = True
) -> None:
    hint = f"${ENV_STORE}" + (f", else {default_hint}" if default_hint else "")
    if source:
        hint += ", else the --source trigger's own store"
        parser.add_argument(
            "--source",
            "--trigger",
            dest="source",
            metavar="MODULE:ATTR",
            help="the poller's PollTrigger or @db.trigger Functions function "
            "(function_app:orders_poll), or a source adapter; a trigger also gives the store",
        )
    parser.add_argument(
        "--store",
        help="state store: DIR, file:DIR, memory:NAME, an Azure connection string, %%SETTING%%, "
        f"azure-blob://HOST/CONTAINER?app=APP, azure-table://..., or a SQL URL (default {hint})",
    )
    parser.add_argument("--app", help=f"application name in shared stores (default ${ENV_APP})")
    parser.add_argument(
        "--container", help=f"blob container for connection strings (default ${ENV_CONTAINER})"
    )
    parser.add_argument("--table", help="table name for azure-table: stores")


def add_poller_argument(parser: argparse.ArgumentParser) -> None:
    """The positional ``poller`` of the commands that read or change one state document."""
    parser.add_argument("poller", help="the poller name (its state document)")


def add_change_options(
    parser: argparse.ArgumentParser,
    *,
    lease: bool = True,
    force_help: str = "proceed under a live lease, fencing its holder out (token + 1)",
    reason_help: str = "why: recorded in the journal",
) -> None:
    """The options of every command that journals a change: --reason, --yes, --actor and,
    where it writes state documents under leases, --force and --backup-dir."""
    parser.add_argument(
        "--reason",
        help=f"{reason_help} (required with --yes, not for a dry run); the record goes to "
        "the --trigger's own history (none with history=False), or with only a store to the "
        "one beside it if that holds the poller's, else to none (said so)",
    )
    add_apply_option(parser)
    parser.add_argument("--actor", help="who, for the journal (default user@host)")
    if lease:
        parser.add_argument("--force", action="store_true", help=force_help)
        parser.add_argument(
            "--backup-dir",
            help=f"where the previous document is saved (default ${ENV_BACKUP_DIR} "
            f"or ./{DEFAULT_BACKUP_DIR})",
        )


def add_cursor_options(parser: argparse.ArgumentParser, flag: str) -> None:
    parser.add_argument(
        "--pk", action="append", default=[], metavar="NAME[:KIND]=VALUE", help="key of that row"
    )
    parser.add_argument(
        "--kind",
        choices=VALUE_KINDS,
        help=f"how to read {flag} (default: the stored checkpoint's kind)",
    )
