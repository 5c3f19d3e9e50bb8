"""dbtrigger on Azure Functions: the Python v2 programming model's glue, in one package.

``DbBindings`` gives the decorators (``@db.trigger``, ``@db.queue_trigger``,
``@db.output``, ``db.partitioned_trigger``); see ``docs/azure.md``.
"""

from __future__ import annotations

from dbtrigger.azure.bindings import (
    ENTRA_SCOPES,
    SQL_COPT_SS_ACCESS_TOKEN,
    DbBindings,
    LeaseScheduleWarning,
    OfflineTimer,
    entra_id_engine,
    function_handler,
    function_trigger,
    lease_schedule_conflict,
    schedule_interval,
)

__all__ = [
    "ENTRA_SCOPES",
    "SQL_COPT_SS_ACCESS_TOKEN",
    "DbBindings",
    "LeaseScheduleWarning",
    "OfflineTimer",
    "entra_id_engine",
    "function_handler",
    "function_trigger",
    "lease_schedule_conflict",
    "schedule_interval",
]
