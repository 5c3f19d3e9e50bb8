"""Wake-up hints for idle workers: a row reaches the handler sooner than one interval.

* :class:`NotifyHint`: PostgreSQL ``LISTEN/NOTIFY``, fed by a statement-level
  trigger that ``dbtrigger wake install`` (or :func:`install`) puts on the table.
* :class:`AdaptivePolling`: shorter idle waits for a while after activity,
  for databases without notifications (MariaDB/MySQL, SQLite).

Give one to a worker: ``dbtrigger run app:orders --wake notify`` or
``Runner(trigger, handler, wake=NotifyHint())``. Off by default; safe to lose.
"""

from dbtrigger.wakeup.ddl import (
    WakePlan,
    default_channel,
    install,
    installed_channel,
    plan_install,
    plan_uninstall,
    uninstall,
)
from dbtrigger.wakeup.hints import AdaptivePolling, NotifyHint, WakeHint, parse_wake

__all__ = [
    "AdaptivePolling",
    "NotifyHint",
    "WakeHint",
    "WakePlan",
    "default_channel",
    "install",
    "installed_channel",
    "parse_wake",
    "plan_install",
    "plan_uninstall",
    "uninstall",
]
