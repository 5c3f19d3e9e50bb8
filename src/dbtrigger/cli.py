"""The ``dbtrigger`` command line: run a worker, run the demo, inspect state.

This module (with the Azure glue) is where environment variables are read; the
library itself takes everything through constructors.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dbtrigger.cli_backfill import add_backfill_command
from dbtrigger.cli_state import add_state_commands
from dbtrigger.errors import ConfigurationError, DbTriggerError
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.runner import Runner
from dbtrigger.state.stores.factory import redact


def load_object(spec: str) -> Any:
    """Import ``package.module:attribute``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"expected MODULE:ATTRIBUTE, got {spec!r}")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, ".")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigurationError(f"{module_name!r} has no attribute {attr!r}") from None
    return target


def cmd_run(args: argparse.Namespace) -> int:
    trigger = load_object(args.trigger)
    if not isinstance(trigger, PollTrigger):
        raise ConfigurationError(f"{args.trigger} is a {type(trigger).__name__}, not a PollTrigger")
    handler = load_object(args.handler) if args.handler else trigger.default_handler
    if handler is None:
        raise ConfigurationError(
            f"{args.trigger} has no handler: decorate one with "
            f"@{args.trigger.split(':')[1]}.handler or pass --handler MODULE:FUNCTION"
        )
    stats = Runner(trigger, handler, interval_seconds=args.interval).run(max_ticks=args.max_ticks)
    print(f"{stats.rows} rows in {stats.ticks} ticks ({stats.failures} failed ticks)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dbtrigger.demo import run_demo  # noqa: PLC0415 - keeps `dbtrigger --help` light

    run_demo(
        Path(args.dir),
        rate=args.rate,
        interval=args.interval,
        batch_size=args.batch_size,
        duration=args.duration,
        seed=args.seed,
        out=sys.stdout,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dbtrigger", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="poll on an interval until SIGINT/SIGTERM")
    run.add_argument("trigger", help="MODULE:ATTRIBUTE naming a PollTrigger")
    run.add_argument("--handler", help="MODULE:FUNCTION (default: the trigger's @handler)")
    run.add_argument("--interval", type=float, default=5.0, help="seconds between idle ticks")
    run.add_argument("--max-ticks", type=int, default=None, help="stop after this many ticks")
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", help="live SQLite orders table polled into the terminal")
    demo.add_argument("--dir", default="dbtrigger-demo", help="where the database and state go")
    demo.add_argument("--rate", type=float, default=8.0, help="writer changes per second")
    demo.add_argument("--interval", type=float, default=1.0, help="seconds between idle ticks")
    demo.add_argument("--batch-size", type=int, default=10)
    demo.add_argument("--duration", type=float, default=None, help="stop after N seconds")
    demo.add_argument("--seed", type=int, default=None, help="seed the writer's randomness")
    demo.set_defaults(func=cmd_demo)

    add_state_commands(sub)
    add_backfill_command(sub)
    return parser


def _print_error(exc: BaseException) -> None:
    """The error and its cause chain, with anything that looks like a secret masked."""
    print(redact(f"error: {exc}"), file=sys.stderr)
    cause = exc.__cause__
    while cause is not None:
        print(redact(f"  caused by {type(cause).__name__}: {cause}"), file=sys.stderr)
        cause = cause.__cause__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except DbTriggerError as exc:
        _print_error(exc)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
