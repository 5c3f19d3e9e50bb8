"""``DbBindings``: dbtrigger as decorators for the Azure Functions Python v2 model.

The polling trigger is not a native Functions trigger: a timer fires, and the
function it runs performs one :class:`~dbtrigger.PollTrigger` tick. The glue
is therefore a decorator that sits *under* ``@app.schedule``::

    app = func.FunctionApp()
    db = DbBindings()

    @app.schedule(schedule="0 */1 * * * *", arg_name="timer", use_monitor=True)
    @db.trigger(arg_name="events", source=source, checkpoint_store=store)
    @db.output("out", url="%DEST_DB_URL%", table="processed", action="upsert",
               conflict_columns=["order_id", "cursor"])
    def orders(timer: func.TimerRequest, events: list[RowChange], out: DbOut) -> None:
        out.set([...])

The Functions worker binds parameters by name, from ``inspect.signature`` and
the annotations. The wrapper ``db.trigger`` returns therefore shows the host
only the parameters it provides (the timer), and hides the ones dbtrigger
injects: the events, an optional ``context`` (the
:class:`~dbtrigger.BatchContext`) and any ``db.output`` parameter.

Failure policy: lease contention is the protocol working (another instance is
polling), so the invocation returns quietly. Everything else propagates and the
invocation fails visibly in the Functions logs: retryable errors (a handler
failure, an unreachable database) are retried by the next timer firing from the
last committed checkpoint; operator errors (bad credentials, a changed source
definition, a corrupt state document) keep failing until someone fixes them.

Nothing here imports ``azure.functions``: the glue is plain Python, so it is
testable and importable without the Functions runtime.
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Engine

from dbtrigger.errors import ConfigurationError, ContentionError
from dbtrigger.metrics import MetricsCollector
from dbtrigger.output import (
    Action,
    call_keywords,
    host_signature,
    output_binding,
    set_host_signature,
)
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.settings import resolve_setting
from dbtrigger.sources.base import SourceAdapter
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger(__name__)

CONTEXT_PARAM = "context"


class LeaseScheduleWarning(UserWarning):
    """``lease_ttl_seconds`` is shorter than the timer interval (runtime contract, section 7)."""


# --- the timer schedule --------------------------------------------------------------

_MONTH_NAMES = {
    m: i + 1
    for i, m in enumerate(
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
    )
}
_DAY_NAMES = {d: i for i, d in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
#: (name, lowest, highest, names) of the six NCRONTAB fields.
_FIELDS: tuple[tuple[str, int, int, Mapping[str, int]], ...] = (
    ("second", 0, 59, {}),
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day", 1, 31, {}),
    ("month", 1, 12, _MONTH_NAMES),
    ("day-of-week", 0, 7, _DAY_NAMES),
)
_TIMESPAN = re.compile(r"^(?:(\d+)\.)?(\d{1,2}):(\d{2}):(\d{2})$")
#: Firings enumerated to find the shortest gap; plenty for any real schedule.
_SAMPLE_FIRINGS = 500
_SAMPLE_YEARS = 5


def _field_values(text: str, name: str, lo: int, hi: int, names: Mapping[str, int]) -> set[int]:
    def number(token: str) -> int:
        key = token.strip().lower()
        if key in names:
            return names[key]
        if not key.isdigit():
            raise ConfigurationError(f"schedule {name} field: {token!r} is not a number")
        return int(key)

    values: set[int] = set()
    for part in text.split(","):
        body, _, step_text = part.partition("/")
        step = number(step_text) if step_text else 1
        if step < 1:
            raise ConfigurationError(f"schedule {name} field: step must be >= 1 in {part!r}")
        if body in ("*", "?"):
            start, end = lo, hi
        elif "-" in body:
            first, _, last = body.partition("-")
            start, end = number(first), number(last)
        else:
            start = number(body)
            end = hi if step_text else start
        if not lo <= start <= end <= hi:
            raise ConfigurationError(
                f"schedule {name} field: {part!r} is outside {lo}-{hi} or reversed"
            )
        values.update(range(start, end + 1, step))
    return values


def _firings(fields: list[set[int]], start: dt.datetime) -> Iterator[dt.datetime]:
    seconds, minutes, hours, days, months, weekdays = (sorted(f) for f in fields)
    dow = {d % 7 for d in weekdays}  # 7 is Sunday too
    day = start
    end = start.replace(year=start.year + _SAMPLE_YEARS)
    while day < end:
        # NCRONTAB requires day-of-month AND day-of-week to match.
        if day.month in months and day.day in days and (day.weekday() + 1) % 7 in dow:
            for h in hours:
                for m in minutes:
                    for s in seconds:
                        yield day.replace(hour=h, minute=m, second=s)
        day += dt.timedelta(days=1)


def schedule_interval(schedule: str) -> dt.timedelta | None:
    """The shortest time between two firings of a Functions timer schedule.

    Accepts the six-field NCRONTAB form (``{second} {minute} {hour} {day}
    {month} {day-of-week}``, with ``*``, ranges, lists, steps and English month
    and day names) and the ``hh:mm:ss`` TimeSpan form. Returns None when the
    schedule fires fewer than twice in five years.

    Raises:
        ConfigurationError: the schedule is not in either form.
    """
    text = schedule.strip()
    span = _TIMESPAN.match(text)
    if span:
        days, hours, minutes, seconds = (int(g) if g else 0 for g in span.groups())
        interval = dt.timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        if interval <= dt.timedelta(0):
            raise ConfigurationError(f"schedule {schedule!r}: a TimeSpan must be positive")
        return interval
    parts = text.split()
    if len(parts) != len(_FIELDS):
        raise ConfigurationError(
            f"schedule {schedule!r} is not a six-field NCRONTAB expression "
            "('{second} {minute} {hour} {day} {month} {day-of-week}') or an hh:mm:ss TimeSpan"
        )
    fields = [
        _field_values(part, name, lo, hi, names)
        for part, (name, lo, hi, names) in zip(parts, _FIELDS, strict=True)
    ]
    shortest: dt.timedelta | None = None
    previous: dt.datetime | None = None
    start = dt.datetime(2024, 1, 1)  # naive on purpose: calendar arithmetic, no real instant
    for count, firing in enumerate(_firings(fields, start)):
        if previous is not None:
            gap = firing - previous
            shortest = gap if shortest is None else min(shortest, gap)
        previous = firing
        if count >= _SAMPLE_FIRINGS:
            break
    return shortest


def lease_schedule_conflict(lease_ttl_seconds: float, schedule: str) -> str | None:
    """Why ``lease_ttl_seconds`` does not suit ``schedule``, or None when it does.

    A tick may run until the timer fires again, and every commit renews the
    lease for another TTL. A TTL shorter than the interval means a batch that
    fits comfortably in the tick's time slot can still outlive its lease; then
    another instance takes over and the batch is delivered twice (window W4).
    A timer faster than the TTL is harmless: overlapping firings find the lease
    taken and return after one read.
    """
    interval = schedule_interval(schedule)
    if interval is None or lease_ttl_seconds >= interval.total_seconds():
        return None
    return (
        f"lease_ttl_seconds={lease_ttl_seconds:g} is shorter than the timer interval "
        f"({interval.total_seconds():g} s) of schedule {schedule!r}: a batch that fits the "
        "interval can outlive its lease and be delivered twice by another instance; set "
        f"lease_ttl_seconds >= {interval.total_seconds():g} (and above the slowest batch)"
    )


def _check_schedule(lease_ttl_seconds: float, schedule: str | None) -> None:
    if schedule is None:
        return
    try:
        resolved = resolve_setting(schedule)
    except ConfigurationError:
        # The host resolves %SETTING% schedules too and reports a missing one itself.
        log.debug("schedule %s is not resolvable here; not checked against the lease", schedule)
        return
    problem = lease_schedule_conflict(lease_ttl_seconds, resolved)
    if problem:
        # stacklevel: warn -> _check_schedule -> decorator -> the user's module
        warnings.warn(problem, LeaseScheduleWarning, stacklevel=3)


# --- the bindings -----------------------------------------------------------------


def _is_function_builder(obj: object) -> bool:
    return type(obj).__name__ == "FunctionBuilder" and hasattr(obj, "add_trigger")


class DbBindings:
    """Decorators that turn a Functions timer into a dbtrigger poller.

    ``triggers`` maps each poller name to its :class:`~dbtrigger.PollTrigger`
    (for inspection, tests and the CLI).
    """

    def __init__(self) -> None:
        self.triggers: dict[str, PollTrigger] = {}

    def trigger(
        self,
        *,
        arg_name: str,
        source: SourceAdapter,
        checkpoint_store: CheckpointStore,
        name: str | None = None,
        batch_size: int = 100,
        max_batches_per_tick: int = 1,
        lease_ttl_seconds: float = 120,
        metrics: MetricsCollector | None = None,
        schedule: str | None = None,
        **trigger_options: Any,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Poll ``source`` each time the function runs; place it under ``@app.schedule``.

        Args:
            arg_name: the handler parameter that receives ``list[RowChange]``.
            source / checkpoint_store / batch_size / max_batches_per_tick /
                lease_ttl_seconds / metrics: as for :class:`~dbtrigger.PollTrigger`.
            name: the poller name (its state document); defaults to the function name.
            schedule: the timer's schedule, repeated here so the lease TTL can
                be checked against it when the module is imported (the
                ``@app.schedule`` above is applied after this decorator, so its
                schedule is not visible yet). A contradiction emits
                :class:`LeaseScheduleWarning`.
            trigger_options: further keyword arguments for ``PollTrigger``
                (``owner_id``, ``clock``, ...).

        The handler may be ``def`` or ``async def``; a parameter named
        ``context`` receives the :class:`~dbtrigger.BatchContext`.
        """

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            if _is_function_builder(fn):
                raise ConfigurationError(
                    "@db.trigger must sit below @app.schedule, directly above the function "
                    "(or above @db.output)"
                )
            if hasattr(fn, "poll_trigger"):
                raise ConfigurationError("@db.trigger is applied twice to one function")
            sig = inspect.signature(fn)
            if arg_name not in sig.parameters:
                raise ConfigurationError(
                    f"@db.trigger(arg_name={arg_name!r}): {getattr(fn, '__name__', fn)!r} "
                    f"has no parameter {arg_name!r}"
                )
            wants_context = CONTEXT_PARAM in sig.parameters and arg_name != CONTEXT_PARAM
            hidden = {arg_name, CONTEXT_PARAM} if wants_context else {arg_name}
            host_sig = host_signature(fn, hidden, "@db.trigger").replace(return_annotation=None)
            poller_name = name or fn.__name__
            if poller_name in self.triggers:
                raise ConfigurationError(
                    f"two triggers are named {poller_name!r}: they would share one state "
                    "document; give each a distinct name="
                )
            poll = PollTrigger(
                name=poller_name,
                source=source,
                checkpoint_store=checkpoint_store,
                batch_size=batch_size,
                max_batches_per_tick=max_batches_per_tick,
                lease_ttl_seconds=lease_ttl_seconds,
                metrics=metrics,
                **trigger_options,
            )
            _check_schedule(lease_ttl_seconds, schedule)

            def make_handler(host_args: dict[str, Any]) -> Callable[..., Any]:
                def handler(events: Any, ctx: Any) -> Any:
                    call = dict(host_args)
                    call[arg_name] = events
                    if wants_context:
                        call[CONTEXT_PARAM] = ctx
                    return fn(**call)

                return handler

            if inspect.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def async_wrapper(*args: Any, **kwargs: Any) -> None:
                    handler = make_handler(call_keywords(host_sig, args, kwargs))
                    try:
                        await poll.tick_async(handler)
                    except ContentionError as exc:
                        _quiet(poller_name, exc)

                wrapper: Callable[..., Any] = async_wrapper
            else:

                @functools.wraps(fn)
                def sync_wrapper(*args: Any, **kwargs: Any) -> None:
                    handler = make_handler(call_keywords(host_sig, args, kwargs))
                    try:
                        poll.tick(handler)
                    except ContentionError as exc:
                        _quiet(poller_name, exc)

                wrapper = sync_wrapper
            set_host_signature(wrapper, host_sig)
            wrapper.poll_trigger = poll  # type: ignore[attr-defined]
            self.triggers[poller_name] = poll
            return wrapper

        return decorator

    def output(
        self,
        arg_name: str,
        *,
        url: str | None = None,
        table: str,
        schema: str | None = None,
        action: Action = "insert",
        conflict_columns: Sequence[str] | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        engine: Engine | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Inject a :class:`~dbtrigger.output.DbOut` as ``arg_name``.

        Rows given to ``out.set(...)`` are written in one transaction after the
        handler returns (before the checkpoint commit, under ``db.trigger``),
        and discarded if it raises. ``url`` may be a ``%SETTING%`` reference;
        ``action="upsert"`` needs ``conflict_columns`` naming the table's
        primary key or a unique constraint. Place it directly above the function.
        """
        return output_binding(
            arg_name,
            url=url,
            table=table,
            schema=schema,
            action=action,
            conflict_columns=conflict_columns,
            engine_kwargs=engine_kwargs,
            engine=engine,
        )


def _quiet(poller: str, exc: ContentionError) -> None:
    log.info(
        "poller %s: another instance holds the lease (%s); this invocation does nothing",
        poller,
        type(exc).__name__,
        extra={"event": "lease_contention", "poller": poller},
    )


__all__ = [
    "DbBindings",
    "LeaseScheduleWarning",
    "lease_schedule_conflict",
    "schedule_interval",
]
