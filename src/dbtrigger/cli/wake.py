"""``dbtrigger wake install|uninstall|status``: the notify wake-up hint's trigger.

Like the change-log commands, anything that changes the database is a dry run
unless ``--yes`` is given: the DDL is printed first, so it can be reviewed, or
copied into a migration instead. The worker side is ``dbtrigger run --wake
notify`` (see :mod:`dbtrigger.wakeup`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from dbtrigger._argparse import add_apply_option, print_then_apply
from dbtrigger._driver_errors import failed_as
from dbtrigger.cli.ddl import open_url_engine
from dbtrigger.errors import CommitError, FetchError
from dbtrigger.wakeup.ddl import WakePlan, apply, installed_channel, plan_install, plan_uninstall


def _change(
    args: argparse.Namespace, make_plan: Callable[[sa.Engine], WakePlan], doing: str
) -> WakePlan | None:
    """Plan, print the DDL, and apply it with ``--yes``; the plan applied, or None
    (a dry run, or nothing to do). ``doing`` names the change in its error."""
    with (
        open_url_engine(args) as engine,
        failed_as(CommitError, f"{doing} the wake-up trigger failed"),
    ):
        plan = make_plan(engine)
        if not plan.statements:
            print(f"-- {args.table} has no wake-up trigger: nothing to do")
            return None
        statements = [s.rstrip() for s in plan.statements]
        if not print_then_apply(args, statements, lambda: apply(engine, plan), end=";\n"):
            return None
    return plan


def cmd_install(args: argparse.Namespace) -> int:
    plan = _change(
        args,
        lambda engine: plan_install(engine, args.table, schema=args.schema, channel=args.channel),
        "installing",
    )
    if plan is not None:
        print(
            f"-- installed: writes to {args.table} notify channel {plan.channel}; run the "
            f"worker with --wake notify" + ("" if args.channel is None else f":{plan.channel}")
        )
    return 0


def cmd_uninstall(args: argparse.Namespace) -> int:
    plan = _change(
        args, lambda engine: plan_uninstall(engine, args.table, schema=args.schema), "removing"
    )
    if plan is not None:
        print(f"-- uninstalled: workers listening on {plan.channel} fall back to their interval")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Exit 1 when the table has no wake-up trigger."""
    with (
        open_url_engine(args) as engine,
        failed_as(FetchError, f"could not read the triggers of {args.table}"),
    ):
        channel = installed_channel(engine, args.table, schema=args.schema)
    if channel is None:
        print(f"{args.table}: no wake-up trigger (dbtrigger wake install ... --yes adds one)")
        return 1
    print(f"{args.table}: writes notify channel {channel}")
    return 0


def add_wake_commands(sub: Any) -> None:
    """Register ``dbtrigger wake ...`` on the top-level subparsers."""
    wake = sub.add_parser(
        "wake",
        help="the LISTEN/NOTIFY wake-up hint's trigger (PostgreSQL): install, uninstall, status",
        description="A statement-level trigger that sends one payload-less NOTIFY per writing "
        "transaction, so a worker run with --wake notify reads new rows at once instead of "
        "after its interval. Changes are dry runs unless --yes.",
    )
    wsub = wake.add_subparsers(dest="wake_command", required=True)
    for name, func, text in (
        ("install", cmd_install, "print (or --yes: run) the trigger's DDL"),
        ("uninstall", cmd_uninstall, "print (or --yes: run) the DDL that removes it"),
        ("status", cmd_status, "the channel the table's trigger notifies (exit 1: none)"),
    ):
        parser = wsub.add_parser(name, help=text)
        parser.add_argument("--url", required=True, help="database URL (or %%SETTING%%)")
        parser.add_argument("--table", required=True, help="the table the poller reads")
        parser.add_argument("--schema", help="its schema (default: the search path's first)")
        if name == "install":
            parser.add_argument(
                "--channel", help="channel name (default: dbt_wake_[<schema>_]<table>)"
            )
        if name != "status":
            add_apply_option(parser)
        parser.set_defaults(func=func)


__all__ = ["add_wake_commands"]
