"""``dbtrigger changelog install|check|uninstall|prune|snapshot``: the change log from the shell.

Like the state commands, anything that changes a database is a dry run unless
``--yes`` is given: the DDL (or the row count) is printed first, so it can be
reviewed, or copied into a migration instead.
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from dbtrigger._argparse import add_apply_option, print_then_apply
from dbtrigger.changelog.drift import install_command
from dbtrigger.changelog.operations import (
    PrunePlan,
    apply,
    drift,
    lowest_checkpoint,
    plan_install,
    plan_prune,
    plan_uninstall,
    prune,
)
from dbtrigger.cli.ddl import open_url_engine
from dbtrigger.durations import duration_seconds
from dbtrigger.errors import ConfigurationError


def parse_duration(text: str) -> dt.timedelta:
    """An age such as ``90s``, ``15m``, ``12h``, ``7d``, ``2w`` (the queue's rule)."""
    return dt.timedelta(seconds=duration_seconds(text))


def cmd_install(args: argparse.Namespace) -> int:
    with open_url_engine(args) as engine:
        plan = plan_install(engine, args.table, schema=args.schema)
        statements = [s.rstrip() for s in plan.statements]
        if not print_then_apply(args, statements, lambda: apply(engine, plan), end=";\n"):
            return 0
        print(f"-- installed: changes of {args.table} now go to {plan.info.log_table}")
        if _rows_before_the_log(engine, args.table, plan.info.log_table, args.schema):
            where = f" --schema {args.schema}" if args.schema else ""
            print(
                f"-- note: {args.table} already holds rows, and they are in no log row: the "
                "log's pollers see only the changes made from now on. To deliver those rows "
                f"too: dbtrigger changelog snapshot --url URL --table {args.table}{where} --yes "
                "(docs/changes.md, 'Existing rows')"
            )
        if any(" RENAME COLUMN " in s for s in plan.statements):
            print(
                "-- the log's key columns were renamed with the table's key: each poller of "
                "this log stops once with the `dbtrigger reset ... --accept-source` command "
                "to run (its checkpoint stays where it is)"
            )
        return 0


def _rows_before_the_log(engine: Engine, table: str, log: str, schema: str | None) -> bool:
    """Whether ``table`` holds rows while its log holds none (a first install)."""
    with engine.connect() as conn:

        def any_row(name: str) -> bool:
            probe = sa.select(sa.literal(1)).select_from(sa.table(name, schema=schema)).limit(1)
            return conn.execute(probe).first() is not None

        return any_row(table) and not any_row(log)


def cmd_check(args: argparse.Namespace) -> int:
    """Exit 1 when a migration left the change log's triggers behind the table."""
    with open_url_engine(args) as engine:
        found = drift(engine, args.table, schema=args.schema)
    if found.missing:
        raise ConfigurationError(
            f"no change log for table {args.table!r}; install it with "
            f"{install_command(args.table, args.schema)}"
        )
    for note in found.notes:
        print(f"note: {note}")
    if not found:
        print(f"the change log of {args.table} matches the table")
        return 0
    print(f"the change log of {args.table} no longer matches the table:")
    for problem in found.problems:
        print(f"  - {problem}")
    print(f"fix: {found.fix}")
    return 1


def cmd_uninstall(args: argparse.Namespace) -> int:
    with open_url_engine(args) as engine:
        plan = plan_uninstall(engine, args.table, schema=args.schema, drop_log=args.drop_log)
        _readers_left_behind(engine, args)
        if not print_then_apply(args, plan.statements, lambda: apply(engine, plan)):
            return 0
        print(f"-- uninstalled the change log triggers of {args.table}")
        return 0


def _readers_left_behind(engine: Engine, args: argparse.Namespace) -> None:
    """Say which registered pollers an uninstall leaves without changes: from then on
    nothing is logged for them, so they stop at their next drift check, and what is
    written before a re-install reaches none of them."""
    from dbtrigger.changelog import readers  # noqa: PLC0415 - only for this command

    with engine.connect() as conn:
        found = readers.registered(conn, args.table, args.schema) or []
    if not found:
        return
    names = ", ".join(f"{r.name} (at sequence {r.seq}, seen {r.seen_at})" for r in found)
    print(
        f"-- {len(found)} poller(s) read this change log: {names}. Once the triggers are gone "
        "no change is logged: each stops with ChangeLogDriftError at its next drift check "
        "(drift_check_seconds, 60 s by default), and changes written before "
        f"`{install_command(args.table, args.schema)}` runs again reach none of them. To "
        "change the table without losing changes, uninstall and install in one transaction "
        "(docs/changes.md, When the table changes)"
    )


def _passed_by(args: argparse.Namespace) -> tuple[int | None, dict[str, int]]:
    """The lowest checkpoint of the named pollers (their state read through the store),
    and each one's."""
    from dbtrigger.changelog.pruning import stored_cursors  # noqa: PLC0415 - only for this option
    from dbtrigger.state.stores.factory import open_store  # noqa: PLC0415

    if not args.store:
        raise ConfigurationError("--passed-by needs --store (where the pollers keep their state)")
    cursors, missing = stored_cursors(open_store(args.store, app=args.app), args.passed_by)
    if missing:
        raise ConfigurationError(
            f"no state for poller {missing[0]!r} in {args.store}: nothing pruned"
        )
    lowest = lowest_checkpoint(cursors)
    return lowest, dict(zip(args.passed_by, cursors, strict=True))


def cmd_prune(args: argparse.Namespace) -> int:
    older_than = parse_duration(args.older_than) if args.older_than else None
    up_to: int | None = None
    at: dict[str, int] = {}
    if args.passed_by:
        up_to, at = _passed_by(args)
        if up_to is None:
            print("a poller has no checkpoint yet: nothing can be pruned")
            return 0
    if older_than is None and up_to is None:
        raise ConfigurationError("prune needs --older-than and/or --passed-by")
    dropping = tuple(args.drop_unread_of or ())
    # The delete takes the rows the plan counted (its cutoff, its top sequence).
    with open_url_engine(args) as engine:
        found = plan_prune(
            engine,
            args.table,
            schema=args.schema,
            older_than=older_than,
            up_to_seq=up_to,
            drop_unread_of=dropping,
            readers_at=at,
        )
        count = found.rows
        if args.yes:
            count = prune(engine, args.table, schema=args.schema, chunk=args.chunk, plan=found)
    scope = []
    if older_than is not None:
        scope.append(f"older than {args.older_than}")
    if up_to is not None:
        scope.append(f"at or below sequence {up_to} (passed by {', '.join(args.passed_by)})")
    if args.yes:
        print(f"deleted {count} change log row(s) {' and '.join(scope)}")
    else:
        print(f"would delete {count} change log row(s) {' and '.join(scope)}; add --yes to apply")
    _tell_readers(found)
    return 0


def _tell_readers(found: PrunePlan) -> None:
    """Which readers keep rows the prune leaves, and which lose rows it takes."""
    at = {r.name: r for r in found.readers or ()}
    if found.kept_unread:
        print("kept, because a registered reader has not read them yet:")
        for name, rows in found.kept_unread.items():
            print(
                f"  - {rows} row(s) unread by {name} "
                f"(at sequence {at[name].seq}, seen {at[name].seen_at})"
            )
        names = " ".join(f"--drop-unread-of {n}" for n in found.kept_unread)
        print(
            f"to delete them anyway (those readers never see those changes): add {names}; "
            "a reader that no longer runs: `dbtrigger changelog readers ... --forget NAME`"
        )
    for name, rows in found.lost.items():
        print(
            f"reader {name} loses {rows} row(s) it has not read (it is at sequence "
            f"{at[name].seq}); it logs changelog_rows_lost at its next start"
        )


def cmd_readers(args: argparse.Namespace) -> int:
    """List the registered readers of a change log (``--forget NAME``: remove one)."""
    from dbtrigger._lock_wait import bounded_transaction, ddl_gives_up  # noqa: PLC0415
    from dbtrigger.changelog import operations, readers  # noqa: PLC0415 - only for this command

    seconds = operations.INSTALL_LOCK_TIMEOUT
    registry = readers.readers_table_name(args.table)
    doing = f"changing the reader registry of {args.table}"
    with (
        open_url_engine(args) as engine,
        ddl_gives_up(engine, registry, args.schema, seconds, doing),
        bounded_transaction(engine, seconds) as conn,
    ):
        if args.forget:
            seen = readers.registered(conn, args.table, args.schema) or []
            seen_at = next((r.seen_at for r in seen if r.name == args.forget), None)
            if seen_at is not None:
                # A poller still running registers again within minutes, and a prune
                # before that takes its unread rows without marking them lost.
                print(
                    f"{args.forget} was last seen {seen_at}: forget it only once its poller "
                    "is stopped for good (a running one registers again at its next "
                    "checkpoint, and a prune in between takes rows it has not read)"
                )
            if not args.yes:
                print(
                    f"would forget reader {args.forget} (a prune no longer waits for it); "
                    "add --yes to apply"
                )
                return 0
            if not readers.forget(conn, args.table, args.schema, args.forget):
                raise ConfigurationError(
                    f"{args.forget} is not a registered reader of {args.table}'s change log"
                )
            print(f"forgot reader {args.forget}")
            return 0
        found = readers.registered(conn, args.table, args.schema)
    if found is None:
        raise ConfigurationError(
            f"the change log of {args.table} has no reader registry (installed by an older "
            f"dbtrigger); upgrade it in place: `{install_command(args.table, args.schema)}`"
        )
    if not found:
        print(f"no reader of {args.table}'s change log has registered yet")
    for r in found:
        lost = f", lost rows up to sequence {r.lost_seq} to a prune" if r.lost_seq else ""
        print(f"{r.name}: at sequence {r.seq}, seen {r.seen_at}{lost}")
    return 0


def cmd_resync(args: argparse.Namespace) -> int:
    """Record a truncate, then write every row the table holds into its change log."""
    from dbtrigger.changelog.snapshot import resync  # noqa: PLC0415 - only for this command

    with open_url_engine(args) as engine:
        counted = resync(engine, args.table, schema=args.schema, apply=False)
        if not args.yes:
            print(
                f"would write a truncate row into the change log of {args.table}, then its "
                f"{counted.rows} row(s) as snapshot entries; add --yes to apply"
            )
            return 0
        done = resync(engine, args.table, schema=args.schema, chunk=args.chunk)
    print(
        f"wrote a truncate row, then {done.rows} row(s) of {args.table}: its readers get "
        "op='truncate' (drop what you hold), then op='upsert' per row, in log order"
    )
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    """Write the rows the table holds now into its change log (``upsert`` entries)."""
    from dbtrigger.changelog.snapshot import snapshot  # noqa: PLC0415 - only for this command

    where = f" where {args.where}" if args.where else ""
    with open_url_engine(args) as engine:
        counted = snapshot(engine, args.table, schema=args.schema, where=args.where, apply=False)
        if not args.yes:
            print(
                f"would write {counted.rows} row(s) of {args.table}{where} into its change log "
                f"as snapshot entries, {args.chunk} per transaction; add --yes to apply"
            )
            return 0
        done = snapshot(engine, args.table, schema=args.schema, where=args.where, chunk=args.chunk)
    print(
        f"wrote {done.rows} row(s) of {args.table}{where} into its change log in {done.chunks} "
        "chunk(s): its pollers deliver them as op='upsert' with metadata['snapshot'], among "
        "the changes, in log order"
    )
    return 0


def add_changelog_commands(sub: Any) -> None:
    """Register ``changelog`` and its subcommands on the CLI's subparsers."""
    changelog = sub.add_parser(
        "changelog",
        help="a trigger-maintained change log: every insert, update and delete",
        description="Install, remove or prune the change log that ChangeLogSource polls.",
    )
    commands = changelog.add_subparsers(dest="changelog_command", required=True)

    def command(
        name: str, help_text: str, func: Any, *, changes: bool = True
    ) -> argparse.ArgumentParser:
        """A subcommand on ``--url``/``--table``/``--schema`` (and ``--yes`` when it
        changes something) that runs ``func``."""
        parser: argparse.ArgumentParser = commands.add_parser(name, help=help_text)
        parser.add_argument("--url", required=True, help="database URL (%%APP_SETTING%% allowed)")
        parser.add_argument("--table", required=True, help="the watched table")
        parser.add_argument("--schema", help="its schema (PostgreSQL/MariaDB)")
        if changes:
            add_apply_option(parser)
        parser.set_defaults(func=func)
        return parser

    command("install", "print (or with --yes apply) the log table and triggers", cmd_install)
    command(
        "check",
        "compare the installed triggers with the table (exit 1 when a migration left them behind)",
        cmd_check,
        changes=False,
    )
    uninstall = command("uninstall", "drop the change log's triggers", cmd_uninstall)
    uninstall.add_argument(
        "--drop-log", action="store_true", help="also drop the log table and its rows"
    )

    prune_cmd = command("prune", "delete old log rows in bounded chunks", cmd_prune)
    prune_cmd.add_argument("--older-than", help="age, e.g. 7d, 12h, 90m, 3600")
    prune_cmd.add_argument(
        "--passed-by",
        action="append",
        metavar="POLLER",
        help="only rows every named poller has committed past (repeat per poller)",
    )
    prune_cmd.add_argument("--store", help="the pollers' state store (for --passed-by)")
    prune_cmd.add_argument(
        "--app", default=None, help="the store's app prefix (default: the CLI's)"
    )
    prune_cmd.add_argument("--chunk", type=int, default=5000, help="rows per delete statement")
    prune_cmd.add_argument(
        "--drop-unread-of",
        action="append",
        metavar="READER",
        help="delete rows this registered reader has not read yet (it loses them; repeat per "
        "reader). Without it no prune deletes a row a registered reader still needs",
    )

    readers_cmd = command(
        "readers",
        "the pollers registered as readers of the log, and how far they read",
        cmd_readers,
    )
    readers_cmd.add_argument(
        "--forget", metavar="READER", help="remove a reader that no longer runs"
    )

    resync_cmd = command(
        "resync",
        "record a truncate, then write every row into the log (after rows left the "
        "table unlogged; dry run unless --yes)",
        cmd_resync,
    )
    resync_cmd.add_argument("--chunk", type=int, default=1000, help="rows per transaction")

    snap = command(
        "snapshot",
        "write the rows the table holds now into its change log (existing rows in the "
        "stream; dry run unless --yes)",
        cmd_snapshot,
    )
    snap.add_argument("--where", help="only the rows matching this condition (SQL)")
    snap.add_argument("--chunk", type=int, default=1000, help="rows per transaction")
