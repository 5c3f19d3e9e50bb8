"""SIGINT and SIGTERM, handled without taking a lock the interrupted code may hold.

A Python signal handler runs on the main thread, between two bytecodes of
whatever that thread was doing. ``threading.Event.set()`` takes the event's
lock, a plain :class:`threading.Lock`. A signal that lands while the main
thread is inside ``wait()`` on that same event and holds that lock (on the way
in, or on the way out once its timeout ran out: a worker idling between ticks
passes there many times a second) has ``set()`` wait for a lock its own thread
holds: forever. The worker then ignores SIGTERM until the SIGKILL that follows
the grace period (Kubernetes, systemd), its lease is not released and its
history not flushed. Seen in test_cdc_chaos under load: a worker delivered
every change, then did not exit within 60 s of SIGTERM. A loop of
``stop.wait(0)`` with a handler that sets ``stop`` hangs on 5 signals in 20.

So the handler installed here takes no lock: it writes the signal's number
to a pipe (``os.write`` takes none) and a thread of its own, the relay, reads
it and does what the signal means (a log line, ``stop.set()``), where a lock
the main thread holds is waited for only until the main thread lets go of it.
What must happen on the main thread itself (a second signal abandoning a
batch by raising :class:`KeyboardInterrupt`) stays in the handler, which
then does nothing but count and raise.

A stop that takes longer than ``overdue_seconds`` after the first signal is
said at WARNING (``stop_overdue``) with the stack of every thread, so the
line before a SIGKILL tells where the worker sat.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

log = logging.getLogger("dbtrigger.runner")

#: How long after the first signal a stop still going on is said at WARNING (with
#: every thread's stack): under the 30 s Kubernetes grants before its SIGKILL.
OVERDUE_SECONDS = 20.0

Handler = Callable[[int, FrameType | None], None]


class SignalRelay:
    """Runs ``act(signum)`` on a thread of its own for each signal a handler posts.

    ``overdue``: called once on that thread when ``overdue_seconds`` pass after
    the first post without :meth:`close` (the stop it asked for is late).
    """

    def __init__(
        self,
        act: Callable[[int], None],
        *,
        name: str = "dbtrigger-signals",
        overdue: Callable[[float], None] | None = None,
        overdue_seconds: float = OVERDUE_SECONDS,
    ) -> None:
        self._act = act
        self._overdue = overdue
        self._overdue_seconds = overdue_seconds
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, signum: int) -> None:
        """From a signal handler: no lock taken, never blocks (a full pipe already
        holds a signal the relay has yet to act on)."""
        with contextlib.suppress(OSError):
            os.write(self._write, bytes([signum & 0xFF]))

    def close(self, timeout: float = 5.0) -> None:
        """End the relay (its read sees the pipe closed); an act still running is
        left to finish on its daemon thread."""
        if self._write < 0:
            return
        os.close(self._write)
        self._write = -1
        self._thread.join(timeout)
        if not self._thread.is_alive():
            os.close(self._read)

    def _run(self) -> None:
        first: float | None = None
        while True:
            wait: float | None = None
            if first is not None and self._overdue is not None:
                wait = max(0.0, first + self._overdue_seconds - time.monotonic())
            ready, _, _ = select.select([self._read], [], [], wait)
            if not ready:  # overdue: said once
                assert self._overdue is not None  # noqa: S101 - only then is there a wait
                self._overdue(time.monotonic() - (first or 0.0))
                self._overdue = None
                continue
            data = os.read(self._read, 64)
            if not data:
                return
            if first is None:
                first = time.monotonic()
            for signum in data:
                try:
                    self._act(signum)
                except Exception:  # the relay must outlive a failing act
                    log.exception("acting on signal %s failed", signum)


def thread_stacks() -> str:
    """Every thread's stack, most recent call last (for a stop that is late)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(parts)


@contextlib.contextmanager
def signals_routed_to(handler: Handler, relay: SignalRelay | None = None) -> Iterator[None]:
    """Route SIGINT and SIGTERM to ``handler`` while the block runs (main thread only).

    With a ``relay``, each signal is posted to it first; ``handler`` then runs in
    the signal's context on the main thread and must take no lock (see the
    module docstring): count, raise, nothing more.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def routed(signum: int, frame: FrameType | None) -> None:
        if relay is not None:
            relay.post(signum)
        handler(signum, frame)

    previous: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, routed)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def stop_on_signals(
    stop: threading.Event, *, overdue_seconds: float = OVERDUE_SECONDS
) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM set ``stop`` (from the relay, never
    from the handler: a loop of ``stop.wait()`` may hold its lock), and a stop still
    going on ``overdue_seconds`` later is said at WARNING with every thread's stack.

    For a loop of one's own around ``tick()``; :class:`~dbtrigger.runtime.runner.Runner`
    does the same for ``dbtrigger run``.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def act(signum: int) -> None:
        asked_to_stop(stop, signum, "stopping")

    relay = SignalRelay(act, overdue=say_overdue, overdue_seconds=overdue_seconds)
    try:
        with signals_routed_to(lambda signum, frame: None, relay):
            yield
    finally:
        relay.close()


def asked_to_stop(stop: threading.Event, signum: int, doing: str, **fields: Any) -> None:
    """What a signal means, on the relay's thread: said once at INFO (``signal 15:
    <doing>``, ``runner_stopping``), then ``stop`` set."""
    if not stop.is_set():
        log.info("signal %s: %s", signum, doing, extra={"event": "runner_stopping", **fields})
    stop.set()


#: What a second signal does where one abandons the batch in flight (``dbtrigger
#: run``, ``dbtrigger backfill``): the one thing a person at the terminal can do.
SECOND_SIGNAL_ABANDONS = (
    "press Ctrl-C again or send another SIGTERM to abandon it now, to be delivered again; "
)


def say_overdue(seconds: float, poller: str | None = None, *, again: str = "") -> None:
    """The WARNING of a stop still going on ``seconds`` after its signal; ``again``
    says what a second signal does, where it does something
    (:data:`SECOND_SIGNAL_ABANDONS`)."""
    log.warning(
        "%sstill stopping %.0f s after the signal, waiting for the batch in flight "
        "(%sa SIGKILL after the grace period abandons it: it is delivered again, the lease "
        "expiring on its own); where each thread is:\n%s",
        f"{poller}: " if poller else "",
        seconds,
        again,
        thread_stacks(),
        extra={"event": "stop_overdue", "poller": poller, "seconds": round(seconds, 1)},
    )


__all__ = [
    "OVERDUE_SECONDS",
    "SECOND_SIGNAL_ABANDONS",
    "SignalRelay",
    "asked_to_stop",
    "say_overdue",
    "signals_routed_to",
    "stop_on_signals",
    "thread_stacks",
]
