"""Command-line options that the CLI (:mod:`dbtrigger.cli`) and the commands the
library registers itself (``dbtrigger queue``) both take: declared once, so every
command spells and explains them the same way; and the dry run ``--yes`` ends.

Anything that changes the database is a dry run unless ``--yes`` is given:
the DDL is printed first, so it can be reviewed, or copied into a migration
instead, and applied only when asked (:func:`print_then_apply`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from dbtrigger.errors import ConfigurationError


def add_apply_option(parser: argparse.ArgumentParser) -> None:
    """``--yes``: a command that changes something shows what it would do unless given it."""
    parser.add_argument("--yes", action="store_true", help="apply (default: dry run)")


def add_json_option(parser: argparse.ArgumentParser, help: str = "machine-readable output") -> None:
    """``--json``: print the command's answer as JSON."""
    parser.add_argument("--json", action="store_true", help=help)


def read_file_option(path: str) -> bytes:
    """The bytes of a file a command was given (``--from-file``, ``--file``): one that
    is missing or cannot be read is a ConfigurationError naming it, never a traceback."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"cannot read {path}: {exc.strerror}") from exc


def print_then_apply(
    args: argparse.Namespace,
    statements: Sequence[str],
    apply: Callable[[], None],
    *,
    end: str = ";",
) -> bool:
    """Print ``statements`` (each followed by ``end``); with ``--yes`` run ``apply``
    and return True, otherwise say that this was a dry run and return False."""
    for statement in statements:
        print(statement + end)
    if not args.yes:
        print("-- dry run: nothing was changed; add --yes to apply")
        return False
    apply()
    return True


__all__ = ["add_apply_option", "add_json_option", "print_then_apply", "read_file_option"]
