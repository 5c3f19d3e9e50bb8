"""An optional PostgreSQL ``LISTEN/NOTIFY`` wake-up hint for idle queue workers.

An idle worker polls every ``interval_seconds``. With
``QueueTrigger(notify_channel="...")`` it also ``LISTEN``\\s on that channel on
a connection of its own, and a ``NOTIFY`` from a producer ends its idle wait
at once, so new work starts within milliseconds instead of up to one interval.

It is a *hint*, never the only signal:

* the interval poll still runs, so rows whose ``dbt_visible_at`` passes
  (retry backoff, expired claims) - which nobody notifies - are claimed, and a
  missed notification (listener down, producer that forgot to notify) costs at
  most one interval;
* the listener connection is best effort: when it fails, the worker logs
  ``queue_listen_failed`` and reconnects with a backoff while polling goes on;
* a notification carries no data: it wakes the worker, which claims with the
  ordinary fenced statement. Waking for nothing costs one empty claim.

Off by default, because notifications have costs of their own (see
``docs/queues.md``): ``NOTIFY`` takes a database-wide lock at commit, which
serialises committing transactions that notified; and behind PgBouncer in
transaction pooling mode ``LISTEN`` does not work (the session is not kept).

The same :class:`Listener` wakes idle *pollers* too
(:class:`dbtrigger.wakeup.NotifyHint`): it needs only an engine and a channel,
and reports under the event names it is given (:class:`ListenEvents`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dbtrigger.errors import ConfigurationError

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from dbtrigger.queue.source import ClaimSource
    from dbtrigger.runtime.telemetry import Telemetry


class HasEngine(Protocol):
    """What the listener needs of a source: the engine it opens its session from."""

    @property
    def engine(self) -> Engine: ...


@dataclass(frozen=True)
class ListenEvents:
    """The telemetry events a :class:`Listener` emits, and what it calls its owner
    in log lines (``queue``, ``poller``)."""

    listening: str
    failed: str
    notified: str
    owner: str


#: A claim queue's listener (``notify_channel=``).
QUEUE_EVENTS = ListenEvents("queue_listening", "queue_listen_failed", "queue_notified", "queue")

#: How often the listener thread looks at its stop flag while no notification comes.
_POLL_SECONDS = 0.5
#: How often an idle wait looks at the runner's stop event.
_STOP_POLL_SECONDS = 0.2
#: Reconnect backoff of a failing listener: doubling up to this.
_MAX_RECONNECT_SECONDS = 30.0


def check_channel(source: ClaimSource, channel: str) -> str:
    """Refuse a channel the hint cannot serve (wrong database or driver, bad name)."""
    return check_listen(
        source.dialect_name, source.url.get_driver_name(), source.name, channel, "notify_channel="
    )


def check_listen(dialect: str, driver: str, name: str, channel: str, option: str) -> str:
    """Refuse a channel a :class:`Listener` cannot serve: not PostgreSQL, not
    psycopg 3.2+, or not a plain identifier. ``option`` names the setting in
    the messages. Returns the channel."""
    from dbtrigger.names import validate_sql_identifier  # noqa: PLC0415 - light import

    channel = validate_sql_identifier(channel, option.rstrip("="))
    if dialect != "postgresql":
        raise ConfigurationError(
            f"{option} is a PostgreSQL LISTEN/NOTIFY hint; {name} is "
            f"{dialect}. Leave it unset: idle workers poll at their interval"
        )
    if driver != "psycopg":
        raise ConfigurationError(
            f"{option} needs the psycopg (3) driver (postgresql+psycopg://...), not {driver!r}"
        )
    import psycopg  # noqa: PLC0415 - only with the hint on PostgreSQL

    version = tuple(int(p) for p in psycopg.__version__.split(".")[:2] if p.isdigit())
    if version < (3, 2):
        raise ConfigurationError(
            f"{option} needs psycopg 3.2 or later (notifications with a timeout), "
            f"found {psycopg.__version__}: pip install -U 'psycopg[binary]'"
        )
    return channel


def idle_wait(listener: Listener | None, seconds: float, stop: threading.Event) -> bool:
    """An idle worker's sleep: up to ``seconds``, ended early by ``stop``, or by a
    ``NOTIFY`` when ``listener`` is given (then True). Without one, plain polling."""
    if listener is None:
        stop.wait(seconds)
        return False
    return listener.wait(seconds, stop)


@dataclass(eq=False, repr=False)
class Listener:
    """A daemon thread that ``LISTEN``\\s on one channel and sets :attr:`wake`.

    Started on the first idle wait, stopped by :meth:`stop`. Every failure is
    logged and retried; none reaches the worker, which keeps polling.
    """

    source: HasEngine
    channel: str
    telemetry: Telemetry
    _: KW_ONLY
    events: ListenEvents = QUEUE_EVENTS
    wake: threading.Event = field(default_factory=threading.Event, init=False)
    #: Set while a LISTEN is established (tests wait on it).
    listening: threading.Event = field(default_factory=threading.Event, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name=f"dbt-listen-{self.channel}", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def wait(self, seconds: float, stop: threading.Event) -> bool:
        """Sleep up to ``seconds``; True when a notification ended the sleep early.

        Returns early (False) when ``stop`` is set. A notification that came
        while the worker was busy ends the next wait at once: no wake-up is lost
        between a claim and the sleep after it.
        """
        self.start()
        deadline = time.monotonic() + seconds
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.wake.wait(min(left, _STOP_POLL_SECONDS)):
                self.wake.clear()
                return True
        return False

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._listen()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - a hint: log, back off, reconnect
                self.listening.clear()
                failures += 1
                delay = min(_MAX_RECONNECT_SECONDS, 0.5 * 2 ** min(failures, 8))
                self.telemetry.emit(
                    self.events.failed,
                    "%s %s: LISTEN %s failed (%s: %s); idle workers keep polling, "
                    "reconnecting in %.1fs",
                    self.events.owner,
                    self.telemetry.poller,
                    self.channel,
                    type(exc).__name__,
                    exc,
                    delay,
                    channel=self.channel,
                )
                self._stop.wait(delay)

    def _listen(self) -> None:
        from psycopg import sql  # noqa: PLC0415 - only with the hint on PostgreSQL

        raw = self.source.engine.raw_connection()
        conn: Any = raw.driver_connection
        raw.detach()  # a session of its own, never handed back to the pool
        try:
            conn.autocommit = True
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            self.listening.set()
            self.telemetry.emit(
                self.events.listening,
                "%s %s: listening on %s for wake-up hints",
                self.events.owner,
                self.telemetry.poller,
                self.channel,
                channel=self.channel,
            )
            # A notification that arrived while LISTEN was being set up (or while
            # the listener was down) may have been missed: wake once to poll.
            self.wake.set()
            while not self._stop.is_set():
                for _ in conn.notifies(timeout=_POLL_SECONDS, stop_after=1):
                    self.telemetry.emit(self.events.notified)
                    self.wake.set()
        finally:
            self.listening.clear()
            raw.close()
