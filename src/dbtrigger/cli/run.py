"""``dbtrigger run``: poll one or more triggers on an interval until SIGINT/SIGTERM.

At start the worker logs a banner per poller (source with its URL redacted,
table, cursor, key, store, batch settings, visibility guard), then one line per
tick (see :mod:`dbtrigger.runtime.runner`). Several ``MODULE:ATTR`` arguments
run several pollers in one process, one thread each, with one shared shutdown.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

from dbtrigger.cli.loading import LoadedTrigger, load_trigger
from dbtrigger.errors import ConfigurationError
from dbtrigger.partitions.member import PartitionedPoller
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.runner import (
    DEFAULT_MAX_BACKOFF_SECONDS,
    DEFAULT_PROGRESS_INTERVAL_SECONDS,
    DrainProgress,
    ProgressCallback,
    Runner,
    log_progress,
)
from dbtrigger.runtime.subscriber_options import SubscriberCall
from dbtrigger.runtime.workers import run_pollers
from dbtrigger.sources.lag import describe_basis
from dbtrigger.state.stores.factory import describe_store, redact

if TYPE_CHECKING:
    from dbtrigger.queue.trigger import QueueTrigger
    from dbtrigger.wakeup.hints import WakeHint

log = logging.getLogger("dbtrigger.runner")


def _version() -> str:
    from dbtrigger import __version__  # noqa: PLC0415 - keeps the module import light

    return str(__version__)


def banner(loaded: LoadedTrigger, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """What an operator needs to know about a poller before its first tick."""
    trigger = loaded.trigger
    if _is_queue(trigger):  # a claim queue: no checkpoint, no lease
        text = (
            f"queue {trigger.name} ({loaded.spec}), owner {trigger.owner_id}\n"
            f"  source      {trigger.source.name}\n"
            f"  batches     {trigger.batch_size} rows, {trigger.max_concurrency} at once; "
            f"visibility timeout {trigger.visibility_timeout:g}s\n"
            f"  interval    {args.interval:g}s when idle; failures back off up to "
            f"{args.max_backoff:g}s"
        )
        return redact(text), {"event": "worker_start", "poller": trigger.name}
    if isinstance(trigger, PartitionedPoller):
        text = "\n".join(
            [f"partitioned poller {trigger.name} ({loaded.spec}), member {trigger.member_id}"]
            + [f"  {line}" for line in trigger.describe()]
            + [
                f"  interval    {args.interval:g}s when idle, at once while ticks deliver rows "
                "or when this member gains partitions"
            ]
        )
        return redact(text), {"event": "worker_start", "poller": trigger.name}
    if not isinstance(trigger, PollTrigger):
        return f"{type(trigger).__name__} {trigger.name} ({loaded.spec})", {
            "event": "worker_start",
            "poller": trigger.name,
        }
    source = trigger.source
    described = source.describe()
    url = described.get("url")
    where = described.get("table") or ("query" if described.get("query") else None)
    pk = ", ".join(described.get("pk_columns") or [])
    visibility = described.get("visibility_mode") or described.get("visibility")
    guarantee = described.get("visibility_guarantee")
    if visibility == "auto":
        guard = "auto: chosen from the dialect and cursor type at the first fetch (logged then)"
    else:
        guard = f"{visibility}" + (f": {guarantee}" if guarantee else "")
    heartbeat = (
        f"heartbeat every {trigger.heartbeat_interval:g}s"
        if trigger.heartbeat_interval
        else "no heartbeat"
    )
    lines = [
        f"poller {trigger.name} ({'Functions function' if loaded.function else 'trigger'} "
        f"{loaded.spec}), owner {trigger.owner_id}",
        f"  source      {source.name}"
        + (f" at {url}" if url else "")
        + (f", table {where}" if where and where != "query" else "")
        + (f", cursor {described.get('cursor_column')}" if described.get("cursor_column") else "")
        + (f", key ({pk})" if pk else ""),
        f"  store       {describe_store(trigger.store)}",
        f"  batches     {trigger.batch_size} rows, up to {trigger.max_batches_per_tick} per tick; "
        f"lease {trigger.lease_ttl.total_seconds():g}s, {heartbeat}",
        f"  interval    {args.interval:g}s when idle, at once while ticks deliver rows; "
        f"failures back off up to {args.max_backoff:g}s",
        f"  wake-up     {_describe_wake(args)}",
        f"  visibility  {guard}",
    ]
    lag_basis = getattr(source, "lag_basis", None)
    basis = lag_basis(resolve=True) if callable(lag_basis) else None
    if callable(lag_basis):
        lines.append(f"  lag         {describe_basis(basis)}")
    fields = {
        "event": "worker_start",
        "poller": trigger.name,
        "source": {k: v for k, v in described.items() if v is not None},
        "store": describe_store(trigger.store),
        "batch_size": trigger.batch_size,
        "max_batches_per_tick": trigger.max_batches_per_tick,
        "lease_ttl_seconds": trigger.lease_ttl.total_seconds(),
        "interval_seconds": args.interval,
        "wake": getattr(args, "wake", None),
        "owner_id": trigger.owner_id,
        "lag_basis": basis,
    }
    return redact("\n".join(lines)), fields


def _is_queue(trigger: object) -> TypeGuard[QueueTrigger]:
    """Whether ``trigger`` is a claim queue's. Asked without importing the queue
    package (a quarter of a partitioned worker's import time): a QueueTrigger
    exists only once its module was imported."""
    queue = sys.modules.get("dbtrigger.queue.trigger")
    return queue is not None and isinstance(trigger, queue.QueueTrigger)


def _kind(trigger: object) -> tuple[str, str]:
    """What the start line calls a trigger, singular and plural."""
    if _is_queue(trigger):
        return "queue", "queues"
    if isinstance(trigger, PartitionedPoller):
        return "partitioned poller", "partitioned pollers"
    return "poller", "pollers"


def _what_runs(loaded: Sequence[LoadedTrigger]) -> str:
    """``1 poller (orders), 1 queue (emails)``: each kind counted, in the order named."""
    groups: dict[tuple[str, str], list[str]] = {}
    for item in loaded:
        groups.setdefault(_kind(item.trigger), []).append(item.trigger.name)
    return ", ".join(
        f"{len(names)} {one if len(names) == 1 else many} ({', '.join(names)})"
        for (one, many), names in groups.items()
    )


def _describe_wake(args: argparse.Namespace) -> str:
    """The banner's wake-up line: what may end an idle sleep early."""
    wake = getattr(args, "wake", None)
    if not wake:
        return "none (--wake notify on PostgreSQL, --wake adaptive elsewhere)"
    if wake.startswith("notify"):
        return f"{wake}: a NOTIFY from the table's trigger (dbtrigger wake install) ends the sleep"
    return f"{wake}: shorter idle waits for a while after activity"


def _progress_callback(args: argparse.Namespace) -> ProgressCallback:
    """Rich progress bars on a terminal when rich is installed; log lines otherwise."""
    if getattr(args, "log_format", "text") != "text" or not sys.stderr.isatty():
        return log_progress
    try:
        rich_progress = importlib.import_module("rich.progress")  # optional dependency
    except ImportError:
        return log_progress
    bars = rich_progress.Progress(transient=True, redirect_stderr=True, redirect_stdout=False)
    tasks: dict[str, Any] = {}

    def show(progress: DrainProgress) -> None:
        if progress.caught_up:
            task = tasks.pop(progress.poller, None)
            if task is not None:
                bars.remove_task(task)
            if not tasks:
                bars.stop()
            log_progress(progress)
            return
        total = progress.delivered + progress.behind if progress.behind is not None else None
        if progress.poller not in tasks:
            bars.start()
            tasks[progress.poller] = bars.add_task(f"{progress.poller}", total=total)
        bars.update(
            tasks[progress.poller],
            completed=progress.delivered,
            total=total,
            description=f"{progress.poller} {progress.rate:,.0f} rows/s",
        )

    return show


def _wake(args: argparse.Namespace) -> WakeHint | None:
    if not getattr(args, "wake", None):
        return None
    from dbtrigger.wakeup.hints import parse_wake  # noqa: PLC0415 - only with --wake

    return parse_wake(args.wake)


def cmd_run(args: argparse.Namespace) -> int:
    specs: Sequence[str] = args.trigger
    if args.handler and len(specs) > 1:
        raise ConfigurationError("--handler applies to one trigger; give each trigger a @handler")
    loaded = [load_trigger(spec, args.handler) for spec in specs]
    names = [item.trigger.name for item in loaded]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"two triggers share a poller name (state document): {names}")
    log.info(
        "dbtrigger %s worker, pid %d: %s; Ctrl-C or SIGTERM finishes the "
        "batch in flight and stops, a second one abandons it",
        _version(),
        os.getpid(),
        _what_runs(loaded),
        extra={"event": "worker_start", "pollers": names},
    )
    for item in loaded:
        text, fields = banner(item, args)
        log.info("%s", text, extra=fields)
        if isinstance(item.trigger, PollTrigger):
            # What the docs require and users get wrong (index, unique key,
            # nullable cursor, guard privilege), as warnings. A source that
            # cannot be read for a reason a person must fix stops the start
            # here, with one message (its first tick would stop on it anyway).
            from dbtrigger.checks import warn_at_start  # noqa: PLC0415 - pollers only

            warn_at_start(item.trigger, raise_operator_errors=True)
    progress = _progress_callback(args)
    runners = []
    for item in loaded:
        handler = item.handler
        if handler is None and isinstance(item.trigger, PollTrigger) and item.trigger.subscribers:
            handler = SubscriberCall()  # fan-out: the subscribers are the handlers
        if handler is None:  # load_trigger refuses this; keeps the type checker informed
            raise ConfigurationError(f"{item.spec} has no handler")
        runners.append(
            Runner(
                item.trigger,
                handler,
                interval_seconds=args.interval,
                max_backoff_seconds=args.max_backoff,
                progress=progress,
                progress_interval_seconds=args.progress_interval,
                wake=_wake(args),  # one per runner: each listens on a session of its own
            )
        )
    stats = run_pollers(runners, max_ticks=args.max_ticks)
    for name, stat in stats.items():
        print(f"{name}: {stat.totals()}")
    return 0


def add_run_command(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="poll one or more triggers until SIGINT/SIGTERM",
        description="Poll one or more triggers as a worker process. Each tick logs one line; "
        "a tick that leaves rows pending is followed at once by the next. Errors a person "
        "must fix stop the worker with exit code 2; transient failures back off.",
    )
    run.add_argument(
        "trigger",
        nargs="+",
        metavar="MODULE:ATTR",
        help="a PollTrigger, or a @db.trigger Azure Functions function "
        "(function_app:orders_poll); several run in one process",
    )
    run.add_argument(
        "--handler", metavar="MODULE:FUNCTION", help="the handler (default: the trigger's own)"
    )
    run.add_argument(
        "--interval", type=float, default=5.0, help="seconds between ticks while idle (default 5)"
    )
    run.add_argument(
        "--wake",
        metavar="HINT",
        help="end idle sleeps early (off by default; the interval poll goes on under it): "
        "notify[:CHANNEL] (PostgreSQL LISTEN/NOTIFY, after `dbtrigger wake install`), "
        "adaptive[:SECONDS] (any database: idle waits from SECONDS, default 0.05, doubling "
        "back to --interval after activity)",
    )
    run.add_argument(
        "--max-ticks", type=int, default=None, help="stop after this many ticks (per poller)"
    )
    run.add_argument(
        "--max-backoff",
        type=float,
        default=DEFAULT_MAX_BACKOFF_SECONDS,
        metavar="SECONDS",
        help="ceiling of the wait between failing ticks, which doubles from --interval "
        f"(default {DEFAULT_MAX_BACKOFF_SECONDS:g})",
    )
    run.add_argument(
        "--progress-interval",
        type=float,
        default=DEFAULT_PROGRESS_INTERVAL_SECONDS,
        metavar="SECONDS",
        help="seconds between progress lines while a backlog drains "
        f"(default {DEFAULT_PROGRESS_INTERVAL_SECONDS:g})",
    )
    run.set_defaults(func=cmd_run, default_log_level="INFO")


__all__ = ["add_run_command", "banner", "cmd_run"]
