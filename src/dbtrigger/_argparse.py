"""Command-line options that the CLI (:mod:`dbtrigger.cli`) and the commands the
library registers itself (``dbtrigger queue``) both take: declared once, so every
command spells and explains them the same way."""

from __future__ import annotations

import argparse


def add_apply_option(parser: argparse.ArgumentParser) -> None:
    """``--yes``: a command that changes something shows what it would do unless given it."""
    parser.add_argument("--yes", action="store_true", help="apply (default: dry run)")


def add_json_option(parser: argparse.ArgumentParser, help: str = "machine-readable output") -> None:
    """``--json``: print the command's answer as JSON."""
    parser.add_argument("--json", action="store_true", help=help)


__all__ = ["add_apply_option", "add_json_option"]
