"""A standalone worker loop: tick on an interval until told to stop.

Outside Azure Functions something has to play the timer. This loop ticks,
ticks again at once while batches come back full (a backlog drains at full
speed instead of one batch per interval) and after any tick that delivered
rows (rows committed while it ran are read at once instead of one interval
later), and otherwise sleeps for the interval. A wake-up hint
(:mod:`dbtrigger.wakeup`, off by default) may end that sleep early.

What an operator sees (logger ``dbtrigger.runner``): one INFO line per tick
that tells its outcome apart (committed, idle, lease held by another owner,
lost race, failed), a progress line every ``progress_interval`` seconds while
a backlog drains, and the handler's traceback once per failing batch (not on
every retry of it).

Failures:

* errors a person must fix (:class:`~dbtrigger.errors.OperatorError`: bad
  configuration, a changed source definition, refused credentials) stop the
  loop and propagate; retrying them only fills the log;
* retryable errors back off across ticks, doubling from the interval up to
  ``max_backoff_seconds``; the log line says when the next try is. A
  successful tick resets the backoff;
* contention (another instance holds the lease or took it over) is the lease
  protocol working and waits the ordinary interval;
* anything that is not a dbtrigger error escaped a tick unmapped (a bug, in
  dbtrigger or in a source adapter or sink of one's own): logged at ERROR with
  its traceback (once while it repeats) and retried with the same backoff. It
  is not taken for an operator error: nothing says a person must act, the
  checkpoint did not move, and a transient cause recovers on its own. The
  worker does not die on it.

Shutdown: the first SIGINT/SIGTERM asks the loop to stop. A tick in progress
finishes the batch it is handling, commits it and releases the lease in the
same write, and starts no further batch. A second signal abandons the
in-flight batch: nothing partial is committed, the lease is released, and the
batch is delivered again by whoever ticks next. The handlers take no lock (see
:mod:`dbtrigger.runtime.stop_signals`), and a stop still going on 20 s after
the signal is said at WARNING (``stop_overdue``) with every thread's stack.

Several runners in one process: :mod:`dbtrigger.runtime.workers`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from dbtrigger.errors import (
    ContentionError,
    DbTriggerError,
    HandlerError,
    OperatorError,
    QuarantineError,
)
from dbtrigger.runtime.kernel import Handler
from dbtrigger.runtime.pacing import (
    DEFAULT_MAX_BACKOFF_SECONDS,
    HELD_BACK_FIRST_SECONDS,
    EndsWait,
    ShortensWait,
    StopOrWoken,
    WakeHint,
    backoff_delay,
    held_back_delay,
    isolated_failure,
    shortened,
)
from dbtrigger.runtime.progress import (
    DEFAULT_PROGRESS_INTERVAL_SECONDS,
    DrainProgress,
    ProgressCallback,
    Tracker,
    log_progress,
)
from dbtrigger.runtime.quiet import (
    DEFAULT_STILL_QUIET_SECONDS,
    QuietCadence,
    for_how_long,
)
from dbtrigger.runtime.run_stats import RunStats
from dbtrigger.runtime.stop_signals import (
    SECOND_SIGNAL_ABANDONS,
    SignalRelay,
    asked_to_stop,
    say_overdue,
    signals_routed_to,
)
from dbtrigger.runtime.trigger import TickReport, Trigger

log = logging.getLogger("dbtrigger.runner")


class Runner:
    """Drive one :class:`~dbtrigger.runtime.trigger.Trigger` until :meth:`stop` (or a signal).

    Args:
        trigger / handler: what to poll and who receives the batches.
        interval_seconds: the sleep after a tick that left nothing pending.
        on_tick: called with every tick's result.
        wake: a wake-up hint (:mod:`dbtrigger.wakeup`) that may end an idle
            sleep early; None (the default): sleep the interval.
        max_backoff_seconds: ceiling of the wait between failing ticks.
        progress: called while a backlog drains (default: a log line).
        progress_interval_seconds: time between two progress reports.
        stop: a shared stop event (several runners in one process).
        still_quiet_seconds: how often an idle (or standby) worker says it is
            still so at INFO; the ticks in between log at DEBUG
            (:mod:`dbtrigger.runtime.quiet`).
    """

    def __init__(
        self,
        trigger: Trigger,
        handler: Handler,
        *,
        interval_seconds: float = 5.0,
        on_tick: Callable[[TickReport], None] | None = None,
        max_backoff_seconds: float = DEFAULT_MAX_BACKOFF_SECONDS,
        progress: ProgressCallback | None = log_progress,
        progress_interval_seconds: float = DEFAULT_PROGRESS_INTERVAL_SECONDS,
        stop: threading.Event | None = None,
        wake: WakeHint | None = None,
        still_quiet_seconds: float = DEFAULT_STILL_QUIET_SECONDS,
    ) -> None:
        if wake is not None:
            wake.attach(trigger)  # refuses a trigger it cannot serve, before any tick
        self.wake = wake
        #: Ticks in a row that delivered nothing (None: none delivered anything yet).
        self._idle_ticks: int | None = None
        #: Ticks in a row whose rows the visibility guard held back.
        self._held_ticks = 0
        self.trigger = trigger
        self.handler = handler
        self.interval = interval_seconds
        self.on_tick = on_tick
        self.max_backoff = max(max_backoff_seconds, 0.0)
        self.progress = progress
        self.progress_interval = progress_interval_seconds
        self.stats = RunStats()
        self._stop = stop or threading.Event()
        self._signals = 0
        #: A signal asked to stop (set in the handler, which takes no lock; the relay
        #: sets ``_stop`` a moment later: :mod:`dbtrigger.runtime.stop_signals`).
        self._requested = False
        #: The relay of the installed signal handler (None: ``_on_signal`` is called
        #: directly, and sets ``_stop`` itself).
        self._relay: SignalRelay | None = None
        #: A tick (a batch that a second signal abandons) is running.
        self._in_tick = False
        self._failures = 0
        self._traced: str | None = None
        self._drain: Tracker | None = None
        self._quiet = QuietCadence(still_quiet_seconds)
        #: When the current run of failing ticks began (monotonic), for "recovered".
        self._failing_since: float | None = None

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._requested or self._stop.is_set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """In the signal's context on the main thread: no lock taken here (see
        :mod:`dbtrigger.runtime.stop_signals`); the relay logs and sets ``_stop``."""
        del frame
        self._signals += 1
        self._requested = True
        if self._relay is None:
            self._stop_requested(signum)
        # Second signal: abandon the in-flight batch; the tick releases the lease.
        # Between ticks there is none: raised there it ended run() with no summary
        # and the trigger left open (`dbtrigger run` exit 130; timeout -s INT sends two).
        if self._signals > 1 and self._in_tick:
            raise KeyboardInterrupt

    def _stop_requested(self, signum: int) -> None:
        """What a signal means, on the relay's thread (or the caller's)."""
        doing = "finishing the current batch, then stopping"
        asked_to_stop(self._stop, signum, doing, poller=self.trigger.name)

    @contextlib.contextmanager
    def _relayed(self, install_signals: bool) -> Iterator[contextlib.AbstractContextManager[None]]:
        """The relay for the whole run, closing included (a stop that is late is said
        at WARNING then too), and the context that installs the signal handlers."""
        if not install_signals or threading.current_thread() is not threading.main_thread():
            yield contextlib.nullcontext()
            return
        relay = SignalRelay(
            self._stop_requested,
            name=f"dbtrigger-signals-{self.trigger.name}",
            overdue=lambda seconds: say_overdue(
                seconds, self.trigger.name, again=SECOND_SIGNAL_ABANDONS
            ),
        )
        self._relay = relay
        try:
            yield signals_routed_to(self._on_signal, relay)
        finally:
            self._relay = None
            relay.close()

    def run(self, *, max_ticks: int | None = None, install_signals: bool = True) -> RunStats:
        with self._relayed(install_signals) as signals:
            with signals:
                while not self.stopping:
                    if max_ticks is not None and self.stats.ticks >= max_ticks:
                        break
                    wait = self._tick_once()
                    if wait > 0:
                        self._idle(wait)
            self.trigger.close()  # its lanes, heartbeat thread and wake-up listener
            if self.wake is not None:
                self.wake.close()
        log.info(
            "%s: stopped after %s",
            self.trigger.name,
            self.stats.summary(),
            extra={
                "event": "runner_stopped",
                "poller": self.trigger.name,
                "ticks": self.stats.ticks,
                "rows": self.stats.rows,
                "failures": self.stats.failures,
            },
        )
        return self.stats

    def _idle(self, seconds: float) -> None:
        """Sleep between ticks; a wake-up hint (the runner's, or a queue's own) may
        end an idle sleep early (never a backoff after a failure). The sleep is
        the trigger's own wait, whose wake-ups (a queue's ``LISTEN``, a partition
        member gaining partitions) a hint must not skip: one that only shortens
        the sleep (:class:`ShortensWait`) shortens it, one that notifies
        (:class:`EndsWait`) ends it too, whichever comes first."""
        if self._failures:
            self._stop.wait(seconds)
            return
        if isinstance(self.wake, ShortensWait):
            seconds = shortened(self.wake, seconds, self._idle_ticks)
        elif isinstance(self.wake, EndsWait):
            woken = self.wake.woken()
            self.trigger.wait_for_work(seconds, StopOrWoken(self._stop, woken))
            woken.clear()  # this wake is spent: the tick that follows reads what it announced
            return
        elif self.wake is not None:  # a hint of one's own that only sleeps
            self.wake.wait(seconds, self._stop, idle_ticks=self._idle_ticks)
            return
        self.trigger.wait_for_work(seconds, self._stop)

    # --- one tick -----------------------------------------------------------------

    def _tick_once(self) -> float:
        """Tick; return how long to wait before the next one (0: at once)."""
        self.stats.ticks += 1
        started = time.perf_counter()
        try:
            self._in_tick = True
            result = self.trigger.tick_result(self.handler, should_stop=lambda: self.stopping)
        except KeyboardInterrupt:
            self._stop.set()
            log.warning(
                "%s: in-flight batch abandoned; it will be delivered again",
                self.trigger.name,
                extra={"event": "batch_abandoned", "poller": self.trigger.name},
            )
            return 0.0
        except OperatorError:
            raise
        except ContentionError as exc:
            # Another instance took the lease (protocol), or a stop let a call go (let_go).
            if self.stopping:
                self._log_outcome("stopped", "stopped; its batch is delivered again", started)
                return 0.0
            self._log_outcome(
                "lease_lost",
                f"lease taken over by another instance ({exc}); next tick in {self.interval:g}s",
                started,
            )
            return self.interval
        except DbTriggerError as exc:
            return self._failed(exc, started)
        except Exception as exc:  # noqa: BLE001 - a bug must not end the worker (see module doc)
            return self._failed(exc, started)
        finally:
            self._in_tick = False
        if self._failures and not result.failing_partitions:
            self._recovered()
            self._failures = 0
            self._traced = None
        self.stats.rows += result.rows
        self._idle_ticks = (
            0 if result.rows else (None if self._idle_ticks is None else self._idle_ticks + 1)
        )
        wait = self._next_wait(result)
        try:
            self._log_result(result, started, wait or self.interval)
            self._track_drain(result, time.perf_counter() - started)
            if self.on_tick is not None:
                self.on_tick(result)
        except Exception:  # the tick is committed: a report that failed must not undo it
            log.exception(
                "%s: reporting a finished tick failed (the tick itself is committed)",
                self.trigger.name,
                extra={"event": "runner_report_failed", "poller": self.trigger.name},
            )
        return wait

    def _next_wait(self, result: TickReport) -> float:
        """At once while batches come back full, and after any tick that delivered
        rows: more may have been committed while it ran. Soon after one whose rows
        the visibility guard held back (see :func:`held_back_delay`). Otherwise
        the interval."""
        if result.more or result.rows:
            self._held_ticks = 0
            return 0.0
        if result.held_back:
            self._held_ticks += 1
            return held_back_delay(self._held_ticks, self.interval, result.held_back_seconds)
        self._held_ticks = 0
        return self.interval

    def _failed(self, exc: Exception, started: float) -> float:
        """Count a failed tick and say when the next try is.

        A :class:`DbTriggerError` is a failure the runtime understood (logged
        at WARNING, the handler's traceback once per failing batch). Anything
        else escaped a tick unmapped - a bug in dbtrigger, in a driver, or in a
        source adapter or sink of one's own: it is logged at ERROR with its
        traceback (once while it repeats) and retried with the same backoff,
        since nothing was committed and the next tick starts from the
        checkpoint; the worker does not die on it.
        """
        self.stats.failures += 1
        self._failures += 1
        if self._failures == 1:
            self._failing_since = time.monotonic()
        self._quiet.level(None)  # the next quiet tick is news again
        # Batches committed before the failing one count (the tick's partial result).
        last = self.trigger.last_result
        committed = last.rows if last is not None and last.outcome == "failed" else 0
        self.stats.rows += committed
        # A member whose other partitions work: the failing ones back off on their own.
        failures = 1 if isolated_failure(last) else self._failures
        delay = backoff_delay(failures, self.interval, self.max_backoff)
        next_at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=delay)
        known = isinstance(exc, DbTriggerError)
        traced: BaseException | None = exc if not known else None
        cause = exc.__cause__
        if isinstance(exc, HandlerError) and cause is not None:
            traced = cause  # the handler's own traceback
        elif isinstance(exc, QuarantineError) and cause is not None:
            # A dead-letter sink of one's own that raised something of its own.
            traced = None if isinstance(cause, DbTriggerError) else cause
        exc_info: Any = None
        if traced is None and known and self._failures == 1:
            # An outage (source or store unreachable, a commit refused): its
            # traceback once, on the first failed tick; one line per tick after.
            self._traced = f"{type(exc).__name__}: {exc}"
            exc_info = (type(exc), exc, exc.__traceback__)
        elif traced is not None:
            # The traceback once per failing batch (or unexpected error): its first
            # failure, or when the error changes; repeats of it get one line.
            signature = f"{type(traced).__name__}: {traced}"
            if signature != self._traced:
                self._traced = signature
                exc_info = (type(traced), traced, traced.__traceback__)
        fields = exc.log_fields() if isinstance(exc, DbTriggerError) else {}
        fields.setdefault("error_type", type(exc).__name__)
        self._log_outcome(
            "failed",
            (f"committed {committed:,} rows, then " if committed else "")
            + f"tick failed ({'' if known else 'unexpected '}{type(exc).__name__}: {exc}); "
            f"failure {self._failures} in a row, next try in {delay:g}s at {next_at:%H:%M:%S}Z",
            started,
            level=logging.WARNING if known else logging.ERROR,
            exc_info=exc_info,
            retry_in_seconds=delay,
            rows=committed,
            failures_in_a_row=self._failures,
            **fields,
        )
        return delay

    def _log_result(self, result: TickReport, started: float, wait: float) -> None:
        """One line per tick, in the tick result's own words; a quiet state at INFO
        when it begins and every few minutes, at DEBUG in between. ``wait``: the
        sleep that follows an idle tick."""
        level, text, fields = self._quiet.line(result, wait, stopping=self.stopping)
        self._log_outcome(result.outcome, text, started, level=level, **fields)

    def _recovered(self) -> None:
        """The first good tick after failing ones: say the outage is over."""
        lasted = time.monotonic() - (self._failing_since or time.monotonic())
        log.info(
            "%s: recovered after %d failed tick%s in %s",
            self.trigger.name,
            self._failures,
            "s" if self._failures != 1 else "",
            for_how_long(lasted),
            extra={
                "event": "recovered",
                "poller": self.trigger.name,
                "failures_in_a_row": self._failures,
                "outage_seconds": round(lasted, 1),
            },
        )
        self._failing_since = None

    def _log_outcome(
        self,
        outcome: str,
        text: str,
        started: float,
        *,
        level: int = logging.INFO,
        exc_info: Any = None,
        **fields: Any,
    ) -> None:
        if not log.isEnabledFor(level):
            return
        fields.setdefault("poller", self.trigger.name)
        log.log(
            level,
            "%s: %s (%.0f ms)",
            self.trigger.name,
            text,
            (time.perf_counter() - started) * 1000,
            exc_info=exc_info,
            extra={"event": "tick", "outcome": outcome, **fields},
        )

    def _track_drain(self, result: TickReport, took: float) -> None:
        if self.progress is None:
            return
        if self._drain is None:
            if result.more:
                # The clock starts with the tick that found the backlog: its rows
                # took its time (a rate over a few microseconds means nothing).
                self._drain = Tracker(
                    self.trigger,
                    self.progress,
                    self.progress_interval,
                    result.rows,
                    started=time.monotonic() - took,
                )
            return
        self._drain.add(result.rows)
        if not result.more:
            if not result.caught_up:
                return  # events or rows still wait for a retry, or rows are held back
            self._drain.finish()
            self._drain = None


__all__ = [
    "DEFAULT_MAX_BACKOFF_SECONDS",
    "DEFAULT_PROGRESS_INTERVAL_SECONDS",
    "HELD_BACK_FIRST_SECONDS",
    "DrainProgress",
    "ProgressCallback",
    "RunStats",
    "Runner",
    "WakeHint",
    "backoff_delay",
    "held_back_delay",
    "log_progress",
    "signals_routed_to",
]
