"""Deliveries that ended with their process, counted from the lease left behind.

A handler that kills its process (``os._exit``, a segfault, an OOM kill, a
hang the platform ends) records no failed attempt: the process is gone before
it can write one. What it leaves is its lease, neither released nor renewed.
So the next owner that takes such a lease over counts it here, in the write
that takes the lease (no extra storage operation), as one failed attempt of
the batch at the checkpoint - the batch the dead owner was delivering, since
a tick holds the lease only while a batch is in flight (its last commit
releases it) - and ``max_attempts`` applies as for an exception.

The count is the failure record's ``attempts``, of which ``crashes`` ended
that way. A commit that moves the checkpoint clears the record (and so the
count); a failure with an exception sets ``crashes`` back to 0 (the latest
attempt did not die); a record written for another checkpoint (moved by hand)
does not apply. Once ``max_attempts`` attempts are counted and the latest of
them died, the batch is not handed over whole again (:func:`after_deaths`):
the handler would kill this process too.

Pure functions of the document and the time, like :mod:`dbtrigger.state.lease`.
"""

from __future__ import annotations

import datetime as dt
import enum

from dbtrigger.state.codec import format_time
from dbtrigger.state.document import FailureRecord, Lease, StateDocument, evolve


def abandoned(doc: StateDocument | None) -> Lease | None:
    """The lease of ``doc`` that a taker finds neither released nor renewed (its
    holder died or hung mid-tick); call it once the lease is known to be free."""
    lease = doc.lease if doc is not None else None
    return lease if lease is not None and not lease.released else None


def died_text(lease: Lease, *, early: bool = False) -> str:
    """The failure record's ``last_error`` for a delivery whose process died
    (``early``: found no longer running before its lease expired)."""
    if early:
        return (
            f"ProcessDied: the process delivering it ({lease.owner_id}, token "
            f"{lease.fencing_token}) stopped without releasing its lease and was found no "
            "longer running on this host (killed or crashed); its lease was taken over "
            f"before it expired at {format_time(lease.expires_at)}"
        )
    return (
        f"ProcessDied: the process delivering it ({lease.owner_id}, token "
        f"{lease.fencing_token}) stopped without releasing its lease, which expired at "
        f"{format_time(lease.expires_at)} (killed, crashed, or hung past its lease)"
    )


def count_death(
    doc: StateDocument, lease: Lease, now: dt.datetime, *, early: bool = False
) -> StateDocument:
    """``doc`` with one more failed attempt, ended by its process's death, at its
    checkpoint; the rows a partial failure recorded as done stay done, and the
    row handed alone when it died (``probing``) joins the rows that killed it.
    ``early``: the holder was found dead before its lease expired."""
    record = doc.failure
    if record is not None and record.from_position not in (None, doc.position):
        record = None  # written for another checkpoint: another batch
    text = died_text(lease, early=early)
    if record is None:
        record = FailureRecord(
            attempts=1,
            first_failed_at=now,
            last_failed_at=now,
            last_error=text,
            from_position=doc.position,
            crashes=1,
        )
    else:
        killed = record.killed
        if record.probing is not None and record.probing not in killed:
            # The row handed alone when it died: named for good, not only until the
            # next step names another (two such rows would each be handed again).
            killed = (*killed, record.probing)
        record = evolve(
            record,
            attempts=record.attempts + 1,
            crashes=record.crashes + 1,
            last_failed_at=now,
            last_error=text,
            from_position=doc.position,
            killed=killed,
        )
    return evolve(doc, failure=record)


class AfterDeaths(enum.Enum):
    """What to do with the batch at the checkpoint before handing it over."""

    DELIVER = "deliver"
    #: ``max_attempts`` attempts are counted and the latest died: not again whole.
    REFUSE = "refuse"
    #: The same, with a dead-letter sink: hand it over one row at a time, each
    #: row's id written to the record (``probing``) before its call; the row a
    #: death names is dead-lettered without being handed over again.
    ISOLATE = "isolate"
    #: With a sink, but handing rows alone stopped finding rows: ``max_attempts``
    #: more deaths named none (the process dies outside the handler calls: reading
    #: the next batch, the commit). Refused as without a sink, saying so.
    OUTSIDE = "outside"


def after_deaths(
    failure: FailureRecord | None, *, max_attempts: int, can_isolate: bool = False
) -> AfterDeaths:
    """Hand the batch over, isolate its rows one by one (``can_isolate``: a
    dead-letter sink takes the row at fault), or refuse: it failed
    ``max_attempts`` times and the latest attempt killed its process (a failure
    with an exception is still handed over, to be retried or bisected as before);
    or, isolating, ``max_attempts`` further deaths named no row (``OUTSIDE``)."""
    if failure is None or failure.crashes == 0 or failure.attempts < max_attempts:
        return AfterDeaths.DELIVER
    if not can_isolate:
        return AfterDeaths.REFUSE
    # Each death while rows are handed alone names a row (``killed``), unless it
    # came outside their calls: max_attempts of those, and isolating is no way on.
    if failure.crashes - len(failure.killed) >= 2 * max_attempts:
        return AfterDeaths.OUTSIDE
    return AfterDeaths.ISOLATE


def probing(
    doc: StateDocument, *, now: dt.datetime, event_id: str | None, done: tuple[str, ...]
) -> StateDocument:
    """``doc`` saying that row ``event_id`` of the failing batch is handed alone
    now, and that the rows ``done`` passed (skipped when the batch comes again)."""
    record = doc.failure
    if record is None or record.from_position not in (None, doc.position):
        record = FailureRecord(
            attempts=1, first_failed_at=now, last_failed_at=now, last_error="", crashes=1
        )
    capped = done[:MAX_DONE_IDS]
    record = evolve(
        record, probing=event_id, done=capped, done_total=len(done), from_position=doc.position
    )
    return evolve(doc, failure=record)


#: As many done rows as a failure record keeps (dbtrigger.state.lease.MAX_DONE_IDS).
MAX_DONE_IDS = 1000

__all__ = ["AfterDeaths", "abandoned", "after_deaths", "count_death", "died_text", "probing"]
