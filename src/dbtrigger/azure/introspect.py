"""A decorated function outside the Functions host: what the CLI runs.

``dbtrigger run``, ``backfill`` and the state commands take a ``module:function``
of a Function App. They find the function's poller and handler through its
binding record (:mod:`dbtrigger.azure.record`), and call the function's own
code with its ``@db.output`` bindings and an :class:`OfflineTimer`, so the CLI
drives exactly what the app deploys.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from dbtrigger.azure.record import FunctionBinding, binding_of
from dbtrigger.errors import ConfigurationError
from dbtrigger.partitions.member import PartitionedPoller
from dbtrigger.runtime.poller import PollTrigger


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


def function_record(obj: Any) -> FunctionBinding:
    """What dbtrigger's decorators recorded on ``obj`` (a function, or what
    ``@app.schedule`` made of it); an empty record for anything else. Builds nothing."""
    return binding_of(_user_function(obj)[0])


def function_trigger(obj: Any) -> PollTrigger | PartitionedPoller | None:
    """The :class:`PollTrigger` of a ``@db.trigger`` function (the
    :class:`PartitionedPoller` of a ``db.partitioned_trigger`` one), or None if
    ``obj`` is neither.

    Raises:
        ConfigurationError: the function's poller needs an app setting that is missing.
    """
    fn, _ = _user_function(obj)
    binding = binding_of(fn)
    if binding.partitioned is not None:
        return binding.partitioned
    return binding.poller.get() if binding.poller is not None else None


def function_handler(obj: Any) -> Callable[..., Any]:
    """A batch handler that runs a ``@db.trigger`` function as the host would
    (a ``db.partitioned_trigger`` function is a batch handler already).

    The function's own code runs with its ``@db.output`` bindings (rows given
    to ``out.set`` are written before the checkpoint commit) and an
    :class:`OfflineTimer` for its timer parameter, so ``dbtrigger run`` and
    ``dbtrigger backfill`` drive exactly what the Function App deploys.

    Raises:
        ConfigurationError: ``obj`` is not a ``@db.trigger`` function, or it
            takes a host binding other than the timer (the CLI cannot provide it).
    """
    fn, timer_arg = _user_function(obj)
    binding = binding_of(fn)
    if binding.partitioned is not None:
        # db.partitioned_trigger decorates the batch handler itself, fn(events[, context]).
        handler_fn: Callable[..., Any] = fn
        return handler_fn
    make_handler = binding.make_handler
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


__all__ = ["OfflineTimer", "function_handler", "function_trigger"]
