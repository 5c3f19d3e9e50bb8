"""What every visibility guard shares: the configuration base, the per-source
binding, what the source tells a guard and what a fetch reports.

The source adapter only talks to these types; the concrete guards live in
:mod:`.window` (every dialect with a clock) and :mod:`.horizons` (PostgreSQL),
and :func:`~dbtrigger.sources.visibility.choose` picks one for ``auto``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement, Select

from dbtrigger import options as opt
from dbtrigger.cursor import Position

#: The rows one fetch returned, in source order, as column mappings.
Rows = Sequence[Mapping[str, Any]]

#: Column comment that marks a PostgreSQL transaction-id column; ``auto``
#: chooses :class:`SnapshotHorizon` for a cursor column that carries it.
XID_COLUMN_MARKER = "dbtrigger:xid8"

#: The bind parameter a guard's bound value goes to (see :class:`FetchCondition`).
BOUND_PARAMETER = "dbtrigger_guard_bound"

#: ``false``: nothing may be read yet. One object, so the statement built with it is reused.
NOTHING: ColumnElement[bool] = sa.false()


# --- what a fetch reports -----------------------------------------------------


@dataclass(frozen=True)
class FetchInfo:
    """What the guard did on the last fetch, for metrics, logs and ``status``.

    Attributes:
        mode: the guard in force (``snapshot-horizon``, ``transaction-horizon``,
            ``safety-window``, ``none``).
        horizon: the bound the fetch used (a transaction id, a cursor value), or
            None when the bound lives only inside the SQL (safety window).
        held_back: rows exist after the checkpoint that the guard withheld
            because a transaction that may precede them is still open.
        held_back_seconds: for how long progress has been held back (0 if not).
        blocking_pid: the backend whose open transaction holds the horizon.
        blocking_xact_age_seconds: how long that transaction has been open.
        blocking_detail: what holds it, in words (a prepared transaction, an
            InnoDB transaction and its thread, a running statement).
        blocking_trx_id: the blocking transaction's id where the database has
            one to show (MariaDB/MySQL ``trx_id``).
    """

    mode: str
    horizon: Any = None
    held_back: bool = False
    held_back_seconds: float = 0.0
    blocking_pid: int | None = None
    blocking_xact_age_seconds: float | None = None
    blocking_detail: str | None = None
    blocking_trx_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "horizon": None if self.horizon is None else str(self.horizon),
            "held_back": self.held_back,
            "held_back_seconds": round(self.held_back_seconds, 3),
            "blocking_pid": self.blocking_pid,
            "blocking_xact_age_seconds": self.blocking_xact_age_seconds,
            "blocking_detail": self.blocking_detail,
            "blocking_trx_id": self.blocking_trx_id,
        }


@dataclass(frozen=True)
class GuardDescription:
    """Which guard is in force and what a stronger one would need (``dbtrigger check``).

    Attributes:
        mode: the guard in force, with its parameters (``transaction-horizon``,
            ``safety-window(5s)``, ``none``); ``auto`` while undecided.
        strength: ``exact``, ``bounded`` or ``none``.
        guarantee: one sentence, as in ``status``.
        needs: what to change for an exact guard (a privilege, a cursor
            column), or None when the guard in force is already exact.
    """

    mode: str
    strength: str
    guarantee: str
    needs: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class FetchCondition(NamedTuple):
    """What a guard adds to one fetch: ``predicate`` ANDed to the keyset statement,
    executed with ``params`` (values of the predicate's named bind parameters).

    A guard returns the *same* predicate object from fetch to fetch while only
    its values change (a horizon that moved on), with the values in ``params``:
    the source then reuses the statement it built, compiled and (psycopg)
    prepared for it. Building and compiling one costs about as much as reading
    a hundred rows, and re-adding the predicate on every fetch was most of what
    a guarded fetch cost over an unguarded one. A new predicate object is
    simply a new statement.
    """

    predicate: ColumnElement[bool]
    params: Mapping[str, Any] = {}


class BoundPredicates:
    """``column <op> :dbtrigger_guard_bound``, one predicate per kind of bound value.

    A bound's Python type (and, for timestamps, whether it is aware) decides
    how SQLAlchemy binds it, so one predicate is kept per kind; the value
    itself only ever goes to :attr:`FetchCondition.params`.
    """

    def __init__(self, make: Callable[[Any], ColumnElement[bool]]) -> None:
        self._make = make
        self._made: dict[tuple[type, bool], ColumnElement[bool]] = {}

    def __call__(self, value: Any) -> FetchCondition:
        kind = (type(value), getattr(value, "tzinfo", None) is not None)
        predicate = self._made.get(kind)
        if predicate is None:
            predicate = self._made[kind] = self._make(value)
        return FetchCondition(predicate, {BOUND_PARAMETER: value})


# --- what the source tells a guard --------------------------------------------


@dataclass(frozen=True)
class GuardTarget:
    """The parts of a source a guard needs, without importing the source.

    ``cursor`` is the expression the fetch orders by; ``bind`` turns a Python
    value into a literal typed like the cursor, ``bind_bound`` into the named
    parameter :data:`BOUND_PARAMETER` typed like it; ``pending`` is the unguarded
    keyset select strictly after a position (no ORDER BY, no LIMIT);
    ``position_of`` is the position just after a fetched row.
    """

    dialect: str
    source_name: str
    cursor_name: str
    cursor: ColumnElement[Any]
    cursor_type: sa.types.TypeEngine[Any] | None
    cursor_comment: str | None
    columns: Mapping[str, ColumnElement[Any]]
    selectable: sa.FromClause
    base_filter: ColumnElement[bool] | None
    bind: Callable[[Any], ColumnElement[Any]]
    bind_bound: Callable[[Any], ColumnElement[Any]]
    pending: Callable[[Position], Select[Any]]
    position_of: Callable[[Mapping[str, Any]], Position]
    table_mode: bool

    def over_rows(self, *columns: ColumnElement[Any]) -> Select[Any]:
        """``SELECT columns`` over the source's rows: its base filter applied, no
        keyset bound (a guard's probe of the highest cursor, say)."""
        stmt = sa.select(*columns).select_from(self.selectable)
        return stmt if self.base_filter is None else stmt.where(self.base_filter)


class ActiveGuard:
    """A guard bound to one source: per-source state (probes, held-back clock).

    The source calls :meth:`before_fetch` (which may run statements of its own
    and ends the transaction it used) and adds the returned condition to the
    fetch statement, then calls :meth:`after_fetch` with the rows it read.
    """

    mode = "none"

    #: True when the guard's statements and the row read are each correct as a
    #: transaction of their own, so that on PostgreSQL the fetch may run in
    #: autocommit (no ``BEGIN`` and ``ROLLBACK`` round trips around the read).
    #: What every guard needs - the row read's snapshot taken after the guard's
    #: own reads - holds all the more when each statement is its own transaction.
    autocommit_reads = True

    def __init__(self, guard: VisibilityGuard, target: GuardTarget) -> None:
        self.guard = guard
        self.target = target
        self.last_info = FetchInfo(mode=self.mode)

    @property
    def guarantee(self) -> str:
        return self.guard.guarantee(self.target.dialect)

    def describe_guard(self) -> GuardDescription:
        """Which guard is in force, how strong it is and what a stronger one needs."""
        dialect = self.target.dialect
        return GuardDescription(
            mode=self.guard.label(),
            strength=self.guard.strength(dialect),
            guarantee=self.guarantee,
            needs=self.guard.needs(dialect),
        )

    def before_fetch(self, conn: Connection, after: Position) -> FetchCondition | None:
        del conn, after
        return None

    def after_fetch(self, conn: Connection, after: Position, rows: Rows, limit: int) -> FetchInfo:
        del conn, after, rows, limit
        return self.last_info


def _check_seconds(name: str, value: float) -> None:
    opt.seconds(name, value, inclusive=True)


# --- the guards ---------------------------------------------------------------


class VisibilityGuard(abc.ABC):
    """Base of the guard configurations. Subclasses are immutable."""

    mode = "none"

    @abc.abstractmethod
    def guarantee(self, dialect: str) -> str:
        """One sentence: what this guard promises on ``dialect``."""

    def label(self) -> str:
        """The mode with its parameters, for logs and ``status``."""
        return self.mode

    def strength(self, dialect: str) -> str:
        """``exact``, ``bounded`` or ``none`` on ``dialect``."""
        del dialect
        return "exact"

    def needs(self, dialect: str) -> str | None:
        """What would make the guard exact on ``dialect`` (None: it is)."""
        del dialect
        return None

    @abc.abstractmethod
    def activate(self, target: GuardTarget) -> ActiveGuard:
        """Bind to a source (validating that the guard fits it)."""


@dataclass(frozen=True)
class NoGuard(VisibilityGuard):
    """No protection: rows of a transaction that commits after a later one can be skipped.

    ``reason`` says why (an explicit opt-out, or why ``auto`` found no guard).
    """

    reason: str = "switched off explicitly"
    mode = "none"

    def guarantee(self, dialect: str) -> str:
        return f"none ({self.reason}): a transaction that commits late can be skipped"

    def strength(self, dialect: str) -> str:
        del dialect
        return "none"

    def needs(self, dialect: str) -> str | None:
        return _exact_needs(dialect)

    def activate(self, target: GuardTarget) -> ActiveGuard:
        return ActiveGuard(self, target)


def _exact_needs(dialect: str) -> str | None:
    """What an exact guard needs on ``dialect`` (see docs/visibility.md)."""
    if dialect == "postgresql":
        return (
            "visibility='auto' (the default): the transaction-id cursor "
            "(install_visibility_trigger) needs nothing, the transaction horizon needs "
            "pg_read_all_stats"
        )
    if dialect in ("mysql", "mariadb"):
        return (
            "GRANT PROCESS ON *.* TO the polling account and visibility='auto' (the "
            "transaction horizon), with a CURRENT_TIMESTAMP or AUTO_INCREMENT cursor"
        )
    if dialect == "sqlite":
        return "values assigned inside the write transaction (rowid, CURRENT_TIMESTAMP)"
    return "no exact guard exists for this dialect; see docs/visibility.md"
