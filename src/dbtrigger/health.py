"""A health check for probes: is this poller keeping up?

Usable from an Azure Functions HTTP endpoint, a container liveness/readiness
probe or a cron job. It costs one state-store read and, when a source is given,
one count and one single-row fetch on the source.

A poller name with no state document is **unknown** (unhealthy) unless a
source is given and shows nothing to deliver yet: a probe with a misspelt
name must not stay green for ever.

A poller is **stale** when its last successful commit is older than
``stale_after`` *while rows are pending*. An idle poller with nothing to do is
healthy however long ago it last committed: on a quiet table, an old
checkpoint is the normal state. When no source is given the pending count is
unknown, and a recorded failure (a batch after the checkpoint kept failing)
stands in for "rows are pending". A live lease under which nothing was
committed for ``stale_after`` is stale too, source or not: a handler call that
does not return keeps its lease renewed, and no failure is recorded for it.

Errors reading the state or the source never raise out of :func:`check_health`:
a probe needs an answer, so they become status ``"error"`` with a redacted
reason and HTTP 503.

Example (Functions v2)::

    @app.route(route="health/orders", auth_level=func.AuthLevel.FUNCTION)
    def orders_health(req: func.HttpRequest) -> func.HttpResponse:
        report = check_health(store, "orders", source=source, stale_after_seconds=600)
        return func.HttpResponse(report.to_json(), status_code=report.http_status,
                                 mimetype="application/json")
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from dbtrigger.cursor import Position
from dbtrigger.durations import human_duration
from dbtrigger.errors import DbTriggerError
from dbtrigger.sources import lag as lagmod
from dbtrigger.sources.base import CountsAfter, MeasuresLag, SourceAdapter
from dbtrigger.state import document as docmod
from dbtrigger.state.lease import describe_lease
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.factory import redact
from dbtrigger.state.unreadable import load_state

#: Status values, from best to worst.
OK, NO_STATE, STALE, UNKNOWN, ERROR = "ok", "no_state", "stale", "unknown_poller", "error"


@dataclass(frozen=True)
class Lag:
    """How far behind the source a position is.

    ``rows`` is the count after the position (None: the source cannot count).
    ``seconds`` is the age of the oldest pending row, 0 when nothing is
    pending, and None when it cannot be known here. ``basis`` says how it
    was measured (:mod:`dbtrigger.sources.lag`): ``cursor`` (a timestamp
    cursor, naive ones against the database's clock), ``column:<name>`` (the
    source's ``lag_column``), or ``observed`` (an integer cursor with no
    time column: only a running worker can observe it, so ``seconds`` is
    None here and ``note`` says what to declare).
    """

    rows: int | None
    seconds: float | None
    note: str = ""
    basis: str | None = None


def measure_lag(
    source: SourceAdapter, position: Position, now: dt.datetime, *, poller: str = "lag"
) -> Lag:
    """Rows pending after ``position`` and the age of the oldest, through the port.

    Raises:
        DbTriggerError: the source failed (FetchError, SerializationError).
    """
    counts = source if isinstance(source, CountsAfter) else None
    rows = counts.count_after(position) if counts is not None else None
    if rows == 0:
        return Lag(0, 0.0)
    first = source.fetch(position, 1)
    if not first:
        if not rows:
            return Lag(0 if rows is None else rows, 0.0)
        # Rows exist but the source's visibility guard holds them back for now
        # (possibly uncommitted writers): how long they have waited is unknown.
        return Lag(rows, None, "pending rows are not yet released by the visibility guard")
    note = "" if counts is not None else "the source cannot count pending rows"
    if isinstance(source, MeasuresLag):
        reading = source.row_age(first[0], now)
        if reading.seconds is not None:
            return Lag(rows, max(0.0, reading.seconds), note, reading.basis)
        if reading.basis == lagmod.OBSERVED:
            why = (
                "the cursor carries no time: declare lag_column= (a timestamp column such as "
                "created_at) for lag in seconds; a running worker reports it as observed"
            )
        else:
            why = f"{reading.basis} is NULL on the oldest pending row"
        return Lag(rows, None, note or why, reading.basis)
    event = source.to_events(first, poller=poller, batch_id="lag-probe")[0]
    cursor = event.cursor
    if isinstance(cursor, dt.datetime) and cursor.tzinfo is not None:
        return Lag(rows, max(0.0, (now - cursor).total_seconds()), note, lagmod.CURSOR)
    kind = type(cursor).__name__
    return Lag(rows, None, note or f"lag in seconds needs an aware timestamp cursor, not {kind}")


@dataclass(frozen=True)
class HealthReport:
    """The answer of one health check; ``to_dict`` is what a probe endpoint returns."""

    poller: str
    status: str
    reason: str
    checked_at: dt.datetime
    last_success_at: dt.datetime | None = None
    seconds_since_success: float | None = None
    pending_rows: int | None = None
    lag_seconds: float | None = None
    lag_basis: str | None = None
    failing_attempts: int = 0
    lease: str = "no lease"
    stale_after_seconds: float = 0.0

    @property
    def healthy(self) -> bool:
        return self.status in (OK, NO_STATE)

    @property
    def http_status(self) -> int:
        """200 when healthy, 503 otherwise (what load balancers and probes expect)."""
        return 200 if self.healthy else 503

    def to_dict(self) -> dict[str, Any]:
        def when(value: dt.datetime | None) -> str | None:
            return docmod.format_time(value) if value is not None else None

        return {
            "poller": self.poller,
            "status": self.status,
            "healthy": self.healthy,
            "reason": self.reason,
            "checked_at": when(self.checked_at),
            "last_success_at": when(self.last_success_at),
            "seconds_since_success": self.seconds_since_success,
            "pending_rows": self.pending_rows,
            "lag_seconds": self.lag_seconds,
            "lag_basis": self.lag_basis,
            "failing_attempts": self.failing_attempts,
            "lease": self.lease,
            "stale_after_seconds": self.stale_after_seconds,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _unknown_reason(store: CheckpointStore, poller: str) -> str:
    try:
        known = sorted(store.list_keys())
    except DbTriggerError:
        known = []
    listed = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "") if known else "none"
    return redact(
        f"no state document for poller {poller!r}: a misspelt name, or a poller that never "
        f"ran (pass source= to tell 'nothing to deliver yet' apart); pollers in the store: "
        f"{listed}"
    )


def _held_without_commit(
    doc: docmod.StateDocument, last_commit: dt.datetime | None, now: dt.datetime
) -> float | None:
    """Seconds a live lease has been held since it was taken or last committed under."""
    lease = doc.lease
    if lease is None or lease.released or lease.expires_at <= now:
        return None
    since = lease.acquired_at if last_commit is None else max(lease.acquired_at, last_commit)
    return (now - since).total_seconds()


def held_past_ttl(doc: docmod.StateDocument, now: dt.datetime) -> float | None:
    """Seconds a live lease has been held with no commit under it, when that is longer
    than its TTL (one batch past what the lease was sized for: a slow or hung
    handler, kept alive by its heartbeat), else None (``dbtrigger status``)."""
    cp = doc.checkpoint
    held = _held_without_commit(doc, cp.updated_at if cp is not None else None, now)
    lease = doc.lease
    if held is None or lease is None:
        return None
    return held if held > (lease.expires_at - lease.heartbeat_at).total_seconds() else None


def check_health(
    store: CheckpointStore,
    poller: str,
    *,
    source: SourceAdapter | None = None,
    stale_after_seconds: float = 600.0,
    now: dt.datetime | None = None,
) -> HealthReport:
    """Judge one poller. Never raises for store or source failures (status "error")."""
    now = now or dt.datetime.now(dt.timezone.utc)
    base: dict[str, Any] = {
        "poller": poller,
        "checked_at": now,
        "stale_after_seconds": stale_after_seconds,
    }
    try:
        stored = store.read(poller)
        doc = load_state(store, poller, stored) if stored is not None else None
        position = doc.position if doc is not None else Position()
        lag = measure_lag(source, position, now, poller=poller) if source is not None else None
    except Exception as exc:  # noqa: BLE001 - a probe reports; a custom source may raise anything
        return HealthReport(
            status=ERROR, reason=redact(f"{type(exc).__name__}: {exc}")[:500], **base
        )
    pending = lag.rows if lag is not None else None
    lag_seconds = lag.seconds if lag is not None else None
    lag_fields: dict[str, Any] = {"lag_seconds": lag_seconds}
    if lag is not None:
        lag_fields["lag_basis"] = lag.basis
    if doc is None and source is None:
        # Nothing shows this poller exists: a misspelt name in a probe must not
        # report healthy for ever. (With a source, "nothing to deliver yet" is
        # a fact that can be checked, below.)
        return HealthReport(
            status=UNKNOWN,
            reason=_unknown_reason(store, poller),
            **base,
        )
    if doc is None:
        if pending:
            # Rows wait and no poller of this name has ever written: a misspelt
            # name, or one that never ran. Either way a name, not a slow poller.
            return HealthReport(
                status=UNKNOWN,
                reason=_unknown_reason(store, poller)
                + f"; {pending} rows are pending in the source",
                pending_rows=pending,
                **lag_fields,
                **base,
            )
        return HealthReport(
            status=NO_STATE,
            reason="no state yet and nothing to deliver; the first tick with rows creates it",
            pending_rows=pending,
            **lag_fields,
            **base,
        )

    # The last success: the checkpoint's commit time (a manual change counts
    # as a fresh start, since it also resets updated_at).
    last = doc.checkpoint.updated_at if doc.checkpoint is not None else None
    attempts = doc.failure.attempts if doc.failure is not None else 0
    since = (now - last).total_seconds() if last is not None else None
    fields: dict[str, Any] = {
        "last_success_at": last,
        "seconds_since_success": since,
        "pending_rows": pending,
        **lag_fields,
        "failing_attempts": attempts,
        "lease": describe_lease(doc.lease, now),
        **base,
    }
    held = _held_without_commit(doc, last, now)
    if held is not None and held > stale_after_seconds and doc.lease is not None:
        return HealthReport(
            status=STALE,
            reason=f"the lease (token {doc.lease.fencing_token}) has been held "
            f"{human_duration(held)} (limit {stale_after_seconds:.0f}s) without a commit: "
            "a handler call that does not return (handler_slow / handler_stuck in that "
            "worker's log; handler_timeout_seconds bounds it), or a worker that died holding it",
            **fields,
        )
    rows_pending = bool(pending) if pending is not None else attempts > 0
    if since is None:
        # Never committed: measure from the first failure if there is one.
        since = (
            (now - doc.failure.first_failed_at).total_seconds() if doc.failure is not None else 0.0
        )
    if rows_pending and since > stale_after_seconds:
        what = f"{pending} rows are pending" if pending else f"batch failed {attempts} times"
        return HealthReport(
            status=STALE,
            reason=f"no successful commit for {human_duration(since)} "
            f"(limit {stale_after_seconds:.0f}s) "
            f"while {what}",
            **fields,
        )
    if rows_pending:
        count = pending if pending is not None else "some"
        reason = f"{count} rows pending, last commit {human_duration(since)} ago"
    else:
        reason = "caught up" if pending == 0 else "no failure recorded"
    return HealthReport(status=OK, reason=reason, **fields)


__all__ = [
    "ERROR",
    "NO_STATE",
    "OK",
    "STALE",
    "UNKNOWN",
    "HealthReport",
    "Lag",
    "check_health",
    "measure_lag",
]
