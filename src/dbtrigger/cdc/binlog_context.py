"""What the parts of a BinlogSource use of it, so that they sit below it.

:class:`~dbtrigger.cdc.binlog_source.BinlogSource` is built from parts: the
reader of the log (:mod:`dbtrigger.cdc.binlog_poll`), the snapshot writer, the
health reporter and the admin. Each is given the source and reads its
configuration and shared state through :class:`BinlogSourceParts`, never
through the class itself: the source imports its parts, no part imports the
source.
"""

from __future__ import annotations

from typing import Any, Protocol

import pymysql

from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc import binlog_setup as setup
from dbtrigger.cdc.binlog_reader import Assembler
from dbtrigger.cdc.log_source import LogSourceParts
from dbtrigger.cdc.snapshots import Snapshot


class BinlogSourceParts(LogSourceParts, Protocol):
    """A BinlogSource as its parts see it (see the module docstring)."""

    facts: setup.ServerFacts
    infos: dict[str, setup.TableInfo]
    control_row: control.ControlRow | None

    @property
    def tables(self) -> list[setup.TableName]: ...

    @property
    def schemas(self) -> list[str]: ...

    def connection(self) -> pymysql.connections.Connection[Any]: ...

    @property
    def control_database(self) -> str: ...

    def facts_expire_text(self) -> str: ...

    @property
    def reader(self) -> str: ...

    def new_control_row(
        self,
        position: tuple[str, int],
        *,
        snapshots: bool = True,
        mark: str | None = None,
        generation: int | None = None,
    ) -> control.ControlRow: ...

    def read_control(
        self, conn: pymysql.connections.Connection[Any], *, lock: bool = False
    ) -> control.ControlRow | None: ...

    def write_control(
        self, conn: pymysql.connections.Connection[Any], row: control.ControlRow
    ) -> None: ...

    def save_snapshots(
        self, conn: pymysql.connections.Connection[Any], snapshots: list[Snapshot]
    ) -> None: ...

    @property
    def server_id(self) -> int: ...

    @property
    def assembler(self) -> Assembler: ...


__all__ = ["BinlogSourceParts"]
