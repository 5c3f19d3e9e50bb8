"""What PostgreSQL must have for logical decoding, checked and (when asked) created.

A :class:`~dbtrigger.cdc.PgLogicalSource` needs three things on the server:

* ``wal_level = logical`` and a free replication slot (``max_replication_slots``);
  stream mode also a WAL sender (``max_wal_senders``). These need a server
  restart to change, so they are checked and reported, never changed.
* a **publication** listing the watched tables (which changes ``pgoutput`` sends);
* a **replication slot** using ``pgoutput`` (where in the log the poller stands;
  the server keeps the WAL the slot still needs).

Publication and slot are created on first use, or beforehand with
``dbtrigger cdc install`` (which prints the SQL first and runs it with
``--yes``). Every refusal says exactly what to change: the setting and the
restart, the ``GRANT``/``ALTER ROLE`` statement, or the SQL an owner must run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from dbtrigger.cdc.pg_connection import execute_or_explain, translated
from dbtrigger.cdc.pg_identity import refuse_without_identity
from dbtrigger.cdc.pg_names import TableName, parse_tables
from dbtrigger.cdc.pgoutput import lsn_text, parse_lsn
from dbtrigger.errors import (
    ConfigurationError,
    ServerSettingError,
    SourceDefinitionError,
    SourcePermissionError,
)

#: The oldest server this source supports: pgoutput's ``messages`` option (the
#: snapshot chunks travel as logical messages) arrived in 14.
MIN_SERVER_VERSION = 140000

_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")


def default_name(poller: str) -> str:
    """``dbtrigger_<poller>`` as a slot/publication name (lowercase, ``_``, <= 63 chars).

    A poller name that had to be changed to fit (upper case, ``-``, ``.``, too
    long) gets a short hash of the original, so two pollers never share a slot.
    """
    base = re.sub(r"[^a-z0-9_]", "_", poller.lower())
    name = f"dbtrigger_{base}"
    if base != poller or len(name) > 63:
        digest = hashlib.sha256(poller.encode()).hexdigest()[:8]
        name = f"{name[:54]}_{digest}"
    return name


def validate_slot_name(name: str, what: str = "slot") -> str:
    if not isinstance(name, str) or not _SLOT_NAME.match(name):
        raise ConfigurationError(
            f"{what} name {name!r} is not valid: use 1-63 lowercase letters, digits or '_'"
        )
    return name


# --- the server -------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerFacts:
    version: int
    wal_level: str
    max_replication_slots: int
    slots_in_use: int
    max_wal_senders: int
    max_slot_wal_keep_size_mb: int  # -1: unlimited
    user: str
    superuser: bool
    replication: bool
    in_recovery: bool


def server_facts(conn: psycopg.Connection[Any]) -> ServerFacts:
    with translated("reading the server's settings"):
        row = conn.execute(
            """
            SELECT current_setting('wal_level'),
                   current_setting('max_replication_slots')::int,
                   (SELECT count(*) FROM pg_replication_slots)::int,
                   current_setting('max_wal_senders')::int,
                   current_setting('max_slot_wal_keep_size')::text,
                   r.rolname, r.rolsuper, r.rolreplication, pg_is_in_recovery()
            FROM pg_roles r WHERE r.rolname = current_user
            """
        ).fetchone()
    assert row is not None  # noqa: S101 - current_user always has a pg_roles row
    keep = row[4]
    keep_mb = -1 if keep in ("-1", "") else _size_mb(keep)
    return ServerFacts(
        conn.info.server_version,
        row[0],
        row[1],
        row[2],
        row[3],
        keep_mb,
        row[5],
        row[6],
        row[7],
        row[8],
    )


def _size_mb(text: str) -> int:
    units = {"kB": 1 / 1024, "MB": 1, "GB": 1024, "TB": 1024 * 1024}
    match = re.match(r"^(\d+)\s*(kB|MB|GB|TB)?$", text.strip())
    if match is None:
        return -1
    return int(int(match.group(1)) * units[match.group(2) or "MB"])


def check_server(facts: ServerFacts, *, stream: bool = False, new_slot: bool = False) -> None:
    """Refuse a server that cannot do logical decoding for this user, saying what to change.

    Raises:
        ServerSettingError: wal_level, slot or sender limits, version.
        SourcePermissionError: the user may not use replication slots.
    """
    if facts.version < MIN_SERVER_VERSION:
        raise ServerSettingError(
            f"PostgreSQL {facts.version // 10000} is too old for PgLogicalSource: it needs 14 "
            "or later (pgoutput's logical messages carry the snapshot chunks)"
        )
    if facts.wal_level != "logical":
        raise ServerSettingError(
            f"wal_level is {facts.wal_level!r} on this server; logical decoding needs "
            "wal_level = logical. Run ALTER SYSTEM SET wal_level = logical; and restart the "
            "server (a reload is not enough). On a managed service set the parameter "
            "(Azure: azure.replication_support = logical; AWS RDS: rds.logical_replication = 1)"
        )
    if new_slot and facts.slots_in_use >= facts.max_replication_slots:
        raise ServerSettingError(
            f"all {facts.max_replication_slots} replication slots are in use "
            "(max_replication_slots); raise it (ALTER SYSTEM SET max_replication_slots = ...; "
            "restart) or drop a slot nobody reads (dbtrigger cdc status shows them)"
        )
    if stream and facts.max_wal_senders < 1:
        raise ServerSettingError(
            "max_wal_senders is 0: stream mode needs a WAL sender. ALTER SYSTEM SET "
            "max_wal_senders = 10; and restart, or use mode='poll'"
        )
    if not (facts.superuser or facts.replication):
        raise SourcePermissionError(
            f"role {facts.user!r} may not use replication slots: run ALTER ROLE "
            f"{facts.user} REPLICATION; as a superuser (Azure: GRANT azure_pg_admin ...; "
            "AWS RDS: GRANT rds_replication TO ...)"
        )


# --- the watched tables ----------------------------------------------------------------


@dataclass(frozen=True)
class TableInfo:
    """A watched table as the catalog describes it now."""

    table: TableName
    oid: int
    replica_identity: str  # d, n, f, i
    primary_key: tuple[str, ...]
    identity_columns: tuple[str, ...]
    #: column name -> (type OID, type as format_type writes it), in column order
    columns: dict[str, tuple[int, str]] = field(default_factory=dict)
    owner: str = ""
    can_lock: bool = True
    #: a domain column's type OID -> its base type's (a domain over a domain: the last)
    domains: dict[int, int] = field(default_factory=dict)

    @property
    def key_columns(self) -> tuple[str, ...]:
        """The columns events carry as ``pk``: the primary key, or the replica
        identity index under ``USING INDEX`` (whose columns every image has)."""
        if self.replica_identity == "i":
            return self.identity_columns
        return self.primary_key

    @property
    def identity_label(self) -> str:
        return {"d": "DEFAULT", "n": "NOTHING", "f": "FULL", "i": "USING INDEX"}.get(
            self.replica_identity, self.replica_identity
        )

    def before_image_note(self) -> str | None:
        """What ``before`` lacks under this table's replica identity (None: nothing)."""
        if self.replica_identity == "f":
            return None
        if self.replica_identity == "n":
            return (
                "REPLICA IDENTITY NOTHING: updates and deletes fail while the table is published, "
                "so it is not; set REPLICA IDENTITY DEFAULT or FULL (cdc install --full-images)"
            )
        if not self.key_columns:
            return (
                "no primary key: updates and deletes fail while the table is published, so it is "
                "not; add a primary key or set REPLICA IDENTITY FULL (cdc install --full-images)"
            )
        return (
            f"REPLICA IDENTITY {self.identity_label}: a delete's before image has only "
            f"{', '.join(self.key_columns)}, and an update has none unless the key changed "
            "(and its after image holds UNCHANGED for a large, TOASTed value it left alone); "
            f"ALTER TABLE {self.table.qualified} REPLICA IDENTITY FULL gives whole rows "
            "(more WAL per update and delete)"
        )


def table_infos(conn: psycopg.Connection[Any], tables: Sequence[TableName]) -> dict[str, TableInfo]:
    """The catalog's view of each watched table.

    Raises:
        SourceDefinitionError: a table does not exist.
    """
    out: dict[str, TableInfo] = {}
    with translated("reading the watched tables from the catalog"):
        bases = dict(
            conn.execute("SELECT oid::int, typbasetype::int FROM pg_type WHERE typtype = 'd'")
        )
        for table in tables:
            row = conn.execute(
                """
                SELECT c.oid, c.relreplident::text, pg_get_userbyid(c.relowner),
                  coalesce((SELECT array_agg(a.attname::text ORDER BY k.ord)
                   FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey::int2[])
                     WITH ORDINALITY k(attnum, ord)
                   JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                   WHERE i.indrelid = c.oid AND i.indisprimary), '{}'),
                  coalesce((SELECT array_agg(a.attname::text ORDER BY k.ord)
                   FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey::int2[])
                     WITH ORDINALITY k(attnum, ord)
                   JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                   WHERE i.indrelid = c.oid AND i.indisreplident), '{}'),
                  coalesce((SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute a
                   WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '{}'),
                  coalesce((SELECT array_agg(a.atttypid::int ORDER BY a.attnum) FROM pg_attribute a
                   WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '{}'),
                  coalesce((SELECT array_agg(format_type(a.atttypid, a.atttypmod) ORDER BY a.attnum)
                   FROM pg_attribute a
                   WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '{}'),
                  has_table_privilege(c.oid, 'UPDATE') OR has_table_privilege(c.oid, 'DELETE')
                    OR has_table_privilege(c.oid, 'TRUNCATE')
                FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
                """,
                (table.schema, table.name),
            ).fetchone()
            if row is None:
                raise SourceDefinitionError(
                    f"table {table.qualified} does not exist (or is not a table) in this "
                    "database: create it, or correct tables= (SCHEMA.TABLE) or the URL's database"
                )
            columns = {
                name: (type_oid, type_name)
                for name, type_oid, type_name in zip(row[5], row[6], row[7], strict=True)
            }
            domains = {t: t for t in set(row[6]) & bases.keys()}
            while any(b in bases for b in domains.values()):  # a domain over a domain
                domains = {t: bases.get(b, b) for t, b in domains.items()}
            out[table.qualified] = TableInfo(
                table,
                row[0],
                row[1],
                tuple(row[3]),
                tuple(row[4]),
                columns,
                row[2],
                row[8],
                domains,
            )
    return out


# --- the publication -------------------------------------------------------------------


def publication_tables(conn: psycopg.Connection[Any], name: str) -> set[str] | None:
    """The tables a publication lists (None: there is no such publication)."""
    with translated("reading the publication"):
        exists = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,))
        if exists.fetchone() is None:
            return None
        rows = conn.execute(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s",
            (name,),
        ).fetchall()
    return {r[0] for r in rows}


def publication_actions(conn: psycopg.Connection[Any], name: str) -> tuple[str, ...] | None:
    """What an existing publication publishes, as ``WITH (publish = ...)`` names it, when
    that leaves out ``truncate`` (None: it publishes truncates, or does not exist)."""
    with translated("reading the publication"):
        row = conn.execute(
            "SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication "
            "WHERE pubname = %s",
            (name,),
        ).fetchone()
    if row is None or row[3]:
        return None
    return tuple(op for op, on in zip(("insert", "update", "delete"), row, strict=False) if on)


def truncate_sql(name: str, actions: Sequence[str]) -> sql.Composed:
    """The statement that makes publication ``name`` publish truncates too."""
    publish = ", ".join((*actions, "truncate"))
    return sql.SQL("ALTER PUBLICATION {} SET (publish = {})").format(
        sql.Identifier(name), sql.Literal(publish)
    )


def publication_sql(
    name: str,
    tables: Sequence[TableName],
    existing: set[str] | None,
    actions: Sequence[str] | None = None,
) -> list[sql.Composed]:
    """The statements that make publication ``name`` list ``tables`` and publish
    truncates (``actions``: what it publishes when that lacks them; none: nothing to do).

    A publication made by hand ``WITH (publish = 'insert, update, delete')`` sends no
    ``TRUNCATE``: its readers would keep every truncated row, so it is extended too.
    """
    if existing is None:
        # Changes of a partitioned table's partitions are published under the
        # table's own name (as they would otherwise come under names no one watches).
        return [
            sql.SQL(
                "CREATE PUBLICATION {} FOR TABLE {} WITH (publish_via_partition_root = true)"
            ).format(sql.Identifier(name), sql.SQL(", ").join(t.identifier() for t in tables))
        ]
    missing = [t for t in tables if t.qualified not in existing]
    statements = [truncate_sql(name, actions)] if actions is not None else []
    if missing:
        statements.append(
            sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                sql.Identifier(name), sql.SQL(", ").join(t.identifier() for t in missing)
            )
        )
    return statements


def ensure_publication(
    conn: psycopg.Connection[Any], name: str, tables: Sequence[TableName], *, create: bool
) -> list[str]:
    """Make the publication list every watched table and publish truncates; the
    statements run (or due).

    With ``create`` False a missing or incomplete publication is an error that
    quotes the SQL to run.

    Raises:
        ConfigurationError / SourcePermissionError: as explained in the message.
        SourceDefinitionError: a table to publish has no replica identity.
    """
    existing = publication_tables(conn, name)
    actions = None
    if existing is not None:
        check_partition_root(conn, name, tables)
        actions = publication_actions(conn, name)
    statements = publication_sql(name, tables, existing, actions)
    texts = [s.as_string(conn) for s in statements]
    if not statements:
        return []
    new = [t for t in tables if existing is None or t.qualified not in existing]
    refuse_without_identity(conn, new)  # updates of the table would fail once published
    if not create:
        lacks = "every watched table" if actions is None else "truncates (a TRUNCATE would be lost)"
        raise ConfigurationError(
            f"publication {name} does not publish {lacks}; run: {'; '.join(texts)}"
        )
    execute_or_explain(
        conn,
        statements,
        doing="creating the publication",
        refused=f"cannot create publication {name}",
        tables=[t.identifier().as_string(conn) for t in tables],
        advice="Only a table's owner may publish it (and CREATE on the database is needed); "
        "have an owner run",
    )
    return texts


def check_partition_root(
    conn: psycopg.Connection[Any], name: str, tables: Sequence[TableName]
) -> None:
    """Refuse a publication that would publish a watched partitioned table under its
    partitions' names (``publish_via_partition_root`` off): those changes would be lost."""
    with translated("reading the publication"):
        row = conn.execute(
            "SELECT pubviaroot FROM pg_publication WHERE pubname = %s", (name,)
        ).fetchone()
        partitioned = [
            t.qualified
            for t in tables
            if conn.execute(
                "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relname = %s AND c.relkind = 'p'",
                (t.schema, t.name),
            ).fetchone()
        ]
    if row is not None and not row[0] and partitioned:
        raise ConfigurationError(
            f"publication {name} publishes the partitions of {', '.join(partitioned)} under "
            "their own names, which this source does not watch; run: ALTER PUBLICATION "
            f"{name} SET (publish_via_partition_root = true)"
        )


def drop_publication(conn: psycopg.Connection[Any], name: str) -> bool:
    with translated(
        "dropping the publication",
        refused=f"only its owner (or a superuser) may drop it; have one run: DROP PUBLICATION "
        f"{name}",
    ):
        if publication_tables(conn, name) is None:
            return False
        conn.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(name)))
    return True


# --- the slot --------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotState:
    """One row of ``pg_replication_slots``, as far as the server version has it."""

    name: str
    plugin: str | None
    database: str | None
    active_pid: int | None
    wal_status: str | None  # reserved, extended, unreserved, lost
    restart_lsn: int | None
    confirmed_flush: int | None
    safe_wal_size: int | None
    retained_bytes: int | None
    invalidation: str | None = None
    failover: bool | None = None

    @property
    def lost(self) -> bool:
        return self.wal_status == "lost" or self.invalidation is not None

    def to_json(self) -> dict[str, Any]:
        """The row as ``dbtrigger cdc status --json`` shows it (LSNs as PostgreSQL spells them)."""
        out = dataclasses.asdict(self)
        out["slot"] = out.pop("name")
        confirmed = out.pop("confirmed_flush")
        out["confirmed_flush_lsn"] = None if confirmed is None else lsn_text(confirmed)
        out["restart_lsn"] = None if self.restart_lsn is None else lsn_text(self.restart_lsn)
        return out


def slot_state(conn: psycopg.Connection[Any], name: str) -> SlotState | None:
    version = conn.info.server_version
    extra = "NULL::text, NULL::bool"
    if version >= 170000:
        extra = "invalidation_reason, failover"
    elif version >= 160000:
        extra = "CASE WHEN conflicting THEN 'conflicting' END, NULL::bool"
    position = "pg_current_wal_lsn()"
    with translated("reading the replication slot"):
        if conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,):
            position = "pg_last_wal_replay_lsn()"
        row = conn.execute(
            sql.SQL(
                "SELECT slot_name::text, plugin::text, database::text, active_pid, wal_status, "
                "restart_lsn::text, confirmed_flush_lsn::text, safe_wal_size, "
                "pg_wal_lsn_diff({position}, restart_lsn)::bigint, {extra} "
                "FROM pg_replication_slots WHERE slot_name = %s"
            ).format(position=sql.SQL(position), extra=sql.SQL(extra)),
            (name,),
        ).fetchone()
    if row is None:
        return None
    return SlotState(
        row[0],
        row[1],
        row[2],
        row[3],
        row[4],
        None if row[5] is None else parse_lsn(row[5]),
        None if row[6] is None else parse_lsn(row[6]),
        row[7],
        row[8],
        row[9],
        row[10],
    )


def create_slot(conn: psycopg.Connection[Any], name: str, *, failover: bool = False) -> int:
    """Create a ``pgoutput`` slot; its starting LSN.

    ``failover`` (PostgreSQL 17+) marks it for synchronisation to standbys, so
    the slot survives a failover (``sync_replication_slots`` on the standby).
    """
    with translated("creating the replication slot"):
        if failover and conn.info.server_version >= 170000:
            row = conn.execute(
                "SELECT lsn::text FROM pg_create_logical_replication_slot("
                "%s, 'pgoutput', false, false, true)",
                (name,),
            ).fetchone()
        else:
            row = conn.execute(
                "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
                (name,),
            ).fetchone()
    assert row is not None  # noqa: S101 - the function returns one row
    return parse_lsn(row[0])


def drop_slot(conn: psycopg.Connection[Any], name: str) -> bool:
    with translated("dropping the replication slot"):
        if slot_state(conn, name) is None:
            return False
        conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    return True


def check_slot_plugin(state: SlotState, database: str | None) -> None:
    if state.plugin != "pgoutput":
        raise SourceDefinitionError(
            f"replication slot {state.name} uses plugin {state.plugin!r}, not pgoutput; name "
            "another slot (slot=) or drop this one if nothing else reads it"
        )
    if database is not None and state.database != database:
        raise SourceDefinitionError(
            f"replication slot {state.name} belongs to database {state.database!r}, not "
            f"{database!r}; slots are per database: name another slot (slot=)"
        )


__all__ = [
    "MIN_SERVER_VERSION",
    "ServerFacts",
    "SlotState",
    "TableInfo",
    "TableName",
    "check_server",
    "check_slot_plugin",
    "create_slot",
    "default_name",
    "drop_publication",
    "drop_slot",
    "ensure_publication",
    "parse_tables",
    "publication_sql",
    "publication_tables",
    "server_facts",
    "slot_state",
    "table_infos",
    "validate_slot_name",
]
