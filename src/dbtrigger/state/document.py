"""The state document: one JSON object per poller holding checkpoint and lease.

Checkpoint and lease live in one document so that every change - acquiring the
lease, committing a batch, heartbeating, releasing - is a single conditional
write. A stale owner can never overwrite a newer owner's checkpoint, because
its write carries an etag that no longer matches.

Version 1 layout (fields beyond the contract's core are optional, so a document
written by the contract's reference format reads fine)::

    {
      "version": 1,
      "poller_name": "orders",
      "source_fingerprint": "sha256:...",
      "checkpoint": {
        "cursor": {"kind": "timestamp+pk", "value": "2026-04-07T01:23:45.123456Z",
                   "tiebreaker": {"id": 12093}, "tiebreaker_kinds": {"id": "int"}},
        "last_successful_batch_id": "batch_20260407_012346_42_0001",
        "updated_at": "2026-04-07T01:23:46.020000Z",
        "metadata": {"row_count": 100}
      },
      "lease": {"owner_id": "...", "fencing_token": 42, "acquired_at": "...",
                "heartbeat_at": "...", "expires_at": "...", "released": false},
      "failure": null,
      "journal": []
    }

``checkpoint`` is ``null`` until the first commit (the poller starts from the
beginning of the source). ``tiebreaker_kinds`` is written for every key so that
uuid, Decimal and timestamp keys read back as themselves; when it is absent, ints
and strings are taken as they are. ``failure`` tracks a batch that keeps failing
(poison handling) and ``journal`` the most recent commits and manual operations.
A failure record looks like::

    {"attempts": 3, "first_failed_at": "...", "last_failed_at": "...",
     "last_error": "ValueError: ...", "batch_id": "...",
     "checkpoint": {...position the failing batch starts from...},
     "done_event_ids": ["..."]}

where ``checkpoint`` and ``done_event_ids`` are optional (see :class:`FailureRecord`).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dbtrigger.cursor import Position, decode_value, encode_value, infer_kind
from dbtrigger.errors import CorruptStateError

VERSION = 1

#: How many journal entries a document keeps; older ones drop off.
DEFAULT_JOURNAL_LIMIT = 50


def format_time(value: dt.datetime) -> str:
    """UTC ISO-8601 with microseconds and ``Z``: the document's only time format."""
    if value.tzinfo is None:
        raise ValueError("state document times must be timezone-aware")
    return (
        value.astimezone(dt.timezone.utc).replace(tzinfo=None).isoformat(timespec="microseconds")
        + "Z"
    )


def parse_time(value: Any, where: str) -> dt.datetime:
    if not isinstance(value, str):
        raise CorruptStateError(f"{where} must be an ISO-8601 string, got {value!r}")
    text = value[:-1] + "+00:00" if value.endswith("Z") else value
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise CorruptStateError(f"{where} is not an ISO-8601 time: {value!r}") from exc
    if parsed.tzinfo is None:
        raise CorruptStateError(f"{where} has no time zone: {value!r}")
    return parsed.astimezone(dt.timezone.utc)


@dataclass(frozen=True)
class Lease:
    """Who may process right now, until when, and under which fencing token."""

    owner_id: str
    fencing_token: int
    acquired_at: dt.datetime
    heartbeat_at: dt.datetime
    expires_at: dt.datetime
    released: bool = False


@dataclass(frozen=True)
class Checkpoint:
    """The last committed position and what committed it."""

    position: Position
    last_successful_batch_id: str | None
    updated_at: dt.datetime
    row_count: int = 0


@dataclass(frozen=True)
class FailureRecord:
    """A batch that has failed and will be retried from ``checkpoint``'s position.

    Kept in the document so every instance agrees on the attempt count, which
    is what lets a poison batch be isolated after ``max_attempts``.

    ``from_position`` is the checkpoint the failing batch starts from; a record
    whose position is not the document's checkpoint any more (the checkpoint
    was reset by hand) no longer applies. ``done`` holds the event ids of rows
    of that batch which the handler already processed (it named other rows in a
    :class:`~dbtrigger.errors.PartialBatchError`, or they passed while a poison
    row was being isolated): they lie after the failed row, so the checkpoint
    cannot move over them yet, and they are skipped when the batch is delivered
    again. Both are optional in the JSON; older documents read as "applies to
    the current checkpoint, nothing done".
    """

    attempts: int
    first_failed_at: dt.datetime
    last_failed_at: dt.datetime
    last_error: str
    batch_id: str | None = None
    from_position: Position | None = None
    done: tuple[str, ...] = ()


@dataclass(frozen=True)
class StateDocument:
    """Immutable, validated view of one poller's state."""

    poller_name: str
    source_fingerprint: str
    checkpoint: Checkpoint | None = None
    lease: Lease | None = None
    failure: FailureRecord | None = None
    journal: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)
    version: int = VERSION

    @property
    def position(self) -> Position:
        return self.checkpoint.position if self.checkpoint else Position()

    def with_journal_entry(
        self, entry: Mapping[str, Any], limit: int = DEFAULT_JOURNAL_LIMIT
    ) -> StateDocument:
        journal = (*self.journal, dict(entry))
        return replace(self, journal=journal[-limit:] if limit > 0 else ())


# --- serialisation -------------------------------------------------------------


def position_to_json(position: Position) -> dict[str, Any]:
    kind, value = encode_value(position.cursor)
    tiebreaker: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for name, pk_value in position.pk.items():
        kinds[name], tiebreaker[name] = encode_value(pk_value)
    return {
        "kind": f"{kind}+pk",
        "value": value,
        "tiebreaker": tiebreaker,
        "tiebreaker_kinds": kinds,
    }


def position_from_json(raw: Any, where: str = "checkpoint.cursor") -> Position:
    if not isinstance(raw, Mapping):
        raise CorruptStateError(f"{where} must be an object, got {raw!r}")
    kind = raw.get("kind")
    if not isinstance(kind, str) or not kind:
        raise CorruptStateError(f"{where}.kind must be a non-empty string")
    cursor_kind = kind.split("+", 1)[0]
    cursor = decode_value(cursor_kind, raw.get("value"))
    tiebreaker = raw.get("tiebreaker") or {}
    kinds = raw.get("tiebreaker_kinds") or {}
    if not isinstance(tiebreaker, Mapping) or not isinstance(kinds, Mapping):
        raise CorruptStateError(f"{where}.tiebreaker must be an object of key values")
    pk = {
        str(name): decode_value(str(kinds.get(name) or infer_kind(value)), value)
        for name, value in tiebreaker.items()
    }
    return Position(cursor=cursor, pk=pk)


def to_json(doc: StateDocument) -> dict[str, Any]:
    checkpoint = None
    if doc.checkpoint is not None:
        checkpoint = {
            "cursor": position_to_json(doc.checkpoint.position),
            "last_successful_batch_id": doc.checkpoint.last_successful_batch_id,
            "updated_at": format_time(doc.checkpoint.updated_at),
            "metadata": {"row_count": doc.checkpoint.row_count},
        }
    lease = None
    if doc.lease is not None:
        lease = {
            "owner_id": doc.lease.owner_id,
            "fencing_token": doc.lease.fencing_token,
            "acquired_at": format_time(doc.lease.acquired_at),
            "heartbeat_at": format_time(doc.lease.heartbeat_at),
            "expires_at": format_time(doc.lease.expires_at),
            "released": doc.lease.released,
        }
    failure = None
    if doc.failure is not None:
        failure = {
            "attempts": doc.failure.attempts,
            "first_failed_at": format_time(doc.failure.first_failed_at),
            "last_failed_at": format_time(doc.failure.last_failed_at),
            "last_error": doc.failure.last_error,
            "batch_id": doc.failure.batch_id,
        }
        if doc.failure.from_position is not None:
            failure["checkpoint"] = position_to_json(doc.failure.from_position)
        if doc.failure.done:
            failure["done_event_ids"] = list(doc.failure.done)
    return {
        "version": doc.version,
        "poller_name": doc.poller_name,
        "source_fingerprint": doc.source_fingerprint,
        "checkpoint": checkpoint,
        "lease": lease,
        "failure": failure,
        "journal": [dict(entry) for entry in doc.journal],
    }


def dumps(doc: StateDocument) -> bytes:
    # Compact on purpose: every commit serialises the document, and an indented
    # dump takes Python's pure-Python encoder (5x slower, 60% more bytes per
    # write). `dbtrigger status/history` and `python -m json.tool` are for eyes.
    return json.dumps(to_json(doc), separators=(",", ":")).encode("utf-8")


def _require(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in raw:
        raise CorruptStateError(f"{where}.{key} is missing")
    value = raw[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptStateError(f"{where}.{key} has the wrong type: {value!r}")
    return value


def from_json(raw: Any) -> StateDocument:
    """Validate and parse a decoded state document.

    Raises:
        CorruptStateError: naming the first field that is missing or malformed.
    """
    if not isinstance(raw, Mapping):
        raise CorruptStateError("state document must be a JSON object")
    version = _require(raw, "version", int, "document")
    if version != VERSION:
        raise CorruptStateError(
            f"state document version {version} is not supported (this dbtrigger reads {VERSION})"
        )
    poller_name = _require(raw, "poller_name", str, "document")
    fingerprint = _require(raw, "source_fingerprint", str, "document")

    checkpoint = None
    raw_cp = raw.get("checkpoint")
    if raw_cp is not None:
        if not isinstance(raw_cp, Mapping):
            raise CorruptStateError("checkpoint must be an object or null")
        meta = raw_cp.get("metadata") or {}
        row_count = meta.get("row_count", 0) if isinstance(meta, Mapping) else 0
        batch_id = raw_cp.get("last_successful_batch_id")
        if batch_id is not None and not isinstance(batch_id, str):
            raise CorruptStateError("checkpoint.last_successful_batch_id must be a string")
        checkpoint = Checkpoint(
            position=position_from_json(_require(raw_cp, "cursor", Mapping, "checkpoint")),
            last_successful_batch_id=batch_id,
            updated_at=parse_time(raw_cp.get("updated_at"), "checkpoint.updated_at"),
            row_count=row_count if isinstance(row_count, int) else 0,
        )

    lease = None
    raw_lease = raw.get("lease")
    if raw_lease is not None:
        if not isinstance(raw_lease, Mapping):
            raise CorruptStateError("lease must be an object or null")
        lease = Lease(
            owner_id=_require(raw_lease, "owner_id", str, "lease"),
            fencing_token=_require(raw_lease, "fencing_token", int, "lease"),
            acquired_at=parse_time(raw_lease.get("acquired_at"), "lease.acquired_at"),
            heartbeat_at=parse_time(raw_lease.get("heartbeat_at"), "lease.heartbeat_at"),
            expires_at=parse_time(raw_lease.get("expires_at"), "lease.expires_at"),
            released=bool(raw_lease.get("released", False)),
        )

    failure = None
    raw_failure = raw.get("failure")
    if raw_failure is not None:
        if not isinstance(raw_failure, Mapping):
            raise CorruptStateError("failure must be an object or null")
        failure = FailureRecord(
            attempts=_require(raw_failure, "attempts", int, "failure"),
            first_failed_at=parse_time(
                raw_failure.get("first_failed_at"), "failure.first_failed_at"
            ),
            last_failed_at=parse_time(raw_failure.get("last_failed_at"), "failure.last_failed_at"),
            last_error=str(raw_failure.get("last_error", "")),
            batch_id=raw_failure.get("batch_id"),
            from_position=(
                position_from_json(raw_failure["checkpoint"], "failure.checkpoint")
                if raw_failure.get("checkpoint") is not None
                else None
            ),
            done=_done_ids(raw_failure.get("done_event_ids")),
        )

    journal_raw = raw.get("journal") or []
    if not isinstance(journal_raw, list) or not all(isinstance(e, Mapping) for e in journal_raw):
        raise CorruptStateError("journal must be a list of objects")

    return StateDocument(
        poller_name=poller_name,
        source_fingerprint=fingerprint,
        checkpoint=checkpoint,
        lease=lease,
        failure=failure,
        journal=tuple(dict(e) for e in journal_raw),
        version=version,
    )


def _done_ids(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(e, str) for e in raw):
        raise CorruptStateError("failure.done_event_ids must be a list of strings")
    return tuple(raw)


def loads(data: bytes | str) -> StateDocument:
    """Parse stored bytes; any malformation becomes :class:`CorruptStateError`."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptStateError(f"state document is not valid JSON: {exc}") from exc
    return from_json(raw)
