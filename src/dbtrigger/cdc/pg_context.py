"""What the parts of a PgLogicalSource use of it, so that they sit below it.

:class:`~dbtrigger.cdc.pg_source.PgLogicalSource` is built from parts: the
poll and stream readers, the snapshot writer, the health reporter and the
admin. Each is given the source and reads its configuration and shared state
through :class:`PgSourceParts`, never through the class itself: the source imports
its parts, no part imports the source.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Protocol

import psycopg
from sqlalchemy.engine import URL

from dbtrigger.cdc import pg_control as control
from dbtrigger.cdc import pg_setup as setup
from dbtrigger.cdc.assembly import SchemaBreak, SchemaGuard
from dbtrigger.cdc.buffer import TransactionBuffer
from dbtrigger.cdc.pg_reader import Decoder
from dbtrigger.cdc.position import LogPosition
from dbtrigger.cdc.snapshots import ChunkWriter
from dbtrigger.metrics import MetricsCollector


class PgSourceParts(Protocol):
    """A PgLogicalSource as its parts see it (see the module docstring)."""

    tables: tuple[setup.TableName, ...]
    mode: str
    snapshot: str
    control_schema: str
    failover: bool
    poller: str | None
    metrics: MetricsCollector | None
    read_timeout: float
    read_ahead: int
    backlog_step: int
    heartbeat_interval: float
    snapshot_chunk_size: int
    snapshot_lock_timeout: float
    stream_wait: float
    buffer: TransactionBuffer[Any]
    acked: LogPosition | None
    confirmed: int | None
    schema_break: SchemaBreak | None
    infos: Mapping[str, setup.TableInfo]

    @property
    def snapshots(self) -> ChunkWriter[Any, Any, Any]: ...

    @property
    def url(self) -> URL: ...

    @property
    def slot(self) -> str: ...

    @property
    def publication(self) -> str: ...

    @property
    def lock(self) -> threading.RLock: ...

    @property
    def guard(self) -> SchemaGuard[int]: ...

    @property
    def decoder(self) -> Decoder: ...

    def connection(self) -> psycopg.Connection[Any]: ...

    def check_not_lost(self, state: setup.SlotState) -> None: ...

    def truncated(self, table: str, commit: str) -> None: ...

    def new_control_row(
        self, created: int | None, *, snapshots: bool = True
    ) -> control.ControlRow: ...

    def close(self) -> None: ...


__all__ = ["PgSourceParts"]
