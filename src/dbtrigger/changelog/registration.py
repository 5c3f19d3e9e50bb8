"""A change log poller recording its position in the readers' registry (internal).

:class:`~dbtrigger.changelog.ChangeLogSource` records the position of the poller
it serves in ``dbt_clreaders_<table>`` (:mod:`dbtrigger.changelog.readers`) at
its first fetch and when the runtime acknowledges a durable checkpoint: both in
the tick. The write is bookkeeping for prunes; the tick's events do not need it.

So it never waits long in silence. It first tries waiting at most
:data:`TRY_SECONDS`. Behind another transaction's lock (on SQLite: any other
connection's write transaction, an application's, a ``changelog install``'s, a
snapshot's, which lock the whole file) it says at WARNING what it waits for and
how long at most (``changelog_reader_waiting``), then waits at most
:data:`LOCK_TIMEOUT`; when that runs out it says so too
(``changelog_reader_unregistered``) and the next fetch or checkpoint tries again.
It used to wait up to 10 s in silence, twice in a tick (at the fetch, then at the
checkpoint): a tick of 100 events behind an application's open write on SQLite
took 20 s, and nothing said why.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from dbtrigger._lock_wait import bounded_transaction, lock_holders, lock_timed_out
from dbtrigger.changelog.drift import install_command
from dbtrigger.changelog.readers import (
    has_registry,
    not_recorded,
    readers_table_name,
    record,
    registered,
    say_forgotten,
)
from dbtrigger.errors import DbTriggerError

log = logging.getLogger("dbtrigger.changelog")

#: How often an idle reader refreshes its registry entry (``seen_at``).
EVERY_SECONDS = 300.0
#: How often a reader draining a backlog records its position.
BACKLOG_SECONDS = 2.0
#: The first try's bound, in silence: long enough for an application's ordinary short
#: write on SQLite to end (a busy application would otherwise have every other tick
#: warn), short enough not to hold a tick (MariaDB/MySQL bound in whole seconds: one).
TRY_SECONDS = 0.1
#: How long recording waits for another transaction's lock once it said so.
LOCK_TIMEOUT = 2.0


class Registration:
    """One poller's entry in the registry of one change log, and when it was written."""

    def __init__(self, table: str, schema: str | None) -> None:
        self._table = table
        self._schema = schema
        #: The poller served (``bind_poller``): its name in the registry.
        self.reader: str | None = None
        #: The position last recorded (None: not yet; -1: the log has no registry).
        self.recorded: int | None = None
        self._recorded_at = 0.0
        self._told_lost = False

    def due(self, seq: int, *, first: bool, caught_up: bool) -> bool:
        """Is a write due now? When the position moved: at once when caught up, at most
        every :data:`BACKLOG_SECONDS` while a backlog drains (a recorded position may
        lag, which only keeps rows longer; one write per batch cost SQLite a synced
        commit each). When it did not: every :data:`EVERY_SECONDS` (``seen_at``)."""
        since = time.monotonic() - self._recorded_at
        if self.reader is None or (seq == self.recorded and since < EVERY_SECONDS):
            return False
        return first or self.recorded is None or caught_up or since >= BACKLOG_SECONDS

    def write(self, engine: Engine, seq: int, *, first: bool) -> None:
        """Record ``seq`` (see the module doc). Never raises: a failure is logged at
        WARNING (``changelog_reader_unregistered``), and the next call tries again."""
        reader = self.reader
        if reader is None:
            return
        seconds = TRY_SECONDS
        try:
            try:
                self._write(engine, reader, seq, first=first, seconds=seconds)
            except SQLAlchemyError as exc:
                if not lock_timed_out(exc):
                    raise
                seconds = LOCK_TIMEOUT
                self._say_waiting(engine, reader)
                self._write(engine, reader, seq, first=first, seconds=seconds)
        except IntegrityError:
            return  # another instance of this poller registered it a moment ago: next time
        except (SQLAlchemyError, DbTriggerError) as exc:
            why = not_recorded(engine, self._table, self._schema, seconds, exc)
            log.warning(
                "could not record poller %s's position in the change log's reader registry of "
                "%s (tried again at the next checkpoint): %s",
                reader,
                self._table,
                why,
                extra={"event": "changelog_reader_unregistered", "poller": reader},
            )
            return
        self._recorded_at = time.monotonic()

    def _write(self, engine: Engine, reader: str, seq: int, *, first: bool, seconds: float) -> None:
        with bounded_transaction(engine, seconds) as conn:
            if not has_registry(conn, self._table, self._schema):
                if self.recorded is None:
                    log.warning(
                        "the change log of %s has no reader registry (installed by an older "
                        "dbtrigger): a prune by age cannot see that poller %s has not read "
                        "every row. Upgrade it in place: `%s`",
                        self._table,
                        reader,
                        install_command(self._table, self._schema),
                        extra={"event": "changelog_reader_unregistered", "poller": reader},
                    )
                self.recorded = -1
                return
            if first and not self._told_lost:
                self._tell_lost(conn, reader, seq)
            inserted = record(conn, self._table, self._schema, reader, seq)
        if inserted and self.recorded is not None and self.recorded >= 0:
            say_forgotten(reader, self._table, seq)
        self.recorded = seq

    def _say_waiting(self, engine: Engine, reader: str) -> None:
        registry = readers_table_name(self._table)
        holders = lock_holders(engine, registry, self._schema)
        log.warning(
            "recording poller %s's position in the change log's reader registry of %s waits "
            "for a lock another transaction holds%s; the tick waits with it, %g s at most",
            reader,
            self._table,
            f" ({holders})" if holders else "",
            LOCK_TIMEOUT,
            extra={"event": "changelog_reader_waiting", "poller": reader},
        )

    def _tell_lost(self, conn: Any, reader: str, seq: int) -> None:
        """Log, once per start, the rows an operator pruned before this reader read them."""
        mine = [r for r in registered(conn, self._table, self._schema) or () if r.name == reader]
        self._told_lost = True
        if mine and mine[0].lost_seq is not None and mine[0].lost_seq > seq:
            log.warning(
                "change log rows of %s after sequence %s up to %s were pruned before poller %s "
                "read them (`changelog prune --drop-unread-of %s`): the changes they held were "
                "not delivered; resync what this poller feeds (docs/changes.md, Pruning)",
                self._table,
                seq,
                mine[0].lost_seq,
                reader,
                reader,
                extra={
                    "event": "changelog_rows_lost",
                    "poller": reader,
                    "through": mine[0].lost_seq,
                },
            )


__all__ = ["BACKLOG_SECONDS", "EVERY_SECONDS", "LOCK_TIMEOUT", "TRY_SECONDS", "Registration"]
