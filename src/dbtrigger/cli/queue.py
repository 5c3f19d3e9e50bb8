"""``dbtrigger queue ...``: the claim queue package's commands, which load a
``MODULE:ATTR`` target through the CLI's loader (the library never imports the
CLI, so the loader is handed to them)."""

from __future__ import annotations

from typing import Any

from dbtrigger.cli.loading import load_object
from dbtrigger.queue import cli as queue_cli


def add_queue_commands(sub: Any) -> None:
    queue_cli.add_queue_commands(sub, load_object)


__all__ = ["add_queue_commands"]
