"""A member's balance cycles in the background, on the cadence's schedule.

A member runs its cycles from a daemon thread, so that a long round of
partition ticks (a slow handler) never makes it look dead to the others. The
thread sleeps until the next cycle is due (:class:`~dbtrigger.partitions.cadence.Cadence`
picks when), runs it, and keeps cycling through failures: a store outage is
logged and retried after the slow interval, and anything unexpected is logged
whole rather than ending the thread (a member whose thread died would keep
ticking partitions the others have taken over).

It also keeps the time of the last heartbeat this member wrote, on its own
monotonic clock: once that is older than the member TTL, the others may have
declared it dead and taken its partitions, so :meth:`BalanceLoop.stale` tells
the member to tick nothing until its next heartbeat is written.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from dbtrigger.errors import DbTriggerError
from dbtrigger.partitions.cadence import Cadence, Liveness
from dbtrigger.partitions.layout import BalanceDecision, Membership

log = logging.getLogger("dbtrigger.partitions")


@dataclass(eq=False, repr=False)
class BalanceLoop:
    """Schedules one member's cycles and runs them from a daemon thread once started."""

    cycle: Callable[[], object]
    leave: Callable[[], None]
    _: KW_ONLY
    poller: str
    member_id: str
    cadence: Cadence
    liveness: Liveness
    monotonic: Callable[[], float]
    ttl: float
    next_at: float = field(default=-float("inf"), init=False)
    delay: float = field(default=0.0, init=False)
    #: When this member's heartbeat was last written (on ``monotonic``).
    beat_at: float = field(default=-float("inf"), init=False)
    closing: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _exit_hook: bool = field(default=False, init=False)
    _stale_said: bool = field(default=False, init=False)

    # --- the schedule ------------------------------------------------------------------

    def written(self) -> None:
        """This member's heartbeat was written just now."""
        self.beat_at = self.monotonic()

    def schedule(
        self, decision: BalanceDecision | None, doc: Membership | None, *, joining: bool
    ) -> None:
        """Pick the next cycle: fast while anything moves, never after a death is due."""
        others = [n for n in (doc.members if doc else ()) if n != self.member_id]
        self.delay = self.cadence.next(
            decision, doc, joining=joining, expiry_in=self.liveness.seconds_to_first_expiry(others)
        )
        self.next_at = self.monotonic() + self.delay

    def retry_later(self) -> None:
        """After a failed cycle (the store is down): try again after the slow interval."""
        self.next_at = self.monotonic() + self.cadence.after_failure()

    def due(self) -> bool:
        return self.monotonic() >= self.next_at

    def stale(self) -> bool:
        """This member's heartbeat is older than the member TTL: the others may have
        taken its partitions (said once per episode, at WARNING)."""
        silent = self.monotonic() - self.beat_at
        if silent <= self.ttl:
            self._stale_said = False
            return False
        if not self._stale_said:
            self._stale_said = True
            log.warning(
                "member %s has not written its heartbeat for %.0fs (member TTL %gs): the others "
                "may have taken its partitions, so it ticks none until its next heartbeat",
                self.member_id,
                silent,
                self.ttl,
                extra={"event": "member_self_fenced", "poller": self.poller},
            )
        return True

    # --- the thread --------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Cycle from a daemon thread from now on (the first cycle is the caller's)."""
        if self.running:
            return
        self.closing.clear()
        if not self._exit_hook:
            # A worker that exits normally (SIGTERM through `dbtrigger run`) gives
            # its partitions back at once instead of after the member TTL.
            atexit.register(self._leave_at_exit)
            self._exit_hook = True
        self._thread = threading.Thread(
            target=self._run, name=f"dbtrigger-balance-{self.poller}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self.closing.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    def _leave_at_exit(self) -> None:
        with contextlib.suppress(DbTriggerError):
            self.leave()

    def _run(self) -> None:
        while not self.closing.wait(max(0.0, self.next_at - self.monotonic())):
            try:
                self.cycle()
            except DbTriggerError as exc:
                # The partitions' own leases keep processing safe meanwhile; the
                # next cycle tries again, and others see us dead only after the TTL.
                self.retry_later()
                log.warning(
                    "balance cycle of %s failed: %s",
                    self.member_id,
                    exc,
                    extra={"event": "balance_failed", "poller": self.poller},
                )
            except Exception:
                # Not ours to swallow silently, but a dead balance thread would stop
                # this member from ever rebalancing: log it whole and keep cycling.
                self.retry_later()
                log.exception(
                    "balance cycle of %s failed unexpectedly",
                    self.member_id,
                    extra={"event": "balance_failed", "poller": self.poller},
                )
