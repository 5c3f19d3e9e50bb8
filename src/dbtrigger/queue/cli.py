"""``dbtrigger queue install|uninstall|status|add|cancel|retry|prune``: a queue's CLI.

Every command that changes or removes something is a dry run unless given
``--yes``: it prints what it would do (the DDL, the rows) first. ``retry
--dead`` and ``cancel`` also want ``--reason``, which is written into each
row's ``dbt_last_error`` so the history of a row stays on the row. ``add``
inserts new work at once, as any producer's ``INSERT`` would.

The queue is named either by ``--url`` and ``--table`` (with ``--schema``,
``--mode``...) or, like the poller commands, by ``--source MODULE:ATTR``
naming a ``QueueTrigger``, a ``ClaimSource``, a ``SidecarFeeder`` or a
``@db.queue_trigger`` function, whose own settings are then used.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from dbtrigger._argparse import add_apply_option, add_json_option, print_then_apply
from dbtrigger._driver_errors import failed_as
from dbtrigger.durations import human_duration
from dbtrigger.errors import CommitError, ConfigurationError
from dbtrigger.queue.cli_jobs import add_job_commands
from dbtrigger.queue.cli_target import (
    claim_source_of,
    parse_duration,
    queue_source,
    table_options,
    table_source,
)

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy.engine import Connection

    from dbtrigger.queue.source import ClaimSource

# SQLAlchemy and the queue modules are imported inside the commands, so
# registering them keeps `dbtrigger --help` light.


def _ddl(args: argparse.Namespace, *, uninstall: bool) -> int:
    from dbtrigger.queue import ddl  # noqa: PLC0415

    probe = table_source(args)
    if probe.mode == "sidecar" and uninstall:
        return _uninstall_sidecar(args, probe)
    try:
        changing = "removing" if uninstall else "adding"
        with (
            failed_as(CommitError, f"DDL on {probe.name} failed"),
            _gives_up(probe, probe.table_name, f"{changing} the claim columns of"),
            probe.transaction() as conn,
        ):
            table = probe.reflect(conn, probe.table_name)
            if uninstall:
                statements = ddl.uninstall_columns(conn, table)
                if statements:
                    _refuse_pending(args, probe, _pending_in_columns(conn, table), "the producers")
            else:
                statements = probe.layout.install(
                    conn,
                    table,
                    existing=args.existing,
                    priority=bool(getattr(args, "priority", False)),
                )
            if not statements:
                print(f"-- {probe.name}: nothing to do")
                return 0
            if not _print_then_run(args, conn, statements):
                return 0
    finally:
        probe.close()
    print(f"-- applied {len(statements)} statement(s) to {probe.name}")
    return 0


def _gives_up(probe: ClaimSource, table: str, doing: str) -> AbstractContextManager[None]:
    """A statement that gave up waiting for a lock (the queue engine's bound) as a
    RetryableError saying ``doing`` ``table``, who holds locks there and what to do:
    the statements before it stay (on PostgreSQL each commits alone, MariaDB's DDL
    commits at once) and running the command again does what is still missing."""
    from dbtrigger._lock_wait import ddl_gives_up  # noqa: PLC0415
    from dbtrigger.queue import engines  # noqa: PLC0415

    return ddl_gives_up(
        probe.engine,
        table,
        probe.schema,
        engines.LOCK_WAIT_SECONDS,
        f"{doing} {table}",
        "statements applied before it stay, and running it again does what is missing: "
        "run the command again once it ends, or end it",
    )


def _pending_in_columns(conn: Connection, table: sa.Table) -> int:
    """Rows of a columns-mode queue not finished yet (``ready`` or ``claimed``)."""
    import sqlalchemy as sa  # noqa: PLC0415

    if "dbt_status" not in table.c:
        return 0
    status = table.c.dbt_status
    query = sa.select(sa.func.count()).where(status.in_(("ready", "claimed")))
    return int(conn.execute(query).scalar_one())


def _refuse_pending(
    args: argparse.Namespace, probe: ClaimSource, pending: int, writers: str
) -> None:
    """Uninstall drops the queue's record of which rows are done: with work not
    done yet it refuses to apply unless ``--discard-pending`` says to drop it
    (a dry run says it would refuse)."""
    if not pending or args.discard_pending:
        return
    message = (
        f"{pending} row(s) of queue {probe.queue_name} are not finished (ready or "
        f"claimed): stop {writers}, let the workers drain the queue "
        "(`dbtrigger queue status`), or add --discard-pending to drop that work"
    )
    if args.yes:
        raise ConfigurationError(message)
    print(f"-- refused with --yes as it stands: {message}")


def _print_then_run(args: argparse.Namespace, conn: Connection, statements: list[str]) -> bool:
    """Print the queue DDL; run it on ``conn`` with ``--yes`` (True), else a dry run."""
    from dbtrigger.queue import ddl  # noqa: PLC0415

    return print_then_apply(
        args, [s.strip() for s in statements], lambda: ddl.apply(conn, statements)
    )


def _uninstall_sidecar(args: argparse.Namespace, probe: ClaimSource) -> int:
    """Remove one queue from the claims table (and the table once no queue uses it).

    Sidecar mode never changed the user table, so there is nothing to undo
    there. What uninstall removes is the queue's claims rows; rows still
    ``ready`` or ``claimed`` are work not done yet, so applying refuses while
    there are any unless ``--discard-pending`` says to drop them.
    """
    from dbtrigger.queue.sidecar_table import uninstall_claims  # noqa: PLC0415

    name, schema = probe.claims_table, probe.schema
    where = f"{schema}.{name}" if schema else name
    failed = f"uninstalling {probe.queue_name} failed"
    try:
        with (
            failed_as(CommitError, failed),
            _gives_up(probe, name, f"removing {probe.queue_name} from"),
            probe.transaction() as conn,
        ):
            plan = uninstall_claims(conn, name, schema, probe.queue_name)
            if plan is None:
                print(f"-- claims table {where} does not exist: nothing to do")
                return 0
            if not plan.statements:
                print(
                    f"-- queue {probe.queue_name} has no rows in {where}, which "
                    f"{plan.other_queues} other queue(s) still use: nothing to do"
                )
                return 0
            counts = ", ".join(f"{s} {n}" for s, n in sorted(plan.by_status.items())) or "no rows"
            print(f"-- queue {probe.queue_name} in claims table {where}: {counts}")
            if plan.other_queues:
                print(f"-- {where} is kept: {plan.other_queues} other queue(s) still use it")
            print("-- the table " + probe.queue_name + " itself is not touched")
            _refuse_pending(args, probe, plan.pending, "the feeder")
            if not _print_then_run(args, conn, plan.statements):
                return 0
    finally:
        probe.close()
    print(
        f"-- applied {len(plan.statements)} statement(s). The feeder's state document "
        "(its checkpoint store) is kept: a feeder started again resumes after its checkpoint"
    )
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    return _ddl(args, uninstall=False)


def cmd_uninstall(args: argparse.Namespace) -> int:
    return _ddl(args, uninstall=True)


def cmd_status(args: argparse.Namespace) -> int:
    return print_status(queue_source(args), as_json=args.json)


def print_status(source: ClaimSource, *, as_json: bool) -> int:
    """``queue status``: rows per status, what is due, waiting and scheduled (closes the
    source when done)."""
    try:
        counts = source.counts()
    finally:
        source.close()
    report: dict[str, Any] = {
        "queue": source.name,
        "by_status": dict(counts.by_status),
        "claimable_now": counts.claimable_now,
        "delayed_retries": counts.delayed,
        "scheduled": counts.scheduled,
        "expired_claims": counts.expired_claims,
        "stranded": counts.stranded,
        "oldest_ready_age_seconds": counts.oldest_ready_age_seconds,
        "oldest_ready_undated": counts.undated,
    }
    if as_json:
        print(json.dumps(report, sort_keys=True))
        return 0
    print(f"queue {source.name}")
    for status, n in counts.by_status.items():
        print(f"  {status:<8} {n}")
    age = counts.oldest_ready_age_seconds
    oldest = "-" if age is None else human_duration(age)
    if counts.undated:
        oldest = (
            "an unknown time (a row inserted without dbt_visible_at keeps SQLite's "
            "1970 default: enqueue() and queue add date their rows)"
        )
    print(f"  claimable now: {counts.claimable_now}, oldest ready for {oldest}")
    print(
        f"  waiting for a retry: {counts.delayed}, scheduled for later: {counts.scheduled}, "
        f"expired claims: {counts.expired_claims}"
    )
    if counts.stranded:
        print(
            f"  STRANDED: {counts.stranded} ready row(s) still carry a finished row's "
            "dbt_visible_at (9999-12-31) and are never claimed: a row made ready again by "
            "hand needs dbt_visible_at set to now (and dbt_claim_token NULL) in the same "
            "UPDATE; `dbtrigger queue retry --stranded --reason ... --yes` does it for these"
        )
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    if args.dead == args.stranded:
        raise ConfigurationError("say which rows to re-drive: --dead or --stranded")
    source = queue_source(args)
    try:
        note = f"re-driven ({args.reason}); before: "
        count = source.redrive_dead(
            note=note, limit=args.limit, dry_run=not args.yes, stranded=args.stranded
        )
    finally:
        source.close()
    what = "stranded" if args.stranded else "dead"
    if args.yes:
        print(f"{count} {what} row(s) of {source.name} are ready again (attempts reset)")
    else:
        print(f"{count} {what} row(s) of {source.name} would be made ready; add --yes to apply")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    seconds = parse_duration(args.older_than)
    statuses = ("done", "canceled", "dead") if args.include_dead else ("done", "canceled")
    source = queue_source(args)
    try:
        count = source.prune(
            older_than_seconds=seconds, chunk=args.chunk, statuses=statuses, dry_run=not args.yes
        )
    finally:
        source.close()
    what = "/".join(statuses)
    if args.yes:
        print(f"deleted {count} {what} row(s) older than {args.older_than} from {source.name}")
    else:
        print(
            f"{count} {what} row(s) older than {args.older_than} would be deleted from "
            f"{source.name} in chunks of {args.chunk}; add --yes to apply"
        )
    return 0


def add_queue_commands(sub: Any, load_object: Callable[[str], Any]) -> None:
    """Register ``dbtrigger queue ...`` on the top-level subparsers; ``load_object``
    imports what ``--source MODULE:ATTR`` names (the CLI's own loader, passed in
    so that this module, part of the library, imports nothing of the CLI)."""
    queue = sub.add_parser(
        "queue", help="claim-mode queue tables: install, status, add, cancel, retry, prune"
    )
    queue.set_defaults(load_object=load_object)
    qsub = queue.add_subparsers(dest="queue_command", required=True)

    install = qsub.add_parser("install", help="print (or --yes: run) the claim-column DDL")
    table_options(install, pk=False)
    install.add_argument(
        "--existing",
        choices=("ready", "done"),
        default="ready",
        help="what rows already in the table become (default: ready, i.e. delivered)",
    )
    install.add_argument(
        "--priority",
        action="store_true",
        help="also add dbt_priority and its index: claims take higher priorities first",
    )
    add_apply_option(install)
    install.set_defaults(func=cmd_install)

    uninstall = qsub.add_parser(
        "uninstall",
        help="print (or --yes: run) DDL removing them (sidecar: the queue's claims rows)",
    )
    table_options(uninstall, pk=False)
    add_apply_option(uninstall)
    uninstall.add_argument(
        "--discard-pending",
        action="store_true",
        help="also drop work not finished yet (ready/claimed rows; sidecar: their claims rows)",
    )
    uninstall.set_defaults(func=cmd_uninstall)

    status = qsub.add_parser("status", help="rows per status, oldest ready age")
    table_options(status)
    add_json_option(status, "one JSON object")
    status.set_defaults(func=cmd_status)

    retry = qsub.add_parser("retry", help="re-drive dead rows (dry run unless --yes)")
    table_options(retry)
    retry.add_argument("--dead", action="store_true", help="re-drive rows in status dead")
    retry.add_argument(
        "--stranded",
        action="store_true",
        help="re-drive ready rows that still carry a finished row's dbt_visible_at",
    )
    retry.add_argument("--limit", type=int, help="at most this many rows")
    retry.add_argument("--reason", required=True, help="why: kept in dbt_last_error")
    add_apply_option(retry)
    retry.set_defaults(func=cmd_retry)

    add_job_commands(qsub)

    prune = qsub.add_parser("prune", help="delete finished rows in bounded chunks")
    table_options(prune)
    prune.add_argument("--older-than", required=True, help="e.g. 7d, 12h, 3600")
    prune.add_argument("--chunk", type=int, default=1000, help="rows per transaction")
    prune.add_argument("--include-dead", action="store_true", help="prune dead rows too")
    # (done and canceled rows are pruned; dead ones only with --include-dead)
    add_apply_option(prune)
    prune.set_defaults(func=cmd_prune)


__all__ = ["add_queue_commands", "claim_source_of", "parse_duration", "print_status"]
