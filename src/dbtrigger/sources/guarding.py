"""Which visibility guard protects a keyset source, decided once and wired to its SQL.

``visibility="auto"`` picks the strongest guard the dialect and the cursor
column support (:func:`~dbtrigger.sources.visibility.choose`). The choice
needs the cursor's declared type, and in query mode (off PostgreSQL) one row
to look at, so it is made at the first fetch that can make it; until then a
fetch returns nothing rather than read unprotected. Once made it is logged
(``visibility_mode``, WARNING when ``auto`` found nothing better than no guard
off SQLite) and kept for the source's life.

The guard sees the source through a :class:`~dbtrigger.sources.visibility.GuardTarget`
built here from the source's :class:`~dbtrigger.sources.keyset.Keyset`, so a
guard adds conditions to the same typed, filtered statements the fetch runs.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.engine import Connection, Engine

from dbtrigger.sources.keyset import Keyset
from dbtrigger.sources.visibility import (
    ActiveGuard,
    GuardTarget,
    NoGuard,
    VisibilityGuard,
    choose,
    is_auto_increment,
)
from dbtrigger.sources.visibility.base import BOUND_PARAMETER
from dbtrigger.sources.visibility.privileges import PrivilegeGap, privilege_gap

log = logging.getLogger("dbtrigger.sources")


class Guarding:
    """The visibility guard of one source: as requested, as planned, as in force."""

    def __init__(self, request: str | VisibilityGuard) -> None:
        self.request = request
        #: The guard bound to the source (None until decided).
        self.active: ActiveGuard | None = None
        #: The keyset ``active`` adds its conditions to (a new one after the
        #: table's columns changed: the guard is bound to it again, as at a restart).
        self._bound: Keyset | None = None
        self._lock = threading.Lock()
        self._autocommit: Engine | None = None
        #: What the guard in force lacks for a missing privilege (set when decided).
        self.gap: PrivilegeGap | None = None
        #: The choices already logged, shared with the source's twins
        #: (:meth:`SqlAlchemySource.derive`): a partitioned poller decides once per
        #: partition, and says it once; the repeats are DEBUG.
        self.announced: set[tuple[str, str, str | None]] = set()

    @property
    def requested(self) -> str:
        """The ``visibility=`` setting: ``auto`` or the configured guard's label."""
        request = self.request
        return request if isinstance(request, str) else request.label()

    @property
    def mode(self) -> str:
        """The guard in force; ``auto`` while undecided."""
        return self.active.guard.label() if self.active is not None else self.requested

    def guarantee(self, dialect: str) -> str | None:
        """What the guard in force promises (None while ``auto`` is undecided)."""
        if self.active is not None:
            return self.active.guarantee
        request = self.request
        return None if isinstance(request, str) else request.guarantee(dialect)

    def planned(self, keyset: Keyset | None, dialect: str) -> VisibilityGuard | None:
        """The guard in force, or the one ``auto`` will choose (``keyset``: after reflection).

        None in query mode off PostgreSQL until a row shows the cursor's type.
        """
        if self.active is not None:
            return self.active.guard
        if isinstance(self.request, VisibilityGuard):
            return self.request
        shape = keyset.shape if keyset is not None else None
        cursor_type = shape.cursor_type if shape is not None else None
        if cursor_type is None and dialect != "postgresql":
            return None
        return choose(
            dialect,
            cursor_type=cursor_type,
            cursor_comment=shape.cursor_comment if shape is not None else None,
            sample_is_timestamp=None,
        )

    def activate(self, conn: Connection, keyset: Keyset, *, source: str) -> ActiveGuard | None:
        """The guard bound to the source; None while ``auto`` cannot decide yet."""
        active = self.active
        if active is not None:
            if self._bound is keyset:
                return active
            rebound = active.guard.activate(target(keyset, source))
            with self._lock:
                self.active, self._bound = rebound, keyset
            return rebound
        request, shape, dialect = self.request, keyset.shape, keyset.dialect
        if isinstance(request, VisibilityGuard):
            guard = request
        else:
            sample = None
            if shape.cursor_type is None and dialect != "postgresql":
                row = conn.execute(keyset.timestamp_probe()).first()
                conn.rollback()
                if row is None:
                    return None  # no row has a cursor yet; decide when one does
                sample = shape.sample_says_timestamp(row[0])
            guard = choose(
                dialect,
                cursor_type=shape.cursor_type,
                cursor_comment=shape.cursor_comment,
                sample_is_timestamp=sample,
                conn=conn,  # MariaDB/MySQL: may the account read INNODB_TRX?
                auto_increment=is_auto_increment(target(keyset, source)),
            )
        active = guard.activate(target(keyset, source))
        with self._lock:
            if self.active is None:
                self.active, self._bound = active, keyset
        # A guard that settled for less for want of a privilege says so once, with
        # the GRANT for this very account (see visibility/privileges.py).
        self.gap = privilege_gap(conn, dialect, guard)
        unprotected = isinstance(guard, NoGuard) and request == "auto"
        warn = (unprotected and dialect != "sqlite") or self.gap is not None
        fix = f"; {self.gap.message}. Fix: {self.gap.grant}" if self.gap is not None else ""
        said = (source, guard.label(), self.gap.grant if self.gap is not None else None)
        with self._lock:
            repeat = said in self.announced
            self.announced.add(said)
        level = logging.DEBUG if repeat else (logging.WARNING if warn else logging.INFO)
        log.log(
            level,
            "%s: visibility %s (%s): %s%s",
            source,
            guard.label(),
            "auto" if request == "auto" else "configured",
            active.guarantee,
            fix,
            extra={
                "event": "visibility_mode",
                "source": source,
                "mode": guard.label(),
                "requested": self.requested,
                "guarantee": active.guarantee,
                **({"grant": self.gap.grant} if self.gap is not None else {}),
            },
        )
        return self.active

    def fetch_engine(self, engine: Engine) -> Engine:
        """The engine for fetches: on PostgreSQL in autocommit once the guard is
        known not to need a transaction (every statement its own snapshot, taken
        when it starts: after the guard's own reads)."""
        guard = self.active
        if guard is None or not guard.autocommit_reads or engine.dialect.name != "postgresql":
            return engine
        if self._autocommit is None:
            self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        return self._autocommit


def target(keyset: Keyset, source: str) -> GuardTarget:
    """What a guard may know of, and add to, the source's statements."""
    shape, spec = keyset.shape, keyset.spec
    assert shape.selectable is not None  # noqa: S101 - the shape is resolved first
    cursor = spec.cursor_column
    return GuardTarget(
        dialect=keyset.dialect,
        source_name=source,
        cursor_name=cursor,
        cursor=keyset.cursor,
        cursor_type=shape.cursor_type,
        cursor_comment=shape.cursor_comment,
        columns=dict(shape.columns),
        selectable=shape.selectable,
        base_filter=keyset.base_filter(),
        bind=lambda value: shape.typed(cursor, value),
        bind_bound=lambda value: shape.typed(cursor, value, param=BOUND_PARAMETER),
        pending=keyset.pending,
        position_of=shape.position_of,
        table_mode=spec.table_mode,
    )


__all__ = ["Guarding", "target"]
