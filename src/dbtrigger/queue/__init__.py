"""Claim-mode queue tables: competing workers, per-row done / retry / dead.

See ``docs/queues.md``. :class:`ClaimSource` names the queue table,
:class:`QueueTrigger` claims batches from it and records each row's outcome;
``dbtrigger queue install|status|retry|prune`` are the operator's side.

Names are imported on first use (like the top-level package), so importing
``dbtrigger.queue`` - or the CLI that registers its commands - loads no
SQLAlchemy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dbtrigger import _lazy

if TYPE_CHECKING:
    from dbtrigger.queue.context import ClaimContext
    from dbtrigger.queue.driver import QueueTickResult
    from dbtrigger.queue.layout import ClaimedRow
    from dbtrigger.queue.operations import QueueCounts
    from dbtrigger.queue.sidecar import SidecarFeeder
    from dbtrigger.queue.source import ClaimSource
    from dbtrigger.queue.trigger import QueueTrigger
    from dbtrigger.state.backoff import Backoff

_LAZY = {
    "Backoff": "dbtrigger.state.backoff",
    "ClaimContext": "dbtrigger.queue.context",
    "ClaimSource": "dbtrigger.queue.source",
    "ClaimedRow": "dbtrigger.queue.layout",
    "QueueCounts": "dbtrigger.queue.operations",
    "QueueTickResult": "dbtrigger.queue.driver",
    "QueueTrigger": "dbtrigger.queue.trigger",
    "SidecarFeeder": "dbtrigger.queue.sidecar",
}


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY)


__all__ = [
    "Backoff",
    "ClaimContext",
    "ClaimSource",
    "ClaimedRow",
    "QueueCounts",
    "QueueTickResult",
    "QueueTrigger",
    "SidecarFeeder",
]
