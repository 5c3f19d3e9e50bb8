"""The ``SourceAdapter`` port: fetch the rows after a position, in position order.

A source owns everything specific to where rows come from: the query, the
cursor and key columns, how a raw row becomes a :class:`~dbtrigger.RowChange`
and how it identifies itself in the state document (its fingerprint). The
runtime only asks for "up to ``limit`` rows after ``position``" and advances the
checkpoint to the position of the last event it delivered.

Contract (checked by one suite against every implementation):

* ``fetch(after, limit)`` returns at most ``limit`` rows, strictly after
  ``after``, ordered by position, and the first ``limit`` such rows: a row can
  only be skipped if it is not visible at all.
* ``to_events`` produces one event per row with ``position_of(event)`` equal to
  the row's position; a row it cannot turn into an event raises
  :class:`~dbtrigger.errors.SerializationError` naming the problem.
* ``fingerprint()`` is stable for an unchanged definition, changes when the
  definition changes, and contains no secret.

Optional capabilities a source may also have are declared below as small
protocols (:class:`ReportsVisibility`, :class:`FindsNullCursors`,
:class:`CountsAfter`, :class:`AcknowledgesCheckpoints`, :class:`BindsToPoller`,
...); the runtime, ``health`` and ``backfill`` ask for one with
``isinstance(source, CountsAfter)`` instead of probing attribute names, so the
name a source must spell is written down once, here, and checked by mypy. A
wrapper that forwards unknown attributes (``__getattr__``) has the
capabilities of what it wraps.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from dbtrigger.cursor import Position
from dbtrigger.errors import DbTriggerError, FetchError
from dbtrigger.events import RowChange, key_dict
from dbtrigger.redaction import redact
from dbtrigger.sources.lag import LagReading


@runtime_checkable
class SourceAdapter(Protocol):
    @property
    def name(self) -> str:
        """Display name for logs and events (``dialect:schema.table``); no secrets."""
        ...

    def fingerprint(self) -> str:
        """``sha256:...`` of the source definition, secrets excluded."""
        ...

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        """Up to ``limit`` raw rows strictly after ``after``, in position order."""
        ...

    def to_events(
        self, rows: Sequence[Mapping[str, Any]], *, poller: str, batch_id: str
    ) -> list[RowChange]:
        """Normalise raw rows into events (raises ``SerializationError``)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Definition details for status output; no secrets."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


def position_of(event: RowChange) -> Position:
    """The checkpoint position just after ``event``."""
    return Position(cursor=event.cursor, pk=key_dict(event))


# --- optional capabilities --------------------------------------------------------------


class VisibilityReport(Protocol):
    """What a visibility guard did on the last fetch (``FetchInfo`` is one)."""

    @property
    def held_back(self) -> bool: ...

    @property
    def held_back_seconds(self) -> float: ...

    @property
    def blocking_pid(self) -> int | None: ...


@runtime_checkable
class ReportsVisibility(Protocol):
    """A source that says after each fetch whether it withheld rows.

    ``last_fetch_info`` is None before the first fetch.
    """

    @property
    def last_fetch_info(self) -> VisibilityReport | None: ...


@runtime_checkable
class FindsNullCursors(Protocol):
    """A source that can list rows it cannot deliver because their cursor is NULL."""

    @property
    def cursor_column(self) -> str: ...

    def null_cursor_keys(self, limit: int = 10) -> list[dict[str, Any]]: ...


@runtime_checkable
class CountsAfter(Protocol):
    """A source that can count the rows after a position (lag in rows)."""

    def count_after(self, after: Position) -> int: ...


@runtime_checkable
class LocatesRows(Protocol):
    """A source that can say which of some exact ``(cursor, pk)`` positions
    still hold one of its rows (its filter applies, no visibility guard: the
    rows were delivered before).

    The settled window asks, when it blocks progress, about entries a read
    could not place (see :mod:`dbtrigger.state.window`): one indexed lookup
    instead of a guess. The positions returned are the rows as the source
    reads them, so their window keys equal those of the rows fetched.
    """

    def present(self, positions: Sequence[Position]) -> list[Position]: ...


@runtime_checkable
class AcceptsFingerprints(Protocol):
    """A source whose stored documents may carry an older fingerprint of the same definition.

    ``accepted_fingerprints()[0]`` is :meth:`SourceAdapter.fingerprint`; the
    rest are what earlier fingerprint algorithms gave this very configuration.
    A stored document carrying any of them belongs to this source.
    """

    def accepted_fingerprints(self) -> tuple[str, ...]: ...


def accepted_fingerprints(source: SourceAdapter) -> tuple[str, ...]:
    """Every fingerprint under which a stored document belongs to ``source``.

    The current one first; then what earlier fingerprint algorithms gave the
    same definition, so upgrading dbtrigger never strands a checkpoint.
    """
    if isinstance(source, AcceptsFingerprints):
        return source.accepted_fingerprints()
    return (source.fingerprint(),)


@runtime_checkable
class AcknowledgesCheckpoints(Protocol):
    """A source that holds its data until told it is durably checkpointed.

    A replication slot keeps every change after the position it was last told
    about, and must not be told early: a crash between releasing and
    checkpointing would lose what was released. The runtime calls
    ``acknowledge(position)`` after a write of the state document that moved
    the checkpoint *landed* (a commit, a partial commit), and on an idle tick
    with the checkpoint it read from the store. ``position`` is always a
    durable checkpoint; the source may release everything at or before it.

    It must not raise for a failure to release (the checkpoint stands; the next
    acknowledgement releases further): the runtime logs and ignores
    :class:`~dbtrigger.errors.DbTriggerError` from it.
    """

    def acknowledge(self, position: Position) -> None: ...


@runtime_checkable
class BindsToPoller(Protocol):
    """A source that must know the poller it serves (a slot named after it, its metrics).

    :class:`~dbtrigger.PollTrigger` calls ``bind_poller(name, metrics)`` once,
    when it is built; a source serves one poller.
    """

    def bind_poller(self, name: str, metrics: Any = None) -> None: ...


class SourceFinding(NamedTuple):
    """One answer of a source's own checks: ``severity`` is ``ok``, ``warning`` or ``error``."""

    check: str
    severity: str
    message: str
    fix: str | None = None


@runtime_checkable
class ChecksItself(Protocol):
    """A source that can check its own setup (server settings, slots, privileges).

    ``dbtrigger check`` reports the findings, ``dbtrigger status --source``
    shows those that are not ``ok``. ``self_check`` must not raise for a
    problem it can describe: it returns an ``error`` finding instead.
    """

    def self_check(self) -> list[SourceFinding]: ...


@runtime_checkable
class DescribesDefinition(Protocol):
    """A source that can say, readably and without secrets, what its fingerprint hashes."""

    def source_definition(self) -> dict[str, Any]: ...


def source_definition(source: SourceAdapter) -> dict[str, Any] | None:
    """The readable definition of ``source`` (see ``readable_definition``), or None.

    None when the source cannot describe itself, or when what it describes is
    not what its fingerprint names (a wrapper forwarding to the source it
    narrows, such as one partition of a table): a definition is only kept
    next to the fingerprint it explains.
    """
    if not isinstance(source, DescribesDefinition):
        return None
    definition = source.source_definition()
    return definition if definition.get("fingerprint") == source.fingerprint() else None


@runtime_checkable
class ValidatesDefinition(Protocol):
    """A source that can connect and check its definition without fetching rows."""

    def validate(self, position: Position | None = None) -> None: ...


def check_reachable(source: SourceAdapter, *, poller: str, then: str) -> None:
    """Connect to ``source`` and read its definition now; raise what stops that, explained.

    Used before a changed source definition may be accepted or suggested for
    acceptance: a typo (a port nothing listens on, another host) also changes
    the fingerprint, and accepting an endpoint that cannot be read would tie
    the checkpoint to it. The error keeps its type (a ``FetchError`` for a
    connection that failed, an operator error for a missing database or
    table), names the source by its password-free URL, and ends with ``then``
    (what to do about it).
    """
    engine = getattr(source, "engine", None)
    try:
        if isinstance(source, ValidatesDefinition):
            source.validate()
        elif engine is not None and hasattr(engine, "connect"):
            # No definition check of its own: a connection is what can be proven
            # without reading (a log source's read may have effects).
            try:
                with engine.connect():
                    pass
            except DbTriggerError:
                raise
            except Exception as exc:  # a driver error: the connection failed
                raise FetchError(
                    f"connecting to {source.name} failed: {type(exc).__name__}: {exc}"
                ) from exc
    except DbTriggerError as exc:
        where = source.describe().get("url") or source.name
        message = redact(
            f"poller {poller!r}: the configured source {source.name} at {where} cannot be read "
            f"({type(exc).__name__}: {exc}); {then}"
        )
        same_kind = type(exc).__init__ is DbTriggerError.__init__  # (all but PartialBatchError)
        error = type(exc)(message, poller=poller, **exc.fields) if same_kind else None
        raise (error or DbTriggerError(message, poller=poller)) from exc


@runtime_checkable
class KnowsCursorKind(Protocol):
    """A source that can say which checkpoint kind its cursor column's values take."""

    def cursor_kind(self) -> str | None: ...

    def column_kinds(self) -> dict[str, str | None]: ...


@runtime_checkable
class MeasuresCursorAge(Protocol):
    """A source that can age a cursor value in seconds, naive timestamps included.

    ``cursor_age_seconds(cursor, now)`` is None when the cursor carries no time
    (integers, decimals): lag in seconds must then be measured by the runtime.
    """

    def cursor_age_seconds(self, cursor: Any, now: dt.datetime) -> float | None: ...


@runtime_checkable
class MeasuresLag(Protocol):
    """A source that measures ``lag_seconds`` for any cursor, and says how.

    See :mod:`dbtrigger.sources.lag` for the bases (``cursor``,
    ``column:<name>``, ``observed``).
    """

    def lag_after(self, after: Position, now: dt.datetime) -> LagReading | None:
        """``lag_seconds`` once the checkpoint is at ``after``; None: not measured this time."""
        ...

    def row_age(self, row: Mapping[str, Any], now: dt.datetime) -> LagReading:
        """How old a raw row of :meth:`SourceAdapter.fetch` is, by the source's basis."""
        ...
