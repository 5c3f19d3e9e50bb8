"""``dbtrigger status | history | reset | clone | release-lease | skip-batch | backfill``.

Operators steer pollers through these commands instead of editing state
documents by hand. Everything goes through the :class:`CheckpointStore` port
(read with an etag, conditional write), so a command can never overwrite a
change it did not see, and the pure transitions in
:mod:`dbtrigger.state.operations` decide what the new document is.

Guardrails on every command that changes state:

* **dry run by default**: the before/after is printed and nothing is written
  until ``--yes`` is given;
* **a live lease refuses the change** unless ``--force``, which fences the
  holder out (fencing token + 1) so its in-flight commit is rejected;
* **``--reason`` is required** and goes into the journal with who and when;
* **the previous document is saved** to a local backup directory first, and the
  command prints how to restore it (``reset --from-file``).

Secrets never reach the terminal: all output and error text passes through
:func:`~dbtrigger.state.stores.factory.redact`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import decimal
import getpass
import json
import os
import re
import socket
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from dbtrigger.cursor import Position, encode_value
from dbtrigger.errors import (
    CasConflictError,
    ConfigurationError,
    DbTriggerError,
)
from dbtrigger.health import measure_lag
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.sources.base import SourceAdapter, position_of
from dbtrigger.state import document as docmod
from dbtrigger.state import operations as ops
from dbtrigger.state.document import StateDocument
from dbtrigger.state.lease import describe_lease
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.factory import describe_store, open_store, redact

ENV_STORE = "DBTRIGGER_STORE"
ENV_APP = "DBTRIGGER_APP"
ENV_CONTAINER = "DBTRIGGER_CONTAINER"
ENV_BACKUP_DIR = "DBTRIGGER_BACKUP_DIR"
DEFAULT_BACKUP_DIR = "dbtrigger-backups"

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


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


# --- configuration ----------------------------------------------------------------------


def store_from_args(args: argparse.Namespace) -> CheckpointStore:
    spec = args.store or os.environ.get(ENV_STORE)
    if not spec:
        raise ConfigurationError(f"no state store given: pass --store or set {ENV_STORE}")
    return open_store(
        spec,
        app=args.app or os.environ.get(ENV_APP),
        container=args.container or os.environ.get(ENV_CONTAINER),
        table=args.table,
    )


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

    @property
    def batch_size(self) -> int | None:
        return self.trigger.batch_size if self.trigger is not None else None


def load_source(spec: str) -> LoadedSource:
    """``--source MODULE:ATTR``: a PollTrigger (its source is used) or a SourceAdapter."""
    from dbtrigger.cli import load_object  # noqa: PLC0415 - cli imports this module

    target = load_object(spec)
    if isinstance(target, PollTrigger):
        return LoadedSource(target.source, target)
    if isinstance(target, SourceAdapter):
        return LoadedSource(target, None)
    raise ConfigurationError(
        f"{spec} is a {type(target).__name__}, not a PollTrigger or a source adapter"
    )


def _read(store: CheckpointStore, poller: str) -> tuple[StateDocument, str, bytes]:
    stored = store.read(poller)
    if stored is None:
        raise ConfigurationError(f"no state for poller {poller!r} in {describe_store(store)}")
    return docmod.loads(stored.data), stored.etag, stored.data


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


def _guess_kind(text: str) -> str:
    return "int" if re.fullmatch(r"-?\d+", text) else "str"


def parse_position(
    cursor: str, pks: Sequence[str], *, kind: str | None, like: StateDocument | None
) -> Position:
    """``--to-cursor V --pk K[:KIND]=V...`` as a Position.

    Kinds come from ``--kind`` / ``K:KIND``, else from the stored checkpoint
    (so a timestamp poller's cursor is parsed as a timestamp), else an integer
    if it looks like one and a string otherwise.
    """
    stored = like.checkpoint.position if like is not None and like.checkpoint else None
    if kind is None:
        kind = encode_value(stored.cursor)[0] if stored is not None else _guess_kind(cursor)
        if kind == "null":
            kind = _guess_kind(cursor)
    pk: dict[str, Any] = {}
    for item in pks:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigurationError(f"--pk expects NAME=VALUE or NAME:KIND=VALUE, got {item!r}")
        name, _, pk_kind = name.partition(":")
        if not pk_kind:
            known = stored.pk.get(name) if stored is not None else None
            pk_kind = encode_value(known)[0] if known is not None else _guess_kind(value)
        pk[name] = parse_value(value, pk_kind)
    if stored is not None and stored.pk and set(pk) != set(stored.pk):
        raise ConfigurationError(
            f"the checkpoint's key is {sorted(stored.pk)}, got --pk for {sorted(pk)}; "
            "give a value for every key column"
        )
    if not pk:
        raise ConfigurationError(
            "a cursor position needs the key too: add --pk NAME=VALUE for each key column "
            "(the position is 'after the row with this cursor and key')"
        )
    return Position(cursor=parse_value(cursor, kind), pk=pk)


# --- status ------------------------------------------------------------------------------


def poller_status(
    store: CheckpointStore,
    poller: str,
    *,
    source: LoadedSource | None,
    now: dt.datetime,
) -> dict[str, Any]:
    """Everything ``status`` shows about one poller, as JSON-able data."""
    out: dict[str, Any] = {"poller": poller}
    try:
        doc, _, _ = _read(store, poller)
    except DbTriggerError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    cp = doc.checkpoint
    out["checkpoint"] = (
        {
            "cursor": docmod.position_to_json(cp.position),
            "display": show_position(cp.position),
            "last_batch_id": cp.last_successful_batch_id,
            "updated_at": docmod.format_time(cp.updated_at),
            "rows_in_last_batch": cp.row_count,
        }
        if cp is not None
        else None
    )
    lease = doc.lease
    out["lease"] = (
        {
            "state": (
                "released" if lease.released else ("live" if now < lease.expires_at else "expired")
            ),
            "owner_id": lease.owner_id,
            "fencing_token": lease.fencing_token,
            "expires_at": docmod.format_time(lease.expires_at),
            "description": describe_lease(lease, now),
        }
        if lease is not None
        else None
    )
    out["fingerprint"] = doc.source_fingerprint
    failure = doc.failure
    out["failure"] = (
        {
            "batch_id": failure.batch_id,
            "attempts": failure.attempts,
            "first_failed_at": docmod.format_time(failure.first_failed_at),
            "last_failed_at": docmod.format_time(failure.last_failed_at),
            "last_error": failure.last_error,
        }
        if failure is not None
        else None
    )
    out["since_last_commit_seconds"] = (
        round((now - cp.updated_at).total_seconds(), 3) if cp is not None else None
    )
    lag: dict[str, Any] = {"rows": None, "seconds": None, "note": "pass --source to measure lag"}
    if source is not None:
        matches = source.source.fingerprint() == doc.source_fingerprint
        out["fingerprint_matches_source"] = matches
        if not matches:
            lag["note"] = "the --source definition differs from this poller's (fingerprint)"
        else:
            try:
                measured = measure_lag(source.source, doc.position, now, poller=poller)
                lag = {
                    "rows": measured.rows,
                    "seconds": None if measured.seconds is None else round(measured.seconds, 3),
                    "note": measured.note,
                }
            except DbTriggerError as exc:
                lag["note"] = f"lag unknown: {type(exc).__name__}: {exc}"
    out["lag"] = lag
    manual = [e for e in doc.journal if e.get("type") == "manual"]
    out["journal_entries"] = len(doc.journal)
    out["last_manual_change"] = dict(manual[-1]) if manual else None
    return out


def _render_one(status: Mapping[str, Any], store: str) -> str:
    if "error" in status:
        return f"poller       {status['poller']}\nerror        {status['error']}"
    cp = status["checkpoint"]
    lease = status["lease"]
    failure = status["failure"]
    lag = status["lag"]
    lines = [
        ("poller", status["poller"]),
        ("store", store),
        ("checkpoint", cp["display"] if cp else "(beginning: nothing committed yet)"),
        (
            "last batch",
            f"{cp['last_batch_id'] or '(manual change)'} at {cp['updated_at']}" if cp else "-",
        ),
        ("lease", lease["description"] if lease else "no lease"),
    ]
    if lag["rows"] is None and lag["seconds"] is None:
        lag_text = f"unknown ({lag['note']})"
    else:
        lag_text = "? rows" if lag["rows"] is None else f"{lag['rows']} rows"
        if lag["seconds"] is not None:
            lag_text += f", oldest pending {lag['seconds']:.1f}s"
        if lag["note"]:
            lag_text += f" ({lag['note']})"
    lines.append(("lag", lag_text))
    fingerprint = status["fingerprint"]
    if "fingerprint_matches_source" in status:
        fingerprint += (
            " (matches --source)"
            if status["fingerprint_matches_source"]
            else " (DIFFERS from --source)"
        )
    lines.append(("fingerprint", fingerprint))
    if failure:
        lines.append(
            (
                "failing",
                f"batch {failure['batch_id']}: {failure['attempts']} attempt(s) since "
                f"{failure['first_failed_at']}; last error: {failure['last_error']}",
            )
        )
    else:
        lines.append(("failing", "none"))
    manual = status["last_manual_change"]
    if manual:
        lines.append(
            (
                "last manual",
                f"{manual.get('operation')} by {manual.get('actor')} at {manual.get('at')}: "
                f"{manual.get('reason')}",
            )
        )
    lines.append(("journal", f"{status['journal_entries']} entries (dbtrigger history)"))
    return "\n".join(f"{k:<12} {v}" for k, v in lines)


def _render_many(statuses: Sequence[Mapping[str, Any]]) -> str:
    rows = [["POLLER", "CURSOR", "LAST COMMIT", "LEASE", "LAG ROWS", "FAILING"]]
    for s in statuses:
        if "error" in s:
            rows.append([s["poller"], f"error: {s['error']}", "", "", "", ""])
            continue
        cp, lease, failure = s["checkpoint"], s["lease"], s["failure"]
        lease_text = "-"
        if lease:
            lease_text = f"{lease['state']} t{lease['fencing_token']}"
        rows.append(
            [
                s["poller"],
                cp["display"] if cp else "(beginning)",
                cp["updated_at"] if cp else "-",
                lease_text,
                "?" if s["lag"]["rows"] is None else str(s["lag"]["rows"]),
                f"{failure['attempts']}x {failure['batch_id']}" if failure else "-",
            ]
        )
    return _table(rows)


def cmd_status(args: argparse.Namespace) -> int:
    with state_store(args) as store:
        return _status(args, store)


def _status(args: argparse.Namespace, store: CheckpointStore) -> int:
    console = Console()
    source = load_source(args.source) if args.source else None
    now = utc_now()
    names = [args.poller] if args.poller else store.list_keys()
    statuses = [poller_status(store, name, source=source, now=now) for name in names]
    if args.json:
        console.json(statuses[0] if args.poller else statuses)
    elif not statuses:
        console.print(f"no pollers in {describe_store(store)}")
    elif args.poller:
        console.print(_render_one(statuses[0], describe_store(store)))
    else:
        console.print(f"store {describe_store(store)}")
        console.print(_render_many(statuses))
    return 1 if any("error" in s for s in statuses) else 0


# --- history -----------------------------------------------------------------------------


def cmd_history(args: argparse.Namespace) -> int:
    console = Console()
    with state_store(args) as store:
        doc, _, _ = _read(store, args.poller)
    entries = list(doc.journal)[-args.limit :] if args.limit else list(doc.journal)
    if args.json:
        console.json(entries)
        return 0
    if not entries:
        console.print(f"poller {args.poller!r} has no journal entries yet")
        return 0
    rows = [["AT", "TYPE", "BATCH / OPERATION", "FROM", "TO", "ROWS", "BY", "TOKEN", "NOTE"]]
    for e in entries:
        if e.get("type") == "commit":
            rows.append(
                [
                    str(e.get("committed_at", "")),
                    "commit",
                    str(e.get("batch_id", "")),
                    show_position(e.get("from")),
                    show_position(e.get("to")),
                    str(e.get("rows", "")),
                    str(e.get("owner_id", "")),
                    str(e.get("fencing_token", "")),
                    f"{e.get('duration_ms', '')} ms",
                ]
            )
        else:
            fenced = e.get("fenced") or {}
            rows.append(
                [
                    str(e.get("at", "")),
                    str(e.get("type", "")),
                    str(e.get("operation", "")),
                    show_position(e.get("before")),
                    show_position(e.get("after")),
                    str(e.get("skipped_rows", "")),
                    str(e.get("actor", "")),
                    str(fenced.get("new_fencing_token", "")),
                    f"reason: {e.get('reason', '')}",
                ]
            )
    console.print(_table(rows))
    return 0


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
    before, etag, raw = _read(store, args.poller)
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


def actor_from_args(args: argparse.Namespace) -> str:
    return str(args.actor or default_actor())


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
    doc, _, _ = _read(store, args.poller)
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


def add_store_options(parser: argparse.ArgumentParser, *, default_hint: str = "") -> None:
    hint = f"${ENV_STORE}" + (f", else {default_hint}" if default_hint else "")
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


def add_change_options(parser: argparse.ArgumentParser, *, lease: bool = True) -> None:
    parser.add_argument("--reason", required=True, help="why: recorded in the journal")
    parser.add_argument("--yes", action="store_true", help="apply (default: dry run)")
    parser.add_argument("--actor", help="who, for the journal (default user@host)")
    if lease:
        parser.add_argument(
            "--force",
            action="store_true",
            help="proceed under a live lease, fencing its holder out (token + 1)",
        )
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


def _add_read_commands(sub: Any) -> None:
    status = sub.add_parser("status", help="checkpoint, lease, lag and failures of pollers")
    status.add_argument("poller", nargs="?", help="one poller (default: all in the store)")
    status.add_argument("--source", help="MODULE:ATTR (PollTrigger or source) to measure lag")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    add_store_options(status)
    status.set_defaults(func=cmd_status)

    history = sub.add_parser("history", help="the poller's journal: commits and manual changes")
    history.add_argument("poller")
    history.add_argument("--limit", type=int, default=0, help="only the last N entries")
    history.add_argument("--json", action="store_true")
    add_store_options(history)
    history.set_defaults(func=cmd_history)


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


def add_state_commands(sub: Any) -> None:
    """Register status, history, reset, clone, release-lease and skip-batch."""
    _add_read_commands(sub)
    _add_reset(sub)
    _add_other_changes(sub)


__all__ = [
    "Console",
    "add_change_options",
    "add_cursor_options",
    "add_state_commands",
    "add_store_options",
    "parse_position",
    "parse_value",
    "poller_status",
    "print_plan",
    "show_position",
]
