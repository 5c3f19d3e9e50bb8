"""The ``dbtrigger`` command line (console entry point ``dbtrigger.cli:main``).

Layout, from the bottom up, with no module importing one above it:
``loading`` (MODULE:ATTR imports) and ``common`` (console, store, positions,
shared options) serve the commands ``run``, ``state_read``, ``state_change``
and ``backfill``; ``state`` registers the state commands; ``main`` builds the
parser and maps errors to exit codes.
"""

from __future__ import annotations

from dbtrigger.cli.loading import load_object
from dbtrigger.cli.main import build_parser, main

__all__ = ["build_parser", "load_object", "main"]
