"""Wake-up hints: end a worker's idle sleep early when new rows may be there.

A worker (``dbtrigger run``, :class:`~dbtrigger.runtime.runner.Runner`) ticks
again at once while ticks deliver rows, and otherwise sleeps for its interval:
a row committed just after an empty tick waits up to one interval. A hint
shortens that wait. Every hint here is *safe to lose*: it only ever ends a
sleep sooner, never makes one longer, and the interval poll goes on under it,
so a hint that never comes (a listener that is down, a producer that does
not notify) costs what polling alone costs.

* :class:`NotifyHint` (PostgreSQL): ``LISTEN`` on a channel that a
  statement-level trigger on the table notifies, one payload-less ``NOTIFY``
  per writing transaction (``dbtrigger wake install``, :mod:`.ddl`). The
  listener is the claim queue's (:class:`dbtrigger.queue.notify.Listener`).
* :class:`AdaptivePolling` (any database; for MariaDB/MySQL and SQLite, which
  have no notifications): after a tick that delivered rows, the idle waits
  start short and double back up to the interval.

Both are off by default. The runner asks a hint only for the idle sleep after
a tick that found nothing; the backoff after a failed tick is never shortened.
"""

from __future__ import annotations

import threading
from typing import Any

from dbtrigger import options as opt
from dbtrigger.errors import ConfigurationError
from dbtrigger.queue.notify import Listener, ListenEvents, check_listen, idle_wait
from dbtrigger.runtime.pacing import WakeHint
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.wakeup.ddl import default_channel

#: The poller's listener events (``wake_*``; the metric ``wake_notifications_total``).
POLLER_EVENTS = ListenEvents("wake_listening", "wake_listen_failed", "wake_notified", "poller")


class AdaptivePolling:
    """Poll sooner for a while after activity: shorter idle waits, doubling back.

    After a tick that delivered rows the runner ticks again at once; once a
    tick finds nothing, the next waits are ``fastest_seconds``, then twice
    that, and so on up to the interval (``fastest * factor ** (idle_ticks -
    1)``). A quiet table is polled at the interval; a busy one is polled
    about every ``fastest_seconds``, i.e. a row waits about that long. The
    cost: after each burst of activity, about ``log2(interval / fastest)``
    extra empty polls (7 for 0.05 s up to 5 s). It needs nothing from the
    database, which is why it is the hint for MariaDB/MySQL and SQLite.
    """

    def __init__(self, fastest_seconds: float = 0.05, factor: float = 2.0) -> None:
        self.fastest = opt.seconds("fastest_seconds", fastest_seconds)
        self.factor = opt.number("factor", factor, minimum=1.0, inclusive=True)

    def attach(self, trigger: Any) -> None:
        del trigger  # needs nothing from it

    def delay(self, seconds: float, idle_ticks: int | None) -> float:
        """The wait after ``idle_ticks`` empty ticks in a row, at most ``seconds``."""
        if idle_ticks is None or idle_ticks < 1:
            return seconds
        steps = min(idle_ticks - 1, 64)
        return float(min(seconds, self.fastest * self.factor**steps))

    def wait(self, seconds: float, stop: threading.Event, *, idle_ticks: int | None) -> bool:
        """The sleep alone, for a caller other than the runner: the runner asks
        :meth:`delay` and sleeps through the trigger's own wait (a queue's
        ``LISTEN``, a partition member's handover still end it)."""
        stop.wait(self.delay(seconds, idle_ticks))
        return False

    def close(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"AdaptivePolling(fastest_seconds={self.fastest:g}, factor={self.factor:g})"


class NotifyHint:
    """PostgreSQL ``LISTEN/NOTIFY``: a commit on the table ends the idle sleep.

    ``channel`` defaults to the one ``dbtrigger wake install`` gives the
    source's table (:func:`~dbtrigger.wakeup.ddl.default_channel`; the watched
    table for a change log). The listener runs on a session of its own,
    started at the first idle wait, reconnecting with a backoff when it fails
    (``wake_listen_failed``) while the interval poll goes on; each
    notification received counts in ``wake_notifications_total``. A
    notification that arrives while a tick runs ends the next wait at once,
    so none is lost between a fetch and the sleep after it. It ends the
    trigger's own wait, not replaces it: what else ends that wait early (a
    queue's ``notify_channel``, a partition member gaining partitions) still
    does.

    Caveats (docs/operations.md): ``NOTIFY`` takes a database-wide lock at
    commit, which serialises committing transactions that notified; behind
    PgBouncer in transaction pooling mode ``LISTEN`` does not work (point the
    worker at PostgreSQL or a session pool); psycopg 3.2+ only.
    """

    def __init__(self, channel: str | None = None) -> None:
        self.channel = channel
        self.listener: Listener | None = None

    def attach(self, trigger: Any) -> None:
        source = trigger.source
        engine = getattr(source, "engine", None)
        name = str(getattr(source, "name", type(source).__name__))
        if engine is None:
            raise ConfigurationError(
                f"the notify wake-up hint needs a source with a database engine "
                f"(SqlAlchemySource, ChangeLogSource); {name} has none. "
                "Use AdaptivePolling (--wake adaptive) instead"
            )
        channel = self.channel or _channel_of(source)
        self.channel = check_listen(
            engine.dialect.name, engine.dialect.driver, name, channel, "the notify wake-up hint"
        )
        telemetry: Telemetry | None = getattr(trigger, "telemetry", None)
        if telemetry is None:  # a partition member: its partitions' triggers have theirs
            telemetry = Telemetry(trigger.name, trigger.metrics)
        self.listener = Listener(source, self.channel, telemetry, events=POLLER_EVENTS)

    def woken(self) -> threading.Event:
        """The event a notification sets, the listener started: the runner ends
        the trigger's own wait on it too (:class:`~dbtrigger.runtime.pacing.EndsWait`),
        so a queue's own ``LISTEN`` or a partition member gaining partitions still
        wakes the worker."""
        if self.listener is None:
            raise ConfigurationError("NotifyHint.woken() before attach(): give it to a Runner")
        self.listener.start()
        return self.listener.wake

    def wait(self, seconds: float, stop: threading.Event, *, idle_ticks: int | None) -> bool:
        """The sleep alone, for a caller other than the runner (which asks :meth:`woken`)."""
        del idle_ticks
        return idle_wait(self.listener, seconds, stop)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.stop()

    def __repr__(self) -> str:
        return f"NotifyHint(channel={self.channel!r})"


def _channel_of(source: Any) -> str:
    """The default channel of ``source``'s table, as ``dbtrigger wake install`` names it."""
    described = source.describe() if callable(getattr(source, "describe", None)) else {}
    table = described.get("watched_table") or described.get("table")
    if not table:
        raise ConfigurationError(
            f"{getattr(source, 'name', source)!r} reads a query, not a table: name the "
            "channel (NotifyHint(channel=...), --wake notify:CHANNEL) that your triggers notify"
        )
    return default_channel(str(table), described.get("schema"))


def parse_wake(text: str) -> WakeHint:
    """``--wake`` of ``dbtrigger run``: ``notify``, ``notify:CHANNEL``, ``adaptive``
    or ``adaptive:SECONDS`` (the shortest wait)."""
    kind, _, arg = text.partition(":")
    if kind == "notify":
        return NotifyHint(arg or None)
    if kind == "adaptive":
        if not arg:
            return AdaptivePolling()
        try:
            fastest = float(arg)
        except ValueError:
            raise ConfigurationError(
                f"--wake adaptive:SECONDS takes a number of seconds, got {arg!r}"
            ) from None
        return AdaptivePolling(fastest)
    raise ConfigurationError(
        f"--wake takes notify, notify:CHANNEL, adaptive or adaptive:SECONDS, got {text!r}"
    )


__all__ = ["POLLER_EVENTS", "AdaptivePolling", "NotifyHint", "WakeHint", "parse_wake"]
