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
import struct
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from dbtrigger.errors import ConfigurationError, ContentionError
from dbtrigger.metrics import MetricsCollector
from dbtrigger.output import (
    Action,
    bind_handler,
    call_keywords,
    output_binding,
    set_host_signature,
)
from dbtrigger.runtime.poller import DEFAULT_MAX_BATCHES_PER_TICK, PollTrigger
from dbtrigger.settings import DeferredSettingError, resolve_setting, setting_number
from dbtrigger.sources.base import SourceAdapter
from dbtrigger.state.stores.base import CheckpointStore

if TYPE_CHECKING:
    from dbtrigger.queue.source import ClaimSource
    from dbtrigger.queue.trigger import QueueTrigger

log = logging.getLogger("dbtrigger.azure")  # the name the docs and log filters use


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


def _refuse_subscribers(options: dict[str, Any]) -> None:
    """A Function is one handler; fan-out is a plain PollTrigger driven by the timer
    (docs/azure.md, "Several subscribers on one read")."""
    if "subscribers" in options:
        raise ConfigurationError(
            "@db.trigger takes no subscribers=: the decorated function is the handler. "
            "For several subscribers on one read build PollTrigger(..., subscribers=...) "
            "and call trigger.run(timer=timer) from an @app.schedule function"
        )


class DbBindings:
    """Decorators that turn a Functions timer into a dbtrigger poller.

    ``triggers`` maps each poller name to its :class:`~dbtrigger.PollTrigger`
    (for inspection, tests and the CLI).
    """

    def __init__(self) -> None:
        self.triggers: dict[str, PollTrigger] = {}
        self.queues: dict[str, QueueTrigger] = {}

    def trigger(
        self,
        *,
        arg_name: str,
        source: SourceAdapter,
        checkpoint_store: CheckpointStore,
        name: str | None = None,
        batch_size: int | str = 100,
        max_batches_per_tick: int | str = DEFAULT_MAX_BATCHES_PER_TICK,
        lease_ttl_seconds: float | str = 120,
        metrics: MetricsCollector | None = None,
        schedule: str | None = None,
        max_concurrency: int = 1,
        **trigger_options: Any,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Poll ``source`` each time the function runs; place it under ``@app.schedule``.

        Args:
            arg_name: the handler parameter that receives ``list[RowChange]``.
            source / checkpoint_store / batch_size / max_batches_per_tick /
                lease_ttl_seconds / metrics: as for :class:`~dbtrigger.PollTrigger`.
                ``batch_size``, ``max_batches_per_tick`` and ``lease_ttl_seconds``
                may be ``%SETTING%`` references, read from the app settings (as
                the Azure SQL trigger reads ``Sql_Trigger_MaxBatchSize``).
            name: the poller name (its state document); defaults to the function name.
            schedule: the timer's schedule, repeated here so the lease TTL can
                be checked against it when the module is imported (the
                ``@app.schedule`` above is applied after this decorator, so its
                schedule is not visible yet). A contradiction emits
                :class:`LeaseScheduleWarning`.
            max_concurrency: parallel lanes per batch, as for ``PollTrigger``: the
                function is called on up to this many parts of a batch at once
                (each call with its own ``@db.output`` rows); keep batches x
                handler time inside ``functionTimeout``.
            trigger_options: further keyword arguments for ``PollTrigger``
                (``owner_id``, ``clock``, ...).

        The handler may be ``def`` or ``async def``; a parameter named
        ``context`` receives the :class:`~dbtrigger.BatchContext`.

        A ``%SETTING%`` that is missing (here, in the source's URL or in the
        store's app name) does not fail the import: the Function App still
        indexes every function, and this one fails each invocation with a
        :class:`~dbtrigger.errors.ConfigurationError` naming the setting.
        """

        _refuse_subscribers(trigger_options)

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            if _is_function_builder(fn):
                raise ConfigurationError(
                    "@db.trigger must sit below @app.schedule, directly above the function "
                    "(or above @db.output)"
                )
            if hasattr(fn, "poll_trigger"):
                raise ConfigurationError("@db.trigger is applied twice to one function")
            host_sig, make_handler = bind_handler(fn, arg_name, "@db.trigger")
            poller_name = name or fn.__name__
            if poller_name in self.triggers:
                raise ConfigurationError(
                    f"two triggers are named {poller_name!r}: they would share one state "
                    "document; give each a distinct name="
                )
            lazy = _LazyPoller(
                fn,
                dict(
                    name=poller_name,
                    source=source,
                    checkpoint_store=checkpoint_store,
                    metrics=metrics,
                    max_concurrency=max_concurrency,
                    **trigger_options,
                ),
                {
                    "batch_size": batch_size,
                    "max_batches_per_tick": max_batches_per_tick,
                    "lease_ttl_seconds": lease_ttl_seconds,
                },
            )
            prepared = lazy.prepared()
            if prepared is not None:
                _check_schedule(prepared.lease_ttl.total_seconds(), schedule)

            if inspect.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def async_wrapper(*args: Any, **kwargs: Any) -> None:
                    handler = make_handler(call_keywords(host_sig, args, kwargs))
                    poll = lazy.ready()
                    try:
                        await poll.tick_async(handler)
                    except ContentionError as exc:
                        _quiet(poller_name, exc)

                wrapper: Callable[..., Any] = async_wrapper
            else:

                @functools.wraps(fn)
                def sync_wrapper(*args: Any, **kwargs: Any) -> None:
                    handler = make_handler(call_keywords(host_sig, args, kwargs))
                    poll = lazy.ready()
                    try:
                        poll.tick(handler)
                    except ContentionError as exc:
                        _quiet(poller_name, exc)

                wrapper = sync_wrapper
            set_host_signature(wrapper, host_sig)
            if prepared is not None:
                wrapper.poll_trigger = prepared  # type: ignore[attr-defined]
                self.triggers[poller_name] = prepared
            wrapper.dbtrigger_build = lazy.build  # type: ignore[attr-defined]
            wrapper.dbtrigger_handler = make_handler  # type: ignore[attr-defined]
            return wrapper

        return decorator

    def queue_trigger(
        self, *, arg_name: str, source: ClaimSource, name: str | None = None, **options: Any
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Drain a claim queue (:class:`~dbtrigger.ClaimSource`) each time the function
        runs; place it under ``@app.schedule``. Options as for
        :class:`~dbtrigger.QueueTrigger`, plus ``max_batches_per_tick`` (default 10);
        ``batch_size``, ``max_batches_per_tick`` and ``visibility_timeout_seconds``
        may be ``%SETTING%`` references, read at the first invocation as for
        :meth:`trigger`. See ``docs/queues.md``."""
        from dbtrigger.azure.queue import queue_trigger  # noqa: PLC0415 - loaded on use

        return queue_trigger(self.queues, arg_name=arg_name, source=source, name=name, **options)

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

    def partitioned_trigger(
        self,
        app: Any,
        *,
        source: SourceAdapter,
        checkpoint_store: CheckpointStore,
        partitions: int,
        schedule: str,
        name: str | None = None,
        queue_name: str | None = None,
        connection: str = "AzureWebJobsStorage",
        time_budget_seconds: float = 240.0,
        **trigger_options: Any,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A partitioned poller spread over Function instances (``docs/scale-out.md``).

        Registers two functions on ``app`` (do not add ``@app.schedule``): a
        timer coordinator ``<fn>_coordinator`` that queues one message per
        partition with work, and a queue-triggered ``<fn>`` that processes the
        partition a message names for up to ``time_budget_seconds``. The queue
        (default ``<poller>-partitions``) is created on first use in the
        storage account of app setting ``connection``. ``fn(events)`` or
        ``fn(events, context)`` is the handler.
        """

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            from dbtrigger.azure.partitions import register_partitioned  # noqa: PLC0415

            poller_name = name or fn.__name__
            if poller_name in self.triggers:
                raise ConfigurationError(f"two triggers are named {poller_name!r}")
            poll = PollTrigger(
                name=poller_name,
                source=source,
                checkpoint_store=checkpoint_store,
                partitions=partitions,
                **trigger_options,
            )
            self.triggers[poller_name] = poll
            queue = queue_name or re.sub(r"[^a-z0-9-]+", "-", f"{poller_name}-partitions".lower())
            register_partitioned(
                app,
                fn,
                poll,
                schedule=schedule,
                queue_name=queue,
                connection=connection,
                time_budget_seconds=time_budget_seconds,
            )
            fn.poll_trigger = poll  # type: ignore[attr-defined]
            return fn

        return decorator


# --- the same function outside the Functions host (CLI: run, backfill) ----------------


class OfflineTimer:
    """Stands in for ``func.TimerRequest`` when a function runs outside the host.

    ``past_due`` is False: the CLI ticks when asked to, never late.
    """

    past_due = False
    schedule_status: Mapping[str, Any] | None = None
    schedule: Mapping[str, Any] | None = None


def _user_function(obj: Any) -> tuple[Any, str | None]:
    """The user function behind ``obj`` and the name of its timer parameter, if known.

    ``obj`` is what a module attribute holds: the function ``@db.trigger``
    returned, or the ``FunctionBuilder`` that ``@app.schedule`` /
    ``@app.function_name`` turned it into.
    """
    inner = getattr(obj, "_function", obj)  # FunctionBuilder -> Function
    get_user_function = getattr(inner, "get_user_function", None)
    timer_arg: str | None = None
    if callable(get_user_function):
        get_trigger = getattr(inner, "get_trigger", None)
        trigger = get_trigger() if callable(get_trigger) else None
        if trigger is not None and "timer" in type(trigger).__name__.lower():
            timer_arg = getattr(trigger, "name", None)
        return get_user_function(), timer_arg
    return obj, None


def function_trigger(obj: Any) -> PollTrigger | None:
    """The :class:`PollTrigger` of a ``@db.trigger`` function, or None if ``obj`` is not one.

    Raises:
        ConfigurationError: the function's poller needs an app setting that is missing.
    """
    fn, _ = _user_function(obj)
    build = getattr(fn, "dbtrigger_build", None)
    poll = build() if callable(build) else getattr(fn, "poll_trigger", None)
    return poll if isinstance(poll, PollTrigger) else None


def function_handler(obj: Any) -> Callable[..., Any]:
    """A batch handler that runs a ``@db.trigger`` function as the host would.

    The function's own code runs with its ``@db.output`` bindings (rows given
    to ``out.set`` are written before the checkpoint commit) and an
    :class:`OfflineTimer` for its timer parameter, so ``dbtrigger run`` and
    ``dbtrigger backfill`` drive exactly what the Function App deploys.

    Raises:
        ConfigurationError: ``obj`` is not a ``@db.trigger`` function, or it
            takes a host binding other than the timer (the CLI cannot provide it).
    """
    fn, timer_arg = _user_function(obj)
    make_handler = getattr(fn, "dbtrigger_handler", None)
    if make_handler is None:
        raise ConfigurationError(f"{getattr(fn, '__name__', fn)!r} is not a @db.trigger function")
    host_args: dict[str, Any] = {}
    for name, param in inspect.signature(fn).parameters.items():
        annotation = str(param.annotation)
        is_timer = name == timer_arg or "TimerRequest" in annotation
        if timer_arg is None and name == "timer":
            is_timer = True
        if is_timer:
            host_args[name] = OfflineTimer()
        elif param.default is inspect.Parameter.empty and param.kind not in (
            inspect.Parameter.VAR_KEYWORD,
            inspect.Parameter.VAR_POSITIONAL,
        ):
            raise ConfigurationError(
                f"function {fn.__name__!r} takes the host binding {name!r}, which only the "
                "Functions host can provide; the CLI provides the timer and @db.output bindings"
            )
    handler: Callable[..., Any] = make_handler(host_args)
    return handler


class _LazyPoller:
    """The PollTrigger of one function: built at decoration, or at the first
    invocation when an app setting it needs is missing (then every invocation
    of that function reports it, and the rest of the app indexes and runs)."""

    def __init__(
        self, fn: Callable[..., Any], options: dict[str, Any], numbers: dict[str, float | str]
    ) -> None:
        self.fn = fn
        self.options = options
        self.numbers = numbers
        self.poll: PollTrigger | None = None

    def build(self) -> PollTrigger:
        if self.poll is None:
            n = self.numbers
            poll = PollTrigger(
                batch_size=int(setting_number(n["batch_size"], "batch_size", int)),
                max_batches_per_tick=int(
                    setting_number(n["max_batches_per_tick"], "max_batches_per_tick", int)
                ),
                lease_ttl_seconds=setting_number(
                    n["lease_ttl_seconds"], "lease_ttl_seconds", float
                ),
                **self.options,
            )
            # What `dbtrigger ... --source` calls this function (exact commands in logs).
            poll.cli_source = f"{self.fn.__module__}:{getattr(self.fn, '__name__', poll.name)}"
            self.poll = poll
        return self.poll

    def prepared(self) -> PollTrigger | None:
        """The poller if it can be built now; None when an app setting is missing."""
        try:
            return self.build()
        except DeferredSettingError:
            return None

    def ready(self) -> PollTrigger:
        """The poller, after the output binding's settings resolved: a missing
        one fails the invocation before anything is fetched or handled."""
        target = getattr(self.fn, "db_output_target", None)
        if target is not None:
            target.dialect  # noqa: B018 - resolves the URL's %SETTING% now
        return self.build()


# --- passwordless database access --------------------------------------------------------

#: Token scopes of Microsoft Entra ID for the Azure database services.
ENTRA_SCOPES = {
    "postgresql": "https://ossrdbms-aad.database.windows.net/.default",
    "mysql": "https://ossrdbms-aad.database.windows.net/.default",
    "mariadb": "https://ossrdbms-aad.database.windows.net/.default",
    "mssql": "https://database.windows.net/.default",
}
#: pyodbc connection attribute that carries an access token (msodbcsql.h).
SQL_COPT_SS_ACCESS_TOKEN = 1256


def entra_id_engine(
    url: str, *, credential: Any = None, scope: str | None = None, **engine_kwargs: Any
) -> Engine:
    """A SQLAlchemy engine that logs in with a Microsoft Entra ID access token.

    Each new connection asks ``credential`` (default
    ``azure.identity.DefaultAzureCredential()``: the managed identity in Azure,
    ``az login`` locally) for a token: the password for PostgreSQL and MySQL,
    the ODBC access-token attribute for Azure SQL (``mssql+pyodbc``). Pass the
    engine as ``engine=`` to a source, a store or ``db.output``; the URL holds
    no secret. ``pool_recycle`` defaults to 1800 s so pooled connections are
    reopened with a fresh token well within its lifetime.

    Raises:
        ConfigurationError: the dialect has no known Entra ID login and no
            ``scope`` was given.
    """
    import sqlalchemy as sa  # noqa: PLC0415 - only this helper needs the event API

    from dbtrigger._engine import create_engine, parse_database_url  # noqa: PLC0415

    parsed = parse_database_url(url)
    dialect = parsed.get_backend_name()
    token_scope = scope or ENTRA_SCOPES.get(dialect)
    if token_scope is None:
        raise ConfigurationError(
            f"no Entra ID login is known for {dialect}; pass scope= and a do_connect listener"
        )
    if credential is None:
        from azure.identity import DefaultAzureCredential  # noqa: PLC0415 - optional extra

        credential = DefaultAzureCredential()
    engine = create_engine(parsed, **{"pool_pre_ping": True, "pool_recycle": 1800, **engine_kwargs})

    @sa.event.listens_for(engine, "do_connect")
    def _token_login(dialect_: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        del dialect_, record, cargs
        token = credential.get_token(token_scope).token
        if dialect == "mssql":
            raw = token.encode("utf-16-le")
            cparams["attrs_before"] = {
                SQL_COPT_SS_ACCESS_TOKEN: struct.pack(f"<I{len(raw)}s", len(raw), raw)
            }
        else:
            cparams["password"] = token

    return engine


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
    "OfflineTimer",
    "entra_id_engine",
    "function_handler",
    "function_trigger",
    "lease_schedule_conflict",
    "schedule_interval",
]
