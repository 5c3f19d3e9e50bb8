"""The ``dbtrigger`` command line (console entry point ``dbtrigger.cli:main``).

Layout, from the bottom up, with no module importing one above it:
``loading`` (MODULE:ATTR imports) and ``common`` (console, store, positions,
shared options) serve the commands ``run``, ``state_read``, ``state_change``
and ``backfill``; ``state`` registers the state commands; ``main`` builds the
parser and maps errors to exit codes, importing the module of the command a
process runs only (:data:`~dbtrigger.cli.main.COMMANDS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dbtrigger import _lazy
from dbtrigger.cli.main import build_parser, main

if TYPE_CHECKING:
    from dbtrigger.cli.loading import load_object

# The loader pulls in the runtime, which ``dbtrigger changelog`` does not need.
__getattr__, __dir__ = _lazy.exports(__name__, {"load_object": "dbtrigger.cli.loading"})

__all__ = ["build_parser", "load_object", "main"]
