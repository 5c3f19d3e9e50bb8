"""Child processes for the racing-writer tests, forked from a server that imported them once.

A ``spawn`` child imports its test module again: about a second of CPU for each of
the 30 racing processes a run starts. A fork server imports those modules once per
pytest worker and forks each child from itself, never from the worker, whose threads
(xdist's) a plain ``fork`` would copy mid-use.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import ForkServerContext

#: Every module whose functions a racing child runs: the server is one per process and
#: imports what it was told when it first starts, whichever test starts it.
RACE_MODULES = ["tests.test_store_contract", "tests.test_sql_store"]


def race_context() -> ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RACE_MODULES)
    return ctx
