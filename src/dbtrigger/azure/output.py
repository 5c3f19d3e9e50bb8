"""``@db.output``: the binding that hands a handler a :class:`~dbtrigger.output.DbOut`.

The adapter itself (the table, the one-transaction write, upserts per
dialect) is :mod:`dbtrigger.output`; this is only the decorator. It must sit
directly above the function, below ``@db.trigger``: each invocation (each
batch, under a trigger) gets a fresh ``DbOut``, and its rows are written when
the function returns, before the trigger commits the checkpoint. Above the
trigger they would be written after the commit, and a failed write would lose
the batch, so that order is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Engine

from dbtrigger.azure.blocking import off_loop
from dbtrigger.azure.host import host_signature, host_wrapper
from dbtrigger.azure.record import attach, binding_of
from dbtrigger.errors import ConfigurationError
from dbtrigger.output import Action, DbOut, OutputTarget


def output_binding(
    arg_name: str,
    *,
    url: str | None = None,
    table: str,
    schema: str | None = None,
    action: Action = "insert",
    conflict_columns: Sequence[str] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    engine: Engine | None = None,
    lock_timeout_seconds: float | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@db.output``: inject a :class:`~dbtrigger.output.DbOut` as ``arg_name``.

    Rows given to ``out.set(...)`` are written in one transaction after the
    handler returns (before the checkpoint commit, under ``db.trigger``), and
    discarded if it raises. ``url`` may be a ``%SETTING%`` reference;
    ``action="upsert"`` needs ``conflict_columns`` naming the table's primary
    key or a unique constraint. ``lock_timeout_seconds`` bounds how long the
    write waits for a lock another transaction holds (default 30 s; under a
    trigger at most a quarter of its ``lease_ttl_seconds``, the default lowered
    to fit). Place it directly above the
    function. The other arguments are :class:`~dbtrigger.output.OutputTarget`'s.
    """
    target = OutputTarget(
        url=url,
        table=table,
        schema=schema,
        action=action,
        conflict_columns=conflict_columns,
        engine_kwargs=engine_kwargs,
        engine=engine,
        lock_timeout_seconds=lock_timeout_seconds,
    )

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if binding_of(fn).is_trigger:
            # Above the trigger, the rows would be written after the whole tick,
            # i.e. after the checkpoint commit: a failed write would lose the batch.
            raise ConfigurationError(
                f"@db.output({arg_name!r}) must sit below @db.trigger, directly above the "
                "function, so that its rows are written before the checkpoint commit"
            )
        sig = inspect.signature(fn)
        if arg_name not in sig.parameters:
            raise ConfigurationError(
                f"@db.output({arg_name!r}): {getattr(fn, '__name__', fn)!r} has no parameter "
                f"{arg_name!r}; put @db.output directly above the function (below @db.trigger)"
            )
        host_sig = host_signature(fn, {arg_name}, "@db.output")

        def run(call: dict[str, Any]) -> Any:
            out = DbOut(target)
            result = fn(**call, **{arg_name: out})
            out.flush()
            return result

        async def run_async(call: dict[str, Any]) -> Any:
            out = DbOut(target)
            result = await fn(**call, **{arg_name: out})
            if out.get():
                await off_loop(out.flush)
            return result

        wrapper = host_wrapper(fn, host_sig, run, run_async)
        attach(wrapper, fn, output=target)
        return wrapper

    return decorator


__all__ = ["output_binding"]
