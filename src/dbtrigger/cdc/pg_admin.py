"""What ``dbtrigger cdc`` does to a PgLogicalSource's server objects: :class:`PgAdmin`.

The source's configuration names the slot, publication, tables and control table:

* ``plan`` - what ``install`` would do (the SQL, in order) and what the
  operator should know (replica identity, ``max_slot_wal_keep_size``);
* ``install`` - do it;
* ``status`` - the slot's health, the publication, snapshot progress;
* ``drop`` - remove slot, publication and control row;
* ``recreate`` - after a slot was lost: a new slot (and, with ``snapshot``,
  the tables read again), never done implicitly;
* ``accept_schema`` - accept the tables' current column types;
* ``request_snapshot`` - queue a re-read of one table (or key range).
"""

from __future__ import annotations

from typing import Any

from psycopg import errors as pg_errors
from psycopg import sql

from dbtrigger._lock_wait import DEFAULT_WRITE_LOCK_TIMEOUT
from dbtrigger.cdc import pg_control as control
from dbtrigger.cdc import pg_setup as setup
from dbtrigger.cdc.admin import Plan, SourceAdmin
from dbtrigger.cdc.pg_connection import connect, ddl_lock_bounded, translated
from dbtrigger.cdc.pg_context import PgSourceParts
from dbtrigger.cdc.pgoutput import lsn_text, parse_lsn
from dbtrigger.cdc.snapshots import add_request, carry_over, watched
from dbtrigger.errors import ConfigurationError, FetchError, SlotLostError

#: How long ``cdc install --full-images`` waits for a lock on a watched table.
INSTALL_LOCK_TIMEOUT = DEFAULT_WRITE_LOCK_TIMEOUT


def full_identity_sql(table: setup.TableName) -> sql.Composed:
    """The statement that gives ``table`` full before images: what the dry run
    prints is what the install runs (names quoted as identifiers)."""
    return sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(table.identifier())


def set_full_identity(conn: Any, table: setup.TableName) -> str:
    """``ALTER TABLE ... REPLICA IDENTITY FULL`` (the statement run), waiting at most
    :data:`INSTALL_LOCK_TIMEOUT` for the table's lock: behind an application's
    transaction open on the table it waited for ever, and every later reader and
    writer of the table queued behind it."""
    statement = full_identity_sql(table)
    with ddl_lock_bounded(
        conn,
        INSTALL_LOCK_TIMEOUT,
        f"setting REPLICA IDENTITY FULL on {table.qualified}",
        "its replica identity is unchanged. Run the command again once that transaction "
        "ends (it completes what is missing), or end it",
        tables=[table.identifier().as_string(conn)],
    ):
        conn.execute(statement)
    return statement.as_string(conn)


#: Retained WAL above which ``status`` and ``dbtrigger check`` warn (bytes).
RETAINED_WARNING = 1024**3


def wal_keep_notes(facts: setup.ServerFacts) -> list[str]:
    if facts.max_slot_wal_keep_size_mb < 0:
        return [
            "max_slot_wal_keep_size is unlimited (-1): a poller that stops reading "
            "makes the server keep WAL until its disk is full. Set a bound, e.g. ALTER SYSTEM "
            "SET max_slot_wal_keep_size = '50GB'; SELECT pg_reload_conf(); (a slot that falls "
            "further behind is invalidated instead, and dbtrigger reports it)"
        ]
    return []


def slot_warnings(state: setup.SlotState | None, facts: setup.ServerFacts) -> list[str]:
    """What an operator must know about a slot's health, loudest first."""
    out: list[str] = []
    if state is None:
        out.append("the slot does not exist (created at the first read, or by cdc install)")
        return out
    if state.lost:
        out.append(
            f"the slot is invalidated ({state.invalidation or state.wal_status}): changes are "
            "lost; run dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes"
        )
    elif state.wal_status == "unreserved":
        out.append(
            "wal_status is 'unreserved': the server is about to remove WAL the slot needs "
            f"(safe_wal_size {state.safe_wal_size}); the poller must catch up now"
        )
    if state.retained_bytes is not None and state.retained_bytes > RETAINED_WARNING:
        out.append(
            f"the slot retains {state.retained_bytes / 1024**3:.1f} GB of WAL: is the poller "
            "running and keeping up?"
        )
    out.extend(wal_keep_notes(facts))
    return out


def made_again(state: setup.SlotState | None, row: control.ControlRow | None) -> str | None:
    """A slot confirmed past the furthest position its poller let it advance to: created
    again by hand (see :mod:`dbtrigger.cdc.pg_control`), in words; None when it is not."""
    if state is None or row is None or row.released_lsn is None:
        return None
    bound = parse_lsn(row.released_lsn)
    if state.confirmed_flush is None or state.confirmed_flush <= bound:
        return None
    return (
        f"the slot starts at {lsn_text(state.confirmed_flush)}, past {row.released_lsn}, the "
        "furthest its poller let it advance: it was dropped and created again by hand (or "
        "advanced by something else), and the changes committed in between are missing; run "
        "dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes"
    )


class PgAdmin(SourceAdmin[PgSourceParts]):
    """The admin protocol for a PgLogicalSource (see the module docstring)."""

    def plan(self, *, full_images: bool = False) -> Plan:
        """What :meth:`install` would run, without running it."""
        source = self.source
        out = Plan()
        with connect(source.url) as conn:
            facts = setup.server_facts(conn)
            try:
                setup.check_server(facts, stream=source.mode == "stream")
            except Exception as exc:  # noqa: BLE001 - a dry run reports, never raises
                out.notes.append(f"BLOCKER: {exc}")
            infos = setup.table_infos(conn, source.tables)
            if not control.exists(conn, source.control_schema):
                out.statements.append(control.create_sql(source.control_schema).as_string(conn))
            elif not control.has_bound(conn, source.control_schema):
                out.statements.append(control.add_bound_sql(source.control_schema).as_string(conn))
            out.statements.extend(
                s.as_string(conn)
                for s in setup.publication_sql(
                    source.publication,
                    source.tables,
                    setup.publication_tables(conn, source.publication),
                    setup.publication_actions(conn, source.publication),
                )
            )
            if setup.slot_state(conn, source.slot) is None:
                failover = (
                    ", false, false, true" if source.failover and facts.version >= 170000 else ""
                )
                out.statements.append(
                    f"SELECT pg_create_logical_replication_slot('{source.slot}', "
                    f"'pgoutput'{failover})"
                )
            for info in infos.values():
                note = info.before_image_note()
                if note is None:
                    continue
                out.notes.append(f"{info.table.qualified}: {note}")
                if info.replica_identity != "f":
                    statement = full_identity_sql(info.table).as_string(conn)
                    (out.statements if full_images else out.optional).append(statement)
            out.notes.extend(f"WARNING: {note}" for note in wal_keep_notes(facts))
            if source.failover and facts.version < 170000:
                out.notes.append(
                    "failover=True needs PostgreSQL 17: on this server the slot is not "
                    "synchronised to standbys and is lost on a failover (dbtrigger cdc recreate "
                    "--snapshot then)"
                )
        return out

    def install(self, *, full_images: bool = False) -> list[str]:
        """Create what is missing (control table, publication, slot); the statements run."""
        source = self.source
        done: list[str] = []
        with connect(source.url) as conn:
            facts = setup.server_facts(conn)
            new_slot = setup.slot_state(conn, source.slot) is None
            setup.check_server(facts, stream=source.mode == "stream", new_slot=new_slot)
            if control.ensure(conn, source.control_schema):
                done.append(f"created {source.control_schema}.{control.TABLE}")
            infos = setup.table_infos(conn, source.tables)
            if full_images:  # first: a table without a key can be published only then
                for info in infos.values():
                    if info.replica_identity != "f":
                        done.append(set_full_identity(conn, info.table))
            done.extend(
                setup.ensure_publication(conn, source.publication, source.tables, create=True)
            )
            if new_slot:
                if control.read_installed(conn, source.control_schema, source.slot):
                    raise SlotLostError(lost_slot_text(source), poller=source.poller)
                source.infos = infos
                created = setup.create_slot(conn, source.slot, failover=source.failover)
                source.write_control(conn, source.new_control_row(created))
                done.append(f"created replication slot {source.slot} at {lsn_text(created)}")
        source.close()
        return done

    def status(self) -> dict[str, Any]:
        """Everything ``dbtrigger cdc status`` shows, as JSON-able data."""
        source = self.source
        with connect(source.url) as conn:
            facts = setup.server_facts(conn)
            state = setup.slot_state(conn, source.slot)
            published = setup.publication_tables(conn, source.publication)
            row = control.read_installed(conn, source.control_schema, source.slot)
            infos = setup.table_infos(conn, source.tables)
        warnings = slot_warnings(state, facts)
        remade = made_again(state, row)
        if remade is not None:
            warnings.insert(0, remade)
        return {
            "slot": state.to_json() if state is not None else None,
            "slot_name": source.slot,
            "publication": source.publication,
            "published_tables": sorted(published) if published is not None else None,
            "wal_level": facts.wal_level,
            "max_slot_wal_keep_size_mb": facts.max_slot_wal_keep_size_mb,
            "server_version": facts.version,
            "snapshots": [s.to_json() for s in row.snapshots] if row is not None else [],
            "created_lsn": row.created_lsn if row is not None else None,
            "released_lsn": row.released_lsn if row is not None else None,
            "tables": {
                q: {"replica_identity": i.identity_label, "key": list(i.key_columns)}
                for q, i in infos.items()
            },
            "warnings": warnings,
            "healthy": state is not None and not state.lost and remade is None,
        }

    def drop(self, *, keep_publication: bool = False) -> list[str]:
        source = self.source
        done: list[str] = []
        source.close()
        with connect(source.url) as conn:
            if _drop_slot(conn, source, "drop"):
                done.append(f"dropped replication slot {source.slot}")
            if not keep_publication and setup.drop_publication(conn, source.publication):
                done.append(f"dropped publication {source.publication}")
            control.delete(conn, source.control_schema, source.slot)
        return done

    def recreate(self, *, snapshot: bool) -> list[str]:
        """A new slot in place of a lost one; with ``snapshot`` the tables are read again.

        The poller's checkpoint stays: positions are LSNs, and every change of the
        new slot comes after every position of the old one, so delivery simply
        continues with what the new slot holds (and the snapshot's rows).
        """
        source = self.source
        done: list[str] = []
        source.close()
        with connect(source.url) as conn:
            state = setup.slot_state(conn, source.slot)
            if state is not None:
                _drop_slot(conn, source, "recreate")
                done.append(
                    f"dropped replication slot {source.slot} "
                    f"({'invalidated' if state.lost else 'still valid: its changes are skipped'})"
                )
            control.ensure(conn, source.control_schema)
            setup.ensure_publication(conn, source.publication, source.tables, create=True)
            source.infos = setup.table_infos(conn, source.tables)
            previous = source.read_control(conn)
            created = setup.create_slot(conn, source.slot, failover=source.failover)
            row = source.new_control_row(created, snapshots=False)
            carry_over(previous, row, source.table_names(), snapshot=snapshot)
            source.write_control(conn, row)
            done.append(
                f"created replication slot {source.slot} at {lsn_text(created)}"
                + (f"; snapshot of {len(source.tables)} table(s) queued" if snapshot else "")
            )
        return done

    def request_snapshot(self, table: str, where: str | None = None) -> dict[str, Any]:
        """Queue a re-read of ``table`` (rows matching ``where``), delivered among the changes."""
        source = self.source
        name = watched(setup.TableName.parse(table).qualified, source.table_names())
        with connect(source.url) as conn, conn.transaction():
            request = add_request(source, conn, name, where, reader=f"slot {source.slot}")
        source.snapshots.poke()
        return request.to_json()

    def schema_changes(self) -> list[str]:
        """Accepted columns whose type differs from the catalog's now, in words."""
        source = self.source
        with connect(source.url) as conn:
            infos = setup.table_infos(conn, source.tables)
            row = source.read_control(conn)
            accepted = row.columns if row is not None else {}
            out = []
            for qualified, info in infos.items():
                for name, oid in accepted.get(qualified, {}).items():
                    now = info.columns.get(name)
                    if now is not None and now[0] != oid:
                        with translated("naming a type"):
                            found = conn.execute("SELECT format_type(%s, NULL)", (oid,)).fetchone()
                        old = found[0] if found else str(oid)
                        out.append(f"{qualified}.{name}: {old} -> {now[1]}")
        return out

    def accept_schema(self) -> list[str]:
        """Accept the watched tables' current column types (after a SchemaChangedError);
        the changes accepted, in words."""
        source = self.source
        changes = self.schema_changes()
        with connect(source.url) as conn:
            infos = setup.table_infos(conn, source.tables)
            row = source.read_control(conn)
            if row is None:
                raise ConfigurationError(
                    f"slot {source.slot} has no control row: nothing accepted yet to change"
                )
            for qualified, info in infos.items():
                row.columns[qualified] = {name: oid for name, (oid, _) in info.columns.items()}
            control.save_columns(conn, source.control_schema, source.slot, row.columns)
        source.close()  # the next read starts over with the accepted columns
        return changes


def _drop_slot(conn: Any, source: PgSourceParts, command: str) -> bool:
    """Drop the slot for ``cdc drop`` / ``cdc recreate``; False when there is none.

    Raises:
        ConfigurationError: a reader holds the slot now (a worker streaming from it,
            or one in the middle of a read): saying so, not "the next tick retries".
    """
    try:
        return setup.drop_slot(conn, source.slot)
    except FetchError as exc:
        if not isinstance(exc.__cause__, pg_errors.ObjectInUse):
            raise
        state = setup.slot_state(conn, source.slot)
        pid = f" (server process {state.active_pid})" if state and state.active_pid else ""
        raise ConfigurationError(
            f"replication slot {source.slot} is being read right now{pid}: a worker of "
            "this poller streams from it (mode='stream' holds it open) or is in the middle "
            f"of a read. Stop the poller's workers, then run dbtrigger cdc {command} again; "
            "nothing was changed"
        ) from exc


def lost_slot_text(source: PgSourceParts) -> str:
    """A slot created for this poller (its control row says so) that is gone now."""
    return (
        f"replication slot {source.slot} does not exist, but it was created for this poller "
        f"({source.control_schema}.{control.TABLE} has its row): the changes it held are gone, "
        "and a new slot would hide that. Recreate it and read the tables again: dbtrigger cdc "
        "recreate MODULE:TRIGGER --snapshot --yes (or, to start afresh, dbtrigger cdc drop "
        "MODULE:TRIGGER --yes)"
    )


__all__ = [
    "RETAINED_WARNING",
    "PgAdmin",
    "lost_slot_text",
    "made_again",
    "slot_warnings",
    "wal_keep_notes",
]
