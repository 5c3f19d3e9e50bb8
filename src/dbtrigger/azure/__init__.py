"""dbtrigger on Azure Functions: the Python v2 programming model's glue, in one package.

``DbBindings`` gives the decorators (``@db.trigger``, ``@db.queue_trigger``,
``@db.output``, ``db.partitioned_trigger``); see ``docs/azure.md``. The
package's rooms: :mod:`~dbtrigger.azure.bindings` (the decorators),
:mod:`~dbtrigger.azure.host` (the signature the host sees),
:mod:`~dbtrigger.azure.record` (what a decorator attached to a function),
:mod:`~dbtrigger.azure.deferred` (options read from app settings at first
use), :mod:`~dbtrigger.azure.schedule` (the timer checked against the lease),
:mod:`~dbtrigger.azure.output`, :mod:`~dbtrigger.azure.queue` and
:mod:`~dbtrigger.azure.partitions` (the other bindings' glue),
:mod:`~dbtrigger.azure.introspect` (a function as the CLI runs it) and
:mod:`~dbtrigger.azure.identity` (the Entra ID engine).
"""

from __future__ import annotations

from dbtrigger.azure.bindings import DbBindings
from dbtrigger.azure.identity import ENTRA_SCOPES, SQL_COPT_SS_ACCESS_TOKEN, entra_id_engine
from dbtrigger.azure.introspect import OfflineTimer, function_handler, function_trigger
from dbtrigger.azure.record import FunctionBinding, binding_of
from dbtrigger.azure.schedule import (
    LeaseScheduleWarning,
    lease_schedule_conflict,
    schedule_interval,
)

__all__ = [
    "ENTRA_SCOPES",
    "SQL_COPT_SS_ACCESS_TOKEN",
    "DbBindings",
    "FunctionBinding",
    "LeaseScheduleWarning",
    "OfflineTimer",
    "binding_of",
    "entra_id_engine",
    "function_handler",
    "function_trigger",
    "lease_schedule_conflict",
    "schedule_interval",
]
