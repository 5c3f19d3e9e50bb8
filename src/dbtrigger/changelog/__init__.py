"""A trigger-maintained change log: every insert, update and delete as an event.

See ``docs/changes.md``. ``install``/``uninstall``/``prune`` are what the
``dbtrigger changelog`` commands run; ``drift`` says what a migration on the
table did to an installed log; :class:`ChangeLogSource` polls the log, and
:class:`ChangeLogPruner` deletes what every reader of it has passed.
"""

from __future__ import annotations

from dbtrigger.changelog.ddl import MARKER, log_table_name, uninstall_ddl
from dbtrigger.changelog.drift import Drift
from dbtrigger.changelog.operations import (
    drift,
    install,
    is_installed,
    plan_install,
    plan_uninstall,
    prune,
    uninstall,
)
from dbtrigger.changelog.pruning import ChangeLogPruner
from dbtrigger.changelog.source import ChangeLogSource
from dbtrigger.changelog.triggers import install_ddl

__all__ = [
    "MARKER",
    "ChangeLogPruner",
    "ChangeLogSource",
    "Drift",
    "drift",
    "install",
    "install_ddl",
    "is_installed",
    "log_table_name",
    "plan_install",
    "plan_uninstall",
    "prune",
    "uninstall",
    "uninstall_ddl",
]
