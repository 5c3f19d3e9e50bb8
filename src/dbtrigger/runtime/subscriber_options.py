"""The options of fan-out (``subscribers=``, ``ack_timeout_seconds``), checked.

``PollTrigger(subscribers={"billing": handle_billing, ...})`` and
``PartitionedPoller(subscribers=...)`` check them here, once, at construction:
every name safe (it is a metric label and a key in the state document) and
distinct, every handler callable. :class:`SubscriberCall` is what a fan-out
tick passes where a single-handler tick passes its handler
(:func:`handler_for` chooses a poller's). :func:`renamed` declares a
subscriber's former name: it takes over what the old name still owed
(:func:`dbtrigger.state.fanout_set.renaming`) instead of the old name leaving
and a new one joining.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dbtrigger.errors import ConfigurationError, UnsafeIdentifierError
from dbtrigger.names import validate_name
from dbtrigger.runtime.kernel import Handler

#: Default ``ack_timeout_seconds``: how long one subscriber call may take (as
#: Airflow's shared-stream ack timeout).
DEFAULT_ACK_TIMEOUT = 300.0

#: The default when a timer firing drives the ticks (``run(timer=...)``: a
#: Functions invocation). The host restarts the worker at ``functionTimeout`` (5
#: minutes by default on the Consumption plan): waiting the default 300 s for a hung
#: subscriber, the invocation was killed before the others' outcomes committed, and
#: every firing handed the same batch to every subscriber again (never a word).
TIMER_ACK_TIMEOUT = 120.0

#: Wraps a subscriber for the way the tick is run (``tick_async``); gets the
#: subscriber and whether it takes a context, returns an ``(events, ctx)`` callable.
Wrap = Callable[[Handler, bool], Handler]


@dataclass(frozen=True)
class SubscriberCall:
    """What a fan-out tick passes where a single-handler tick passes its handler.

    :class:`FanOut` calls the subscribers instead (through ``wrap`` when set);
    the object itself is never called as a handler.
    """

    wrap: Wrap | None = None

    def __call__(self, *args: Any) -> None:
        raise ConfigurationError("the fan-out marker was called as a handler; this is a bug")


@dataclass(frozen=True)
class Renamed:
    """A subscriber declared with its former names (:func:`renamed`); called, it
    calls ``handler`` (whose signature it shows)."""

    handler: Handler
    formerly: tuple[str, ...]

    def __call__(self, *args: Any) -> Any:
        return self.handler(*args)

    @property
    def __wrapped__(self) -> Handler:  # inspect.signature reads the handler's
        return self.handler


def renamed(handler: Handler, *, formerly: str | Iterable[str]) -> Renamed:
    """``handler`` as the subscriber that used to be called ``formerly``.

    ``subscribers={"index": renamed(handle_index, formerly="search")}``: the
    events the state document still owes ``search`` (waiting for its retry)
    are owed to ``index`` from the first tick on, with their attempt counts,
    and the recorded fan-out set names ``index`` - no ``subscriber_joined`` /
    ``subscriber_left``, no backfill to run. Without it a rename is one
    subscriber leaving (what it owed is dead-lettered with a sink, or holds
    the checkpoint) and another joining at the checkpoint. Harmless to keep
    once every instance runs with it; remove it when convenient.
    """
    names = (formerly,) if isinstance(formerly, str) else tuple(formerly)
    if not names:
        raise ConfigurationError("renamed(..., formerly=) needs the subscriber's former name")
    for name in names:
        validate_name(name, "former subscriber name")
    return Renamed(handler, names)


def renames_of(subscribers: Mapping[str, Handler] | None) -> dict[str, str]:
    """Former name -> current name, for the subscribers declared with :func:`renamed`."""
    return {
        old: name
        for name, fn in (subscribers or {}).items()
        if isinstance(fn, Renamed)
        for old in fn.formerly
    }


def check_fan_out(
    subscribers: object, *, ack_timeout: float | None
) -> tuple[dict[str, Handler] | None, float]:
    """``PollTrigger``'s fan-out options, checked: (subscribers or None, ack timeout)."""
    checked = None if subscribers is None else validate_subscribers(subscribers)
    if ack_timeout is None:
        return checked, DEFAULT_ACK_TIMEOUT
    if checked is None:
        raise ConfigurationError(
            "ack_timeout_seconds applies to subscribers= only (a single handler's "
            "batch has no per-subscriber deadline; size lease_ttl_seconds instead)"
        )
    if not ack_timeout > 0:
        raise ConfigurationError(f"ack_timeout_seconds must be > 0, got {ack_timeout}")
    return checked, ack_timeout


def handler_for(
    poller: str,
    subscribers: Mapping[str, Handler] | None,
    given: Handler | None,
    registered: Handler | None,
) -> Handler:
    """The handler a tick of ``poller`` runs with: the one ``given`` to ``tick()``,
    ``drain()`` or ``run()``, the fan-out marker with ``subscribers``, or the one
    ``registered`` with ``@trigger.handler``.

    A registered handler is what ``dbtrigger run`` drives; the README registers one
    and then calls ``drain()``, so a tick run in-process uses it too rather than
    refusing.

    Raises:
        ConfigurationError: a handler given to a poller with subscribers, or none at all.
    """
    if subscribers is not None:
        if given is not None and not isinstance(given, SubscriberCall):
            raise ConfigurationError(
                f"poller {poller!r} has subscribers= ({', '.join(subscribers)}): "
                "tick(), drain() and run() take no handler; add it as one more subscriber"
            )
        return given if given is not None else SubscriberCall()
    handler = given if given is not None else registered
    if handler is not None and not callable(handler):
        raise ConfigurationError(
            f"poller {poller!r}: the handler must be a function, got {type(handler).__name__}"
        )
    if handler is None:
        raise ConfigurationError(
            f"poller {poller!r} needs a handler: register one with @trigger.handler, "
            "pass tick(handler) / drain(handler) / run(timer=..., handler=...), or "
            "construct it with subscribers={name: handler}"
        )
    return handler


def refuse_registration(poller: str, subscribers: Mapping[str, Handler] | None) -> None:
    """``@trigger.handler`` on a poller with ``subscribers=``: refused, its handlers
    are the subscribers (``PollTrigger`` and ``PartitionedPoller`` alike).

    Raises:
        ConfigurationError: ``subscribers`` were given.
    """
    if subscribers is not None:
        raise ConfigurationError(
            f"poller {poller!r} has subscribers=: its handlers are the subscribers; "
            "add this one to subscribers= instead of @handler"
        )


def validate_subscribers(raw: object) -> dict[str, Handler]:
    """Check ``subscribers=``: a mapping (or pairs) of safe, distinct names to callables.

    Raises:
        ConfigurationError: naming the problem (empty, a duplicate or unsafe
            name, a handler that is not callable).
    """
    if isinstance(raw, Mapping):
        pairs = list(raw.items())
    elif isinstance(raw, Iterable) and not isinstance(raw, str | bytes):
        pairs = list(raw)
        if not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise ConfigurationError(
                "subscribers= must be a mapping of name -> handler (or (name, handler) pairs)"
            )
    else:
        raise ConfigurationError(
            f"subscribers= must be a mapping of name -> handler, got {type(raw).__name__}"
        )
    if not pairs:
        raise ConfigurationError(
            "subscribers= is empty: give at least one subscriber (an event handed to nobody "
            "is never clean), or leave it out and pass a handler"
        )
    out: dict[str, Handler] = {}
    folded: dict[str, str] = {}
    for name, fn in pairs:
        try:
            validate_name(name, "subscriber name")
        except UnsafeIdentifierError as exc:
            raise ConfigurationError(
                f"{exc} (a subscriber name is a metric label and a key in the state document)"
            ) from None
        if name.lower() in folded:
            raise ConfigurationError(
                f"duplicate subscriber name {name!r}"
                + (f" (same as {folded[name.lower()]!r} but for case)" if name not in out else "")
                + ": each subscriber needs its own name"
            )
        if not callable(fn):
            raise ConfigurationError(
                f"subscriber {name!r} is not callable ({type(fn).__name__}): give a function "
                "taking (events) or (events, ctx)"
            )
        folded[name.lower()] = name
        out[name] = fn
    formerly: dict[str, str] = {}
    for name, fn in out.items():
        for old in fn.formerly if isinstance(fn, Renamed) else ():
            if old in out:
                raise ConfigurationError(
                    f"subscriber {name!r} is renamed(formerly={old!r}), but {old!r} is a "
                    "subscriber too: drop one of them (a rename cannot keep the old name)"
                )
            if old in formerly:
                raise ConfigurationError(
                    f"subscribers {formerly[old]!r} and {name!r} both say they were {old!r}: "
                    "what it owed can go to one of them only"
                )
            formerly[old] = name
    return out
