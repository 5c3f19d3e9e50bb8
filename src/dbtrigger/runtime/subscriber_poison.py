"""A fan-out subscriber's poison event: found alone, as a single handler's is.

A subscriber that raises on its share of a batch (any exception but a
:class:`~dbtrigger.errors.PartialBatchError` naming events) fails every event
of that share for itself. Retried together, they fail together again, and at
the subscriber's ``max_attempts``-th delivery every one of them would be
dead-lettered in its name: one poison event would take its share-mates along
(before this module, 9 innocent events of 10). So at that delivery, with a
dead-letter sink, the share is bisected on the subscriber's own thread
(:func:`dbtrigger.quarantine.isolate`, the rule :func:`~dbtrigger.state.verdict.should_isolate`
applies to a single handler's batch): halves that pass are accepted, the
events that fail alone are what the call failed. The search runs inside the
subscriber's ack timeout; a call given up meanwhile (timed out, lease lost),
or more than ``quarantine_limit`` events failing alone (an outage, not poison),
leaves the call's first error as it was.

A failure on a transient error (:func:`~dbtrigger.state.verdict.transient`: a
write that gave up waiting for another transaction's lock, a lost connection)
says nothing about the events: the share is not bisected, and on an event's
last attempt the failure is deferred (not counted) instead of giving up on it,
so it is never dead-lettered for it (:func:`failed_resolutions`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from dbtrigger.errors import LostLeaseError, PartialBatchError
from dbtrigger.events import RowChange
from dbtrigger.isolation import isolate, match_failed
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.state import fanout
from dbtrigger.state.fanout import Resolution
from dbtrigger.state.verdict import should_isolate, transient


class _GivenUp(Exception):
    """The subscriber's call was given up while its share was being bisected."""


def isolate_share(
    events: Sequence[RowChange],
    call: Callable[[list[RowChange]], None],
    error: Exception,
    *,
    attempts: Mapping[str, int],
    max_attempts: int,
    has_sink: bool,
    limit: int,
    ctx: BatchContext,
    telemetry: Telemetry,
) -> Exception | None:
    """The error a subscriber's failed call on ``events`` leaves (see the module doc):
    ``error`` itself, a PartialBatchError naming the events that fail alone, or
    None when none does. ``attempts``: the deliveries each event had before this one."""
    named = isinstance(error, PartialBatchError) and bool(match_failed(events, error))
    attempt = 1 + max((attempts.get(e.event_id, 0) for e in events), default=0)
    if transient(error) or not should_isolate(
        attempt=attempt,
        max_attempts=max_attempts,
        has_sink=has_sink,
        named=named,
        pending=len(events),
    ):
        return error

    def check() -> None:
        if ctx.cancelled:  # timed out, or the lease is gone: the results are not used
            raise _GivenUp

    try:
        found = isolate(
            events, lambda part: call(list(part)), first_error=error, limit=limit, check=check
        )
    except (_GivenUp, LostLeaseError):
        return error
    telemetry.emit(
        "batch_bisected",
        "subscriber %s: bisected its share of batch %s in %d calls: %d event(s) fail "
        "alone, %d passed%s",
        ctx.subscriber,
        ctx.batch_id,
        found.calls,
        len(found.bad),
        len(found.ok),
        " (stopped: too many failing events for poison, looks like an outage)"
        if found.aborted
        else "",
        batch_id=ctx.batch_id,
        calls=found.calls,
        subscriber=ctx.subscriber,
    )
    if found.aborted:
        return error
    if not found.bad:
        return None
    return PartialBatchError(
        [dict(e.pk) for e, _ in found.bad],
        f"{len(found.bad)} event(s) fail alone for subscriber {ctx.subscriber}",
        causes={i: exc for i, (_, exc) in enumerate(found.bad)},
    )


def failed_resolutions(
    events: Sequence[RowChange],
    error: BaseException | None,
    attempts: Mapping[str, int],
    max_attempts: int,
) -> dict[str, Resolution]:
    """What a subscriber's failed call (``error``; None: it did not fail) says of
    each event it failed: the events a PartialBatchError names, else all of them,
    failed with the reason; one whose failure is transient, on its last attempt
    (``attempts``: its deliveries before this one), deferred instead."""
    if error is None:
        return {}
    causes: list[tuple[RowChange, BaseException]] = []
    if isinstance(error, PartialBatchError):
        causes = match_failed(events, error)
    if not causes:
        causes = [(e, error) for e in events]
    out: dict[str, Resolution] = {}
    for event, cause in causes:
        reason = f"{type(cause).__name__}: {cause}"
        last = attempts.get(event.event_id, 0) + 1 >= max_attempts
        out[event.event_id] = (
            fanout.defer(reason) if last and transient(cause) else fanout.fail(reason)
        )
    return out
