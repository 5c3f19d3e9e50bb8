"""Naming a queue on the command line: ``--url``/``--table`` (with ``--schema``,
``--mode``...) or ``--source MODULE:ATTR`` naming a ``QueueTrigger``, a
``ClaimSource``, a ``SidecarFeeder`` or a ``@db.queue_trigger`` function, whose
own settings are then used; and the durations the commands take.

Every ``dbtrigger queue`` command (:mod:`dbtrigger.queue.cli`,
:mod:`dbtrigger.queue.cli_jobs`) and the state commands that find a queue
(``dead-letter``, ``check``) name it through here.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from dbtrigger._driver_errors import failed_as
from dbtrigger.durations import duration_seconds
from dbtrigger.errors import ConfigurationError, FetchError

if TYPE_CHECKING:
    from dbtrigger.queue.source import ClaimSource

parse_duration = duration_seconds


def claim_source_of(target: Any) -> ClaimSource | None:
    """The ClaimSource behind what ``--source MODULE:ATTR`` named, or None."""
    from dbtrigger.queue.sidecar import SidecarFeeder  # noqa: PLC0415
    from dbtrigger.queue.source import ClaimSource  # noqa: PLC0415
    from dbtrigger.queue.trigger import QueueTrigger  # noqa: PLC0415

    if isinstance(target, ClaimSource):
        return target
    if isinstance(target, (QueueTrigger, SidecarFeeder)):
        return target.source
    # A @db.queue_trigger function (the FunctionBuilder @app.schedule made of it).
    inner = getattr(target, "_function", target)
    get_user_function = getattr(inner, "get_user_function", None)
    function = get_user_function() if callable(get_user_function) else target
    source = getattr(function, "dbtrigger_queue_source", None)
    return source if isinstance(source, ClaimSource) else None


def loaded_source(args: argparse.Namespace) -> ClaimSource | None:
    spec = getattr(args, "source", None)
    if not spec:
        if not args.url or not args.table:
            raise ConfigurationError(
                "name the queue: --url URL --table TABLE, or --source MODULE:ATTR (a "
                "QueueTrigger, ClaimSource, SidecarFeeder or @db.queue_trigger function)"
            )
        return None
    if args.url or args.table:
        raise ConfigurationError(
            "--source names the queue's URL and table already: drop --url/--table, or --source"
        )
    target = args.load_object(spec)
    source = claim_source_of(target)
    if source is None:
        raise ConfigurationError(
            f"{spec} is a {type(target).__name__}, not a QueueTrigger, ClaimSource, "
            "SidecarFeeder or @db.queue_trigger function"
        )
    return source


def queue_source(args: argparse.Namespace) -> ClaimSource:
    loaded = loaded_source(args)
    if loaded is not None:
        return loaded
    return _from_args(args, list(args.pk) or _primary_key(args))


def table_source(args: argparse.Namespace) -> ClaimSource:
    """The queue's source for what needs only its tables (install, uninstall): the
    one ``--source`` names, or one of ``--url``/``--table`` whose key is not read."""
    return loaded_source(args) or _from_args(args, ["_"])


def _from_args(args: argparse.Namespace, pk_columns: list[str]) -> ClaimSource:
    from dbtrigger.queue.source import ClaimSource  # noqa: PLC0415

    return ClaimSource(
        url=args.url,
        table=args.table,
        schema=args.schema,
        pk_columns=pk_columns,
        where=getattr(args, "where", None),
        mode=args.mode,
        claims_table=args.claims_table,
    )


def _primary_key(args: argparse.Namespace) -> list[str]:
    probe = _from_args(args, ["_"])
    try:
        with (
            failed_as(FetchError, f"could not inspect {probe.name}"),
            probe.engine.connect() as conn,
        ):
            table = probe.reflect(conn, probe.table_name)
    finally:
        probe.close()
    names = [c.name for c in table.primary_key.columns]
    if not names:
        raise ConfigurationError(f"{args.table} has no primary key: name its key with --pk")
    return names


def table_options(parser: argparse.ArgumentParser, *, pk: bool = True) -> None:
    parser.add_argument(
        "--source",
        "--trigger",
        dest="source",
        metavar="MODULE:ATTR",
        help="the queue's QueueTrigger, ClaimSource, SidecarFeeder or @db.queue_trigger "
        "function: its URL, table, key and mode are used (instead of --url/--table...)",
    )
    parser.add_argument("--url", help="database URL (or %%APP_SETTING%%)")
    parser.add_argument("--table", help="the queue table")
    parser.add_argument("--schema", help="its schema (default: the connection's)")
    parser.add_argument(
        "--mode",
        choices=("columns", "sidecar"),
        default="columns",
        help="claim columns on the table, or a sidecar claims table (default: columns)",
    )
    parser.add_argument(
        "--claims-table", default="dbtrigger_claims", help="sidecar mode: the claims table"
    )
    if pk:
        parser.add_argument(
            "--pk",
            action="append",
            default=[],
            metavar="COLUMN",
            help="key column (repeat for several; default: the primary key)",
        )
        parser.add_argument("--where", help="the queue's filter, as configured on its source")


__all__ = [
    "claim_source_of",
    "loaded_source",
    "parse_duration",
    "queue_source",
    "table_options",
    "table_source",
]
