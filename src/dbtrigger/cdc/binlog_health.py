"""A BinlogSource's health: settings, privileges and retention, for check, status and metrics.

A binary log is not kept for its readers: the server removes files older than
``binlog_expire_logs_seconds`` (``expire_logs_days`` before MySQL 8 /
MariaDB 10.6) whether or not a poller has read them. A poller that falls
behind by more than that loses changes, so the source measures, at most every
:data:`~dbtrigger.cdc.health.REPORT_SECONDS` while it runs, how much log lies between its position
and the end (``cdc_retained_bytes``, the same gauge a PostgreSQL slot sets)
and warns when its position is in the oldest file the server still keeps (the
next purge removes it). A position whose file is gone already is a
:class:`~dbtrigger.errors.SlotLostError` when the source starts reading.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc import binlog_setup as setup
from dbtrigger.cdc.binlog_context import BinlogSourceParts
from dbtrigger.cdc.binlog_reader import Where
from dbtrigger.cdc.health import ERROR, OK, WARNING, HealthReporter
from dbtrigger.errors import DbTriggerError, SourceDefinitionError
from dbtrigger.sources.base import SourceFinding

if TYPE_CHECKING:
    from dbtrigger.cdc.position import LogPosition
    from dbtrigger.metrics import MetricsCollector

log = logging.getLogger("dbtrigger.cdc")


def resume_file(
    source: BinlogSourceParts, after: LogPosition | None, files: Sequence[tuple[str, int]]
) -> tuple[str | None, int]:
    """(file name or None when it is gone: purged, or the log was reset, offset) where a
    read for ``after`` would start."""
    row = source.control_row
    key = "-" if after is None else after.text
    names = dict(files)
    if row is not None and row.through_after == key and row.through_file in names:
        return row.through_file, row.through_pos or 0
    if after is None:
        if row is None or row.created_file is None:
            return None, 0
        return (row.created_file if row.created_file in names else None), row.created_pos or 0
    where = Where.parse(after.commit)
    for name, _ in files:
        if setup.file_index(name) == where.file_index:
            return name, where.offset
    return None, where.offset


def behind_bytes(files: Sequence[tuple[str, int]], name: str, offset: int) -> int:
    """Bytes of binary log from ``name:offset`` to the end."""
    total = 0
    seen = False
    for file, size in files:
        if file == name:
            seen = True
            total += max(0, size - offset)
        elif seen:
            total += size
    return total


#: The position's log is gone: an error for ``dbtrigger check`` (the worker stops with
#: SlotLostError), never a warning to read past.
LOST = (
    "the binary log file the position needs was purged, or the log was reset (RESET "
    "MASTER, another server): changes are lost; run dbtrigger cdc recreate "
    "MODULE:TRIGGER --snapshot --yes"
)


def retention_notes(
    source: BinlogSourceParts, after: LogPosition | None, files: Sequence[tuple[str, int]]
) -> list[str]:
    """What an operator must know about the log the position needs, loudest first."""
    name, _offset = resume_file(source, after, files)
    if name is None:
        return [LOST]
    out: list[str] = []
    if len(files) > 1 and files[0][0] == name:
        out.append(
            f"the position is in {name}, the oldest binary log the server keeps "
            f"(binlog_expire_logs_seconds={source.facts_expire_text()}); the next purge "
            "removes it and the changes after it: the poller must catch up now"
        )
    return out


class RetentionReporter(HealthReporter[BinlogSourceParts]):
    """Sets ``cdc_slot_lost`` and ``cdc_retained_bytes`` (log behind the position); warns
    about retention once per finding."""

    def __init__(self, source: BinlogSourceParts) -> None:
        super().__init__(source)
        self._warned: set[str] = set()

    def retention_warning(
        self, after: LogPosition | None, files: Sequence[tuple[str, int]]
    ) -> None:
        for note in retention_notes(self.source, after, files):
            if note in self._warned:
                continue
            self._warned.add(note)
            log.warning(
                "binlog reader %s: %s",
                self.source.reader,
                note,
                extra={"event": "cdc_binlog_retention", "poller": self.source.poller},
            )

    def measure(self, metrics: MetricsCollector, after: LogPosition | None) -> None:
        s = self.source
        files = setup.binary_logs(s.connection())
        name, offset = resume_file(s, after, files)
        metrics.set_gauge("cdc_slot_lost", 1.0 if name is None else 0.0)
        if name is not None:
            metrics.set_gauge("cdc_retained_bytes", float(behind_bytes(files, name, offset)))
        self.retention_warning(after, files)


def held_stop(source: BinlogSourceParts, conn: Any) -> str | None:
    """The stop a reader recorded at a watched table moved off its name (renamed away,
    dropped: :mod:`dbtrigger.cdc.binlog_ddl`), or None."""
    try:
        row = control.read_installed(conn, source.control_database, source.reader)
    except DbTriggerError:
        return None
    held = None if row is None else row.schema_break
    return held if control.is_table_gone(held) else None


def self_check(source: BinlogSourceParts) -> list[SourceFinding]:
    """What ``dbtrigger check`` reports for a BinlogSource (never raises for a finding)."""
    findings: list[SourceFinding] = []
    try:
        conn = setup.connect(source.url, database=False)
    except DbTriggerError as exc:
        return [SourceFinding("connection", ERROR, str(exc))]
    try:
        facts = setup.server_facts(conn)
        problems = setup.setting_problems(facts)
        if problems:
            findings.extend(SourceFinding("server", ERROR, p) for p in problems)
        else:
            findings.append(
                SourceFinding(
                    "server",
                    OK,
                    f"{facts.version}: log_bin ON, binlog_format ROW, binlog_row_image FULL",
                )
            )
        if not facts.names_from_log and facts.mariadb:
            findings.append(
                SourceFinding(
                    "column names",
                    WARNING,
                    "binlog_row_metadata is not FULL: column names are read from "
                    "information_schema; a table whose column count differs from the log's "
                    "stops delivery, and so does a change written before an ALTER TABLE "
                    "that changed its table's columns but read by a worker started after "
                    "it, unless the statement's text makes its names certain (ADD COLUMN, "
                    "RENAME COLUMN, MODIFY/CHANGE in place of a column that is not a "
                    "string); otherwise a snapshot of the table is then needed",
                    "SET GLOBAL binlog_row_metadata = 'FULL' (MariaDB 10.5+), and in my.cnf",
                )
            )
        if facts.server_id == source.server_id:
            findings.append(
                SourceFinding(
                    "server_id",
                    ERROR,
                    f"server_id {source.server_id} is the server's own",
                    "pass server_id= with another value",
                )
            )
        held = held_stop(source, conn)
        if held is not None:  # a watched table renamed away or dropped: the worker stopped
            findings.append(SourceFinding("delivery", ERROR, held))
        try:
            files = setup.binary_logs(conn)
            infos = setup.table_infos(conn, source.tables)
        except SourceDefinitionError as exc:  # a watched table that is not there
            if held is None:
                findings.append(SourceFinding("tables", ERROR, str(exc)))
            return findings
        except DbTriggerError as exc:
            if held is None:
                findings.append(SourceFinding("privileges", ERROR, str(exc)))
            return findings
        findings.append(
            SourceFinding(
                "tables",
                OK,
                ", ".join(
                    f"{q} (key {', '.join(i.key_columns) or 'none'})" for q, i in infos.items()
                ),
            )
        )
        if control.exists(conn, source.control_database):
            row = source.read_control(conn)
            if row is None:
                findings.append(
                    SourceFinding("reader", WARNING, f"reader {source.reader} is not installed yet")
                )
            else:
                source.control_row = source.control_row or row
                for note in retention_notes(source, source.acked, files):
                    level = ERROR if note == LOST else WARNING
                    findings.append(SourceFinding("retention", level, note))
        if not facts.expire_seconds:
            findings.append(
                SourceFinding(
                    "retention",
                    OK,
                    "binary logs are kept until purged by hand (binlog_expire_logs_seconds=0)",
                )
            )
    except DbTriggerError as exc:
        findings.append(SourceFinding("server", ERROR, str(exc)))
    finally:
        conn.close()
    return findings


__all__ = [
    "RetentionReporter",
    "behind_bytes",
    "held_stop",
    "resume_file",
    "retention_notes",
    "self_check",
]
