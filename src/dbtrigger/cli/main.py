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
import importlib
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dbtrigger.cli.logs import FORMATS, LEVELS, configure_logging
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


#: Every command, in the order ``dbtrigger --help`` lists them: the module that
#: registers a group of commands, its function that does, and the group's names.
COMMANDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("dbtrigger.cli.run", "add_run_command", ("run",)),
    (__name__, "add_demo_command", ("demo",)),
    (
        "dbtrigger.cli.state",
        "add_state_commands",
        ("status", "reset", "clone", "release-lease", "skip-batch"),
    ),
    ("dbtrigger.cli.history", "add_history_command", ("history",)),
    ("dbtrigger.cli.replay", "add_replay_command", ("replay",)),
    ("dbtrigger.cli.deadletter", "add_dead_letter_commands", ("dead-letter",)),
    ("dbtrigger.cli.positions", "add_position_commands", ("rewind", "bookmark")),
    ("dbtrigger.cli.backfill", "add_backfill_command", ("backfill",)),
    ("dbtrigger.cli.changelog", "add_changelog_commands", ("changelog",)),
    ("dbtrigger.cli.cdc", "add_cdc_commands", ("cdc",)),
    ("dbtrigger.cli.partitions", "add_partition_commands", ("partitions",)),
    ("dbtrigger.cli.queue", "add_queue_commands", ("queue",)),
    ("dbtrigger.cli.wake", "add_wake_commands", ("wake",)),
    ("dbtrigger.cli.check", "add_check_command", ("check",)),
)


def add_demo_command(sub: Any) -> None:
    demo = sub.add_parser("demo", help="live SQLite orders table polled into the terminal")
    demo.add_argument("--dir", default="dbtrigger-demo", help="where the database and state go")
    demo.add_argument("--rate", type=float, default=8.0, help="writer changes per second")
    demo.add_argument("--interval", type=float, default=1.0, help="seconds between idle ticks")
    demo.add_argument("--batch-size", type=int, default=10, help="rows per batch (default 10)")
    demo.add_argument("--duration", type=float, default=None, help="stop after N seconds")
    demo.add_argument("--seed", type=int, default=None, help="seed the writer's randomness")
    demo.set_defaults(func=cmd_demo)


def _known(command: str | None) -> bool:
    return any(command in names for _, _, names in COMMANDS)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with a command's name, one that knows its group only.

    Each process imports the module of the command it runs, not the others'
    (``dbtrigger run`` never imports claim queues, change logs, replay,
    backfill or the backlog endpoint; ``dbtrigger changelog`` not even the
    runtime). A group's parser parses its commands exactly as the whole parser
    does; ``None`` or a name no group has gives the whole parser, whose help
    and "invalid choice" errors list every command.
    """
    return _build_parser(command, exit_on_error=True)


def _build_parser(command: str | None, *, exit_on_error: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dbtrigger",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        exit_on_error=exit_on_error,
    )
    parser.add_argument("--version", action="version", version=_version())
    _add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    whole = not _known(command)
    for module, function, names in COMMANDS:
        if whole or command in names:
            getattr(importlib.import_module(module), function)(sub)
    for subparser in sub.choices.values():
        _add_global_options(subparser, top=False)
    return parser


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed by the parser of the command it names (:func:`build_parser`).

    The command word is found before parsing (:func:`_command_of`); should
    argparse see another one (``--sett history status``: an abbreviated
    option's value), the group's parser fails on it and the whole parser
    parses ``argv`` again, so what is parsed, and every error, is the whole
    parser's.
    """
    command = _command_of(argv)
    if _known(command):
        try:
            return _build_parser(command, exit_on_error=False).parse_args(argv)
        except argparse.ArgumentError:
            pass
    return build_parser().parse_args(argv)


def _print_error(exc: BaseException) -> None:
    """The error and its cause chain, with anything that looks like a secret masked.

    One line per cause, and only causes that add something: a driver error
    wrapped by SQLAlchemy is the same text twice.
    """
    shown = [f"error: {exc}"]
    cause = exc.__cause__
    seen = {id(exc)}
    while cause is not None and id(cause) not in seen:  # (a chain may loop)
        seen.add(id(cause))
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
    args = parse_arguments(argv)
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
