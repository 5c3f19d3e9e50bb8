"""``@db.queue_trigger``: a claim queue drained by an Azure Functions timer.

Like ``@db.trigger`` it sits under ``@app.schedule`` and hides the parameters
dbtrigger injects (the events, and ``context`` for the
:class:`~dbtrigger.ClaimContext`) from the host::

    @app.schedule(schedule="*/10 * * * * *", arg_name="timer")
    @db.queue_trigger(arg_name="events", source=ClaimSource(...), visibility_timeout_seconds=120)
    def send(timer, events, context):
        for e in events:
            ...

Each firing claims and handles batches until a claim comes back short or
``max_batches_per_tick`` batches were handled (a bounded run keeps an
invocation inside the host's time limit; what is left is claimed by the next
firing or by another instance - any number may run at once, there is no
lease). Failed rows are recorded on the queue (retry / dead), so a handler
failure does not fail the invocation; a database outage or a configuration
error does, and shows in the Functions logs.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from dbtrigger.errors import ConfigurationError
from dbtrigger.metrics import MetricsCollector
from dbtrigger.output import bind_handler, call_keywords, set_host_signature
from dbtrigger.quarantine import QuarantineSink
from dbtrigger.queue.source import ClaimSource
from dbtrigger.queue.trigger import QueueTrigger
from dbtrigger.settings import DeferredSettingError, setting_number


def queue_trigger(
    registry: dict[str, QueueTrigger],
    *,
    arg_name: str,
    source: ClaimSource,
    name: str | None = None,
    batch_size: int | str = 100,
    max_batches_per_tick: int | str = 10,
    visibility_timeout_seconds: float | str = 60,
    max_attempts: int = 5,
    dead_letter: QuarantineSink | None = None,
    metrics: MetricsCollector | None = None,
    **options: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The decorator behind :meth:`dbtrigger.azure.DbBindings.queue_trigger`.

    ``batch_size``, ``max_batches_per_tick`` and ``visibility_timeout_seconds``
    may be ``%SETTING%`` references, as on ``@db.trigger``: read when the
    queue is first used, so a missing or malformed setting fails that
    function's invocations (naming the option and the setting), not the import.
    """
    numbers = _Numbers(
        {
            "batch_size": (batch_size, int),
            "max_batches_per_tick": (max_batches_per_tick, int),
            "visibility_timeout_seconds": (visibility_timeout_seconds, float),
        }
    )

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if type(fn).__name__ == "FunctionBuilder":
            raise ConfigurationError(
                "@db.queue_trigger must sit below @app.schedule, directly above the function"
            )
        host_sig, make_handler = bind_handler(fn, arg_name, "@db.queue_trigger")
        queue_name = name or fn.__name__
        if queue_name in registry:
            raise ConfigurationError(f"two queue triggers are named {queue_name!r}")
        built: list[tuple[QueueTrigger, int]] = []
        lock = threading.Lock()

        def ready() -> tuple[QueueTrigger, int]:
            """The queue and its batches per firing, built on the first use."""
            with lock:
                if not built:
                    resolved = numbers.resolve()
                    queue = QueueTrigger(
                        name=queue_name,
                        source=source,
                        batch_size=int(resolved["batch_size"]),
                        visibility_timeout_seconds=resolved["visibility_timeout_seconds"],
                        max_attempts=max_attempts,
                        quarantine=dead_letter,
                        metrics=metrics,
                        **options,
                    )
                    registry[queue_name] = queue
                    wrapper.queue_trigger = queue  # type: ignore[attr-defined]
                    built.append((queue, int(resolved["max_batches_per_tick"])))
                return built[0]

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> None:
                handler = make_handler(call_keywords(host_sig, args, kwargs))
                queue, max_batches = ready()
                for _ in range(max_batches):
                    if not (await queue.tick_result_async(handler)).more:
                        break

            wrapper: Callable[..., Any] = async_wrapper
        else:

            @functools.wraps(fn)
            def sync_wrapper(*args: Any, **kwargs: Any) -> None:
                handler = make_handler(call_keywords(host_sig, args, kwargs))
                queue, max_batches = ready()
                queue.drain(handler, max_ticks=max_batches)

            wrapper = sync_wrapper
        set_host_signature(wrapper, host_sig)
        if numbers.known:
            ready()  # every option is known now: configuration errors show at import
        return wrapper

    return decorator


class _Numbers:
    """The decorator's numeric options: literal ones checked at once (a mistake in
    code fails the import), ``%SETTING%`` ones read at the first use."""

    def __init__(self, options: dict[str, tuple[object, type[int] | type[float]]]) -> None:
        self.options = options
        self.known = True
        for option, (value, kind) in options.items():
            try:
                self._one(option, value, kind)
            except DeferredSettingError:
                self.known = False

    def resolve(self) -> dict[str, float]:
        return {o: self._one(o, value, kind) for o, (value, kind) in self.options.items()}

    @staticmethod
    def _one(option: str, value: object, kind: type[int] | type[float]) -> float:
        number = setting_number(value, option, kind)
        if option == "max_batches_per_tick" and number < 1:
            raise ConfigurationError(f"max_batches_per_tick must be >= 1, got {number}")
        return number
