"""A standalone worker loop: tick on an interval until told to stop.

Outside Azure Functions something has to play the timer. This loop ticks,
ticks again at once while batches come back full (a backlog drains at full
speed instead of one batch per interval), and otherwise sleeps for the
interval. Failures are logged and retried on the next interval, except errors
an operator must fix, which stop the loop and propagate.

Shutdown: the first SIGINT/SIGTERM asks the loop to stop. A tick in progress
finishes the batch it is handling, commits it and releases the lease in the
same write, and starts no further batch. A second signal abandons the
in-flight batch: nothing partial is committed, the lease is released, and the
batch is delivered again by whoever ticks next.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from dbtrigger.errors import DbTriggerError, OperatorError
from dbtrigger.runtime.delivery import Handler
from dbtrigger.runtime.poller import PollTrigger, TickResult

log = logging.getLogger("dbtrigger.runner")


@dataclass
class RunStats:
    ticks: int = 0
    rows: int = 0
    failures: int = 0


class Runner:
    """Drive one :class:`PollTrigger` until :meth:`stop` (or a signal)."""

    def __init__(
        self,
        trigger: PollTrigger,
        handler: Handler,
        *,
        interval_seconds: float = 5.0,
        on_tick: Callable[[TickResult], None] | None = None,
    ) -> None:
        self.trigger = trigger
        self.handler = handler
        self.interval = interval_seconds
        self.on_tick = on_tick
        self.stats = RunStats()
        self._stop = threading.Event()
        self._signals = 0

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self._signals += 1
        if self._signals == 1:
            log.info(
                "signal %s: finishing the current batch, then stopping",
                signum,
                extra={"event": "runner_stopping", "poller": self.trigger.name},
            )
            self._stop.set()
            return
        # Second signal: abandon the in-flight batch; the tick releases the lease.
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def _signals_installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous: dict[signal.Signals, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, self._on_signal)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run(self, *, max_ticks: int | None = None) -> RunStats:
        with self._signals_installed():
            while not self._stop.is_set():
                if max_ticks is not None and self.stats.ticks >= max_ticks:
                    break
                more = self._tick_once()
                if not more:
                    self._stop.wait(self.interval)
        log.info(
            "runner stopped after %d ticks, %d rows",
            self.stats.ticks,
            self.stats.rows,
            extra={"event": "runner_stopped", "poller": self.trigger.name},
        )
        return self.stats

    def _tick_once(self) -> bool:
        self.stats.ticks += 1
        try:
            result = self.trigger.tick_result(self.handler, should_stop=self._stop.is_set)
        except KeyboardInterrupt:
            self._stop.set()
            log.warning(
                "in-flight batch abandoned; it will be delivered again",
                extra={"event": "batch_abandoned", "poller": self.trigger.name},
            )
            return False
        except OperatorError:
            raise
        except DbTriggerError as exc:
            self.stats.failures += 1
            log.warning(
                "tick failed, retrying in %.1fs: %s",
                self.interval,
                exc,
                extra={"event": "tick_failed", "poller": self.trigger.name, **exc.log_fields()},
            )
            return False
        self.stats.rows += result.rows
        if self.on_tick is not None:
            self.on_tick(result)
        return result.more
