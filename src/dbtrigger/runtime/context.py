"""What a handler learns about the batch it is given, and how it says what
became of each event (:meth:`BatchContext.reject`, :meth:`BatchContext.retry`).

:class:`EventContext` is what every context offers, whichever trigger calls
the handler: a poller's :class:`BatchContext` and a queue's
:class:`~dbtrigger.queue.context.ClaimContext` both satisfy it (mypy checks
that where the delivery kernel takes either), so a handler written against it
runs under both.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, PartialBatchError
from dbtrigger.events import RowChange
from dbtrigger.redaction import redact


@runtime_checkable
class EventContext(Protocol):
    """The context every handler may take as its second argument.

    Attributes:
        batch_id: this delivery's id (a poller's batch id, a queue's claim token).
        poller_name: the trigger's name.
        owner_id: this instance's identity (the lease holder, the claimer).
        cancelled: True once nothing this call does will be recorded any more
            (a lost lease or claim, a fan-out ack timeout): stop early.
    """

    @property
    def batch_id(self) -> str: ...

    @property
    def poller_name(self) -> str: ...

    @property
    def owner_id(self) -> str: ...

    @property
    def cancelled(self) -> bool: ...

    def reject(self, event: RowChange, reason: str | BaseException) -> None:
        """Settle ``event`` as dead now: to the dead-letter sink, never delivered again."""
        ...

    def retry(
        self, event: RowChange, reason: str | BaseException, *, delay_seconds: float | None = None
    ) -> None:
        """Deliver ``event`` again after a backoff (or ``delay_seconds``); it counts an attempt."""
        ...

    def attempts(self, event: RowChange) -> int:
        """How many times ``event`` has been delivered, this time included."""
        ...


def describe_event(event: RowChange) -> str:
    return f"event {event.event_id} (pk {dict(event.pk)}, cursor {event.cursor!r})"


def reason_text(reason: str | BaseException) -> str:
    """A mark's reason as recorded (the history, the state document, the dead-letter
    sink, the queue's row): the text, or an exception's type and message, with any
    credential in it masked (an exception quoting a URL or a token)."""
    return redact(reason if isinstance(reason, str) else f"{type(reason).__name__}: {reason}")


#: The longest ``delay_seconds``: 1000 years. Longer is a unit mistake (milliseconds,
#: a timestamp), and overflows a claim queue's time column or a datetime.
MAX_DELAY_SECONDS = 1000 * 365.25 * 86400


def check_delay(delay_seconds: object, verb: str = "retry") -> float | None:
    """``delay_seconds`` of ``ctx.retry``: None (the backoff decides) or seconds from 0
    to :data:`MAX_DELAY_SECONDS`.

    Raises:
        ConfigurationError: anything else (a bool, NaN, a negative or too long delay, text).
    """
    if delay_seconds is None:
        return None
    if (
        isinstance(delay_seconds, (int, float))
        and not isinstance(delay_seconds, bool)
        and math.isfinite(delay_seconds)
        and 0 <= delay_seconds <= MAX_DELAY_SECONDS
    ):
        return float(delay_seconds)
    raise ConfigurationError(
        f"ctx.{verb}(..., delay_seconds={delay_seconds!r}): give a number of seconds from 0 "
        "to 1000 years, or None for the backoff"
    )


class EventMarks:
    """The per-event outcomes a handler marked during one batch.

    Marks are open while the handler runs; a handler call that raises takes
    its marks with it (:meth:`rollback`), since the whole batch failed. Every
    event that is not marked is accepted when the handler returns.
    """

    def __init__(
        self,
        events: Sequence[RowChange],
        *,
        can_reject: bool,
        attempts: Mapping[str, int] | None = None,
        owed: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        # Event ids are computed on first use (events may be lazy): a batch
        # whose handler marks nothing never pays for them here.
        self._events = events
        self._id_set: set[str] | None = None
        self.can_reject = can_reject
        self.attempts = dict(attempts or {})
        #: Fan-out: waiting events still owed to some subscribers only (event
        #: id -> subscriber -> attempts); see dbtrigger.state.fanout.
        self.owed = dict(owed or {})
        self.open = True
        self.rejected: dict[str, str] = {}
        self.retried: dict[str, str] = {}
        #: ``ctx.retry(..., delay_seconds=)``: event id -> seconds, instead of the
        #: backoff (read for the ids in :attr:`retried` only).
        self.delays: dict[str, float] = {}
        #: The first misuse (a programming error); the batch fails with it even
        #: if the handler swallowed it, so a reject is never silently an accept.
        self.misuse: ConfigurationError | None = None
        self._lock = threading.Lock()

    def mark(
        self, kind: str, event: RowChange, reason: str, delay_seconds: float | None = None
    ) -> None:
        try:
            self._mark(kind, event, reason, delay_seconds)
        except ConfigurationError as exc:
            raise self.refuse(exc) from None

    def refuse(self, exc: ConfigurationError) -> ConfigurationError:
        """Record a misuse (the first one fails the batch, even if the handler
        swallows it) and return it to raise."""
        with self._lock:
            if self.misuse is None:
                self.misuse = exc
        return exc

    def _mark(self, kind: str, event: RowChange, reason: str, delay_seconds: float | None) -> None:
        with self._lock:
            if not self.open:
                raise ConfigurationError(
                    f"ctx.{kind}() on {describe_event(event)} after the handler returned: "
                    "mark outcomes while the handler runs"
                )
            if getattr(event, "event_id", None) not in self._ids():
                raise ConfigurationError(
                    f"ctx.{kind}() on {describe_event(event)}: that event is not in this batch"
                    if isinstance(event, RowChange)
                    else f"ctx.{kind}() needs a RowChange of this batch, got {event!r}"
                )
            if kind == "reject" and not self.can_reject:
                raise ConfigurationError(
                    f"ctx.reject() on {describe_event(event)}: a rejected event goes to the "
                    "dead-letter sink, and this poller has none; pass quarantine=... to "
                    "PollTrigger (an event is never dropped silently)"
                )
            mine, other = (
                (self.rejected, self.retried) if kind == "reject" else (self.retried, self.rejected)
            )
            if event.event_id in other:
                raise ConfigurationError(
                    f"ctx.{kind}() on {describe_event(event)}: it is already marked "
                    f"{'retry' if kind == 'reject' else 'reject'}"
                )
            mine[event.event_id] = str(reason)
            if delay_seconds is None:
                self.delays.pop(event.event_id, None)
            else:
                self.delays[event.event_id] = delay_seconds

    def _ids(self) -> set[str]:
        if self._id_set is None:
            self._id_set = {e.event_id for e in self._events}
        return self._id_set

    def snapshot(self) -> tuple[dict[str, str], dict[str, str]]:
        with self._lock:
            return dict(self.rejected), dict(self.retried)

    @contextmanager
    def undone_on_failure(self) -> Iterator[None]:
        """Around one handler call: a call that fails takes the marks it made with
        it; one that returns, or partly succeeds (``PartialBatchError``: its marked
        rows stay unsettled), leaves them standing."""
        rejected, retried = self.snapshot()
        try:
            yield
        except PartialBatchError:
            raise
        except BaseException:
            with self._lock:
                self.rejected, self.retried = rejected, retried
            raise

    def close(self) -> None:
        with self._lock:
            self.open = False


@dataclass(frozen=True)
class BatchContext:
    """Passed as the second argument to handlers that accept two.

    ``fencing_token`` increases with every lease acquisition: a sink that stores
    the highest token it has seen and refuses lower ones cannot be written by a
    stale owner (a "fenced" write). ``lease_lost`` is set when the lease is lost
    while the handler runs (the heartbeat's renewal was refused: another
    instance took over); a long synchronous handler should check
    :attr:`cancelled` and stop early, since its results will be discarded
    anyway. An async handler's task is cancelled for it. The event belongs to
    the tick, so every batch of a tick shares it.

    ``attempt`` counts deliveries of this batch (1 on the first); from
    ``max_attempts`` on, a failure makes it a poison candidate. When a batch is bisected
    to isolate poison rows, the handler receives parts of it with the same
    context.

    Per-event outcomes: every event of the batch is *accepted* when the
    handler returns, unless the handler marked it while it ran -
    :meth:`reject` (terminal: written to the dead-letter sink, never
    delivered again) or :meth:`retry` (delivered again after a backoff; after
    ``max_attempts`` deliveries it is dead-lettered like a poison row). A
    retried event holds the checkpoint back until it is settled, while later
    events keep flowing. Raising still fails the whole batch, and discards
    the marks of that call.
    """

    poller_name: str
    batch_id: str
    batch_index: int
    fencing_token: int
    owner_id: str
    source_name: str
    checkpoint_before: Position
    checkpoint_after: Position
    tick_started_at: dt.datetime
    attempt: int = 1
    lease_lost: threading.Event = field(default_factory=threading.Event, compare=False)
    marks: EventMarks | None = field(default=None, compare=False, repr=False)
    #: Fan-out (``subscribers=``): the name of the subscriber this call is for.
    subscriber: str | None = None
    #: Fan-out: set when this subscriber's call outlived ``ack_timeout_seconds``
    #: (its events count as failed for it; whatever it does now is discarded).
    timed_out: threading.Event | None = field(default=None, compare=False, repr=False)
    #: True when ``dbtrigger replay`` hands a recorded batch over again (the
    #: live checkpoint does not move; see dbtrigger.replay.batches).
    replay: bool = False
    #: A replay's recorded commit time (what :attr:`now` gives during one).
    recorded_at: dt.datetime | None = None
    #: The failure record's digest of the rows its last failed attempt held (None:
    #: no earlier failed attempt recorded one): a poison batch whose rows differ
    #: from them is news (:mod:`dbtrigger.runtime.poison_report`).
    failed_digest: str | None = field(default=None, compare=False, repr=False)

    @property
    def now(self) -> dt.datetime:
        """A time that is the same on every delivery of this batch's record: the
        tick's start, and during a replay the recorded commit time. Use it
        instead of the clock where a replay must reproduce what the first run did."""
        return self.recorded_at if self.recorded_at is not None else self.tick_started_at

    @property
    def cancelled(self) -> bool:
        """True once the lease is lost, or (fan-out) this subscriber's call timed
        out: nothing this call does from now on will be committed."""
        return self.lease_lost.is_set() or (self.timed_out is not None and self.timed_out.is_set())

    def reject(self, event: RowChange, reason: str | BaseException) -> None:
        """Settle ``event`` as rejected: it goes to the dead-letter sink with
        ``reason`` and is never delivered again.

        Raises:
            ConfigurationError: the poller has no dead-letter (``quarantine``)
                sink, ``event`` is not in this batch, or the handler returned.
        """
        self._marks("reject").mark("reject", event, reason_text(reason))

    def retry(
        self,
        event: RowChange,
        reason: str | BaseException,
        *,
        delay_seconds: float | None = None,
    ) -> None:
        """Deliver ``event`` again later: after an exponential backoff with
        jitter, or no sooner than ``delay_seconds`` (a ``Retry-After``).

        Raises:
            ConfigurationError: ``event`` is not in this batch, the handler
                returned, ``delay_seconds`` is not a number >= 0, or (fan-out)
                ``delay_seconds`` was given: a fan-out subscriber's retries
                follow the poller's backoff.
        """
        marks = self._marks("retry")
        try:
            delay = check_delay(delay_seconds)
            if delay is not None and self.subscriber is not None:
                raise ConfigurationError(
                    f"ctx.retry(..., delay_seconds=) in subscriber {self.subscriber!r}: a "
                    "fan-out event is retried per subscriber on the poller's backoff "
                    "(retry_delay_seconds); leave delay_seconds out"
                )
        except ConfigurationError as exc:
            raise marks.refuse(exc) from None
        marks.mark("retry", event, reason_text(reason), delay)

    def attempts(self, event: RowChange) -> int:
        """How many times ``event`` has been delivered, this time included."""
        marks = self._marks("attempts")
        return marks.attempts.get(event.event_id, 0) + 1

    def _marks(self, what: str) -> EventMarks:
        if self.marks is None:
            raise ConfigurationError(f"ctx.{what}() is only available inside a handler call")
        return self.marks
