"""The change log's triggers, per dialect: written so that no DDL breaks a write.

A trigger runs inside the application's statement: if it fails, the
application's INSERT, UPDATE or DELETE fails. A migration on the watched table
must therefore never turn the change log into an outage. Each dialect gets
there its own way:

* **PostgreSQL** names no column of the table. Row images are
  ``to_jsonb(OLD)`` / ``to_jsonb(NEW)`` whatever the columns are now; the key
  is read *from the image* by the log's own key names and assigned to typed
  variables inside a block that catches data exceptions. A renamed key is then
  simply absent (NULL), a key whose new type the log's column cannot hold
  (``int`` to ``bigint`` past 2^31, to ``text``) is NULL too, and the write
  goes through. The block has no write in it, so its subtransaction never
  takes a transaction id of its own.
* **MariaDB/MySQL** have no row-to-JSON, so the trigger must name the
  columns, and a named column that was dropped or renamed is an error at run
  time ("Unknown column in NEW"). Every read of ``NEW``/``OLD`` is therefore
  done first, each in its own block with an ``EXIT HANDLER`` for the errors a
  DDL can cause, into local variables; the log row is then written from the
  variables alone. What could not be read is NULL: the images after a column
  was dropped or renamed, the key after the key column was. The trigger is
  created under strict ``sql_mode`` so that a key the log's column cannot hold
  is an error (caught, NULL) rather than silently clamped. Catching is per
  read, never around a write: a handler that catches a failed multi-row
  INSERT keeps the rows written before the failure.
* **SQLite** triggers name the columns too, but SQLite itself looks after
  them: ``RENAME COLUMN`` rewrites the trigger, ``DROP COLUMN`` of a column a
  trigger names is refused (the ALTER fails, not the writes).

A ``TRUNCATE`` fires no row trigger. PostgreSQL has statement triggers for
it: a second trigger on the same function logs one ``truncate`` row (no key,
no images), delivered as an event with ``op == "truncate"``. MariaDB/MySQL
have none: :mod:`dbtrigger.changelog.vanished` finds rows that left the table
with no delete logged, and ``dbtrigger changelog resync`` records it. SQLite
has no ``TRUNCATE``: its ``DELETE`` without ``WHERE`` fires the row triggers.

A primary-key update is logged as two rows, a ``delete`` of the old key then
an ``insert`` of the new one, so that replaying the log key by key (the replica
in docs/changes.md) ends with the table's keys.
"""

from __future__ import annotations

from dbtrigger.changelog.ddl import (
    MARKER,
    ColumnInfo,
    Quote,
    TableInfo,
    log_ddl,
    marker_text,
    qualified_name,
)

#: MariaDB/MySQL errors a DDL on the watched table can make a trigger's read
#: raise: unknown column (dropped, renamed), and values that no longer fit the
#: log's columns or JSON text (out of range, truncated, incorrect value or
#: string, too long, incompatible collation).
MYSQL_DDL_ERRORS = (1054, 1264, 1265, 1267, 1292, 1366, 1406)

#: MariaDB's "syntax error in JSON text": what a column-by-column image raises
#: after a column whose value JSON_OBJECT cannot render as JSON. Caught there
#: too, so that no column type can make the application's write fail.
MYSQL_JSON_SYNTAX_ERROR = 4038

#: The sql_mode the MariaDB/MySQL triggers are created under (a trigger keeps
#: the mode it was created with): strict, so a key that does not fit is an
#: error the trigger catches, never a silently clamped value.
TRIGGER_SQL_MODE = "STRICT_ALL_TABLES,ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION"


def install_ddl(info: TableInfo, quote: Quote) -> list[str]:
    """Statements that create the log table, its index and the triggers.

    The table and index statements are idempotent; triggers are (re)created, so
    run :func:`~dbtrigger.changelog.ddl.foreign_triggers` first (``install`` does) to make sure no
    trigger of the same name belongs to someone else. A log that already
    exists in an older layout is brought up to date by
    :func:`dbtrigger.changelog.drift.log_migration`, run between the two.
    """
    return [*log_ddl(info, quote), *trigger_ddl(info, quote)]


def trigger_ddl(info: TableInfo, quote: Quote) -> list[str]:
    """The statements that (re)create the change log's triggers of ``info``."""
    if info.dialect == "postgresql":
        return _postgresql(info, quote)
    if info.dialect == "sqlite":
        return _sqlite(info, quote)
    return _mysql(info, quote)


# --- PostgreSQL --------------------------------------------------------------------------


def _postgresql(info: TableInfo, quote: Quote) -> list[str]:
    target = qualified_name(info, info.table, quote)
    log = qualified_name(info, info.log_table, quote)
    function = qualified_name(info, info.function_name, quote)
    trigger, truncate_trigger = info.trigger_names()
    key_names = ", ".join(quote(c.name) for c in info.pk)
    indexes = range(1, len(info.pk) + 1)

    def keys(which: str) -> str:
        return ", ".join(f"dbt_v_{which}_{i}" for i in indexes)

    # The key's JSON values compared, not the typed copies: a key that the log
    # cannot hold is NULL in both, which must not hide a key change.
    moved = " OR ".join(
        f"(dbt_v_old -> '{c.name}') IS DISTINCT FROM (dbt_v_new -> '{c.name}')" for c in info.pk
    )

    def row(op: str, which: str, before: str, after: str) -> str:
        return f"('{op}', {keys(which)}, {before}, {after}, dbt_v_xid)"

    def insert(*rows: str) -> str:
        return (
            # Trigger body text: identifiers validated and quoted, no values from input.
            f"INSERT INTO {log} (dbt_op, {key_names}, dbt_before, dbt_after, dbt_txid)\n"  # noqa: S608
            f"      VALUES {', '.join(rows)};"
        )

    declarations = "\n".join(
        f"  dbt_v_{which}_{i} {column.sql_type};"
        for which in ("old", "new")
        for i, column in zip(indexes, info.pk, strict=True)
    )
    reads = "\n".join(
        f"    dbt_v_{which}_{i} := dbt_v_{which} ->> '{column.name}';"
        for which in ("old", "new")
        for i, column in zip(indexes, info.pk, strict=True)
    )
    old, new = "dbt_v_old::text", "dbt_v_new::text"
    # Trigger body text: identifiers validated and quoted, no values from input.
    truncated = f"INSERT INTO {log} (dbt_op, dbt_txid) VALUES ('truncate', dbt_v_xid);"  # noqa: S608
    body = (
        f"-- {marker_text(info)}\n"
        "-- Names no column of the table: images are to_jsonb(OLD/NEW), the key is read\n"
        "-- from them, so no ALTER TABLE makes a write fail (a key the log cannot hold is NULL).\n"
        "DECLARE\n"
        "  dbt_v_old jsonb;\n"
        "  dbt_v_new jsonb;\n"
        f"{declarations}\n"
        "  dbt_v_xid bigint := pg_current_xact_id()::text::bigint;\n"
        "BEGIN\n"
        "  IF TG_OP = 'TRUNCATE' THEN  -- the statement trigger: one marker, no key, no image\n"
        f"    {truncated}\n"
        "    RETURN NULL;\n"
        "  END IF;\n"
        "  IF TG_OP <> 'INSERT' THEN dbt_v_old := to_jsonb(OLD); END IF;\n"
        "  IF TG_OP <> 'DELETE' THEN dbt_v_new := to_jsonb(NEW); END IF;\n"
        "  BEGIN\n"
        f"{reads}\n"
        "  EXCEPTION WHEN data_exception THEN\n"
        "    NULL;  -- the key no longer fits the log's column: logged without it\n"
        "  END;\n"
        "  IF TG_OP = 'INSERT' THEN\n"
        f"    {insert(row('insert', 'new', 'NULL', new))}\n"
        "  ELSIF TG_OP = 'DELETE' THEN\n"
        f"    {insert(row('delete', 'old', old, 'NULL'))}\n"
        f"  ELSIF {moved} THEN\n"
        "    -- a key change: the old key is deleted, the new one inserted\n"
        f"    {insert(row('delete', 'old', old, 'NULL'), row('insert', 'new', 'NULL', new))}\n"
        "  ELSE\n"
        f"    {insert(row('update', 'new', old, new))}\n"
        "  END IF;\n"
        "  RETURN NULL;\n"
        "END"
    )
    return [
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $f$\n"
        f"{body}\n$f$",
        f"DROP TRIGGER IF EXISTS {quote(trigger)} ON {target}",
        f"CREATE TRIGGER {quote(trigger)} AFTER INSERT OR UPDATE OR DELETE ON {target} "
        f"FOR EACH ROW EXECUTE FUNCTION {function}()",
        f"DROP TRIGGER IF EXISTS {quote(truncate_trigger)} ON {target}",
        f"CREATE TRIGGER {quote(truncate_trigger)} AFTER TRUNCATE ON {target} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
        # Fire in every session: with session_replication_role = replica (a logical
        # replication subscriber's apply worker, pg_restore --disable-triggers, bulk
        # loaders skipping foreign keys) an ordinary trigger is silent, and the change
        # was never logged.
        f"ALTER TABLE {target} ENABLE ALWAYS TRIGGER {quote(trigger)}",
        f"ALTER TABLE {target} ENABLE ALWAYS TRIGGER {quote(truncate_trigger)}",
    ]


# --- MariaDB / MySQL ---------------------------------------------------------------------


def _value(column: ColumnInfo, record: str, quote: Quote, hex_fn: str) -> str:
    """A column of ``record`` (the table itself when empty) as its image holds it: binary
    columns as hex text (JSON has no bytes), BIT as its number (not its raw bytes).

    SQLite lets any column hold bytes whatever its declared type, and its
    ``json_object`` refuses them ("JSON cannot hold BLOB values"), which would fail
    the application's write: there bytes in any column are hex text too."""
    value = f"{record}.{quote(column.name)}" if record else quote(column.name)
    if column.binary:
        return f"{hex_fn}({value})"
    if column.bit:
        return f"CAST({value} AS UNSIGNED)"
    if hex_fn == "hex":  # SQLite
        return f"CASE WHEN typeof({value}) = 'blob' THEN hex({value}) ELSE {value} END"
    return value


def _image(info: TableInfo, record: str, quote: Quote, json_object: str, hex_fn: str) -> str:
    """``JSON_OBJECT('col', NEW.col, ...)``, each value as :func:`_value` renders it."""
    parts = [f"'{c.name}', {_value(c, record, quote, hex_fn)}" for c in info.columns]
    return f"{json_object}({', '.join(parts)})"


def current_image_sql(info: TableInfo, quote: Quote) -> str:
    """A row image of the table's columns *now*, as the row triggers render one."""
    if info.dialect == "sqlite":
        return _image(info, "", quote, "json_object", "hex")
    return _image(info, "", quote, "JSON_OBJECT", "HEX")


def _mysql(info: TableInfo, quote: Quote) -> list[str]:
    target = qualified_name(info, info.table, quote)
    log = qualified_name(info, info.log_table, quote)
    key_names = ", ".join(quote(c.name) for c in info.pk)
    errors = ", ".join(str(code) for code in MYSQL_DDL_ERRORS)
    indexes = range(1, len(info.pk) + 1)

    def guarded(assignment: str, fallback: str = "NULL") -> str:
        variable = assignment.split(" = ", 1)[0]
        return (
            f"  BEGIN DECLARE EXIT HANDLER FOR {errors} SET {variable} = {fallback}; "
            f"SET {assignment}; END;"
        )

    def image_read(which: str, record: str) -> str:
        """The whole image in one JSON_OBJECT; if a column it names is gone, column by column."""
        variable = f"dbt_v_{which}"
        one_by_one = []
        for column in info.columns:
            value = _value(column, record, quote, "HEX")
            # Through dbt_v_part: a SET that fails leaves its target NULL on MariaDB.
            one_by_one.append(
                f"      BEGIN DECLARE EXIT HANDLER FOR {errors}, {MYSQL_JSON_SYNTAX_ERROR} "
                "BEGIN END; "
                f"SET dbt_v_part = JSON_INSERT({variable}, '$.\"{column.name}\"', {value}); "
                f"SET {variable} = dbt_v_part; END;"
            )
        return "\n".join(
            [
                "  BEGIN",
                f"    DECLARE EXIT HANDLER FOR {errors}",
                "    BEGIN  /* a column named here is gone: the columns that are still there */",
                f"      SET {variable} = JSON_OBJECT();",
                *one_by_one,
                "    END;",
                f"    SET {variable} = {_image(info, record, quote, 'JSON_OBJECT', 'HEX')};",
                "  END;",
            ]
        )

    def write(op: str, which: str, before: str, after: str) -> str:
        keys = ", ".join(f"dbt_v_{which}_{i}" for i in indexes)
        return (
            f"INSERT INTO {log} (dbt_op, {key_names}, dbt_before, dbt_after) "  # noqa: S608
            f"VALUES ('{op}', {keys}, {before}, {after});"
        )

    def body(records: tuple[str, ...], writes: str, moved: bool) -> str:
        lines = ["BEGIN", f"  /* {marker_text(info)} */"]
        for record in records:
            which = record.lower()
            lines += [
                f"  DECLARE dbt_v_{which}_{i} {c.sql_type} DEFAULT NULL;"
                for i, c in zip(indexes, info.pk, strict=True)
            ]
            lines.append(f"  DECLARE dbt_v_{which} LONGTEXT CHARACTER SET utf8mb4 DEFAULT NULL;")
        lines.append("  DECLARE dbt_v_part LONGTEXT CHARACTER SET utf8mb4 DEFAULT NULL;")
        if moved:
            lines.append("  DECLARE dbt_v_moved BOOLEAN DEFAULT FALSE;")
        lines.append("  /* every read of the row first, each on its own: what DDL broke is NULL */")
        for record in records:
            which = record.lower()
            lines += [
                guarded(f"dbt_v_{which}_{i} = {record}.{quote(c.name)}")
                for i, c in zip(indexes, info.pk, strict=True)
            ]
            lines.append(image_read(which, record))
        if moved:
            same = " AND ".join(f"OLD.{quote(c.name)} <=> NEW.{quote(c.name)}" for c in info.pk)
            lines.append(guarded(f"dbt_v_moved = NOT ({same})", "FALSE"))
        lines += [writes, "END"]
        return "\n".join(lines)

    update_writes = (
        "  IF dbt_v_moved THEN  /* a key change: the old key is deleted, the new one inserted */\n"
        f"    {write('delete', 'old', 'dbt_v_old', 'NULL')}\n"
        f"    {write('insert', 'new', 'NULL', 'dbt_v_new')}\n"
        "  ELSE\n"
        f"    {write('update', 'new', 'dbt_v_old', 'dbt_v_new')}\n"
        "  END IF;"
    )
    bodies = {
        "INSERT": body(("NEW",), "  " + write("insert", "new", "NULL", "dbt_v_new"), False),
        "UPDATE": body(("OLD", "NEW"), update_writes, True),
        "DELETE": body(("OLD",), "  " + write("delete", "old", "dbt_v_old", "NULL"), False),
    }
    out = [
        "SET @dbt_saved_sql_mode = @@SESSION.sql_mode",
        f"SET SESSION sql_mode = '{TRIGGER_SQL_MODE}'",
    ]
    for name, (event, text) in zip(info.trigger_names(), bodies.items(), strict=True):
        qualified = qualified_name(info, name, quote)
        create = "CREATE OR REPLACE TRIGGER" if info.mariadb else "CREATE TRIGGER"
        if not info.mariadb:  # MySQL cannot replace a trigger in one statement
            out.append(f"DROP TRIGGER IF EXISTS {qualified}")
        out.append(f"{create} {qualified} AFTER {event} ON {target} FOR EACH ROW {text}")
    out.append("SET SESSION sql_mode = @dbt_saved_sql_mode")
    return out


# --- SQLite --------------------------------------------------------------------------------


def _sqlite(info: TableInfo, quote: Quote) -> list[str]:
    target = qualified_name(info, info.table, quote)
    log = qualified_name(info, info.log_table, quote)
    key_names = ", ".join(quote(c.name) for c in info.pk)

    def image(record: str) -> str:
        return _image(info, record, quote, "json_object", "hex")

    def keys(record: str) -> str:
        return ", ".join(f"{record}.{quote(c.name)}" for c in info.pk)

    def write(op: str, record: str, before: str, after: str, where: str = "") -> str:
        return (
            f"INSERT INTO {log} (dbt_op, {key_names}, dbt_before, dbt_after) "
            f"SELECT '{op}', {keys(record)}, {before}, {after}{where};"
        )

    moved = " OR ".join(f"OLD.{quote(c.name)} IS NOT NEW.{quote(c.name)}" for c in info.pk)
    update = "\n  ".join(
        [
            "/* a key change: the old key is deleted, the new one inserted */",
            write("delete", "OLD", image("OLD"), "NULL", f" WHERE {moved}"),
            write("insert", "NEW", "NULL", image("NEW"), f" WHERE {moved}"),
            write("update", "NEW", image("OLD"), image("NEW"), f" WHERE NOT ({moved})"),
        ]
    )
    bodies = {
        "INSERT": write("insert", "NEW", "NULL", image("NEW")),
        "UPDATE": update,
        "DELETE": write("delete", "OLD", image("OLD"), "NULL"),
    }
    out = []
    for name, (event, text) in zip(info.trigger_names(), bodies.items(), strict=True):
        qualified = qualified_name(info, name, quote)
        out.append(f"DROP TRIGGER IF EXISTS {qualified}")
        out.append(
            f"CREATE TRIGGER {qualified} AFTER {event} ON {target} FOR EACH ROW BEGIN\n"
            f"  /* {marker_text(info)} */\n  {text}\nEND"
        )
    return out


__all__ = ["MARKER", "MYSQL_DDL_ERRORS", "current_image_sql", "install_ddl", "trigger_ddl"]
