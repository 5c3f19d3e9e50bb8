"""``dbtrigger cdc install|status|drop|recreate|snapshot|accept-schema``: log capture, by hand.

Each command names a trigger (``MODULE:ATTRIBUTE``: a ``PollTrigger``, a
function decorated with ``@db.trigger``, or the source itself) whose source is
a log-based source (:class:`~dbtrigger.cdc.admin.AdministeredLogSource`), and
works through that source's own admin (:mod:`dbtrigger.cdc.admin`), so every
database goes through one code path.

As everywhere in this CLI, a command that changes something is a dry run
unless ``--yes`` is given: it prints what it would do first.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dbtrigger._argparse import add_apply_option
from dbtrigger.cli.loading import load_object
from dbtrigger.errors import ConfigurationError

DRY_RUN = "-- dry run: nothing was changed; add --yes to apply"


def _admin(spec: str) -> Any:
    from dbtrigger.cdc.admin import AdministeredLogSource  # noqa: PLC0415

    target = load_object(spec)
    if not isinstance(target, AdministeredLogSource):
        from dbtrigger.azure.introspect import function_trigger  # noqa: PLC0415 - optional

        target = function_trigger(target) or target  # a @db.trigger function: its poller
        target = getattr(target, "source", target)  # a PollTrigger: its source
    if not isinstance(target, AdministeredLogSource):
        raise ConfigurationError(
            f"{spec} is not (and has no) log-based source: dbtrigger cdc works with "
            "PgLogicalSource and BinlogSource (its PollTrigger, its @db.trigger function, or the "
            "source itself)"
        )
    return target.admin()


def cmd_install(args: argparse.Namespace) -> int:
    admin = _admin(args.trigger)
    plan = admin.plan(full_images=args.full_images)
    for note in plan.notes:
        print(f"-- {note}")
    for statement in plan.statements:
        print(statement.rstrip(";") + ";")
    for statement in plan.optional:
        print(f"-- offered, with --full-images (whole before images, more WAL): {statement};")
    if any(note.startswith("BLOCKER") for note in plan.notes):
        return 2
    if not args.yes:
        print(DRY_RUN if plan.statements else "-- nothing to install")
        return 0
    for line in admin.install(full_images=args.full_images):
        print(f"-- {line}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = _admin(args.trigger).status()
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True, default=str))
        return 0 if status.get("healthy") else 1
    if "lines" in status:  # a source that words its own status (BinlogSource)
        return _print_status(status, [(str(k), v) for k, v in status["lines"]])
    slot = status.get("slot") or {}
    lines = [
        ("slot", status.get("slot_name")),
        (
            "state",
            "missing"
            if not slot
            else f"wal_status {slot.get('wal_status')}"
            + (f", invalidated ({slot.get('invalidation')})" if slot.get("invalidation") else "")
            + (f", read by pid {slot.get('active_pid')}" if slot.get("active_pid") else ""),
        ),
    ]
    if slot:
        retained = slot.get("retained_bytes")
        safe = slot.get("safe_wal_size")
        lines.append(
            (
                "retained",
                ("?" if retained is None else f"{retained / 2**20:.1f} MB")
                + ("" if safe is None else f"; {safe / 2**20:.0f} MB until invalidation"),
            )
        )
        lines.append(("confirmed", slot.get("confirmed_flush_lsn")))
    lines.append(("publication", f"{status.get('publication')}: {status.get('published_tables')}"))
    for table, info in (status.get("tables") or {}).items():
        lines.append(("table", f"{table}: REPLICA IDENTITY {info['replica_identity']}"))
    return _print_status(status, lines)


def _print_status(status: dict[str, Any], lines: list[tuple[str, Any]]) -> int:
    for snap in status.get("snapshots") or []:
        state = "done" if snap["done"] else "in progress"
        where = f" where {snap['where']}" if snap.get("where") else ""
        lines.append(
            (
                "snapshot",
                f"{snap['table']}{where}: {snap['rows']} rows, {snap['chunks']} chunks, {state}",
            )
        )
    for warning in status.get("warnings") or []:
        lines.append(("WARNING", warning))
    print("\n".join(f"{k:<12} {v}" for k, v in lines))
    return 0 if status.get("healthy") else 1


def cmd_drop(args: argparse.Namespace) -> int:
    admin = _admin(args.trigger)
    if not args.yes:
        status = admin.status()
        if status.get("kind") == "binlog":
            what = f"binlog reader {status.get('reader')}'s control row"
        else:
            what = f"replication slot {status.get('slot_name')}" + (
                "" if args.keep_publication else f" and publication {status.get('publication')}"
            )
        print(
            f"-- would drop {what}; the poller's checkpoint then names changes that cannot "
            "be read again"
        )
        print(DRY_RUN)
        return 0
    for line in admin.drop(keep_publication=args.keep_publication) or ["nothing to drop"]:
        print(f"-- {line}")
    return 0


def cmd_recreate(args: argparse.Namespace) -> int:
    if args.snapshot is None:
        raise ConfigurationError(
            "say what to do about the changes the old slot held: --snapshot reads the tables "
            "again (recommended), --no-snapshot accepts that they are missed"
        )
    admin = _admin(args.trigger)
    if not args.yes:
        status = admin.status()
        if status.get("kind") == "binlog":
            what = (
                f"-- would start binlog reader {status.get('reader')} again at the server's "
                "position now (changes since the checkpoint are skipped)"
            )
        else:
            what = (
                f"-- would drop replication slot {status.get('slot_name')} (if it still exists) "
                "and create it anew"
            )
        print(what + (", then read every table again into the log" if args.snapshot else ""))
        print(DRY_RUN)
        return 0
    for line in admin.recreate(snapshot=args.snapshot):
        print(f"-- {line}")
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    admin = _admin(args.trigger)
    where = f" where {args.where}" if args.where else ""
    if not args.yes:
        print(f"-- would read {args.table}{where} again, in chunks, among the changes")
        print(DRY_RUN)
        return 0
    request = admin.request_snapshot(args.table, args.where)
    print(f"-- queued: {request['table']}{where}; a running poller picks it up within seconds")
    return 0


def cmd_accept_schema(args: argparse.Namespace) -> int:
    admin = _admin(args.trigger)
    changes = admin.schema_changes()
    for change in changes:
        print(f"-- {change}")
    if not changes:
        print("-- no column changed type")
        return 0
    if not args.yes:
        print(DRY_RUN)
        return 0
    admin.accept_schema()
    print("-- accepted: events of the new shape are delivered from the next tick")
    return 0


def add_cdc_commands(sub: Any) -> None:
    """Register ``cdc`` and its subcommands on the CLI's subparsers."""
    cdc = sub.add_parser(
        "cdc",
        help="log-based capture: install, inspect and repair a PgLogicalSource's slot",
        description="Install, inspect and repair the server objects of a log-based source.",
    )
    commands = cdc.add_subparsers(dest="cdc_command", required=True)

    def command(name: str, help_text: str, *, changes: bool = True) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(name, help=help_text)
        parser.add_argument(
            "trigger", help="MODULE:ATTRIBUTE naming a PollTrigger, @db.trigger function or source"
        )
        if changes:
            add_apply_option(parser)
        return parser

    install = command("install", "print (or with --yes create) publication, slot, control table")
    install.add_argument(
        "--full-images",
        action="store_true",
        help="also give every table whole before images (PostgreSQL: REPLICA IDENTITY FULL)",
    )
    install.set_defaults(func=cmd_install)

    status = command(
        "status", "the slot's health, retained WAL and snapshot progress", changes=False
    )
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=cmd_status)

    drop = command("drop", "drop the slot (and publication): the server keeps no more WAL for it")
    drop.add_argument("--keep-publication", action="store_true", help="drop only the slot")
    drop.set_defaults(func=cmd_drop)

    recreate = command(
        "recreate",
        "a new slot (binlog: reader start) after one was lost, invalidated or created again "
        "by hand, or the binary log was reset",
    )
    choice = recreate.add_mutually_exclusive_group()
    choice.add_argument(
        "--snapshot",
        dest="snapshot",
        action="store_true",
        default=None,
        help="read every table again (what the lost slot held is covered)",
    )
    choice.add_argument(
        "--no-snapshot",
        dest="snapshot",
        action="store_false",
        help="only what happens from now on (the changes the lost slot held are missed)",
    )
    recreate.set_defaults(func=cmd_recreate)

    snapshot = command("snapshot", "read one table (or key range) again while streaming goes on")
    snapshot.add_argument("--table", required=True, help="one of the source's tables")
    snapshot.add_argument("--where", help="an SQL condition limiting the rows read")
    snapshot.set_defaults(func=cmd_snapshot)

    accept = command("accept-schema", "accept a column type change the source holds delivery for")
    accept.set_defaults(func=cmd_accept_schema)


__all__ = ["add_cdc_commands"]
