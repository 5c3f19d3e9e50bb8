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

from dbtrigger.cli.state_change import add_change_commands
from dbtrigger.cli.state_read import add_read_commands


def add_state_commands(sub: Any) -> None:
    """Register status, history, reset, clone, release-lease and skip-batch."""
    add_read_commands(sub)
    add_change_commands(sub)


__all__ = ["add_state_commands"]
