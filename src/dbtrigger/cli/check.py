"""``dbtrigger check MODULE:TRIGGER``: verify a poller's table and store before trusting it.

Exit status: 0 when nothing can lose rows (warnings are printed), 1 when a
finding is an error (rows can be lost or the poller cannot run), 2 when the
trigger cannot be loaded at all. ``--json`` prints the report as JSON.
"""

from __future__ import annotations

import argparse
from typing import Any

from dbtrigger.cli.loading import as_trigger, load_object, partitioned_of
from dbtrigger.errors import ConfigurationError
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.state.stores.factory import redact


def cmd_check(args: argparse.Namespace) -> int:
    from dbtrigger.checks import check_trigger, summary  # noqa: PLC0415 - SQLAlchemy on use only
    from dbtrigger.queue.checks import check_queue  # noqa: PLC0415
    from dbtrigger.queue.cli import claim_source_of  # noqa: PLC0415
    from dbtrigger.queue.sidecar import SidecarFeeder  # noqa: PLC0415

    target = load_object(args.trigger)
    loaded = as_trigger(target, args.trigger)
    reports = []
    group = partitioned_of(loaded.trigger) if loaded is not None else None
    if group is not None:  # its table and store: every partition reads and writes them
        reports.append(check_trigger(group, probe_store=not args.no_store_probe))
    elif loaded is not None and isinstance(loaded.trigger, PollTrigger):
        reports.append(check_trigger(loaded.trigger, probe_store=not args.no_store_probe))
    queue = claim_source_of(target)
    if queue is not None:  # a queue, or a sidecar feeder's queue too
        name = None if isinstance(target, SidecarFeeder) else getattr(loaded, "trigger", None)
        reports.append(check_queue(queue, getattr(name, "name", None)))
    if not reports:
        raise ConfigurationError(
            f"{args.trigger} is a {type(target).__name__}, not a PollTrigger, a "
            "PartitionedPoller, a @db.trigger function, a QueueTrigger, ClaimSource or "
            "SidecarFeeder"
        )
    if args.json:
        text = reports[0].to_json() if len(reports) == 1 else _json_list(reports)
    else:
        text = "\n".join(r.to_text() for r in reports)
    print(redact(text))
    return summary(reports)


def _json_list(reports: list[Any]) -> str:
    return "[" + ",\n".join(r.to_json() for r in reports) + "]"


def add_check_command(sub: Any) -> None:
    check = sub.add_parser(
        "check", help="verify the table, keys, index, privileges and store a trigger needs"
    )
    check.add_argument(
        "trigger",
        help="MODULE:ATTRIBUTE naming a PollTrigger, a PartitionedPoller, a @db.trigger "
        "function, a QueueTrigger (or its ClaimSource) or a SidecarFeeder",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument(
        "--no-store-probe",
        action="store_true",
        help="do not write and delete the probe key that proves the store is writable",
    )
    check.set_defaults(func=cmd_check)


__all__ = ["add_check_command", "cmd_check"]
