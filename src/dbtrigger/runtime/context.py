"""What a handler learns about the batch it is given."""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass, field

from dbtrigger.cursor import Position


@dataclass(frozen=True)
class BatchContext:
    """Passed as the second argument to handlers that accept two.

    ``fencing_token`` increases with every lease acquisition: a sink that stores
    the highest token it has seen and refuses lower ones cannot be written by a
    stale owner (a "fenced" write). ``lease_lost`` is set when the lease is lost
    while the handler runs (the heartbeat's renewal was refused: another
    instance took over); a long synchronous handler should check
    :attr:`cancelled` and stop early, since its results will be discarded
    anyway. An async handler's task is cancelled for it. The event belongs to
    the tick, so every batch of a tick shares it.

    ``attempt`` counts deliveries of this batch (1 on the first); from
    ``max_attempts`` on, a failure makes it a poison candidate. When a batch is bisected
    to isolate poison rows, the handler receives parts of it with the same
    context.
    """

    poller_name: str
    batch_id: str
    batch_index: int
    fencing_token: int
    owner_id: str
    source_name: str
    checkpoint_before: Position
    checkpoint_after: Position
    tick_started_at: dt.datetime
    attempt: int = 1
    lease_lost: threading.Event = field(default_factory=threading.Event, compare=False)

    @property
    def cancelled(self) -> bool:
        """True once the lease is lost: nothing this batch does will be committed."""
        return self.lease_lost.is_set()
