"""``dbtrigger check MODULE:TRIGGER``: verify a poller's table and store before trusting it.

Exit status: 0 when nothing can lose rows (warnings are printed), 1 when a
finding is an error (rows can be lost or the poller cannot run), 2 when the
trigger cannot be loaded at all. ``--json`` prints the report as JSON.
"""

from __future__ import annotations

import argparse
from typing import Any

from dbtrigger.cli.loading import load_object
from dbtrigger.errors import ConfigurationError
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.state.stores.factory import redact


def cmd_check(args: argparse.Namespace) -> int:
    from dbtrigger.checks import check_trigger, summary  # noqa: PLC0415 - SQLAlchemy on use only

    trigger = load_object(args.trigger)
    if not isinstance(trigger, PollTrigger):
        raise ConfigurationError(f"{args.trigger} is a {type(trigger).__name__}, not a PollTrigger")
    report = check_trigger(trigger, probe_store=not args.no_store_probe)
    print(redact(report.to_json() if args.json else report.to_text()))
    return summary([report])


def add_check_command(sub: Any) -> None:
    check = sub.add_parser(
        "check", help="verify the table, keys, index, privileges and store a trigger needs"
    )
    check.add_argument("trigger", help="MODULE:ATTRIBUTE naming a PollTrigger")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument(
        "--no-store-probe",
        action="store_true",
        help="do not write and delete the probe key that proves the store is writable",
    )
    check.set_defaults(func=cmd_check)


__all__ = ["add_check_command", "cmd_check"]
