"""Pruning what every reader of a change log has passed: the one place that reads their state.

A log row may go once every poller that reads the log has committed past it.
Their checkpoints are in their state documents, so pruning reads other
pollers' state: that is this module's job, and no source's. Two callers:

* ``dbtrigger changelog prune --passed-by NAME... --store ...`` prunes once;
* :class:`ChangeLogPruner`, which ``ChangeLogSource(prune_passed_by=...)``
  builds, prunes now and then as the runtime tells the source that its own
  checkpoint is durable (the ``acknowledge`` hook of
  :class:`~dbtrigger.sources.base.AcknowledgesCheckpoints`): after a commit,
  and on an idle tick. It never runs inside a fetch, and a failed prune is
  logged and tried again later, never raised into the tick.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Sequence

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from dbtrigger import options as opt
from dbtrigger._lock_wait import DEFAULT_STORE_LOCK_TIMEOUT
from dbtrigger.changelog.operations import lowest_checkpoint, prune
from dbtrigger.errors import ConfigurationError, DbTriggerError
from dbtrigger.redaction import redact
from dbtrigger.state import document
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger("dbtrigger.changelog")


def stored_cursors(
    store: CheckpointStore, pollers: Sequence[str]
) -> tuple[list[object], list[str]]:
    """The checkpoint cursor of each of ``pollers`` that has state, and those that have none."""
    cursors: list[object] = []
    missing: list[str] = []
    for name in pollers:
        stored = store.read(name)
        if stored is None:
            missing.append(name)
        else:
            cursors.append(document.loads(stored.data).position.cursor)
    return cursors, missing


#: How long a prune after a commit waits for a lock another transaction holds on the
#: log (the poller's tick waits with it) before it gives up until the next interval.
PRUNE_LOCK_TIMEOUT = DEFAULT_STORE_LOCK_TIMEOUT


class ChangeLogPruner:
    """Deletes, at most every ``every_seconds``, the log rows every named poller passed.

    Args:
        passed_by: every poller that reads the log (their names in ``store``).
        store: where those pollers keep their state.
        every_seconds: the least time between two prunes.
        keep_seconds: how long rows every poller passed are kept anyway (the
            retention that replays and rewinds can count on; 0: none).

    A poller without a checkpoint yet blocks pruning: it still needs every row.
    """

    def __init__(
        self,
        *,
        passed_by: Sequence[str],
        store: CheckpointStore,
        every_seconds: float = 300.0,
        keep_seconds: float = 0.0,
    ) -> None:
        if isinstance(passed_by, str):
            raise ConfigurationError("prune_passed_by must be a list of poller names")
        every_seconds = opt.seconds("prune_every_seconds", every_seconds)
        self.passed_by = tuple(passed_by)
        self.store = store
        self.every_seconds = every_seconds
        #: Rows every reader passed are kept this long (dbt_changed_at), so that
        #: replays and rewinds of that window stay exact (docs/changes.md, Retention).
        self.keep = opt.seconds("prune_keep_seconds", keep_seconds, inclusive=True)
        self._next = 0.0

    def due(self) -> bool:
        """Whether a prune may run now (and, if so, the next one not before the interval)."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.every_seconds
        return True

    def run(self, engine: Engine, table: str, *, schema: str | None, source: str) -> int:
        """Prune now: the rows deleted (0 when a poller has no checkpoint, or on failure).

        A failure (the store or the database) is logged at WARNING as
        ``changelog_prune_failed`` and the next interval tries again.
        """
        try:
            cursors, missing = stored_cursors(self.store, self.passed_by)
            if missing:
                return 0  # a poller that has not started yet still needs every row
            up_to = lowest_checkpoint(cursors)
            if up_to is None:
                return 0
            older = dt.timedelta(seconds=self.keep) if self.keep else None
            deleted = prune(
                engine,
                table,
                schema=schema,
                up_to_seq=up_to,
                older_than=older,
                readers_at=dict(zip(self.passed_by, cursors, strict=True)),  # type: ignore[arg-type]
                lock_timeout_seconds=PRUNE_LOCK_TIMEOUT,
            )
        except (DbTriggerError, SQLAlchemyError) as exc:
            log.warning(
                "pruning the change log of %s failed (retried in %gs): %s",
                table,
                self.every_seconds,
                redact(str(exc)),
                extra={"event": "changelog_prune_failed", "source": source},
            )
            return 0
        if deleted:
            log.info(
                "pruned %d change log row(s) of %s up to sequence %s",
                deleted,
                table,
                up_to,
                extra={"event": "changelog_pruned", "source": source, "rows": deleted},
            )
        return deleted


__all__ = ["ChangeLogPruner", "stored_cursors"]
