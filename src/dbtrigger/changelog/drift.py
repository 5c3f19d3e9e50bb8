"""What a migration did to an installed change log, and what install does about it.

The triggers never make a write fail (see :mod:`dbtrigger.changelog.triggers`),
but a migration can still leave the log short of something: row images
without a column added since install (MariaDB/MySQL, SQLite), row images
written under a column's old name (SQLite), rows whose images or key the
trigger could not read (a dropped or renamed column on MariaDB/MySQL, a
renamed or retyped key). :func:`find_drift` compares what is installed with
the table as it is now; ``dbtrigger check``, a starting worker and the source
(at its first fetch, then every ``drift_check_seconds``) turn a non-empty
answer into :class:`~dbtrigger.errors.ChangeLogDriftError`, which names the
one command that repairs it: install again.

Installing again regenerates the triggers for the table as it is and, through
:func:`log_migration`, brings the log's key columns to the table's key
(renamed with it, retyped with it, made nullable where the v1 layout had them
NOT NULL), then fills in the key of rows logged without one, from their row
images, where the images hold it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from dbtrigger.changelog.ddl import (
    MARKER_PREFIX,
    OLDER_VERSIONS,
    OP_WIDTH,
    VERSION,
    Quote,
    TableInfo,
    existing_triggers,
    keys_nullable,
    log_key_columns,
    log_table_name,
    ours,
    qualified_name,
    read_marker,
    reflect_table,
)
from dbtrigger.changelog.vanished import unlogged_since_truncate, vanished_keys
from dbtrigger.errors import ChangeLogDriftError, ConfigurationError


def install_command(table: str, schema: str | None) -> str:
    """The command that (re)installs the change log of ``table``."""
    where = f" --schema {schema}" if schema else ""
    return f"dbtrigger changelog install --url URL --table {table}{where} --yes"


def resync_command(table: str, schema: str | None) -> str:
    """The command that records a truncate and re-sends every row of ``table``."""
    where = f" --schema {schema}" if schema else ""
    return f"dbtrigger changelog resync --url URL --table {table}{where} --yes"


@dataclass(frozen=True)
class LogKey:
    """One key column of the log table as it is now."""

    name: str
    sql_type: str
    nullable: bool


def log_keys(conn: sa.Connection, table: str, schema: str | None) -> list[LogKey] | None:
    """The log's key columns (None when the log table does not exist)."""
    name = log_table_name(table)
    inspector = sa.inspect(conn)
    if not inspector.has_table(name, schema=schema):
        return None
    compiler = conn.dialect.type_compiler_instance
    columns = {c["name"]: c for c in inspector.get_columns(name, schema=schema)}
    return [
        LogKey(n, compiler.process(columns[n]["type"]), bool(columns[n]["nullable"]))
        for n in log_key_columns(list(columns))
    ]


@dataclass(frozen=True)
class Drift:
    """How an installed change log differs from its table now (no problems: in sync)."""

    table: str
    schema: str | None
    problems: tuple[str, ...] = ()
    #: Installing again renames the log's key columns: a poller must accept the new source.
    key_renamed: bool = False
    #: Not installed at all (no log table): not drift, an install that never happened.
    missing: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)
    #: Rows gone from the table with no delete logged (a TRUNCATE on MariaDB/MySQL):
    #: the one problem that installing again does not repair; ``resync`` does.
    vanished: int = 0

    def __bool__(self) -> bool:
        return bool(self.problems)

    @property
    def fix(self) -> str:
        """The command that repairs it: install again; resync for vanished rows alone."""
        if self.vanished and len(self.problems) == 1:
            return resync_command(self.table, self.schema)
        return install_command(self.table, self.schema)

    def error(self) -> ChangeLogDriftError:
        fix = self.fix
        if fix != install_command(self.table, self.schema):
            return ChangeLogDriftError(
                f"the change log of {self.table} no longer tells its readers what the table holds: "
                + "; ".join(self.problems)
                + f". The application's writes go on; record it and re-send every row to the "
                f"log's readers: `{fix}` (docs/changes.md, 'TRUNCATE')",
                problems=list(self.problems),
                fix=fix,
            )
        then = (
            "; it renames the log's key columns to the table's, so the poller then asks "
            "you to accept the changed source (the command is printed)"
            if self.key_renamed
            else ""
        )
        return ChangeLogDriftError(
            f"the change log of {self.table} no longer matches the table: "
            + "; ".join(self.problems)
            + f". The application's writes go on; re-install the change log: `{fix}`{then} "
            "(docs/changes.md, 'When the table changes')",
            problems=list(self.problems),
            fix=fix,
        )


def find_drift(
    conn: sa.Connection, table: str, schema: str | None, *, whole_log: bool = True
) -> Drift:
    """Compare the installed triggers and log with ``table`` as it is now; ``whole_log``
    False looks for rows gone unlogged among the keys of the newest log rows only
    (:mod:`dbtrigger.changelog.vanished`)."""
    keys = log_keys(conn, table, schema)
    if keys is None:
        return Drift(table, schema, missing=True)
    if not sa.inspect(conn).has_table(table, schema=schema):
        return Drift(
            table,
            schema,
            (
                f"table {table} does not exist: it was dropped (its triggers with it; if "
                "for good, `dbtrigger changelog uninstall ... --drop-log --yes` removes the "
                "log), or renamed (the triggers went with it and still write to this log)",
            ),
        )
    try:
        info = reflect_table(conn, table, schema)
    except ConfigurationError as exc:
        return Drift(table, schema, (str(exc),))
    problems: list[str] = []
    unverified: list[str] = []
    specs = _trigger_problems(conn, info, problems, unverified)
    key_renamed = _key_problems(info, keys, specs, problems)
    for spec in specs[:1]:  # the triggers are generated together: one describes them all
        _column_problems(info, spec, problems)
    # Only for a log that fits the table: otherwise install again first, then compare.
    log_key_names = [k.name for k in keys]
    gone = [] if problems else vanished_keys(conn, info, log_key_names, whole_log=whole_log)
    if gone:
        problems.append(_vanished_problem(info, gone))
    elif whole_log and not problems:
        gone = unlogged_since_truncate(conn, info, log_key_names)
        if gone:
            problems.append(_unlogged_problem(info, gone))
    return Drift(
        table,
        schema,
        tuple(dict.fromkeys(problems)),
        key_renamed=key_renamed,
        notes=tuple(unverified),
        vanished=len(gone),
    )


#: How rows leave an SQLite table unlogged: REPLACE removes the rows in its way without
#: firing their delete triggers unless the writing connection turned recursive
#: triggers on (SQLite's documented rule), and no trigger can tell it from an IGNORE.
_SQLITE_REPLACE = (
    "an INSERT OR REPLACE / REPLACE INTO that removed the rows in its way (SQLite fires "
    "no delete trigger for them unless the writing connection ran PRAGMA "
    "recursive_triggers = ON: do that in the application, or write INSERT ... ON "
    "CONFLICT DO UPDATE, which is logged), or a delete while the change log's triggers "
    "were missing"
)

#: How rows leave a PostgreSQL table unlogged: a partition's own TRUNCATE, or a
#: partition detached or dropped, fires no trigger of the partitioned table.
_PG_PARTITIONS = (
    "on a partitioned table, a TRUNCATE of one partition, or a partition detached or "
    "dropped (no trigger fires for those: TRUNCATE the partitioned table, or delete the "
    "rows, to have them logged), or a delete while the change log's triggers were "
    "missing or disabled"
)


def _vanished_problem(info: TableInfo, gone: list[tuple[Any, ...]]) -> str:
    shown = ", ".join(
        str(k[0]) if len(k) == 1 else "(" + ", ".join(map(str, k)) + ")" for k in gone[:5]
    )
    more = f" and {len(gone) - 5} more" if len(gone) > 5 else ""
    how = (
        "a TRUNCATE TABLE (which fires no trigger on MariaDB/MySQL) or a foreign key's "
        "ON DELETE CASCADE (which fires none either)"
        if info.dialect in ("mysql", "mariadb")
        else _SQLITE_REPLACE
        if info.dialect == "sqlite"
        else _PG_PARTITIONS
        if info.dialect == "postgresql"
        else "a delete while the change log's triggers were missing or disabled"
    )
    return (
        f"{len(gone)} row(s) the change log holds as present are gone from {info.table} with "
        f"no delete logged (key {shown}{more}): {how}; the log's readers still hold them"
    )


def _unlogged_problem(info: TableInfo, keys: list[tuple[Any, ...]]) -> str:
    shown = ", ".join(
        str(k[0]) if len(k) == 1 else "(" + ", ".join(map(str, k)) + ")" for k in keys[:5]
    )
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return (
        f"{len(keys)} row(s) {info.table} holds have no change logged since the last truncate "
        f"in its change log (key {shown}{more}), so its readers dropped them there and never "
        "got them back: a `changelog resync` that stopped part-way (it logs the truncate, "
        "then the table chunk by chunk), or rows written while the triggers were missing"
    )


def _hidden_trigger(conn: sa.Connection, info: TableInfo, name: str) -> bool:
    """MariaDB/MySQL: a trigger that exists but this account may not see (no TRIGGER privilege).

    ``information_schema.TRIGGERS`` lists nothing without the privilege;
    ``SHOW CREATE TRIGGER`` tells "does not exist" (1360) from "access denied".
    """
    if info.dialect not in ("mysql", "mariadb"):
        return False
    quote = conn.dialect.identifier_preparer.quote
    qualified = qualified_name(info, name, quote)
    try:  # a failed statement does not end a MariaDB/MySQL transaction
        conn.exec_driver_sql(f"SHOW CREATE TRIGGER {qualified}").fetchall()
    except sa.exc.DBAPIError as exc:
        code = exc.orig.args[0] if exc.orig is not None and exc.orig.args else None
        return code != 1360  # ER_TRG_DOES_NOT_EXIST: really missing
    return False  # readable after all (listed a moment later): not hidden


def _trigger_problems(
    conn: sa.Connection, info: TableInfo, problems: list[str], unverified: list[str]
) -> list[dict[str, Any]]:
    """Missing, foreign or outdated triggers; returns the specs of the current ones."""
    found = existing_triggers(conn, info)
    specs: list[dict[str, Any]] = []
    versions = {marker[0] for t in found.values() if ours(t) and (marker := read_marker(t))}
    expected = info.trigger_names()
    if versions and max(versions) < VERSION and info.dialect == "postgresql":
        expected = expected[:1]  # the TRUNCATE trigger is new in v3: the upgrade adds it
    missing = [n for n in expected if n not in found]
    hidden = [n for n in missing if _hidden_trigger(conn, info, n)]
    if hidden:
        # Not drift: this account cannot tell. Say so, and check what can be read.
        unverified.append(
            f"trigger(s) {', '.join(hidden)} cannot be read by this account (MariaDB/MySQL "
            "show triggers only with the TRIGGER privilege on the table): the triggers were "
            "not compared with the table"
        )
        missing = [n for n in missing if n not in hidden]
    if missing:
        problems.append(
            f"trigger(s) {', '.join(missing)} missing (changes are not being logged; a table "
            "dropped and re-created, or rebuilt by a migration, loses its triggers). What "
            "was written while they were missing is in no log row: after the install, "
            f"`{resync_command(info.table, info.schema)}` re-sends the table to every reader"
        )
    current = {n for n, text in found.items() if (read_marker(text) or (0,))[0] >= VERSION}
    _disabled_problems(conn, info, list(found), problems, current)
    for name, text in sorted(found.items()):
        marker = read_marker(text) if ours(text) else None
        if marker is None:
            problems.append(f"trigger {name} was not written by the change log")
            continue
        version, spec = marker
        if version < VERSION:
            lacks = OLDER_VERSIONS.get(version, "its triggers predate this release's")
            problems.append(
                f"the triggers were installed by an older dbtrigger ({MARKER_PREFIX}{version}; "
                f"this release writes {MARKER_PREFIX}{VERSION}): {lacks}. Upgrade them in "
                f"place, no change is lost meanwhile: `{install_command(info.table, info.schema)}`"
            )
        elif version > VERSION:
            problems.append(f"installed by a newer dbtrigger ({MARKER_PREFIX}{version})")
        elif spec is not None:
            specs.append(spec)
    return specs


def _disabled_problems(
    conn: sa.Connection,
    info: TableInfo,
    names: list[str],
    problems: list[str],
    current: set[str],
) -> None:
    """PostgreSQL triggers switched off (``ALTER TABLE ... DISABLE TRIGGER``, as
    ``DISABLE TRIGGER ALL`` around a bulk load does) or firing only for replicas: each
    write then goes unlogged, and the trigger looks installed. Triggers of this
    release (``current``; older ones are reported as such) enabled for ordinary
    sessions only, as ``ENABLE TRIGGER ALL`` leaves them: a replica-role session's
    writes go unlogged."""
    if info.dialect != "postgresql" or not names:
        return
    rows = conn.execute(
        sa.text(
            "SELECT t.tgname, t.tgenabled FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE NOT t.tgisinternal AND t.tgname = ANY(:names) "
            "AND t.tgenabled IN ('D', 'R', 'O') "
            "AND c.relname = :table AND n.nspname = coalesce(:schema, current_schema())"
        ),
        {"names": names, "table": info.table, "schema": info.schema},
    )
    states = {str(name): str(state) for name, state in rows}
    off = sorted(n for n, state in states.items() if state in ("D", "R"))
    # ENABLE TRIGGER (not ALWAYS), as after DISABLE/ENABLE TRIGGER ALL around a bulk
    # load: they fire in ordinary sessions only. Since v3 they are installed ALWAYS.
    ordinary = sorted(n for n, state in states.items() if state == "O" and n in current)
    target = f"{info.schema}.{info.table}" if info.schema else info.table
    resync = f"`{resync_command(info.table, info.schema)}` re-sends the table to every reader"
    if off:
        enable = "; ".join(f"ALTER TABLE {target} ENABLE ALWAYS TRIGGER {n}" for n in off)
        problems.append(
            f"trigger(s) {', '.join(off)} disabled (ALTER TABLE ... DISABLE TRIGGER): changes "
            f"are not being logged. Enable them: `{enable}`; the changes written while they "
            f"were off are in no log row ({resync})"
        )
    if ordinary:
        enable = "; ".join(f"ALTER TABLE {target} ENABLE ALWAYS TRIGGER {n}" for n in ordinary)
        problems.append(
            f"trigger(s) {', '.join(ordinary)} enabled for ordinary sessions only (ALTER "
            "TABLE ... ENABLE TRIGGER, as after a DISABLE TRIGGER ALL around a bulk load): "
            "the writes of a session with session_replication_role = replica (a logical "
            f"replication subscriber, pg_restore) are not being logged. Enable them always: "
            f"`{enable}`; such writes made meanwhile are in no log row ({resync})"
        )


def _key_problems(
    info: TableInfo, keys: list[LogKey], specs: list[dict[str, Any]], problems: list[str]
) -> bool:
    """The log's key columns against the table's key; True when install will rename them."""
    table_key = [c.name for c in info.pk]
    log_names = [k.name for k in keys]
    renamed = False
    traced = specs[0].get("key") if specs else None
    if log_names != table_key or (traced is not None and traced != table_key):
        renamed = len(log_names) == len(table_key) and log_names != table_key
        consequence = (
            "SQLite renamed it in the triggers; the log's key column keeps the old name"
            if info.dialect == "sqlite"
            else "changes are logged without their key"
        )
        problems.append(
            f"the key of {info.table} is ({', '.join(table_key)}); the change log was "
            f"installed for ({', '.join(log_names)}): {consequence}"
        )
        return renamed
    for key, column in zip(keys, info.pk, strict=True):
        if info.dialect != "sqlite" and key.sql_type != column.sql_type:
            problems.append(
                f"key column {column.name} is {column.sql_type} in the table, {key.sql_type} "
                "in the log: keys the log cannot hold are logged as NULL"
            )
        if keys_nullable(info) and not key.nullable:
            problems.append("the log's key columns are NOT NULL (the layout of an older dbtrigger)")
    return renamed


def _column_problems(info: TableInfo, spec: dict[str, Any], problems: list[str]) -> None:
    """Row-trigger dialects: the columns the triggers name against the table's."""
    if not info.row_triggers:
        return  # PostgreSQL: images are to_jsonb(row), whatever the columns are
    traced = [str(c) for c in spec.get("columns", [])]
    now = [c.name for c in info.columns]
    gone = [c for c in traced if c not in now]
    added = [c for c in now if c not in traced]
    if gone:
        problems.append(
            f"column(s) {', '.join(gone)} dropped or renamed since install"
            + (
                " (row images still carry the old names)"
                if info.dialect == "sqlite"
                else " (changes are logged without row images)"
            )
        )
    if added:
        problems.append(f"column(s) {', '.join(added)} added since install (not in row images)")
    binary = set(spec.get("binary", []))
    flipped = [c.name for c in info.columns if c.name in traced and c.binary != (c.name in binary)]
    if flipped:
        problems.append(f"column(s) {', '.join(flipped)} changed to or from a binary type")
    bits = set(spec.get("bit", []))
    wrong = [c.name for c in info.columns if c.name in traced and c.bit != (c.name in bits)]
    if wrong:
        problems.append(
            f"column(s) {', '.join(wrong)} changed to or from BIT (or the triggers come from an "
            "earlier dbtrigger, which logged a BIT value as raw bytes: invalid JSON)"
        )


# --- install again: bring the log to the table ------------------------------------------


def log_migration(conn: sa.Connection, info: TableInfo, quote: Quote) -> list[str]:
    """Statements that fit an existing log to ``info``'s key; [] for a new or fitting log.

    Raises:
        ConfigurationError: the key changed its number of columns: no log
            column can be carried over; the log must be drained and dropped.
    """
    keys = log_keys(conn, info.table, info.schema)
    if keys is None:
        return []
    log = qualified_name(info, info.log_table, quote)
    if len(keys) != len(info.pk):
        raise ConfigurationError(
            f"the key of {info.table} is now ({', '.join(c.name for c in info.pk)}); its change "
            f"log is keyed by ({', '.join(k.name for k in keys)}). A log cannot carry keys of a "
            "different shape: deliver what it holds, then `dbtrigger changelog uninstall "
            f"--table {info.table} --drop-log --yes`, install again, and start the poller "
            "afresh (a new source)"
        )
    out: list[str] = []
    for key, column in zip(keys, info.pk, strict=True):
        name = quote(column.name)
        if key.name != column.name:
            out.append(f"ALTER TABLE {log} RENAME COLUMN {quote(key.name)} TO {name}")
        retype = info.dialect != "sqlite" and key.sql_type != column.sql_type
        relax = keys_nullable(info) and not key.nullable
        if info.dialect == "postgresql":
            if retype:
                out.append(
                    f"ALTER TABLE {log} ALTER COLUMN {name} TYPE {column.sql_type} "
                    f"USING {name}::text::{column.sql_type}"
                )
            if relax:
                out.append(f"ALTER TABLE {log} ALTER COLUMN {name} DROP NOT NULL")
        elif info.dialect != "sqlite" and (retype or relax):
            out.append(f"ALTER TABLE {log} MODIFY COLUMN {name} {column.sql_type} NULL")
    if keys_nullable(info) and _has_null_keys(conn, info, keys):
        out.append(_fill_keys(info, quote))
    if op_width(conn, info) < OP_WIDTH:  # a v1/v2 log: 'truncate' needs 8 characters
        op = f"VARCHAR({OP_WIDTH})"
        if info.dialect == "postgresql":
            out.append(f"ALTER TABLE {log} ALTER COLUMN dbt_op TYPE {op}")
        else:
            out.append(f"ALTER TABLE {log} MODIFY COLUMN dbt_op {op} NOT NULL")
    return out


def op_width(conn: sa.Connection, info: TableInfo) -> int:
    """How many characters the log's ``dbt_op`` holds (SQLite: any)."""
    if info.dialect == "sqlite":
        return OP_WIDTH
    for column in sa.inspect(conn).get_columns(info.log_table, schema=info.schema):
        if column["name"] == "dbt_op":
            return int(getattr(column["type"], "length", None) or OP_WIDTH)
    return OP_WIDTH


def _has_null_keys(conn: sa.Connection, info: TableInfo, keys: list[LogKey]) -> bool:
    log = sa.table(info.log_table, *(sa.column(k.name) for k in keys), schema=info.schema)
    nulls = sa.or_(*(log.c[k.name].is_(None) for k in keys))
    probe = sa.select(sa.literal(1)).select_from(log).where(nulls).limit(1)
    return conn.execute(probe).first() is not None


def _fill_keys(info: TableInfo, quote: Quote) -> str:
    """Set the key of rows logged without one from their row image, where it holds the key."""
    log = qualified_name(info, info.log_table, quote)
    nulls = " OR ".join(f"{quote(c.name)} IS NULL" for c in info.pk)
    if info.dialect == "postgresql":
        image = "coalesce(dbt_after, dbt_before)::jsonb"
        sets = ", ".join(
            f"{quote(c.name)} = ({image} ->> '{c.name}')::{c.sql_type}" for c in info.pk
        )
    else:
        image = "COALESCE(dbt_after, dbt_before)"

        def value(name: str, binary: bool) -> str:
            text = f"JSON_VALUE({image}, '$.{name}')"
            return f"UNHEX({text})" if binary else text

        sets = ", ".join(f"{quote(c.name)} = {value(c.name, c.binary)}" for c in info.pk)
    return f"UPDATE {log} SET {sets} WHERE {nulls}"  # noqa: S608 - identifiers validated, quoted
