"""A decorated function as the Functions host sees it: its signature, and the handler inside.

The Functions worker binds parameters by name, from ``inspect.signature`` and
the annotations. A dbtrigger decorator therefore shows the host only the
parameters the host provides (the timer, its own bindings) and hides the ones
dbtrigger injects: the events, an optional ``context`` and any ``@db.output``
parameter. Every decorator does it the same way, with these helpers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from dbtrigger.azure.record import HandlerFactory
from dbtrigger.errors import ConfigurationError

#: The parameter name under which a decorated function receives the batch context.
CONTEXT_PARAM = "context"


def refuse_function_builder(fn: object, message: str) -> None:
    """Refuse a decorator placed above ``@app.schedule`` (it would wrap the host's
    ``FunctionBuilder``, not the function)."""
    if type(fn).__name__ == "FunctionBuilder":
        raise ConfigurationError(message)


def bind_handler(
    fn: Callable[..., Any], arg_name: str, what: str
) -> tuple[inspect.Signature, HandlerFactory]:
    """What a trigger decorator needs to turn ``fn`` into a batch handler.

    Returns the signature the Functions host sees (``arg_name`` and, when
    ``fn`` asks for it, ``context`` hidden) and a factory that, given the
    host's arguments of one invocation, makes the ``(events, ctx)`` handler
    the poller or queue calls. ``@db.trigger`` and ``@db.queue_trigger``
    inject the same way, so they share this.
    """
    sig = inspect.signature(fn)
    if arg_name not in sig.parameters:
        raise ConfigurationError(
            f"{what}(arg_name={arg_name!r}): {getattr(fn, '__name__', fn)!r} "
            f"has no parameter {arg_name!r}"
        )
    wants_context = CONTEXT_PARAM in sig.parameters and arg_name != CONTEXT_PARAM
    if wants_context:
        _refuse_host_context(fn, sig.parameters[CONTEXT_PARAM].annotation, what)
    hidden = {arg_name, CONTEXT_PARAM} if wants_context else {arg_name}
    host_sig = host_signature(fn, hidden, what).replace(return_annotation=None)

    def make_handler(host_args: dict[str, Any]) -> Callable[[Any, Any], Any]:
        def handler(events: Any, ctx: Any) -> Any:
            call = dict(host_args)
            call[arg_name] = events
            if wants_context:
                call[CONTEXT_PARAM] = ctx
            return fn(**call)

        return handler

    return host_sig, make_handler


def _refuse_host_context(fn: Callable[..., Any], annotation: Any, what: str) -> None:
    """Refuse ``context: func.Context``: dbtrigger's ``context`` is the BatchContext.

    Every Functions sample writes ``context: func.Context`` for the invocation
    context; here the host never passes it (the parameter is hidden from it),
    so ``context.invocation_id`` would fail each invocation as a handler error
    and redeliver the batch for ever. Read as text, so a string annotation
    (``from __future__ import annotations``) is seen too and ``azure.functions``
    is not imported.
    """
    if isinstance(annotation, str):
        text = annotation
    else:
        module = getattr(annotation, "__module__", "") or ""
        text = f"{module}.{getattr(annotation, '__qualname__', '')}"
    if text.rsplit(".", 1)[-1] != "Context" or (
        not isinstance(annotation, str) and not text.startswith("azure.functions")
    ):
        return
    raise ConfigurationError(
        f"{what}: parameter 'context' of {getattr(fn, '__name__', fn)!r} is annotated "
        f"{text if isinstance(annotation, str) else 'func.Context'}, but under {what} it "
        "receives dbtrigger's BatchContext (batch id, fencing token, checkpoints), not the "
        "host's func.Context, which is not passed: annotate it `context: BatchContext` "
        "(from dbtrigger import BatchContext), or drop it"
    )


def host_signature(fn: Callable[..., Any], hidden: set[str], what: str) -> inspect.Signature:
    """``fn``'s signature without the ``hidden`` (injected) parameters.

    Every remaining parameter must be passable by name, because injected
    arguments are passed by name and the Functions host passes bindings by name.
    """
    sig = inspect.signature(fn)
    for param in sig.parameters.values():
        if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            raise ConfigurationError(
                f"{what}: parameter {param.name!r} of {getattr(fn, '__name__', fn)!r} cannot be "
                "passed by name; the Functions host passes every binding by name"
            )
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in hidden])


def call_keywords(sig: inspect.Signature, args: Any, kwargs: Any) -> dict[str, Any]:
    """Bind a call against ``sig`` and return it as keyword arguments only."""
    bound = sig.bind(*args, **kwargs)
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def set_host_signature(wrapper: Any, sig: inspect.Signature) -> None:
    """Expose ``sig`` as the wrapper's signature and annotations.

    The Functions worker matches parameter names to bindings, using both
    ``inspect.signature`` and the annotations; hidden parameters must not show
    up in either.
    """
    wrapper.__signature__ = sig
    annotations = {
        name: p.annotation
        for name, p in sig.parameters.items()
        if p.annotation is not inspect.Parameter.empty
    }
    if sig.return_annotation is not inspect.Signature.empty:
        annotations["return"] = sig.return_annotation
    wrapper.__annotations__ = annotations


def host_wrapper(
    fn: Callable[..., Any],
    sig: inspect.Signature,
    run: Callable[[dict[str, Any]], Any],
    run_async: Callable[[dict[str, Any]], Awaitable[Any]],
) -> Callable[..., Any]:
    """What the host calls instead of ``fn``: its arguments bound against ``sig``
    (the host's view of ``fn``) and handed over as keywords to ``run_async`` when
    ``fn`` is a coroutine function (the wrapper is one too, so the worker awaits
    it on its loop), else to ``run``. ``sig`` is what the host sees of the wrapper."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            return await run_async(call_keywords(sig, args, kwargs))

        wrapper: Callable[..., Any] = async_wrapper
    else:

        @functools.wraps(fn)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            return run(call_keywords(sig, args, kwargs))

        wrapper = sync_wrapper
    set_host_signature(wrapper, sig)
    return wrapper


__all__ = [
    "CONTEXT_PARAM",
    "bind_handler",
    "call_keywords",
    "host_signature",
    "host_wrapper",
    "refuse_function_builder",
    "set_host_signature",
]
