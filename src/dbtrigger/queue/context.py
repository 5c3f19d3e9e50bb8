"""What a queue handler learns about its claim, and how it marks single rows.

A handler that takes two arguments receives a :class:`ClaimContext`. Every
row it does not mark is accepted when it returns; raising fails every row not
marked. Marks:

* ``ctx.retry(event, reason, *, delay_seconds=None)`` - this row failed; try
  it again after a backoff, or after ``delay_seconds`` (counts an attempt;
  dead after ``max_attempts``);
* ``ctx.reject(event, reason)`` - this row can never succeed; make it dead now
  (and write it to the dead-letter sink, if one is configured);
* ``ctx.attempts(event)`` - which delivery of the row this is (1 on the first).

The signatures are :class:`~dbtrigger.BatchContext`'s, so a handler written for
a poller marks the same way under a queue.

Marking an event that is not in the batch, or marking after the handler
returned, is a :class:`~dbtrigger.errors.ConfigurationError` naming the event:
a mark that silently did nothing would lose the handler's verdict.
"""

from __future__ import annotations

import datetime as dt
import threading
import warnings
from collections.abc import Mapping

from dbtrigger._deprecation import DeprecatedAlias
from dbtrigger.errors import ConfigurationError
from dbtrigger.events import RowChange
from dbtrigger.queue.outcome import Mark
from dbtrigger.queue.statements import Key
from dbtrigger.runtime.context import check_delay, reason_text


class ClaimContext:
    """Passed as the second argument to queue handlers that accept two.

    Attributes:
        queue_name: the :class:`~dbtrigger.queue.trigger.QueueTrigger` name.
        claim_token: this claim's token (also ``batch_id``): completions are
            fenced by it, so a worker whose claim expired cannot overwrite the
            result of the worker that took the row over.
        owner_id: who claimed (the trigger's ``owner_id``; ``worker_id`` is its
            deprecated spelling).
        claimed_at: when (worker clock, for logs).
        lost: set when the heartbeat finds that every row of the claim was
            taken over; a long handler should check :attr:`cancelled` and stop
            (an async handler is cancelled for it).
    """

    def __init__(
        self,
        *,
        queue_name: str,
        claim_token: str,
        owner_id: str,
        claimed_at: dt.datetime,
        keys: Mapping[str, Key],
        attempts: Mapping[str, int],
        lost: threading.Event,
    ) -> None:
        self.queue_name = queue_name
        self.claim_token = claim_token
        self.owner_id = owner_id
        self.claimed_at = claimed_at
        self.lost = lost
        self._keys = dict(keys)
        self._attempts = dict(attempts)
        self._marks: dict[Key, Mark] = {}
        self._closed = False
        self._lock = threading.Lock()

    # Names shared with BatchContext, so code written for both can log either.
    @property
    def batch_id(self) -> str:
        return self.claim_token

    @property
    def poller_name(self) -> str:
        return self.queue_name

    worker_id: DeprecatedAlias[str] = DeprecatedAlias(
        "owner_id", "ClaimContext.worker_id is deprecated: use ctx.owner_id, as on BatchContext"
    )

    @property
    def cancelled(self) -> bool:
        """True once every row of the claim was lost: nothing more will be recorded."""
        return self.lost.is_set()

    def attempts(self, event: RowChange) -> int:
        """How many times ``event`` has been delivered (claimed), this time included."""
        self._key(event, "attempts")
        return self._attempts[event.event_id]

    def attempt(self, event: RowChange) -> int:
        """Deprecated spelling of :meth:`attempts` (the poller's ``BatchContext`` name)."""
        warnings.warn(
            "ClaimContext.attempt(event) is deprecated: use ctx.attempts(event), "
            "as on BatchContext",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.attempts(event)

    def retry(
        self,
        event: RowChange,
        reason: str | BaseException,
        *,
        delay_seconds: float | None = None,
    ) -> None:
        """Fail ``event`` alone: it comes back after a backoff, or no sooner than
        ``delay_seconds`` (a ``Retry-After``)."""
        delay = check_delay(delay_seconds)
        text = reason_text(reason)
        self._mark(event, Mark("retry", text or "retry requested", delay), "retry")

    def reject(self, event: RowChange, reason: str | BaseException) -> None:
        """Make ``event`` dead now: it is never delivered again (unless re-driven)."""
        text = reason_text(reason)
        self._mark(event, Mark("reject", text or "rejected"), "reject")

    def _key(self, event: RowChange, verb: str) -> Key:
        key = self._keys.get(getattr(event, "event_id", ""))
        if key is None:
            raise ConfigurationError(
                f"ctx.{verb}() was given an event that is not in this batch "
                f"(event_id={getattr(event, 'event_id', event)!r}, pk="
                f"{dict(getattr(event, 'pk', {}) or {})}, claim {self.claim_token})"
            )
        return key

    def _mark(self, event: RowChange, mark: Mark, verb: str) -> None:
        key = self._key(event, verb)
        with self._lock:
            if self._closed:
                raise ConfigurationError(
                    f"ctx.{verb}() on event {event.event_id} (pk {dict(event.pk)}) after the "
                    "handler returned: the batch was already settled"
                )
            self._marks[key] = mark

    def close(self) -> dict[Key, Mark]:
        """End marking (the handler returned or raised); the marks made."""
        with self._lock:
            self._closed = True
            return dict(self._marks)
