"""What the parts of a PgLogicalSource use of it, so that they sit below it.

:class:`~dbtrigger.cdc.pg_source.PgLogicalSource` is built from parts: the
poll and stream readers, the snapshot writer, the health reporter and the
admin. Each is given the source and reads its configuration and shared state
through :class:`PgSourceParts`, never through the class itself: the source imports
its parts, no part imports the source.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import psycopg

from dbtrigger.cdc import pg_control as control
from dbtrigger.cdc import pg_setup as setup
from dbtrigger.cdc.assembly import SchemaGuard
from dbtrigger.cdc.log_source import LogSourceParts
from dbtrigger.cdc.pg_reader import Decoder
from dbtrigger.cdc.snapshots import Snapshot
from dbtrigger.errors import SlotLostError


class PgSourceParts(LogSourceParts, Protocol):
    """A PgLogicalSource as its parts see it (see the module docstring)."""

    tables: tuple[setup.TableName, ...]
    control_schema: str
    infos: Mapping[str, setup.TableInfo]

    @property
    def slot(self) -> str: ...

    def connection(self) -> psycopg.Connection[Any]: ...

    @property
    def publication(self) -> str: ...

    mode: str
    failover: bool
    backlog_step: int
    stream_wait: float
    confirmed: int | None

    bound: int | None
    bounded: bool

    def check_not_lost(self, state: setup.SlotState) -> None: ...

    def raise_bound(self, conn: psycopg.Connection[Any], lsn: int) -> None: ...

    def check_identity(self, conn: psycopg.Connection[Any], confirmed: int | None) -> None: ...

    def check_published(self, conn: psycopg.Connection[Any]) -> None: ...

    def set_timeout(self, conn: psycopg.Connection[Any], seconds: float) -> None: ...

    @property
    def standing_timeout(self) -> float: ...

    def lost_slot(self) -> SlotLostError | None: ...

    guard: SchemaGuard[int]

    @property
    def decoder(self) -> Decoder: ...

    def new_control_row(
        self, created: int | None, *, snapshots: bool = True
    ) -> control.ControlRow: ...

    def read_control(
        self, conn: psycopg.Connection[Any], *, lock: bool = False
    ) -> control.ControlRow | None: ...

    def write_control(self, conn: psycopg.Connection[Any], row: control.ControlRow) -> None: ...

    def save_snapshots(self, conn: psycopg.Connection[Any], snapshots: list[Snapshot]) -> None: ...


__all__ = ["PgSourceParts"]
