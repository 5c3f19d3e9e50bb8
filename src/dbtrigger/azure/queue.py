"""``@db.queue_trigger``: a claim queue drained by an Azure Functions timer.

Like ``@db.trigger`` it sits under ``@app.schedule`` and hides the parameters
dbtrigger injects (the events, and ``context`` for the
:class:`~dbtrigger.ClaimContext`) from the host::

    @app.schedule(schedule="*/10 * * * * *", arg_name="timer")
    @db.queue_trigger(arg_name="events", source=ClaimSource(...), visibility_timeout_seconds=120)
    def send(timer, events, context):
        for e in events:
            ...

Each firing is one tick of the queue: it claims and handles batches until a
claim comes back short or ``max_batches_per_tick`` batches were handled (a
bounded run keeps an invocation inside the host's time limit; what is left is
claimed by the next firing or by another instance - any number may run at
once, there is no lease). Left out, ``max_batches_per_tick`` is still 10 here,
with a ``DeprecationWarning``: it becomes 1, as on ``@db.trigger``. Failed
rows are recorded on the queue (retry / dead), so a handler failure does not
fail the invocation; a database outage or a configuration
error does, and shows in the Functions logs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from dbtrigger.azure.deferred import Lazy, NumberSpec, check_written
from dbtrigger.azure.host import (
    bind_handler,
    host_wrapper,
    refuse_function_builder,
)
from dbtrigger.azure.record import attach
from dbtrigger.errors import ConfigurationError
from dbtrigger.metrics import MetricsCollector
from dbtrigger.quarantine import QuarantineSink
from dbtrigger.queue.source import ClaimSource
from dbtrigger.queue.trigger import QueueTrigger


def queue_trigger(
    registry: dict[str, QueueTrigger],
    *,
    arg_name: str,
    source: ClaimSource,
    name: str | None = None,
    batch_size: int | str = 100,
    max_batches_per_tick: int | str | None = None,
    visibility_timeout_seconds: float | str = 60,
    max_attempts: int = 5,
    quarantine: QuarantineSink | None = None,
    metrics: MetricsCollector | None = None,
    dead_letter: QuarantineSink | None = None,
    **options: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The decorator behind :meth:`dbtrigger.azure.DbBindings.queue_trigger`.

    ``batch_size``, ``max_batches_per_tick`` and ``visibility_timeout_seconds``
    may be ``%SETTING%`` references, as on ``@db.trigger``: read when the
    queue is first used, so a missing or malformed setting fails that
    function's invocations (naming the option and the setting), not the import
    (:mod:`dbtrigger.azure.deferred`). ``dead_letter=`` is the deprecated
    spelling of ``quarantine=``, as on ``QueueTrigger``.
    """
    if dead_letter is not None:
        if quarantine is not None:
            raise ConfigurationError(
                "@db.queue_trigger got both dead_letter= and quarantine=; pass quarantine= only"
            )
        warnings.warn(
            "@db.queue_trigger(dead_letter=...) is deprecated: use quarantine=..., "
            "as on @db.trigger and QueueTrigger",
            DeprecationWarning,
            stacklevel=3,
        )
        quarantine = dead_letter
    if max_batches_per_tick is None:
        warnings.warn(
            "@db.queue_trigger without max_batches_per_tick= handles up to 10 batches per "
            "firing; the default becomes 1, as on @db.trigger. Pass max_batches_per_tick=10 "
            "to keep that (or 1 for the new default)",
            DeprecationWarning,
            stacklevel=3,
        )
        max_batches_per_tick = 10

    numbers: dict[str, NumberSpec] = {
        "batch_size": (batch_size, int, None),
        "max_batches_per_tick": (max_batches_per_tick, int, 1),
        "visibility_timeout_seconds": (visibility_timeout_seconds, float, None),
    }
    check_written(numbers)  # a mistake in the code fails the import

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        refuse_function_builder(
            fn, "@db.queue_trigger must sit below @app.schedule, directly above the function"
        )
        host_sig, make_handler = bind_handler(fn, arg_name, "@db.queue_trigger")
        queue_name = name or fn.__name__
        if queue_name in registry:
            raise ConfigurationError(f"two queue triggers are named {queue_name!r}")

        def build(numbers: dict[str, int | float]) -> QueueTrigger:
            queue = QueueTrigger(
                name=queue_name,
                source=source,
                batch_size=int(numbers["batch_size"]),
                visibility_timeout_seconds=numbers["visibility_timeout_seconds"],
                max_batches_per_tick=int(numbers["max_batches_per_tick"]),
                max_attempts=max_attempts,
                quarantine=quarantine,
                metrics=metrics,
                **options,
            )
            registry[queue_name] = queue
            return queue

        lazy = Lazy(build, numbers)

        def run(call: dict[str, Any]) -> None:
            lazy.get().tick(make_handler(call))

        async def run_async(call: dict[str, Any]) -> None:
            await lazy.get().tick_async(make_handler(call))

        wrapper = host_wrapper(fn, host_sig, run, run_async)
        attach(wrapper, fn, queue=lazy)
        # `dbtrigger queue ... --source function_app:send` finds the queue table here.
        wrapper.dbtrigger_queue_source = source  # type: ignore[attr-defined]
        lazy.prepared()  # every option known now: configuration errors show at import
        return wrapper

    return decorator


__all__ = ["queue_trigger"]
