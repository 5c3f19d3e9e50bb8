"""What ``dbtrigger cdc`` does for a BinlogSource, behind the database-neutral admin protocol.

A binlog has no server object to create (no slot, no publication): ``install``
creates the control tables and the reader's row, which records where the
reader starts (the server's binlog position now) and queues the initial
snapshot. ``recreate`` after a purged position moves that start to now (with
``--snapshot`` the tables are read again); a poller whose checkpoint is older
than the new start goes on from there, never silently: only this command
moves it. ``status`` shows the settings, the reader, the binlog files the
server keeps and how far behind the last recorded position is.
"""

from __future__ import annotations

import time
from typing import Any

from dbtrigger.cdc import binlog_control as control
from dbtrigger.cdc import binlog_setup as setup
from dbtrigger.cdc.admin import Plan, SourceAdmin
from dbtrigger.cdc.binlog_context import BinlogSourceParts
from dbtrigger.cdc.binlog_health import behind_bytes
from dbtrigger.cdc.binlog_poll import file_mark, mark_text
from dbtrigger.cdc.binlog_setup import current_position
from dbtrigger.cdc.binlog_snapshot import log_position
from dbtrigger.cdc.snapshots import add_request, carry_over, watched
from dbtrigger.errors import ConfigurationError, DbTriggerError, SourceDefinitionError


class BinlogAdmin(SourceAdmin[BinlogSourceParts]):
    """The admin protocol for a BinlogSource (see the module docstring)."""

    def plan(self, *, full_images: bool = False) -> Plan:
        """What :meth:`install` would run, and what the operator should know first."""
        source = self.source
        out = Plan()
        with setup.connect(source.url, database=False) as conn:
            facts = setup.server_facts(conn)
            out.notes.extend(f"BLOCKER: {p}" for p in setup.setting_problems(facts))
            try:
                files = setup.binary_logs(conn)
                setup.table_infos(conn, source.tables)
            except Exception as exc:  # noqa: BLE001 - a dry run reports, never raises
                out.notes.append(f"BLOCKER: {exc}")
                files = []
            upgrade = None
            if not control.exists(conn, source.control_database):
                out.statements.extend(control.create_sql(source.control_database))
            elif (upgrade := control.upgrade_sql(conn, source.control_database)) is not None:
                out.statements.append(upgrade)  # a control table of an earlier version
            if upgrade is not None:
                out.notes.append("the control table gains columns; the readers' rows are kept")
            elif control.read_installed(conn, source.control_database, source.reader):
                out.notes.append(f"reader {source.reader} is installed already")
            else:
                where = current_position(conn, files) if facts.log_bin else ("?", 0)
                out.statements.append(
                    f"-- record reader {source.reader} (server_id {source.server_id}) at "
                    f"{where[0]}:{where[1]}"
                    + (", snapshot of each table queued" if source.snapshot == "initial" else "")
                )
            out.notes.append(
                f"the reader connects as a replica with server_id {source.server_id}: no other "
                "replica or reader of this server may use it (pass server_id= to choose)"
            )
            if not facts.expire_seconds:
                out.notes.append(
                    "binlog_expire_logs_seconds is 0: the server keeps binary logs until they are "
                    "purged by hand (disk grows); set a retention longer than the longest time a "
                    "poller may be stopped, e.g. SET GLOBAL binlog_expire_logs_seconds = 604800"
                )
        return out

    def install(self, *, full_images: bool = False) -> list[str]:
        """Create the control tables and the reader's row; what was done."""
        source = self.source
        done: list[str] = []
        with setup.connect(source.url, database=False) as conn:
            facts = setup.server_facts(conn)
            setup.check_server(facts)
            files = setup.binary_logs(conn)
            source.infos = setup.table_infos(conn, source.tables)
            if control.ensure(conn, source.control_database):
                done.append(
                    f"created {source.control_database}.{control.TABLE} and {control.CHUNKS}"
                )
            if source.read_control(conn) is None:
                start = current_position(conn, files)
                row = source.new_control_row(
                    start,
                    mark=file_mark(source, start[0]),
                    generation=control.next_generation(None, time.time()),
                )
                row.created_gtid = control.gtid_at(conn, *start)
                source.write_control(conn, row)
                done.append(
                    f"recorded reader {source.reader} at {row.created_file}:{row.created_pos}"
                    + (
                        f"; snapshot of {len(row.snapshots)} table(s) queued"
                        if row.snapshots
                        else ""
                    )
                )
        source.close()
        return done

    def status(self) -> dict[str, Any]:
        """Everything ``dbtrigger cdc status`` shows, as JSON-able data."""
        source = self.source
        with setup.connect(source.url, database=False) as conn:
            facts = setup.server_facts(conn)
            problems = setup.setting_problems(facts)
            row = control.read_installed(conn, source.control_database, source.reader)
            files = setup.binary_logs(conn)  # after the row: a position in it is within them
            try:
                infos = setup.table_infos(conn, source.tables)
            except SourceDefinitionError:
                if row is None or not control.is_table_gone(row.schema_break):
                    raise
                infos = {}  # renamed away or dropped: the recorded stop says so below
            found: str | None = control.UNKNOWN  # the GTID state there (MariaDB)
            if row is not None and facts.mariadb:
                at = row.last_recorded()
                if at.file in dict(files):
                    found = control.gtid_at(conn, str(at.file), at.pos)
        warnings = list(problems)
        position: dict[str, Any] | None = None
        if row is None:
            warnings.append(
                "the reader is not installed (created at the first read, or by cdc install)"
            )
        else:
            recorded = row.last_recorded()
            name, offset = (
                (recorded.file, recorded.pos) if recorded.file in dict(files) else (None, 0)
            )
            other = None if name is None else other_log(source, row, files, name, offset)
            gtid = recorded.gtid
            if other is None and name is not None and not control.same_gtid(gtid, found):
                other = (
                    f"the log at {name}:{offset} holds GTID {found or '(no event boundary)'}, "
                    f"not {gtid or '(none)'} as when the position was recorded"
                )
            position = {
                "created": f"{row.created_file}:{row.created_pos}",
                "generation": row.generation,
                "read_through": None
                if row.through_file is None
                else f"{row.through_file}:{row.through_pos}",
                "checkpoint_at_read_through": row.through_after,
                "behind_bytes": None if name is None else behind_bytes(files, name, offset),
            }
            if other is not None:
                position["behind_bytes"] = None
                warnings.append(
                    f"{other}: the log was reset (RESET MASTER) or this is another server, and "
                    "the changes since that position are lost; run dbtrigger cdc recreate "
                    "MODULE:TRIGGER --snapshot --yes (a checkpoint of the old log is then "
                    "passed over)"
                )
            elif name is None:
                warnings.append(
                    "the binary log file of the last recorded position was purged: changes are "
                    "lost; run dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes"
                )
            elif len(files) > 1 and files[0][0] == name:
                warnings.append(
                    f"the last recorded position is in {name}, the oldest binary log the server "
                    "keeps: the next purge removes it; the poller must catch up now"
                )
            if control.is_table_gone(row.schema_break):
                warnings.append(f"delivery is held: {row.schema_break}")
            elif row.schema_break:
                warnings.append(
                    f"delivery is held at a column type change: {row.schema_break}; accept it "
                    "with dbtrigger cdc accept-schema MODULE:TRIGGER --yes"
                )
        lines: list[tuple[str, Any]] = [
            ("reader", f"{source.reader} (server_id {source.server_id})"),
            ("server", f"{facts.version}, server_id {facts.server_id}"),
            (
                "binlog",
                f"format {facts.binlog_format}, row image {facts.binlog_row_image}, row metadata "
                f"{facts.binlog_row_metadata or '(none)'}, {len(files)} file(s) "
                f"{files[0][0] if files else ''}..{files[-1][0] if files else ''}, retention "
                f"{source.facts_expire_text() if facts.expire_seconds else '0 (until purged)'}",
            ),
        ]
        if position is not None:
            lines.append(("created", position["created"]))
            behind = position["behind_bytes"]
            lines.append(
                (
                    "position",
                    f"read through {position['read_through'] or '(not recorded yet)'}"
                    + ("" if behind is None else f"; {behind / 2**20:.1f} MB of log after it"),
                )
            )
        for q, info in infos.items():
            lines.append(("table", f"{q}: key ({', '.join(info.key_columns) or 'none'})"))
        return {
            "kind": "binlog",
            "reader": source.reader,
            "server_id": source.server_id,
            "server_version": facts.version,
            "binlog_format": facts.binlog_format,
            "binlog_row_image": facts.binlog_row_image,
            "binlog_row_metadata": facts.binlog_row_metadata,
            "expire_seconds": facts.expire_seconds,
            "binary_logs": [{"name": n, "size": s} for n, s in files],
            "position": position,
            "snapshots": [s.to_json() for s in row.snapshots] if row is not None else [],
            "tables": {q: {"key": list(i.key_columns)} for q, i in infos.items()},
            "lines": [[k, v] for k, v in lines],
            "warnings": warnings,
            "healthy": not problems
            and position is not None
            and position["behind_bytes"] is not None
            and not (row is not None and row.schema_break),
        }

    def drop(self, *, keep_publication: bool = False) -> list[str]:
        source = self.source
        source.close()
        with setup.connect(source.url, database=False) as conn:
            if control.delete(conn, source.control_database, source.reader):
                return [
                    f"removed reader {source.reader} from {source.control_database}.{control.TABLE}"
                ]
        return []

    def recreate(self, *, snapshot: bool) -> list[str]:
        """Start the reader again at the server's position now; with ``snapshot`` read the tables.

        The poller's checkpoint stays; the source goes on from the new start (which
        is after it), so the changes between the two are skipped: that is what the
        operator asked for, and the snapshot brings the tables' rows back.
        """
        source = self.source
        source.close()
        with setup.connect(source.url, database=False) as conn:
            setup.check_server(setup.server_facts(conn))
            files = setup.binary_logs(conn)
            control.ensure(conn, source.control_database)
            source.infos = setup.table_infos(conn, source.tables)
            previous = source.read_control(conn)
            start = current_position(conn, files)
            row = source.new_control_row(
                start,
                snapshots=False,
                mark=file_mark(source, start[0]),
                generation=control.next_generation(previous, time.time()),
            )
            row.created_gtid = control.gtid_at(conn, *start)
            carry_over(previous, row, source.table_names(), snapshot=snapshot)
            source.write_control(conn, row)
        return [
            f"reader {source.reader} starts again at {row.created_file}:{row.created_pos}"
            + (f"; snapshot of {len(source.tables)} table(s) queued" if snapshot else "")
        ]

    def request_snapshot(self, table: str, where: str | None = None) -> dict[str, Any]:
        """Queue a re-read of ``table`` (rows matching ``where``), delivered among the changes."""
        source = self.source
        name = setup.TableName.parse(table, source.url.database).qualified
        watched(name, source.table_names())
        with setup.connect(source.url, database=False) as conn:
            conn.begin()
            # No control row: refused, and closing the connection rolls back.
            request = add_request(
                source,
                conn,
                name,
                where,
                reader=f"reader {source.reader}",
                position=lambda row: log_position(conn, row),
            )
            conn.commit()
        source.snapshots.poke()
        return request.to_json()

    def schema_changes(self) -> list[str]:
        """The column type change delivery is held at, if any."""
        source = self.source
        with setup.connect(source.url, database=False) as conn:
            row = control.read_installed(conn, source.control_database, source.reader)
        held = None if row is None else row.schema_break
        return [held] if held and not control.is_table_gone(held) else []

    def accept_schema(self) -> list[str]:
        """Accept the new column types: forget the accepted types of the tables that changed."""
        source = self.source
        with setup.connect(source.url, database=False) as conn:
            row = source.read_control(conn)
            if row is None:
                raise ConfigurationError(
                    f"reader {source.reader} has no control row: nothing accepted yet to change"
                )
            held = None if control.is_table_gone(row.schema_break) else row.schema_break
            if control.is_table_gone(row.schema_break):
                raise ConfigurationError(
                    f"delivery is held by no column type change but: {row.schema_break}"
                )
            changes = [held] if held else []
            changed = [t for t in row.columns if held and f" of {t} " in held]
            for table in changed or list(row.columns):
                row.columns.pop(table, None)  # the next read accepts what the log has now
            control.update(
                conn, source.control_database, source.reader, columns=row.columns, schema_break=None
            )
        source.close()
        return changes


def other_log(
    source: BinlogSourceParts,
    row: control.ControlRow,
    files: list[tuple[str, int]],
    name: str,
    offset: int,
) -> str | None:
    """What says the recorded position ``name:offset`` is not in the server's log now (its
    offset past the file's end, or the file's mark not the one recorded), or None."""
    if offset > dict(files)[name]:
        return f"the recorded position {name}:{offset} is beyond the end of that file"
    mark = row.last_recorded().mark
    if mark is None:
        return None
    try:
        found = file_mark(source, name)
    except DbTriggerError as exc:
        return f"{name} cannot be read ({exc})"
    if found == mark:
        return None
    return (
        f"{name} is not the file the position {name}:{offset} was recorded in (that one was "
        f"{mark_text(mark)}, this one is {mark_text(found)})"
    )


__all__ = ["BinlogAdmin"]
