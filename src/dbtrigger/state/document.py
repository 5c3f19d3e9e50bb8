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
     "batch_end": {...position of its last row...}, "batch_rows": 100,
     "batch_digest": "sha256:...",
     "done_event_ids": ["..."], "done_total": 1500}

where everything after ``batch_id`` is optional (see :class:`FailureRecord`):
a reader that does not know a field keeps it (below), so v1 readers still read it.

Rolling upgrades: a document may be written by a newer dbtrigger that knows
fields this one does not. Unknown keys at the top level and inside
``checkpoint``, ``checkpoint.metadata``, ``lease`` and ``failure`` are kept in
the ``extra`` mapping of the matching dataclass and written back unchanged, so
an older instance taking a turn never erases them. Known fields are
type-checked one by one: a value of the wrong type (``"released": "false"``)
is a :class:`~dbtrigger.errors.CorruptStateError`, never a guess.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from dbtrigger.cursor import Position
from dbtrigger.errors import CorruptStateError
from dbtrigger.state.codec import format_time, parse_time, position_from_json, position_to_json
from dbtrigger.state.kept_texts import JournalRecord, journal_text, static_text
from dbtrigger.state.kept_texts import encode_json as _encode
from dbtrigger.state.raw_fields import count, require, typed
from dbtrigger.state.window import Window

# The encodings of times and positions live below the document (the window
# and the journal use them too); they are still read from here by most callers.
from dbtrigger.state.written_texts import WrittenTexts

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

VERSION = 1

#: How many journal entries a document keeps; older ones drop off. One limit
#: for every writer: a poller's commits (``PollTrigger(journal_limit=)``) and
#: an operator's manual changes alike.
DEFAULT_JOURNAL_LIMIT = 20


@dataclass(frozen=True)
class Lease:
    """Who may process right now, until when, and under which fencing token."""

    owner_id: str
    fencing_token: int
    acquired_at: dt.datetime
    heartbeat_at: dt.datetime
    expires_at: dt.datetime
    released: bool = False
    #: The process that took the lease (:mod:`dbtrigger._process`), or None.
    process: Mapping[str, Any] | None = field(default=None, hash=False)
    #: Fields this version does not know, written back as they were read.
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Checkpoint:
    """The last committed position and what committed it."""

    position: Position
    last_successful_batch_id: str | None
    updated_at: dt.datetime
    row_count: int = 0
    #: Fields this version does not know (``metadata`` ones under ``"metadata"``).
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)


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
    #: How many rows of the batch were processed in all; more than ``len(done)``
    #: when the id list was capped to keep the record small (those past the cap
    #: are delivered again: a duplicate, never a loss).
    done_total: int = 0
    #: Where the failing batch ended and how many rows it had, so that
    #: ``dbtrigger skip-batch`` skips exactly the rows the handler saw. None
    #: when the writer did not record them (older versions).
    batch_end: Position | None = None
    batch_rows: int | None = None
    #: :func:`digest_event_ids` of those rows, to check a skip drops exactly them.
    batch_digest: str | None = None
    #: How many of the latest ``attempts`` ended with the process delivering the
    #: batch gone (killed, crashed, hung past its lease): counted when the next
    #: owner takes over a lease left neither released nor renewed
    #: (:mod:`dbtrigger.state.crashes`); an attempt that failed with an
    #: exception sets it back to 0.
    crashes: int = 0
    #: While such a batch is handed over one row at a time to find the row at
    #: fault (with a dead-letter sink), the event id of the row handed alone
    #: right now: written before the call, so a death during it names the row.
    probing: str | None = None
    #: The rows (their ``probing`` keys) that killed the process while handed
    #: alone: each added by the takeover that counted that death, so a row
    #: found once is never handed over again though later steps name others.
    killed: tuple[str, ...] = ()
    #: Fields this version does not know, written back as they were read.
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)


_Frozen = TypeVar("_Frozen", bound="DataclassInstance")
_FIELDS: dict[type, frozenset[str]] = {}


def evolve(obj: _Frozen, **changes: Any) -> _Frozen:
    """``dataclasses.replace`` for this module's frozen dataclasses, at a fifth of
    its cost (a commit makes four): none of them checks anything when it is
    made (no ``__post_init__``, every field in ``__init__``), so the new object
    is the old one's fields with ``changes`` over them, with no ``__init__``
    to run. An unknown field name is a ``TypeError``, as with ``replace``."""
    kind = type(obj)
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = frozenset(f.name for f in fields(kind))
    if not names.issuperset(changes):
        raise TypeError(f"{kind.__name__} has no field(s) {sorted(set(changes) - names)}")
    new = object.__new__(kind)
    state = new.__dict__
    state.update(obj.__dict__)
    state.update(changes)
    return new


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
    #: Top-level fields this version does not know, written back as they were read.
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)
    #: Per-event outcomes above the checkpoint (:class:`~dbtrigger.state.window.Window`,
    #: decided on by :mod:`dbtrigger.state.window`); None when there are none, and
    #: then the field is left out of the JSON, so a document that never used
    #: ``ctx.retry`` is byte-for-byte what it always was.
    window: Window | None = None
    #: What the fingerprint hashes, readable and secret-free, with that fingerprint
    #: (see ``dbtrigger.sources.fingerprint.readable_definition``); None for sources
    #: that cannot describe themselves and documents written before it existed (the
    #: field is then left out of the JSON). Read it through :func:`known_definition`.
    source_definition: Mapping[str, Any] | None = None

    @property
    def position(self) -> Position:
        return self.checkpoint.position if self.checkpoint else Position()

    def with_journal_entry(
        self, entry: Mapping[str, Any], limit: int = DEFAULT_JOURNAL_LIMIT
    ) -> StateDocument:
        record = entry if isinstance(entry, JournalRecord) else JournalRecord(entry)
        journal = (*self.journal, record)
        return evolve(self, journal=journal[-limit:] if limit > 0 else ())


# --- serialisation -------------------------------------------------------------


_TOP_KEYS = frozenset(
    {
        "version",
        "poller_name",
        "source_fingerprint",
        "checkpoint",
        "lease",
        "failure",
        "journal",
        "window",
        "source_definition",
    }
)
_CHECKPOINT_KEYS = frozenset({"cursor", "last_successful_batch_id", "updated_at", "metadata"})
_LEASE_KEYS = frozenset(
    {"owner_id", "fencing_token", "acquired_at", "heartbeat_at", "expires_at", "released"}
)
_FAILURE_KEYS = frozenset(
    {
        "attempts",
        "crashes",
        "probing",
        "killed",
        "first_failed_at",
        "last_failed_at",
        "last_error",
        "batch_id",
        "checkpoint",
        "done_event_ids",
        "done_total",
        "batch_end",
        "batch_rows",
        "batch_digest",
    }
)


def digest_event_ids(event_ids: Iterable[str]) -> str:
    """``sha256:...`` of a batch's event ids in order: the identity of exactly those rows."""
    ids = list(event_ids)
    # Each id followed by a newline, hashed in one update.
    text = "\n".join(ids) + "\n" if ids else ""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _unknown(raw: Mapping[str, Any], known: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k not in known}


def _checkpoint_to_json(checkpoint: Checkpoint) -> dict[str, Any]:
    extra = dict(checkpoint.extra)
    meta_extra = extra.pop("metadata", None)
    metadata = dict(meta_extra) if isinstance(meta_extra, Mapping) else {}
    metadata["row_count"] = checkpoint.row_count
    return {
        **extra,
        "cursor": position_to_json(checkpoint.position),
        "last_successful_batch_id": checkpoint.last_successful_batch_id,
        "updated_at": format_time(checkpoint.updated_at),
        "metadata": metadata,
    }


def _failure_to_json(failure: FailureRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        **failure.extra,
        "attempts": failure.attempts,
        "first_failed_at": format_time(failure.first_failed_at),
        "last_failed_at": format_time(failure.last_failed_at),
        "last_error": failure.last_error,
        "batch_id": failure.batch_id,
    }
    if failure.from_position is not None:
        out["checkpoint"] = position_to_json(failure.from_position)
    if failure.done:
        out["done_event_ids"] = list(failure.done)
    if failure.done_total > len(failure.done):
        out["done_total"] = failure.done_total
    if failure.batch_end is not None:
        out["batch_end"] = position_to_json(failure.batch_end)
    if failure.batch_rows is not None:
        out["batch_rows"] = failure.batch_rows
    if failure.batch_digest is not None:
        out["batch_digest"] = failure.batch_digest
    if failure.crashes:
        out["crashes"] = failure.crashes
    if failure.probing is not None:
        out["probing"] = failure.probing
    if failure.killed:
        out["killed"] = list(failure.killed)
    return out


def _lease_json(lease: Lease) -> dict[str, Any]:
    return {
        **lease.extra,
        "owner_id": lease.owner_id,
        "fencing_token": lease.fencing_token,
        "acquired_at": format_time(lease.acquired_at),
        "heartbeat_at": format_time(lease.heartbeat_at),
        "expires_at": format_time(lease.expires_at),
        "released": lease.released,
        **({"process": dict(lease.process)} if lease.process is not None else {}),
    }


def _static_json(doc: StateDocument) -> dict[str, Any]:
    """The document's first fields, which a poller's commits never change."""
    definition = (
        {"source_definition": dict(doc.source_definition)}
        if doc.source_definition is not None
        else {}
    )
    return {
        **doc.extra,
        "version": doc.version,
        "poller_name": doc.poller_name,
        "source_fingerprint": doc.source_fingerprint,
        **definition,
    }


def _head_json(doc: StateDocument) -> dict[str, Any]:
    """The document's fields up to the journal, in the order they are written."""
    return {
        **_static_json(doc),
        "checkpoint": _checkpoint_to_json(doc.checkpoint) if doc.checkpoint else None,
        "lease": _lease_json(doc.lease) if doc.lease is not None else None,
        "failure": _failure_to_json(doc.failure) if doc.failure else None,
    }


def _static_head(doc: StateDocument) -> str:
    """:func:`_static_json` as JSON less its closing brace (encoded once while the
    documents share those parts: the source definition is a third of a commit's
    encoding otherwise)."""
    return static_text(
        (doc.extra, doc.source_definition),
        (doc.version, doc.poller_name, doc.source_fingerprint),
        lambda: _static_json(doc),
    )


def to_json(doc: StateDocument) -> dict[str, Any]:
    return (
        _head_json(doc)
        | {"journal": [dict(entry) for entry in doc.journal]}
        | ({"window": window} if (window := _window_json(doc)) is not None else {})
    )


def _window_json(doc: StateDocument) -> dict[str, Any] | None:
    return doc.window.to_json() if doc.window is not None else None


def dumps(doc: StateDocument) -> bytes:
    """The stored bytes: compact JSON, exactly ``json.dumps(to_json(doc))`` with no spaces.

    Compact on purpose: every commit serialises the document, and an indented
    dump takes Python's pure-Python encoder (5x slower, 60% more bytes per
    write); `dbtrigger status/history` and `python -m json.tool` are for eyes.
    The journal is spliced in from its entries' kept texts (:class:`JournalRecord`)
    rather than encoded again: ``"journal"`` and ``"window"`` are always the
    last keys, so the text is the head object, then those two, then ``}``.
    """
    if not _TOP_KEYS.isdisjoint(doc.extra):
        # Only a hand-built document can name them in ``extra`` (a read one
        # never does); their key order is then ``to_json``'s, so take that path.
        return _encode(to_json(doc)).encode("utf-8")
    texts, joined = journal_text(doc.journal)
    # What a commit changes, encoded in one call (each call sets up an encoder).
    changing = {
        "checkpoint": _checkpoint_to_json(doc.checkpoint) if doc.checkpoint else None,
        "lease": _lease_json(doc.lease) if doc.lease is not None else None,
        "failure": _failure_to_json(doc.failure) if doc.failure else None,
    }
    parts = [_static_head(doc), ",", _encode(changing)[1:-1], ',"journal":[', joined, "]"]
    window = _window_json(doc)
    if window is not None:
        parts += (',"window":', _encode(window))
    parts.append("}")
    data = "".join(parts).encode("utf-8")
    _written.remember(data, texts)
    return data


_written = WrittenTexts()


def _checkpoint_from_json(raw_cp: Any) -> Checkpoint:
    if not isinstance(raw_cp, Mapping):
        raise CorruptStateError("checkpoint must be an object or null")
    meta = raw_cp.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, Mapping):
        raise CorruptStateError(f"checkpoint.metadata must be an object, got {meta!r}")
    extra = _unknown(raw_cp, _CHECKPOINT_KEYS)
    meta_extra = _unknown(meta, frozenset({"row_count"}))
    if meta_extra:
        extra["metadata"] = meta_extra
    return Checkpoint(
        position=position_from_json(require(raw_cp, "cursor", Mapping, "checkpoint")),
        last_successful_batch_id=typed(raw_cp, "last_successful_batch_id", str, "checkpoint"),
        updated_at=parse_time(raw_cp.get("updated_at"), "checkpoint.updated_at"),
        row_count=count(meta, "row_count", "checkpoint.metadata", 0) or 0,
        extra=extra,
    )


def _lease_from_json(raw_lease: Any) -> Lease:
    if not isinstance(raw_lease, Mapping):
        raise CorruptStateError("lease must be an object or null")
    # Only a hint (a lease taken over early when its holder provably died): one
    # that is not an object is kept as an unknown field and never believed.
    process = raw_lease.get("process")
    known = _LEASE_KEYS | {"process"} if isinstance(process, Mapping) else _LEASE_KEYS
    return Lease(
        owner_id=require(raw_lease, "owner_id", str, "lease"),
        fencing_token=require(raw_lease, "fencing_token", int, "lease"),
        acquired_at=parse_time(raw_lease.get("acquired_at"), "lease.acquired_at"),
        heartbeat_at=parse_time(raw_lease.get("heartbeat_at"), "lease.heartbeat_at"),
        expires_at=parse_time(raw_lease.get("expires_at"), "lease.expires_at"),
        released=typed(raw_lease, "released", bool, "lease", False),
        process=dict(process) if isinstance(process, Mapping) else None,
        extra=_unknown(raw_lease, known),
    )


def _failure_from_json(raw_failure: Any) -> FailureRecord:
    if not isinstance(raw_failure, Mapping):
        raise CorruptStateError("failure must be an object or null")

    def position(key: str) -> Position | None:
        value = raw_failure.get(key)
        return None if value is None else position_from_json(value, f"failure.{key}")

    done = _done_ids(raw_failure.get("done_event_ids"))
    done_total = count(raw_failure, "done_total", "failure", len(done)) or 0
    return FailureRecord(
        attempts=count(raw_failure, "attempts", "failure", None, required=True) or 0,
        first_failed_at=parse_time(raw_failure.get("first_failed_at"), "failure.first_failed_at"),
        last_failed_at=parse_time(raw_failure.get("last_failed_at"), "failure.last_failed_at"),
        last_error=typed(raw_failure, "last_error", str, "failure", ""),
        batch_id=typed(raw_failure, "batch_id", str, "failure"),
        from_position=position("checkpoint"),
        done=done,
        done_total=max(done_total, len(done)),
        batch_end=position("batch_end"),
        batch_rows=count(raw_failure, "batch_rows", "failure", None),
        batch_digest=typed(raw_failure, "batch_digest", str, "failure"),
        crashes=count(raw_failure, "crashes", "failure", 0) or 0,
        probing=typed(raw_failure, "probing", str, "failure"),
        killed=_done_ids(raw_failure.get("killed"), "failure.killed"),
        extra=_unknown(raw_failure, _FAILURE_KEYS),
    )


def from_json(raw: Any) -> StateDocument:
    """Validate and parse a decoded state document.

    Raises:
        CorruptStateError: naming the first field that is missing or malformed.
    """
    if not isinstance(raw, Mapping):
        raise CorruptStateError("state document must be a JSON object")
    version = require(raw, "version", int, "document")
    if version != VERSION:
        raise CorruptStateError(
            f"state document version {version} is not supported (this dbtrigger reads {VERSION})"
        )
    raw_cp, raw_lease, raw_failure = raw.get("checkpoint"), raw.get("lease"), raw.get("failure")
    journal_raw = raw.get("journal")
    if journal_raw is None:
        journal_raw = []
    if not isinstance(journal_raw, list) or not all(isinstance(e, Mapping) for e in journal_raw):
        raise CorruptStateError("journal must be a list of objects")
    return StateDocument(
        poller_name=require(raw, "poller_name", str, "document"),
        source_fingerprint=require(raw, "source_fingerprint", str, "document"),
        checkpoint=None if raw_cp is None else _checkpoint_from_json(raw_cp),
        lease=None if raw_lease is None else _lease_from_json(raw_lease),
        failure=None if raw_failure is None else _failure_from_json(raw_failure),
        journal=tuple(JournalRecord(e) for e in journal_raw),
        version=version,
        extra=_unknown(raw, _TOP_KEYS),
        window=_window(raw.get("window")),
        source_definition=_definition(raw.get("source_definition")),
    )


def _definition(raw: Any) -> Mapping[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise CorruptStateError("source_definition must be an object or null")
    return dict(raw)


def known_definition(doc: StateDocument) -> Mapping[str, Any] | None:
    """The document's recorded source definition, if it is the one its fingerprint names.

    A dbtrigger that predates the field keeps it unchanged while it rewrites the
    fingerprint (``reset --accept-source``): such a stale copy is not believed.
    """
    definition = doc.source_definition
    if definition is None or definition.get("fingerprint") != doc.source_fingerprint:
        return None
    return definition


def _window(raw: Any) -> Window | None:
    """The stored window, typed (None when absent or holding nothing).

    Raises:
        CorruptStateError: naming the malformed part.
    """
    window = Window.from_json(raw)
    return window if window or window.extra else None


def _done_ids(raw: Any, what: str = "failure.done_event_ids") -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(e, str) for e in raw):
        raise CorruptStateError(f"{what} must be a list of strings")
    return tuple(raw)


def loads(data: bytes | str) -> StateDocument:
    """Parse stored bytes; any malformation becomes :class:`CorruptStateError`."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptStateError(f"state document is not valid JSON: {exc}") from exc
    except RecursionError:
        # json's C decoder recurses once per nesting level: a hostile or broken
        # document must be reported as corrupt, not crash the tick.
        raise CorruptStateError(
            "state document is nested too deeply to be a state document"
        ) from None
    doc = from_json(raw)
    texts = _written.texts_of(data, len(doc.journal))
    if texts is not None:
        for entry, text in zip(doc.journal, texts, strict=True):
            if isinstance(entry, JournalRecord) and entry._json is None:
                entry._json = text
    return doc


__all__ = [
    "DEFAULT_JOURNAL_LIMIT",
    "VERSION",
    "Checkpoint",
    "FailureRecord",
    "JournalRecord",
    "Lease",
    "StateDocument",
    "digest_event_ids",
    "dumps",
    "format_time",
    "from_json",
    "known_definition",
    "loads",
    "parse_time",
    "position_from_json",
    "position_to_json",
    "to_json",
]
