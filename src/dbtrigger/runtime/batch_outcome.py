"""What became of a delivered batch: the typed outcome the tick turns into a write.

:class:`~dbtrigger.runtime.delivery.Delivery` (and its fan-out,
:class:`~dbtrigger.runtime.subscribers.FanOut`) hands a batch over and
returns :class:`Delivered` - every row settled, with the per-event marks to
fold into the window - or :class:`Undelivered` - which rows did settle, the
failed attempt to record and the error to raise. The tick driver
(:mod:`dbtrigger.runtime.tick`) decides the write from it; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dbtrigger.runtime.context import BatchContext
from dbtrigger.state import document as docmod
from dbtrigger.state.journal import Outcomes


@dataclass(frozen=True)
class Delivered:
    """The handler returned (or the batch's poison rows were set aside).

    ``quarantined`` rows were set aside as poison. Of the per-event marks,
    ``rejected`` (id -> reason) were written to the dead-letter sink, as were
    ``exhausted`` (retried on the last attempt); ``retried`` (id -> reason)
    wait for another delivery. Every other event is accepted.
    """

    quarantined: int = 0
    rejected: Mapping[str, str] = field(default_factory=dict)
    retried: Mapping[str, str] = field(default_factory=dict)
    exhausted: frozenset[str] = frozenset()
    #: Fan-out: retried event id -> the subscribers it goes to again (with
    #: their attempts); see dbtrigger.state.fanout.
    owed: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    #: Retried event id -> ``ctx.retry(..., delay_seconds=)``, instead of the backoff.
    delays: Mapping[str, float] = field(default_factory=dict)
    #: Fan-out: each subscriber's outcomes over the batch (journal, metrics).
    by_subscriber: Mapping[str, Outcomes] = field(default_factory=dict)
    #: Fan-out: retried ids that no subscriber failed - they only wait for busy
    #: subscribers, so no attempt is counted and no backoff applies.
    deferred: frozenset[str] = frozenset()

    @property
    def unsettled(self) -> frozenset[str]:
        """Ids that must not count as settled: waiting for a retry."""
        return frozenset(self.retried)

    @property
    def dead_lettered(self) -> frozenset[str]:
        """Ids written to the dead-letter sink: settled for good."""
        return frozenset(self.rejected) | self.exhausted

    def outcomes(self, rows: int) -> Outcomes:
        """The counts the batch's journal entry keeps: of its ``rows`` events, every
        one not rejected, retried or exhausted was accepted."""
        failed = len(self.retried) + len(self.exhausted)
        return Outcomes(
            accepted=rows - len(self.rejected) - failed,
            rejected=len(self.rejected),
            failed=failed,
            subscribers=self.by_subscriber,
        )


@dataclass(frozen=True)
class Undelivered:
    """Some rows are not settled: record ``cause`` as a failed attempt (with
    the ``settled`` rows), then raise ``error``."""

    cause: BaseException
    settled: frozenset[str]
    error: Exception


Outcome = Delivered | Undelivered


def batch_fields(ctx: BatchContext, rows: int) -> dict[str, Any]:
    """The log fields every record about a batch carries."""
    return {
        "batch_id": ctx.batch_id,
        "fencing_token": ctx.fencing_token,
        "checkpoint_before": docmod.position_to_json(ctx.checkpoint_before),
        "checkpoint_after": docmod.position_to_json(ctx.checkpoint_after),
        "rows": rows,
        "attempt": ctx.attempt,
    }
