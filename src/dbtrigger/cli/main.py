"""The parser of the ``dbtrigger`` command and its error handling.

This package (with the Azure glue and :mod:`dbtrigger.settings`) is where
environment variables are read; the library itself takes everything through
constructors.

Exit codes: 0 success, 1 a command's own "not good" answer (``status`` with an
unreadable poller), 2 an error a person must fix (one line on stderr, with its
cause chain, secrets masked), 130 interrupted, 141 output pipe closed.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dbtrigger.cli.logs import FORMATS, LEVELS, configure_logging
from dbtrigger.cli.run import add_run_command
from dbtrigger.errors import DbTriggerError
from dbtrigger.redaction import redact
from dbtrigger.settings import find_local_settings, load_local_settings

DESCRIPTION = """\
Poll SQL tables into handlers, at least once, and operate the pollers:
run workers, inspect and change their state, backfill, or try the demo.
"""

EPILOG = """\
Environment: DBTRIGGER_STORE, DBTRIGGER_APP_NAME, DBTRIGGER_CONTAINER and
DBTRIGGER_BACKUP_DIR give defaults for --store, --app, --container and
--backup-dir. Run inside an Azure Functions project (a directory with host.json),
the Values of its local.settings.json are read as the host would (--settings).
`dbtrigger COMMAND --help` describes each command.
"""

#: Exit code of a command whose output pipe was closed (as for SIGPIPE).
EXIT_BROKEN_PIPE = 141


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


def _version() -> str:
    from dbtrigger import __version__  # noqa: PLC0415 - avoid importing the package early

    return f"dbtrigger {__version__}"


def _add_global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """Options accepted before or after the command name (``dbtrigger run X -v``)."""
    default = None if top else argparse.SUPPRESS
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0 if top else argparse.SUPPRESS,
        help="more log output: -v INFO, -vv DEBUG",
    )
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        type=str.upper,
        default=default,
        help="log level (default INFO for run, WARNING otherwise)",
    )
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text" if top else argparse.SUPPRESS,
        help="text lines, or one JSON object per line with the structured fields",
    )
    parser.add_argument(
        "--settings",
        metavar="FILE",
        default=default,
        help="read app settings from this local.settings.json (default: the one in the "
        "current directory if it holds a Functions project's host.json)",
    )
    parser.add_argument(
        "--no-settings",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="do not read local.settings.json even inside a Functions project",
    )


#: Global options that take a value (``--log-level DEBUG run ...``).
_VALUED_OPTIONS = ("--log-level", "--log-format", "--settings")


def _command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names, when it names one before any help or version flag."""
    args = iter(argv)
    for arg in args:
        if arg in _VALUED_OPTIONS:
            next(args, None)
        elif arg in ("-h", "--help", "--version"):
            return None
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``command="run"``, one that knows ``run`` only.

    A worker process (``dbtrigger run``) parses its arguments with the second:
    the other commands' modules (claim queues, change logs, replay, backfill,
    the backlog endpoint...) are then never imported, which is about a quarter
    of a cold worker's import time. It parses ``run`` exactly as the whole
    parser does.
    """
    parser = argparse.ArgumentParser(
        prog="dbtrigger",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    _add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_run_command(sub)
    if command != "run":
        _add_other_commands(sub)
    for subparser in sub.choices.values():
        _add_global_options(subparser, top=False)
    return parser


def _add_other_commands(sub: Any) -> None:
    # Imported here: a worker's parser (build_parser("run")) needs none of them.
    from dbtrigger.cli.backfill import add_backfill_command  # noqa: PLC0415
    from dbtrigger.cli.cdc import add_cdc_commands  # noqa: PLC0415
    from dbtrigger.cli.changelog import add_changelog_commands  # noqa: PLC0415
    from dbtrigger.cli.check import add_check_command  # noqa: PLC0415
    from dbtrigger.cli.deadletter import add_dead_letter_commands  # noqa: PLC0415
    from dbtrigger.cli.history import add_history_command  # noqa: PLC0415
    from dbtrigger.cli.loading import load_object  # noqa: PLC0415
    from dbtrigger.cli.partitions import add_partition_commands  # noqa: PLC0415
    from dbtrigger.cli.positions import add_position_commands  # noqa: PLC0415
    from dbtrigger.cli.replay import add_replay_command  # noqa: PLC0415
    from dbtrigger.cli.state import add_state_commands  # noqa: PLC0415
    from dbtrigger.cli.wake import add_wake_commands  # noqa: PLC0415
    from dbtrigger.queue.cli import add_queue_commands  # noqa: PLC0415

    demo = sub.add_parser("demo", help="live SQLite orders table polled into the terminal")
    demo.add_argument("--dir", default="dbtrigger-demo", help="where the database and state go")
    demo.add_argument("--rate", type=float, default=8.0, help="writer changes per second")
    demo.add_argument("--interval", type=float, default=1.0, help="seconds between idle ticks")
    demo.add_argument("--batch-size", type=int, default=10, help="rows per batch (default 10)")
    demo.add_argument("--duration", type=float, default=None, help="stop after N seconds")
    demo.add_argument("--seed", type=int, default=None, help="seed the writer's randomness")
    demo.set_defaults(func=cmd_demo)

    add_state_commands(sub)
    add_history_command(sub)
    add_replay_command(sub)
    add_dead_letter_commands(sub)
    add_position_commands(sub)
    add_backfill_command(sub)
    add_changelog_commands(sub)
    add_cdc_commands(sub)
    add_partition_commands(sub)
    add_queue_commands(sub, load_object)
    add_wake_commands(sub)
    add_check_command(sub)


def _print_error(exc: BaseException) -> None:
    """The error and its cause chain, with anything that looks like a secret masked.

    One line per cause, and only causes that add something: a driver error
    wrapped by SQLAlchemy is the same text twice.
    """
    shown = [f"error: {exc}"]
    cause = exc.__cause__
    while cause is not None:
        first = (str(cause).strip().splitlines() or [""])[0]
        core = re.sub(r"^\([\w.]+\) ", "", first)[:80]  # SQLAlchemy's "(driver.Error) "
        if core and not any(core in line for line in shown):
            shown.append(f"  caused by {type(cause).__name__}: {first}")
        cause = cause.__cause__
    for line in shown:
        print(redact(line), file=sys.stderr)


def _log_level(args: argparse.Namespace) -> str:
    if args.log_level:
        return str(args.log_level)
    if args.verbose:
        return "DEBUG" if args.verbose >= 2 else "INFO"
    return str(getattr(args, "default_log_level", "WARNING"))


def _read_settings(args: argparse.Namespace) -> None:
    if args.no_settings:
        return
    path = Path(args.settings) if args.settings else find_local_settings()
    if path is None:
        return
    names = load_local_settings(path)
    logging.getLogger("dbtrigger.cli").info(
        "read %d app settings from %s", len(names), path, extra={"event": "settings_loaded"}
    )


def _silence_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so the exit flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_of(argv)
    parser = build_parser("run" if command == "run" else None)
    args = parser.parse_args(argv)
    configure_logging(_log_level(args), args.log_format)
    try:
        _read_settings(args)
        return int(args.func(args))
    except DbTriggerError as exc:
        _print_error(exc)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
