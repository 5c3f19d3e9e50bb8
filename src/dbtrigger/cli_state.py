"""``dbtrigger status | history | reset | clone | release-lease | skip-batch | backfill``.

Operators steer pollers through these commands instead of editing state
documents by hand. Everything goes through the :class:`CheckpointStore` port
(read with an etag, conditional write), so a command can never overwrite a
change it did not see, and the pure transitions in
:mod:`dbtrigger.state.operations` decide what the new document is.

Guardrails on every command that changes state:

* **dry run by default**: the before/after is printed and nothing is written
  until ``--yes`` is given;
* **a live lease refuses the change** unless ``--force``, which fences the
  holder out (fencing token + 1) so its in-flight commit is rejected;
* **``--reason`` is required** and goes into the journal with who and when;
* **the previous document is saved** to a local backup directory first, and the
  command prints how to restore it (``reset --from-file``).

Secrets never reach the terminal: all output and error text passes through
:func:`~dbtrigger.state.stores.factory.redact`.
"""

from __future__ import annotations

from typing import Any

from dbtrigger.cli_state_change import add_change_commands, print_plan
from dbtrigger.cli_state_common import (
    DEFAULT_BACKUP_DIR,
    ENV_APP,
    ENV_BACKUP_DIR,
    ENV_CONTAINER,
    ENV_STORE,
    VALUE_KINDS,
    Console,
    LoadedSource,
    actor_from_args,
    add_change_options,
    add_cursor_options,
    add_store_options,
    close_store,
    default_actor,
    load_source,
    parse_position,
    parse_value,
    read_state,
    show_position,
    state_store,
    store_from_args,
    utc_now,
)
from dbtrigger.cli_state_read import add_read_commands, poller_status


def add_state_commands(sub: Any) -> None:
    """Register status, history, reset, clone, release-lease and skip-batch."""
    add_read_commands(sub)
    add_change_commands(sub)


__all__ = [
    "DEFAULT_BACKUP_DIR",
    "ENV_APP",
    "ENV_BACKUP_DIR",
    "ENV_CONTAINER",
    "ENV_STORE",
    "VALUE_KINDS",
    "Console",
    "LoadedSource",
    "actor_from_args",
    "add_change_options",
    "add_cursor_options",
    "add_state_commands",
    "add_store_options",
    "close_store",
    "default_actor",
    "load_source",
    "parse_position",
    "parse_value",
    "poller_status",
    "print_plan",
    "read_state",
    "show_position",
    "state_store",
    "store_from_args",
    "utc_now",
]
