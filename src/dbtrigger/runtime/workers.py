"""Several pollers in one process: one :class:`~dbtrigger.runtime.runner.Runner`
per trigger, one thread each, one signal handler, one shared stop.

``dbtrigger run`` with several ``--source`` arguments comes here. The first
SIGINT/SIGTERM lets every runner finish and commit its batch in flight (each
releases its lease in that commit); a second one abandons the in-flight
batches uncommitted. An operator error in one runner stops the others too,
and is raised to the caller.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from types import FrameType

from dbtrigger.runtime.runner import Runner, RunStats
from dbtrigger.runtime.stop_signals import (
    SECOND_SIGNAL_ABANDONS,
    SignalRelay,
    asked_to_stop,
    say_overdue,
    signals_routed_to,
)

log = logging.getLogger("dbtrigger.runner")


def run_pollers(runners: Sequence[Runner], *, max_ticks: int | None = None) -> dict[str, RunStats]:
    """Run several runners in one process until a signal, ``max_ticks``, or an error.

    Each runner gets a thread; they share one stop event and one signal
    handler. The first SIGINT/SIGTERM lets every runner finish and commit its
    batch in flight; a second one returns at once, abandoning in-flight
    batches uncommitted (they are delivered again once their leases expire).
    An operator error in any runner stops all of them and is raised here.
    """
    if len(runners) == 1:
        runner = runners[0]
        return {runner.trigger.name: runner.run(max_ticks=max_ticks)}
    names = [r.trigger.name for r in runners]
    if len(set(names)) != len(names):
        from dbtrigger.errors import ConfigurationError  # noqa: PLC0415 - rare path

        raise ConfigurationError(f"two pollers have the same name in {names}")
    stop = threading.Event()
    for runner in runners:
        runner._stop = stop  # one shared shutdown
    errors: list[BaseException] = []
    signals = {"n": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        """In the signal's context: no lock taken (the relay logs and sets ``stop``)."""
        del signum, frame
        signals["n"] += 1
        if signals["n"] > 1:
            raise KeyboardInterrupt

    def stop_requested(signum: int) -> None:
        asked_to_stop(stop, signum, "finishing the batches in flight, then stopping")

    def work(runner: Runner) -> None:
        try:
            runner.run(max_ticks=max_ticks, install_signals=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)
            stop.set()

    threads = [
        threading.Thread(target=work, args=(r,), name=f"dbtrigger-{r.trigger.name}", daemon=True)
        for r in runners
    ]
    relay = SignalRelay(
        stop_requested,
        overdue=lambda seconds: say_overdue(seconds, again=SECOND_SIGNAL_ABANDONS),
    )
    with contextlib.closing(relay), signals_routed_to(on_signal, relay):
        for thread in threads:
            thread.start()
        try:
            while any(t.is_alive() for t in threads):
                for thread in threads:
                    thread.join(0.2)
        except KeyboardInterrupt:
            log.warning(
                "second signal: abandoning the batches in flight; they will be delivered "
                "again once their leases expire",
                extra={"event": "batch_abandoned"},
            )
            return {r.trigger.name: r.stats for r in runners}
    if errors:
        raise errors[0]
    return {r.trigger.name: r.stats for r in runners}


__all__ = ["run_pollers"]
