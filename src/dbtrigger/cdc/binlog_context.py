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
from sqlalchemy.engine import URL

from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc import binlog_setup as setup
from dbtrigger.cdc.assembly import SchemaBreak
from dbtrigger.cdc.binlog_reader import Assembler
from dbtrigger.cdc.buffer import TransactionBuffer
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cdc.snapshots import ChunkWriter
from dbtrigger.metrics import MetricsCollector


class BinlogSourceParts(Protocol):
    """A BinlogSource as its parts see it (see the module docstring)."""

    snapshot: str
    poller: str | None
    metrics: MetricsCollector | None
    read_timeout: float
    read_ahead: int
    heartbeat_interval: float
    snapshot_chunk_size: int
    snapshot_lock_timeout: float
    buffer: TransactionBuffer[Any]
    acked: LogPosition | None
    schema_break: SchemaBreak | None
    facts: setup.ServerFacts
    infos: dict[str, setup.TableInfo]
    control_row: control.ControlRow | None

    @property
    def snapshots(self) -> ChunkWriter[Any, Any, Any]: ...

    @property
    def url(self) -> URL: ...

    @property
    def tables(self) -> list[setup.TableName]: ...

    @property
    def schemas(self) -> list[str]: ...

    @property
    def control_database(self) -> str: ...

    @property
    def reader(self) -> str: ...

    @property
    def server_id(self) -> int: ...

    @property
    def assembler(self) -> Assembler: ...

    def connection(self) -> pymysql.connections.Connection[Any]: ...

    def facts_expire_text(self) -> str: ...

    def new_control_row(
        self, position: tuple[str, int], *, snapshots: bool = True
    ) -> control.ControlRow: ...

    def close(self) -> None: ...


__all__ = ["BinlogSourceParts"]
