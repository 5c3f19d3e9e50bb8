"""Visibility guards: never checkpoint past a row that is not committed yet.

Cursor polling assumes rows become visible in cursor order. They do not: a
writer takes its cursor value (``now()``, a sequence number, a transaction id)
when it writes and the row becomes visible when it *commits*. A transaction that
takes a small value early and commits late appears behind a checkpoint that has
already moved past it, and a plain keyset poller never looks back: the row is
lost. A guard adds one condition to the fetch so that the poller only consumes
the part of the cursor order that can no longer change.

Guards (configuration objects, immutable, shareable):

* :class:`SnapshotHorizon` - PostgreSQL, exact. The cursor is a transaction-id
  column stamped by a trigger (:func:`install_visibility_trigger`); the fetch
  only returns rows whose id is below ``pg_snapshot_xmin(pg_current_snapshot())``
  computed in the same statement, i.e. rows of transactions that ended before
  every transaction still running began. Works for any table whatever its own
  keys; needs no privilege.
* :class:`TransactionHorizon` - PostgreSQL, exact for cursor values the
  database assigns inside the writing transaction (``now()``,
  ``clock_timestamp()``, a sequence without a per-session cache). Probes the
  highest visible cursor, then waits until every transaction that was open at
  the probe has ended (``pg_stat_activity``) before consuming up to it. Needs to
  see every session of the database (``pg_read_all_stats``).
* :class:`MariaDbHorizon` - MariaDB/MySQL, exact for ``CURRENT_TIMESTAMP`` and
  ``AUTO_INCREMENT`` cursors: consumes only values no open writing transaction
  or running statement can still commit (``INNODB_TRX`` and ``PROCESSLIST``,
  the PROCESS privilege). ``auto`` falls back to the safety window without it.
* :class:`SafetyWindow` - every dialect with a clock (MariaDB/MySQL, SQLite,
  SQL Server, PostgreSQL on request): only rows whose timestamp is older than
  the database's own clock minus N seconds, the bound computed in the fetch
  statement. Bounded: a writer that commits more than N seconds after taking
  its timestamp can still be skipped.
* :class:`NoGuard` - explicit opt-out.

``"auto"`` (the default of :class:`~dbtrigger.sources.sqlalchemy.SqlAlchemySource`)
picks the strongest guard the dialect and cursor support; see :func:`choose`
and ``docs/visibility.md`` for the table.

Why the PostgreSQL transaction id has to *be* the cursor: filtering a
``BIGSERIAL`` cursor by ``xid < xmin`` is not enough. Transaction 101 takes
id 5 and stays open; transaction 100 inserts id 10 and commits. The horizon is
101, so id 10 (xid 100) is consumed and checkpointed; when 101 commits, id 5 is
behind the checkpoint. Sequence order and transaction order are unrelated, so
the order the poller walks must be the transaction order itself.
"""

from __future__ import annotations

from dbtrigger.sources.visibility.base import (
    XID_COLUMN_MARKER,
    ActiveGuard,
    FetchCondition,
    FetchInfo,
    GuardDescription,
    GuardTarget,
    NoGuard,
    VisibilityGuard,
)
from dbtrigger.sources.visibility.choice import choose, is_timestamp_type, parse_visibility
from dbtrigger.sources.visibility.held_back import DEFAULT_WARN_AFTER_SECONDS
from dbtrigger.sources.visibility.horizons import SnapshotHorizon, TransactionHorizon
from dbtrigger.sources.visibility.mariadb import (
    MariaDbHorizon,
    can_read_transactions,
    is_auto_increment,
)
from dbtrigger.sources.visibility.window import (
    DEFAULT_WINDOW_SECONDS,
    WINDOW_DIALECTS,
    SafetyWindow,
    window_predicate,
)
from dbtrigger.sources.visibility.xid_trigger import (
    install_visibility_trigger,
    visibility_trigger_ddl,
)

__all__ = [
    "DEFAULT_WARN_AFTER_SECONDS",
    "DEFAULT_WINDOW_SECONDS",
    "WINDOW_DIALECTS",
    "XID_COLUMN_MARKER",
    "ActiveGuard",
    "FetchCondition",
    "FetchInfo",
    "GuardDescription",
    "GuardTarget",
    "MariaDbHorizon",
    "NoGuard",
    "SafetyWindow",
    "SnapshotHorizon",
    "TransactionHorizon",
    "VisibilityGuard",
    "can_read_transactions",
    "choose",
    "install_visibility_trigger",
    "is_auto_increment",
    "is_timestamp_type",
    "parse_visibility",
    "visibility_trigger_ddl",
    "window_predicate",
]
