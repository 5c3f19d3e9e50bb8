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

The wrapper ``db.trigger`` returns shows the host only the parameters it
provides (the timer) and hides the ones dbtrigger injects: the events, an
optional ``context`` (the :class:`~dbtrigger.BatchContext`) and any
``db.output`` parameter (:mod:`dbtrigger.azure.host`). What each decorator set
up is kept in one record on the function (:mod:`dbtrigger.azure.record`).

Failure policy: lease contention is the protocol working (another instance is
polling), so the invocation returns quietly. Everything else propagates and the
invocation fails visibly in the Functions logs: retryable errors (a handler
failure, an unreachable database) are retried by the next timer firing from the
last committed checkpoint; operator errors (bad credentials, a changed source
definition, a corrupt state document) keep failing until someone fixes them.

Nothing here imports ``azure.functions``: the glue is plain Python, so it is
testable and importable without the Functions runtime. The rest of the
package: the schedule check (:mod:`~dbtrigger.azure.schedule`), options read
from app settings at first use (:mod:`~dbtrigger.azure.deferred`), the claim
queue and partition glue (:mod:`~dbtrigger.azure.queue`,
:mod:`~dbtrigger.azure.partitions`), the CLI's view of a function
(:mod:`~dbtrigger.azure.introspect`) and the Entra ID engine
(:mod:`~dbtrigger.azure.identity`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dbtrigger.azure.claims import claim
from dbtrigger.azure.deferred import Lazy
from dbtrigger.azure.host import (
    bind_handler,
    host_wrapper,
    refuse_function_builder,
)
from dbtrigger.azure.inputs import input_binding, reader_binding, writer_binding
from dbtrigger.azure.output import output_binding
from dbtrigger.azure.record import attach, binding_of
from dbtrigger.azure.schedule import ScheduleCheck, check_schedule
from dbtrigger.errors import ConfigurationError, ContentionError
from dbtrigger.metrics import MetricsCollector
from dbtrigger.partitions.member import PartitionedPoller
from dbtrigger.runtime.poller import DEFAULT_MAX_BATCHES_PER_TICK, PollTrigger
from dbtrigger.sources.base import SourceAdapter
from dbtrigger.state.stores.base import CheckpointStore

if TYPE_CHECKING:
    from dbtrigger.output import OutputTarget
    from dbtrigger.queue.source import ClaimSource
    from dbtrigger.queue.trigger import QueueTrigger

log = logging.getLogger("dbtrigger.azure")  # the name the docs and log filters use


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

    ``triggers`` maps each poller name to its :class:`~dbtrigger.PollTrigger`,
    ``partitioned`` to its :class:`~dbtrigger.partitions.PartitionedPoller` and
    ``queues`` to its :class:`~dbtrigger.QueueTrigger` (for inspection, tests
    and the CLI).
    """

    def __init__(self) -> None:
        self.triggers: dict[str, PollTrigger] = {}
        self.partitioned: dict[str, PartitionedPoller] = {}
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
                :class:`LeaseScheduleWarning`; a schedule that can never fire
                (``0 0 0 31 2 *``) is a :class:`ConfigurationError`. Given as a
                ``%SETTING%`` (as ``@app.schedule`` takes it), a missing or
                malformed setting fails only this function's invocations (a
                ``DeferredSettingError`` naming it), not the import. Measured on
                the wall clock of ``WEBSITE_TIME_ZONE`` when that is set.
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
            refuse_function_builder(
                fn,
                "@db.trigger must sit below @app.schedule, directly above the function "
                "(or above @db.output)",
            )
            if binding_of(fn).poller is not None:
                raise ConfigurationError("@db.trigger is applied twice to one function")
            host_sig, make_handler = bind_handler(fn, arg_name, "@db.trigger")
            poller_name = name or fn.__name__
            if poller_name in self.triggers:
                raise ConfigurationError(
                    f"two triggers are named {poller_name!r}: they would share one state "
                    "document; give each a distinct name="
                )
            if "owner_id" not in trigger_options:  # an explicit owner: another instance, on purpose
                claim(self, checkpoint_store, poller_name, getattr(fn, "__qualname__", poller_name))
            options: dict[str, Any] = dict(
                name=poller_name,
                source=source,
                checkpoint_store=checkpoint_store,
                metrics=metrics,
                max_concurrency=max_concurrency,
                **trigger_options,
            )
            # What `dbtrigger ... --source` calls this function (exact commands in logs).
            cli_source = f"{fn.__module__}:{getattr(fn, '__name__', poller_name)}"

            def build(numbers: dict[str, int | float]) -> PollTrigger:
                poll = PollTrigger(
                    batch_size=int(numbers["batch_size"]),
                    max_batches_per_tick=int(numbers["max_batches_per_tick"]),
                    lease_ttl_seconds=numbers["lease_ttl_seconds"],
                    **options,
                )
                poll.cli_source = cli_source
                return poll

            lazy = Lazy(
                build,
                {
                    "batch_size": (batch_size, int, None),
                    "max_batches_per_tick": (max_batches_per_tick, int, None),
                    "lease_ttl_seconds": (lease_ttl_seconds, float, None),
                },
            )
            prepared = lazy.prepared()
            ttl = prepared.lease_ttl.total_seconds() if prepared is not None else None
            schedule_check = check_schedule(ttl, schedule)
            output = binding_of(fn).output
            if output is not None and ttl is not None:
                output.fit_lease(ttl)  # a lock wait longer than that is refused now

            def ready() -> PollTrigger:
                return _ready(lazy, output, schedule_check, poller_name)

            def run(call: dict[str, Any]) -> None:
                handler = make_handler(call)
                poll = ready()
                try:
                    poll.run(handler=handler)
                except ContentionError as exc:
                    _quiet(poller_name, exc)

            async def run_async(call: dict[str, Any]) -> None:
                handler = make_handler(call)
                poll = ready()
                try:
                    await poll.run_async(handler=handler)
                except ContentionError as exc:
                    _quiet(poller_name, exc)

            wrapper = host_wrapper(fn, host_sig, run, run_async)
            attach(wrapper, fn, poller=lazy, make_handler=make_handler)
            if prepared is not None:
                self.triggers[poller_name] = prepared
            return wrapper

        return decorator

    def queue_trigger(
        self, *, arg_name: str, source: ClaimSource, name: str | None = None, **options: Any
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Drain a claim queue (:class:`~dbtrigger.ClaimSource`) each time the function
        runs; place it under ``@app.schedule``. Options as for
        :class:`~dbtrigger.QueueTrigger` (one firing is one tick: up to
        ``max_batches_per_tick`` claims; left out, 10 with a DeprecationWarning,
        becoming 1 as here on ``@db.trigger``); ``batch_size``,
        ``max_batches_per_tick`` and ``visibility_timeout_seconds``
        may be ``%SETTING%`` references, read at the first invocation as for
        :meth:`trigger`. See ``docs/queues.md``."""
        from dbtrigger.azure.queue import queue_trigger  # noqa: PLC0415 - loaded on use

        return queue_trigger(self.queues, arg_name=arg_name, source=source, name=name, **options)

    #: ``@db.output(arg_name, url=..., table=...)``: see
    #: :func:`~dbtrigger.azure.output.output_binding`.
    output = staticmethod(output_binding)
    #: ``@db.input(arg_name, url=..., table=..., pk=...)`` or ``(..., query=..., params=...)``:
    #: one row, or a query's rows, read into the function
    #: (:func:`~dbtrigger.azure.inputs.input_binding`).
    input = staticmethod(input_binding)
    #: ``@db.inject_reader(arg_name, url=..., table=...)``: a
    #: :class:`~dbtrigger.dbio.DbReader` (:func:`~dbtrigger.azure.inputs.reader_binding`).
    inject_reader = staticmethod(reader_binding)
    #: ``@db.inject_writer(arg_name, url=..., table=...)``: a
    #: :class:`~dbtrigger.dbio.DbWriter` per invocation, ``with writer.transaction():``
    #: for several writes in one transaction (:func:`~dbtrigger.azure.inputs.writer_binding`).
    inject_writer = staticmethod(writer_binding)

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
            if poller_name in self.triggers or poller_name in self.partitioned:
                raise ConfigurationError(f"two triggers are named {poller_name!r}")
            check_schedule(None, schedule)  # malformed, or never fires: refused here
            poll = PartitionedPoller(
                name=poller_name,
                source=source,  # type: ignore[arg-type]  # PartitionedPoller checks it
                checkpoint_store=checkpoint_store,
                partitions=partitions,
                **trigger_options,
            )
            self.partitioned[poller_name] = poll
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
            attach(fn, fn, partitioned=poll)
            return fn

        return decorator


def _ready(
    lazy: Lazy[PollTrigger],
    output: OutputTarget | None,
    schedule_check: ScheduleCheck | None,
    poller: str,
) -> PollTrigger:
    """The poller, after the output binding's settings resolved: a missing one fails
    the invocation before anything is fetched or handled (so does a schedule setting
    that is missing or malformed; a lease too short for the schedule is logged once)."""
    schedule = schedule_check.resolved() if schedule_check is not None else None
    if output is not None:
        output.dialect  # noqa: B018 - resolves the URL's %SETTING% now
    poll = lazy.get()
    if schedule_check is not None and schedule is not None:
        schedule_check.check_lease(poller, poll.lease_ttl.total_seconds(), schedule)
    if output is not None:
        output.fit_lease(poll.lease_ttl.total_seconds())
    return poll


def _quiet(poller: str, exc: ContentionError) -> None:
    # Not always another instance: a handler given up by handler_timeout_seconds, or a
    # store outage longer than the TTL, loses the lease too; the error says which.
    log.info(
        "poller %s: the lease was lost during this invocation (%s: %s); what it did not "
        "commit is delivered again",
        poller,
        type(exc).__name__,
        exc,
        extra={"event": "lease_contention", "poller": poller},
    )


__all__ = ["DbBindings"]
