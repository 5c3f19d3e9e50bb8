"""A running claim's heartbeat: extend it, and tell the handler once it is lost.

Run on the trigger's heartbeat thread (:class:`~dbtrigger.runtime.kernel.KeepAlive`)
every ``heartbeat_interval_seconds`` while a claim's handler call runs. The claim
is lost - ``lost`` is set, so ``ctx.cancelled`` turns true and an async handler is
cancelled - when either

* an extension lands and finds the claim holding no row any more (it expired and
  another worker took the rows, or someone made them ready, finished or deleted
  them), or
* no extension has landed for ``visibility_timeout_seconds``: every extension
  since failed (this worker cannot reach the database), so the claim has expired
  on the database's side whatever it would answer, and another worker may be
  delivering its rows. Before, only the first case was told: a worker cut off from
  its database ran its handler on beside the worker that took the rows over, with
  ``ctx.cancelled`` false.

The second is judged on this process's monotonic clock from the moment the claim
or the last extension *returned*, which is no earlier than the database's time the
expiry was set from: the claim is expired then, unless an extension landed whose
answer was lost. So that call is treated as given up (``given_up``): the heartbeat
stops, and nothing it returns is recorded (its rows count as lost and come again),
or a call that stopped on ``ctx.cancelled`` could be settled as done by a claim that
still held its rows.
Once a call was given up (``handler_timeout_seconds``) the heartbeat stops and the
claim lapses. A claim found holding no row after its last rows went to their own
settlement (``settling``) was finished, not lost: a beat landing between that
settlement and the end of the tick logged ``queue_claim_lost`` about results that
had just been recorded.
"""

from __future__ import annotations

import threading
import time

from dbtrigger.errors import DbTriggerError
from dbtrigger.queue.source import ClaimSource
from dbtrigger.runtime.telemetry import Telemetry


class ClaimBeat:
    """One claim's heartbeat (a :class:`KeepAlive` beat: returns the seconds to the
    next beat, None to stop)."""

    def __init__(
        self,
        *,
        name: str,
        token: str,
        source: ClaimSource,
        telemetry: Telemetry,
        interval: float,
        visibility: float,
        lost: threading.Event,
        given_up: threading.Event,
        settling: threading.Event,
    ) -> None:
        self.name, self.token, self.source, self.telemetry = name, token, source, telemetry
        self.interval, self.visibility = interval, visibility
        self.lost, self.given_up, self.settling = lost, given_up, settling
        #: When the claim certainly expires unless an extension lands (monotonic).
        self.held_until = time.monotonic() + visibility

    def __call__(self) -> float | None:
        if self.given_up.is_set():
            return None
        started = time.monotonic()
        try:
            held = self.source.extend(token=self.token, visibility=self.visibility)
        except DbTriggerError as exc:
            self.telemetry.emit(
                "queue_claim_extend_failed",
                "queue %s: extending claim %s failed (%s); retrying in %.1fs",
                self.name,
                self.token,
                exc,
                self.interval,
                batch_id=self.token,
            )
            if time.monotonic() >= self.held_until and not self.settling.is_set():
                # (Once its rows went to their settlement, the fence judges them.)
                # As a call given up: nothing it returns is recorded, and the claim
                # lapses. An extension whose answer was lost may have landed, and a
                # settlement would then pass the fence and mark done rows a call
                # told to stop never finished.
                self.given_up.set()
                self._lost(
                    f"no extension landed for visibility_timeout_seconds={self.visibility:g} "
                    f"(the last failure: {exc}), so it has expired and another worker may "
                    "be delivering its rows"
                )
                return None
            return self._next(started)
        self.telemetry.emit("queue_claim_extended")
        if held:
            self.held_until = time.monotonic() + self.visibility
        elif self.settling.is_set():
            return None  # its own settlement finished the rows: nothing left to hold
        else:
            self._lost(
                "it holds no row any more (it expired, or its rows were made ready, "
                "finished or deleted by someone else)"
            )
        return self._next(started)

    def _next(self, started: float) -> float:
        return max(0.0, self.interval - (time.monotonic() - started))

    def _lost(self, why: str) -> None:
        if self.lost.is_set():
            return
        self.lost.set()
        self.telemetry.emit(
            "queue_claim_lost",
            "queue %s: claim %s is lost: %s; ctx.cancelled is set and the handler's "
            "results will not be recorded",
            self.name,
            self.token,
            why,
            batch_id=self.token,
        )


__all__ = ["ClaimBeat"]
