"""Where a queue's claim state lives: the strategy a ``ClaimSource`` builds once.

Claiming is the same statements whatever the layout (:mod:`dbtrigger.queue.statements`);
what differs is which table they run on and how a claimed row becomes a
:class:`ClaimedRow`:

* :class:`ColumnsLayout` (``mode="columns"``): the claim columns live on the
  user's table, and a claimed row *is* the user's row;
* :class:`~dbtrigger.queue.sidecar_table.SidecarLayout` (``mode="sidecar"``): a claims
  table beside an untouched user table holds them, and the user rows are read
  by key once claimed.

The source chooses one when it is built and asks it, at its first connection,
for the :class:`~dbtrigger.queue.statements.ClaimTable` (after checking the
table it needs), and after every claim for the rows; it never asks which
layout it has.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dbtrigger.errors import ConfigurationError
from dbtrigger.metrics import SafeMetrics
from dbtrigger.queue.ddl import install_columns
from dbtrigger.queue.schema import (
    ATTEMPTS,
    CLAIM_COLUMNS,
    PREFIX,
    PRIORITY,
    VISIBLE_AT,
    DialectTime,
    check_claim_columns,
)
from dbtrigger.queue.statements import ClaimBatch, ClaimTable, Key
from dbtrigger.runtime.telemetry import Telemetry

log = logging.getLogger("dbtrigger.queue")


@dataclass(frozen=True)
class ClaimedRow:
    """One claimed row: its key, its values (without claim columns) and its attempt number."""

    key: Key
    pk: Mapping[str, Any]
    values: Mapping[str, Any] | None
    attempt: int
    cursor: Any = None
    #: Claimed alone because its previous claim expired holding only it
    #: (:mod:`dbtrigger.queue.pick`): with its attempts used up it goes dead.
    isolated: bool = False


@dataclass(frozen=True)
class Claim:
    """One claim's rows; ``more``: claim again at once (the pick was full or rows
    were left in it); ``bisected``: ``(rows of an expired claim, rows taken)``."""

    rows: list[ClaimedRow]
    more: bool = False
    bisected: tuple[int, int] | None = None


@dataclass(frozen=True)
class QueueTable:
    """What a layout is told at the source's first connection: the checked user table
    and what the queue's configuration says about it."""

    name: str  # the source's name, for messages and telemetry
    user: sa.Table
    pk_columns: tuple[str, ...]
    time: DialectTime
    filter: sa.ColumnElement[bool] | None  # the where= filter, bound
    install_hint: str  # the ``dbtrigger queue install`` command for this queue


class ClaimLayout(Protocol):
    """A place for the claim columns (see the module docstring)."""

    #: ``columns`` or ``sidecar``: the ``mode=`` that chose this layout.
    mode: str
    #: The claims table's name, or None when the claim state lives on the rows.
    claims_table: str | None

    def target(self, conn: Connection, queue: QueueTable) -> ClaimTable:
        """The claim statements, after checking the table they run on."""
        ...

    def install(
        self, conn: Connection, user: sa.Table, *, existing: str, priority: bool
    ) -> list[str]:
        """The DDL that gives the (reflected) user table's queue its claim state (none
        when it has it): what ``dbtrigger queue install`` prints and runs."""
        ...

    def rows(self, conn: Connection, batch: ClaimBatch, queue: QueueTable) -> list[ClaimedRow]:
        """The claimed rows of ``batch`` as the handler sees them."""
        ...

    def match_user_keys(
        self, table: ClaimTable, pks: Sequence[Mapping[str, Any]], pk_columns: Sequence[str]
    ) -> sa.ColumnElement[bool]:
        """The claim rows of the user rows with these keys (every version, in sidecar mode)."""
        ...

    def user_key_columns(self, table: ClaimTable) -> list[sa.ColumnElement[Any]]:
        """The claim table's columns that say which user row a claim row is for."""
        ...

    def user_pk(self, values: Sequence[Any], pk_columns: Sequence[str]) -> dict[str, Any]:
        """The user key from the values of :meth:`user_key_columns`."""
        ...


class ColumnsLayout:
    """The claim columns on the user's table (``mode="columns"``)."""

    mode = "columns"
    claims_table: str | None = None

    def target(self, conn: Connection, queue: QueueTable) -> ClaimTable:
        user = queue.user
        missing = [c for c in CLAIM_COLUMNS if c not in user.c]
        if missing:
            raise ConfigurationError(
                f"{user.name} has no claim column(s) {', '.join(missing)}: install them with\n"
                f"  {queue.install_hint} --yes\n"
                "(without --yes it prints the DDL it would run)",
                missing_columns=missing,
            )
        check_claim_columns(user, queue.time, conn.dialect)
        lead = [PRIORITY, VISIBLE_AT] if PRIORITY in user.c else [VISIBLE_AT]
        if not any([c.name for c in i.columns][: len(lead)] == lead for i in user.indexes):
            Telemetry(queue.name, SafeMetrics(None, queue.name), logger=log).emit(
                "queue_index_missing",
                "queue %s has no index on (%s): every claim scans the table; "
                "`dbtrigger queue install` creates it",
                queue.name,
                ", ".join(lead),
                source=queue.name,
            )
        return ClaimTable(user, queue.pk_columns, queue.time, queue.filter)

    def install(
        self, conn: Connection, user: sa.Table, *, existing: str, priority: bool
    ) -> list[str]:
        return install_columns(conn, user, existing=existing, priority=priority)

    def match_user_keys(
        self, table: ClaimTable, pks: Sequence[Mapping[str, Any]], pk_columns: Sequence[str]
    ) -> sa.ColumnElement[bool]:
        return table.key_in([tuple(pk[c] for c in pk_columns) for pk in pks])

    def user_key_columns(self, table: ClaimTable) -> list[sa.ColumnElement[Any]]:
        return list(table.key_columns)

    def user_pk(self, values: Sequence[Any], pk_columns: Sequence[str]) -> dict[str, Any]:
        return dict(zip(pk_columns, values, strict=True))

    def rows(self, conn: Connection, batch: ClaimBatch, queue: QueueTable) -> list[ClaimedRow]:
        del conn  # the claim returned the rows themselves
        rows = batch.rows
        if not rows:
            return []
        pk_columns = queue.pk_columns
        names = [k for k in rows[0] if not k.startswith(PREFIX)]  # the user's columns
        out = []
        for row in rows:
            key = tuple([row[k] for k in pk_columns])
            out.append(
                ClaimedRow(
                    key=key,
                    pk=dict(zip(pk_columns, key, strict=True)),
                    values={k: row[k] for k in names},
                    attempt=int(row[ATTEMPTS]),
                    isolated=batch.isolated,
                )
            )
        return out


__all__ = ["Claim", "ClaimLayout", "ClaimedRow", "ColumnsLayout", "QueueTable"]
