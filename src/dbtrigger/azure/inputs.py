"""``@db.input``, ``@db.inject_reader``, ``@db.inject_writer``: a table in a function.

As in azure-functions-db, a function reads rows into a parameter or gets a
reader or writer injected, with any trigger (an HTTP route, a timer, a
``@db.trigger`` poller):

* ``@db.input("user", url=..., table="users", pk=lambda req: {"id": ...})``
  injects one row (a dict, or None: ``on_not_found="raise"`` raises
  :class:`~dbtrigger.errors.RowNotFoundError` instead);
  ``@db.input("rows", url=..., query="SELECT ... WHERE x = :x", params=...)``
  injects a list of dicts. ``pk`` and ``params`` may be callables whose
  parameter names are the function's other parameters (the request, the
  timer, the events);
* ``@db.inject_reader("reader", url=..., table=...)`` injects a
  :class:`~dbtrigger.dbio.DbReader`; ``@db.inject_writer("writer", url=...,
  table=...)`` a :class:`~dbtrigger.dbio.DbWriter` of its own for the
  invocation (``with writer.transaction():`` groups writes).

The injected parameters are hidden from the Functions host, as every
dbtrigger binding's are; settings and connections follow
:mod:`dbtrigger.dbio` (``%SETTING%`` read at the first use, nothing connects
before a read or write). Under ``@db.trigger`` these sit below it, directly
above the function (with ``@db.output``), so they run for each batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal

from sqlalchemy.engine import Engine

from dbtrigger._lock_wait import DEFAULT_WRITE_LOCK_TIMEOUT
from dbtrigger.azure.blocking import off_loop
from dbtrigger.azure.host import host_signature, host_wrapper
from dbtrigger.azure.record import binding_of
from dbtrigger.dbio import DbReader, DbWriter
from dbtrigger.errors import ConfigurationError, RowNotFoundError

Given = Mapping[str, Any] | Callable[..., Mapping[str, Any]] | None


def _given(value: Given, host_args: Mapping[str, Any], what: str) -> dict[str, Any]:
    """A static mapping, or a callable's answer given the function's own arguments."""
    if value is None:
        return {}
    if not callable(value):
        _checked_given(value, what)
        return dict(value)
    wanted = inspect.signature(value).parameters
    missing = [n for n, p in wanted.items() if n not in host_args and p.default is p.empty]
    if missing:
        raise ConfigurationError(
            f"{what}: the callable asks for {', '.join(missing)}, which the function does not "
            f"take; its parameters are {', '.join(host_args) or 'none'}"
        )
    answer = value(**{n: host_args[n] for n in wanted if n in host_args})
    if not isinstance(answer, Mapping):
        raise ConfigurationError(
            f"{what}: the callable returned {type(answer).__name__}, expected a dict"
        )
    return dict(answer)


def _checked_given(value: object, what: str) -> None:
    """Refuse anything but None, a dict or a callable (checked when decorating)."""
    if value is not None and not callable(value) and not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{what}: expected a dict or a callable returning one, got {type(value).__name__}"
        )


def _inject(
    arg_name: str, what: str, make: Callable[[dict[str, Any]], Any]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator passing ``make(host arguments)`` as ``arg_name`` (hidden from the host)."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if binding_of(fn).is_trigger:
            raise ConfigurationError(
                f"{what}({arg_name!r}) must sit below @db.trigger, directly above the function "
                "(with @db.output), so that it runs for each batch"
            )
        if arg_name not in inspect.signature(fn).parameters:
            raise ConfigurationError(
                f"{what}({arg_name!r}): {getattr(fn, '__name__', fn)!r} has no parameter "
                f"{arg_name!r}"
            )
        host_sig = host_signature(fn, {arg_name}, what)

        def run(call: dict[str, Any]) -> Any:
            return fn(**call, **{arg_name: make(call)})

        async def run_async(call: dict[str, Any]) -> Any:
            value = await off_loop(make, call)  # the read leaves the loop (blocking.py)
            return await fn(**call, **{arg_name: value})

        return host_wrapper(fn, host_sig, run, run_async)

    return decorator


def input_binding(
    arg_name: str,
    *,
    url: str | None = None,
    table: str | None = None,
    schema: str | None = None,
    pk: Given = None,
    query: str | None = None,
    params: Given = None,
    on_not_found: Literal["none", "raise"] = "none",
    engine: Engine | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@db.input``: inject one row (``pk`` and ``table``) or a query's rows (``query``)."""
    if (pk is None) == (query is None):
        raise ConfigurationError(f"@db.input({arg_name!r}) needs exactly one of pk= or query=")
    if pk is not None and table is None:
        raise ConfigurationError(f"@db.input({arg_name!r}, pk=...) needs table=")
    if params is not None and query is None:
        raise ConfigurationError(f"@db.input({arg_name!r}): params= goes with query=")
    if on_not_found not in ("none", "raise"):
        raise ConfigurationError(f"on_not_found must be 'none' or 'raise', got {on_not_found!r}")
    _checked_given(pk, f"@db.input({arg_name!r}, pk=...)")
    _checked_given(params, f"@db.input({arg_name!r}, params=...)")
    reader = DbReader(
        url=url, table=table, schema=schema, engine=engine, engine_kwargs=engine_kwargs
    )

    def read(host_args: dict[str, Any]) -> Any:
        if query is not None:
            return reader.query(query, _given(params, host_args, f"@db.input({arg_name!r})"))
        key = _given(pk, host_args, f"@db.input({arg_name!r})")
        row = reader.get(pk=key)
        if row is None and on_not_found == "raise":
            raise RowNotFoundError(f"no row of {reader.name} has the key {key!r}")
        return row

    return _inject(arg_name, "@db.input", read)


def reader_binding(
    arg_name: str,
    *,
    url: str | None = None,
    table: str | None = None,
    schema: str | None = None,
    engine: Engine | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@db.inject_reader``: inject a :class:`~dbtrigger.dbio.DbReader` (shared)."""
    reader = DbReader(
        url=url, table=table, schema=schema, engine=engine, engine_kwargs=engine_kwargs
    )
    return _inject(arg_name, "@db.inject_reader", lambda host_args: reader)


def writer_binding(
    arg_name: str,
    *,
    url: str | None = None,
    table: str,
    schema: str | None = None,
    engine: Engine | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    lock_timeout_seconds: float = DEFAULT_WRITE_LOCK_TIMEOUT,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@db.inject_writer``: inject a :class:`~dbtrigger.dbio.DbWriter`, one per
    invocation (its own transaction) on one shared engine."""
    shared = DbWriter(
        url=url,
        table=table,
        schema=schema,
        engine=engine,
        engine_kwargs=engine_kwargs,
        lock_timeout_seconds=lock_timeout_seconds,
    )
    return _inject(arg_name, "@db.inject_writer", lambda host_args: DbWriter._sharing(shared))


__all__ = ["input_binding", "reader_binding", "writer_binding"]
