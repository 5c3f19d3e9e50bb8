"""What a failed delivery means, and how far the checkpoint may move after it.

Two pure decisions the tick used to make inline, between handler calls and
CAS writes:

* :func:`judge` - the batch verdict. A batch whose handler failed is either
  retried (attempts remain), set aside row by row into the quarantine sink
  (it failed ``max_attempts`` times, some rows pass and a few fail alone),
  reported as *poison* (same, but there is no sink: the poller cannot pass
  it), or treated as an *outage* (no row passes, or more rows fail alone than
  ``quarantine_limit``: the handler's dependency is down, and emptying the
  source into the sink would be the wrong cure). A failure on a *transient*
  error (:func:`transient`: a write that gave up waiting for a lock, a lost
  connection) is an outage too, whatever the rows did: it says nothing about
  them, and setting them aside would lose rows that a later delivery writes.
* :func:`advance` - the checkpoint can only pass a *contiguous* run of settled
  rows at the head of a batch; settled rows after the first unsettled one are
  remembered by id (the failure record's ``done``) and skipped when the batch
  comes back.

No I/O, no clock: tests/test_verdict.py checks both table by table.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence, Set
from dataclasses import dataclass

from dbtrigger.errors import HandlerError, OperatorError, RetryableError

#: How deep :func:`transient` follows ``raise ... from`` causes.
_CAUSE_DEPTH = 8


class Verdict(enum.Enum):
    """The fate of a batch after a delivery."""

    SETTLED = "settled"
    """Every row was processed or set aside: commit."""
    RETRY = "retry"
    """It failed and attempts remain: record the attempt, deliver it again."""
    QUARANTINE = "quarantine"
    """Write the rows that fail alone to the sink, then commit past them."""
    POISON = "poison"
    """Attempts are used up and there is no sink: retried for ever, loudly."""
    OUTAGE = "outage"
    """Attempts are used up but the failure looks like an outage: retry."""


def transient(error: BaseException | None) -> bool:
    """Does ``error``, or an error it was raised from, say that a database or a
    service was briefly unavailable rather than anything about the rows? A
    :class:`~dbtrigger.errors.RetryableError` (``OutputLockTimeoutError``: another
    transaction held a lock; ``OutputWriteError``: a lost connection;
    ``OutputReferenceError``: a row referred to is not there yet; ``FetchError``)
    is; a :class:`~dbtrigger.errors.OperatorError` (a constraint, a value) and a
    plain exception are not. Such a failure is never evidence of poison."""
    for _ in range(_CAUSE_DEPTH):
        if error is None or isinstance(error, OperatorError):
            return False
        if isinstance(error, RetryableError) and not isinstance(error, HandlerError):
            return True
        error = error.__cause__
    return False


def should_isolate(
    *, attempt: int, max_attempts: int, has_sink: bool, named: bool, pending: int
) -> bool:
    """Bisect the batch to find the rows that fail alone?

    Only for a poison candidate (attempts used up) with somewhere to put the
    rows, whose failure did not already name its rows (``PartialBatchError``),
    and which has more than one row left to deliver.
    """
    return attempt >= max_attempts and has_sink and not named and pending > 1


def judge(
    *,
    rows: int,
    settled: int,
    failed: int,
    aborted: bool,
    attempt: int,
    max_attempts: int,
    has_sink: bool,
    quarantine_limit: int,
    transient_failure: bool = False,
) -> Verdict:
    """The verdict on a batch of ``rows`` rows after a delivery.

    ``settled`` rows passed (now or on an earlier delivery), ``failed`` rows
    did not, and ``aborted`` says the bisection stopped early because too
    many rows failed on their own. ``transient_failure``: a failure was a transient error
    (:func:`transient`), which is never poison: retried, nothing set aside.
    """
    if failed == 0:
        return Verdict.SETTLED
    if attempt < max_attempts:
        return Verdict.RETRY
    if transient_failure:
        return Verdict.OUTAGE
    if not has_sink:
        return Verdict.POISON
    # Poison is a row that fails while its neighbours pass (now, or on an
    # earlier delivery). When no row of a multi-row batch has passed, or more
    # than the limit fail on their own, the dependency is down.
    if aborted or failed > quarantine_limit or (rows > 1 and settled == 0):
        return Verdict.OUTAGE
    return Verdict.QUARANTINE


@dataclass(frozen=True)
class Advance:
    """How far a failed batch's settled rows move the checkpoint.

    ``head`` rows at the front of the batch are settled and contiguous (the
    checkpoint moves to the last of them when ``head > 0``); ``done`` are the
    ids of settled rows after the first unsettled one, in batch order.
    """

    head: int
    done: tuple[str, ...]


def advance(ids: Sequence[str], settled: Set[str]) -> Advance:
    """Split a batch (event ids in position order) into the committable head and
    the settled rows that must be remembered instead."""
    head = 0
    while head < len(ids) and ids[head] in settled:
        head += 1
    return Advance(head, tuple(i for i in ids[head:] if i in settled))
