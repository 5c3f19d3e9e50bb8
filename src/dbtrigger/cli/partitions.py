"""``dbtrigger partitions show|set|split|merge|ddl``: a partitioned poller from the shell.

The commands take the poller itself (``--trigger MODULE:ATTR``: a
``PartitionedPoller``, a ``PollTrigger(partitions=...)`` or a
``@db.partitioned_trigger`` function of a Function App): its source says
how buckets are computed and its store where the documents live. Changes are
dry runs unless ``--yes``; they need ``--reason``, write a backup of every
document they change, and journal the change in the membership document and
in each new partition's state document.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from dbtrigger._argparse import add_json_option, read_file_option
from dbtrigger.cli.common import actor_from_args, add_change_options, backup_dir
from dbtrigger.cli.loading import load_object
from dbtrigger.durations import human_duration
from dbtrigger.errors import ConfigurationError
from dbtrigger.partitions import recovery, regroup
from dbtrigger.partitions.backlog import DEFAULT_TARGET_ROWS, Backlog, measure_backlog
from dbtrigger.partitions.buckets import (
    is_utf8,
    partition_ddl,
    server_encoding,
    zerofill_columns,
)
from dbtrigger.partitions.endpoint import (
    DEFAULT_MIN_INTERVAL_SECONDS,
    BacklogCache,
    BacklogServer,
    parse_address,
)
from dbtrigger.partitions.inspect import table
from dbtrigger.partitions.member import PartitionedPoller, membership_key
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.stop_signals import SignalRelay, signals_routed_to
from dbtrigger.sources.errors_map import mapped


def load_partitioned(spec: str) -> PartitionedPoller:
    """``MODULE:ATTR`` naming a ``PartitionedPoller``, a ``PollTrigger(partitions=N)``, or a
    ``@db.partitioned_trigger`` function of a Function App (its poller)."""
    target = load_object(spec)
    if isinstance(target, PartitionedPoller):
        return target
    poll: object = target if isinstance(target, PollTrigger) else None
    if poll is None and callable(target):
        from dbtrigger.azure.introspect import function_trigger  # noqa: PLC0415 - optional

        poll = function_trigger(target)
    if isinstance(poll, PartitionedPoller):
        return poll
    if isinstance(poll, PollTrigger) and isinstance(poll.partitioned, PartitionedPoller):
        return poll.partitioned
    raise ConfigurationError(
        f"{spec} is not a partitioned poller (a PartitionedPoller, PollTrigger(partitions=N) "
        "or a @db.partitioned_trigger function)"
    )


def cmd_show(args: argparse.Namespace) -> int:
    poller = load_partitioned(args.trigger)
    state = poller.group_state(lag=not args.no_lag)
    if args.json:
        print(json.dumps(state.to_json(), indent=2))
        return 0
    for line in state.render():
        print(line)
    return 0


def cmd_backlog(args: argparse.Namespace) -> int:
    """The scale signal: measure once and print it, or serve it over HTTP (--serve)."""
    poller = load_partitioned(args.trigger)
    if args.target < 1:
        raise ConfigurationError(f"--target must be at least 1 row, got {args.target}")
    if args.serve:
        if args.min_interval < 0:
            raise ConfigurationError(f"--min-interval cannot be negative, got {args.min_interval}")
        return _serve_backlog(poller, args)
    backlog = measure_backlog(poller)
    if args.json:
        print(json.dumps(backlog.to_json(args.target), indent=2))
        return 0
    for line in describe_backlog(backlog, args.target):
        print(line)
    return 0


def describe_backlog(backlog: Backlog, target: int) -> list[str]:
    oldest = backlog.oldest_seconds
    lines = [
        f"poller {backlog.poller}: {backlog.rows:,} rows behind in {len(backlog.partitions)} "
        f"partitions"
        + ("" if oldest is None else f", the oldest {human_duration(oldest)} old")
        + f"; {backlog.members} member(s); desired replicas {backlog.desired_replicas(target)} "
        f"at {target:,} rows each",
    ]
    if backlog.unknown:
        lines.append(f"  not counted (their source failed): {', '.join(backlog.unknown)}")
    rows = [["PARTITION", "ROWS", "OLDEST", "OWNER"]]
    for p in backlog.partitions:
        rows.append(
            [
                p.id,
                "?" if p.rows is None else str(p.rows),
                "-" if p.oldest_seconds is None else human_duration(p.oldest_seconds),
                p.owner or "(unowned)",
            ]
        )
    lines.extend("  " + line for line in table(rows))
    return lines


def _serve_backlog(poller: PartitionedPoller, args: argparse.Namespace) -> int:
    server = BacklogServer(
        parse_address(args.serve),
        BacklogCache(lambda: measure_backlog(poller), min_interval=args.min_interval),
        target_rows=args.target,
    )
    print(
        f"serving the backlog of {poller.name} on {server.url} (/backlog, /metrics, /healthz), "
        f"measured at most every {args.min_interval:g}s, {args.target:,} rows per replica; "
        "Ctrl-C or SIGTERM stops",
        flush=True,
    )

    # The signal's relay thread shuts the server down (shutdown() waits for the loop
    # to end, so never from the handler on the loop's own thread; nor does the
    # handler start a thread: that takes a lock the interrupted thread may hold).
    relay = SignalRelay(lambda signum: server.shutdown(), name="dbtrigger-signals-backlog")
    try:
        with signals_routed_to(lambda signum, frame: None, relay):
            server.serve_forever(poll_interval=0.2)
    finally:
        relay.close()
    server.server_close()
    return 0


def _write_backups(directory: Path, backups: dict[str, bytes], stamp: str) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, data in backups.items():
        path = directory / f"{key}.{stamp}.regroup.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        paths.append(path)
    return paths


def _target(args: argparse.Namespace, poller: PartitionedPoller) -> int:
    if args.action == "set":
        if args.count is None:
            raise ConfigurationError("partitions set needs --count N")
        return int(args.count)
    doc, _ = poller.load_membership()
    current = len(doc.partitions)
    if args.action == "split":
        return current * 2
    if current % 2:
        raise ConfigurationError(f"cannot merge {current} partitions in pairs; use set --count")
    return current // 2


def cmd_change(args: argparse.Namespace) -> int:
    poller = load_partitioned(args.trigger)
    count = _target(args, poller)
    preview, _, _ = regroup.plan(poller, count)
    if not preview.moves:
        print(f"poller {poller.name} already has {count} partitions: nothing to do")
        return 0
    if not args.yes:
        for line in preview.describe():
            print(line)
        print("dry run: nothing was changed; add --yes (and --reason) to apply")
        return 0
    if not args.reason or not args.reason.strip():
        raise ConfigurationError("changing the partitions needs --reason")
    done = regroup.apply(
        poller,
        count,
        actor=actor_from_args(args),
        reason=args.reason,
        force=args.force,
        wait_seconds=args.wait,
    )
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    paths = _write_backups(backup_dir(args), done.backups, stamp)
    for line in done.describe():
        print(line)
    print(f"backups: {', '.join(str(p) for p in paths)}")
    return 0


def cmd_reset_layout(args: argparse.Namespace) -> int:
    """Replace an unreadable membership document (see :mod:`dbtrigger.partitions.recovery`)."""
    poller = load_partitioned(args.trigger)
    if bool(args.from_file) == bool(args.from_state):
        raise ConfigurationError("reset-layout needs one of --from-state or --from-file BACKUP")
    now = dt.datetime.now(dt.timezone.utc)
    actor, reason = actor_from_args(args), args.reason or ""
    if args.from_state:
        rebuilt = recovery.from_state(poller, actor=actor, reason=reason, now=now)
    else:
        data = read_file_option(args.from_file)
        rebuilt = recovery.from_file(
            poller, data, path=args.from_file, actor=actor, reason=reason, now=now
        )
    print(f"poller {poller.name}: {len(rebuilt.doc.partitions)} partition(s)")
    for line in recovery.describe(rebuilt):
        print(line)
    if not args.yes:
        print("dry run: nothing was changed; add --yes (and --reason, --force) to apply")
        return 0
    if not args.reason or not args.reason.strip():
        raise ConfigurationError("reset-layout needs --reason")
    if not args.force:
        raise ConfigurationError(
            "reset-layout needs --force: nothing can be checked in a document that cannot be read"
        )
    key = membership_key(poller.name)
    old = recovery.replace_unreadable(poller.store, key, rebuilt.doc)
    stamp = now.strftime("%Y%m%dT%H%M%S%fZ")
    [path] = _write_backups(backup_dir(args), {key: old}, stamp)
    print(f"applied (generation {rebuilt.doc.generation}); the unreadable document is in {path}")
    return 0


def cmd_ddl(args: argparse.Namespace) -> int:
    poller = load_partitioned(args.trigger)
    source = poller.source
    described: dict[str, Any] = source.describe()
    if not described.get("table"):
        raise ConfigurationError("a stored bucket column needs a table source, not a query")
    quote = source.engine.dialect.identifier_preparer.quote
    for statement in partition_ddl(
        source.dialect_name,
        described["table"],
        source.pk_columns,
        source.cursor_column,
        quote,
        schema=described.get("schema"),
        zerofill=_zerofill(source, described["table"], described.get("schema")),
    ):
        print(statement + ";")
    try:
        encoding = server_encoding(source.engine)
    except sa.exc.SQLAlchemyError:  # the DDL is printed; the note needs the database
        encoding = None
    if not is_utf8(encoding):
        print(
            f"note: this database's encoding is {encoding}: the stored column hashes a key's "
            f"{encoding} bytes, and the poller checks every row's bucket against the UTF-8 "
            "hash, so a text key with a character outside ASCII would be refused at its fetch. "
            "With integer or UUID keys (or ASCII-only text) the column is exact; otherwise "
            "run without it (each fetch then hashes the key's UTF-8 form).",
            file=sys.stderr,
        )
    return 0


def _zerofill(source: Any, table: str, schema: str | None) -> frozenset[str]:
    """The key columns declared ``ZEROFILL`` (MariaDB/MySQL), whose bucket is
    taken of the number's own digits (:func:`~dbtrigger.partitions.buckets.sql_bucket`)."""
    if source.dialect_name not in ("mysql", "mariadb"):
        return frozenset()
    with mapped(f"read the columns of {table}"):
        columns = sa.inspect(source.engine).get_columns(table, schema=schema)
    return zerofill_columns(source.dialect_name, {c["name"]: c for c in columns}, source.pk_columns)


def add_partition_commands(sub: Any) -> None:
    """Register ``partitions`` and its subcommands on the CLI's subparsers."""
    group = sub.add_parser(
        "partitions",
        help="inspect or change a partitioned poller's partitions",
        description="Partitions of a PollTrigger(partitions=N): owners, lag, split and merge.",
    )
    commands = group.add_subparsers(dest="action", required=True)

    def command(name: str, func: Any, **texts: str) -> argparse.ArgumentParser:
        """A subcommand on ``--trigger`` that runs ``func`` (``texts``: its help and
        description)."""
        parser: argparse.ArgumentParser = commands.add_parser(name, **texts)
        parser.add_argument("--trigger", required=True, help="MODULE:ATTR naming the poller")
        parser.set_defaults(func=func)
        return parser

    show = command(
        "show",
        cmd_show,
        help="members, and each partition's owner, lease, checkpoint, lag and retries",
    )
    add_json_option(show)
    show.add_argument("--no-lag", action="store_true", help="skip the per-partition row count")

    for action, text in (
        ("set", "regroup into --count partitions (only splits or merges ranges)"),
        ("split", "double the partitions: every range splits in two"),
        ("merge", "halve the partitions: neighbouring ranges merge"),
    ):
        change = command(action, cmd_change, help=text)
        if action == "set":
            change.add_argument("--count", type=int, help="the new number of partitions")
        add_change_options(
            change,
            force_help="fence out a member processing a partition now (its batch is redelivered)",
        )
        change.add_argument(
            "--wait", type=float, default=30.0, help="seconds to wait for batches in flight"
        )

    backlog = command(
        "backlog",
        cmd_backlog,
        help="the scale signal: rows behind per partition, desired replicas (--serve: HTTP)",
        description="Rows after each partition's checkpoint and the age of the oldest, the "
        "total, and desired replicas = min(partitions, ceil(rows / --target)). With --serve, "
        "an HTTP endpoint KEDA's metrics-api scaler reads (GET /backlog; /metrics for "
        "Prometheus).",
    )
    add_json_option(backlog)
    backlog.add_argument(
        "--target",
        type=int,
        default=DEFAULT_TARGET_ROWS,
        help=f"rows behind per replica (default {DEFAULT_TARGET_ROWS})",
    )
    backlog.add_argument("--serve", metavar="HOST:PORT", help="serve it over HTTP until stopped")
    backlog.add_argument(
        "--min-interval",
        type=float,
        default=DEFAULT_MIN_INTERVAL_SECONDS,
        metavar="SECONDS",
        help="--serve: measure at most this often; requests in between get the last "
        f"measurement (default {DEFAULT_MIN_INTERVAL_SECONDS:g})",
    )

    reset = command(
        "reset-layout",
        cmd_reset_layout,
        help="replace an unreadable membership document (--from-state or --from-file)",
        description="Replace a partitions membership document that cannot be read: rebuilt "
        "from the partitions' own state documents (--from-state; merge floors are dropped, "
        "so rows may be delivered again, none skipped) or from a saved one (--from-file).",
    )
    how = reset.add_mutually_exclusive_group()
    how.add_argument(
        "--from-state", action="store_true", help="rebuild it from the partition documents"
    )
    how.add_argument("--from-file", metavar="BACKUP", help="a saved membership document")
    add_change_options(reset, force_help="required: the document replaced cannot be checked")

    command("ddl", cmd_ddl, help="print DDL for an indexed bucket column")
