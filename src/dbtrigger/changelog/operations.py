"""Install, uninstall and prune a change log: what the CLI commands run.

Each function takes an engine and returns the statements it ran (or would run:
``apply=False`` is the dry run the CLI shows by default). Install and uninstall
run in one transaction where the dialect has transactional DDL (PostgreSQL,
SQLite); on MariaDB/MySQL each DDL statement commits by itself, which is why
every statement is idempotent on its own.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from dbtrigger.changelog.ddl import (
    MARKER,
    TableInfo,
    existing_triggers,
    foreign_triggers,
    has_index,
    install_ddl,
    log_table_name,
    reflect_table,
    uninstall_ddl,
)
from dbtrigger.errors import ConfigurationError

#: Rows one prune statement deletes; keeps each transaction (and its locks) short.
DEFAULT_PRUNE_CHUNK = 5000


@dataclass(frozen=True)
class Plan:
    """What an install/uninstall does: the table it is for and its statements."""

    info: TableInfo
    statements: tuple[str, ...]


def _quote(engine: Engine) -> sa.sql.compiler.IdentifierPreparer:
    return engine.dialect.identifier_preparer


def plan_install(engine: Engine, table: str, *, schema: str | None = None) -> Plan:
    """The statements that install the change log of ``table``.

    Raises:
        ConfigurationError: the table is missing or has no primary key, or a
            trigger with one of the change log's names exists and was not
            written by it (it is never replaced).
    """
    with engine.connect() as conn:
        info = reflect_table(conn, table, schema)
        foreign = foreign_triggers(conn, info)
        if foreign:
            raise ConfigurationError(
                f"table {table!r} already has trigger(s) {', '.join(foreign)} that the change "
                "log did not create; rename or drop them first (they are never replaced)"
            )
        skip_index = info.dialect in ("mysql", "mariadb") and has_index(conn, info)
    statements = install_ddl(info, _quote(engine).quote)
    if skip_index:
        statements = [s for s in statements if not s.startswith("CREATE INDEX")]
    return Plan(info, tuple(statements))


def plan_uninstall(
    engine: Engine, table: str, *, schema: str | None = None, drop_log: bool = False
) -> Plan:
    """The statements that remove the change log's triggers (and the log with ``drop_log``).

    Triggers of the same names that the change log did not write are refused,
    as on install.
    """
    with engine.connect() as conn:
        info = reflect_table(conn, table, schema)
        foreign = foreign_triggers(conn, info)
    if foreign:
        raise ConfigurationError(
            f"trigger(s) {', '.join(foreign)} on {table!r} were not created by the change log; "
            "not dropping them"
        )
    return Plan(info, tuple(uninstall_ddl(info, _quote(engine).quote, drop_log=drop_log)))


def apply(engine: Engine, plan: Plan) -> None:
    """Run a plan; in one transaction where the dialect allows."""
    with engine.begin() as conn:
        for statement in plan.statements:
            conn.exec_driver_sql(statement)


def install(engine: Engine, table: str, *, schema: str | None = None) -> Plan:
    """Create the log table, its index and the triggers (idempotent)."""
    plan = plan_install(engine, table, schema=schema)
    apply(engine, plan)
    return plan


def uninstall(
    engine: Engine, table: str, *, schema: str | None = None, drop_log: bool = False
) -> Plan:
    plan = plan_uninstall(engine, table, schema=schema, drop_log=drop_log)
    apply(engine, plan)
    return plan


def is_installed(engine: Engine, table: str, *, schema: str | None = None) -> bool:
    """True when every trigger of the change log is present (and is ours)."""
    with engine.connect() as conn:
        info = reflect_table(conn, table, schema)
        found = existing_triggers(conn, info)
    return len(found) == len(info.trigger_names()) and all(
        MARKER in text for text in found.values()
    )


def log_table(engine: Engine, table: str, schema: str | None) -> sa.Table:
    """The reflected log table of ``table``.

    Raises:
        ConfigurationError: the change log is not installed (names the command).
    """
    name = log_table_name(table)
    try:
        with engine.connect() as conn:
            return sa.Table(name, sa.MetaData(), schema=schema, autoload_with=conn)
    except sa.exc.NoSuchTableError:
        raise ConfigurationError(
            f"no change log for table {table!r} (table {name} is missing); install it with "
            f"`dbtrigger changelog install --url URL --table {table}"
            + (f" --schema {schema}" if schema else "")
            + " --yes`"
        ) from None


def prune(
    engine: Engine,
    table: str,
    *,
    schema: str | None = None,
    older_than: dt.timedelta | None = None,
    up_to_seq: int | None = None,
    chunk: int = DEFAULT_PRUNE_CHUNK,
    apply: bool = True,
    now: dt.datetime | None = None,
) -> int:
    """Delete log rows older than ``older_than`` and/or at or below ``up_to_seq``.

    Works in chunks of ``chunk`` rows, each its own short transaction, so a big
    prune never holds locks for long. Returns the rows deleted (with
    ``apply=False``: the rows that would be).

    ``up_to_seq`` is how pruning stays safe for pollers: pass the lowest
    checkpoint of every poller reading the log (``prune_passed`` does), and no
    row a poller still has to read is deleted.
    """
    if older_than is None and up_to_seq is None:
        raise ConfigurationError("prune needs older_than and/or up_to_seq (refusing to delete all)")
    if chunk < 1:
        raise ConfigurationError(f"chunk must be >= 1, got {chunk}")
    log = log_table(engine, table, schema)
    conditions: list[sa.ColumnElement[bool]] = []
    if older_than is not None:
        moment = (now or dt.datetime.now(dt.timezone.utc)) - older_than
        conditions.append(log.c.dbt_changed_at < _db_time(engine, moment))
    if up_to_seq is not None:
        conditions.append(log.c.dbt_seq <= up_to_seq)
    where = sa.and_(*conditions)
    if not apply:
        with engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).where(where)).scalar_one())
    deleted = 0
    while True:
        with engine.begin() as conn:
            # The chunk's last sequence number bounds the delete: at most `chunk`
            # matching rows lie at or below it, whatever the dialect's DELETE allows.
            bound = conn.execute(
                sa.select(log.c.dbt_seq)
                .where(where)
                .order_by(log.c.dbt_seq)
                .offset(chunk - 1)
                .limit(1)
            ).scalar()
            stmt = sa.delete(log).where(where)
            if bound is not None:
                stmt = stmt.where(log.c.dbt_seq <= bound)
            count = conn.execute(stmt).rowcount or 0
        deleted += count
        if bound is None or count == 0:
            return deleted


def _db_time(engine: Engine, moment: dt.datetime) -> object:
    """``moment`` as the log's ``dbt_changed_at`` compares on this dialect.

    PostgreSQL stores a ``timestamptz``; MariaDB a ``DATETIME(6)`` in the
    session time zone (UTC is assumed, as ``CURRENT_TIMESTAMP`` on a UTC
    server); SQLite text in UTC (``strftime('%Y-%m-%d %H:%M:%f', 'now')``).
    """
    utc = moment.astimezone(dt.timezone.utc)
    if engine.dialect.name == "postgresql":
        return utc
    if engine.dialect.name == "sqlite":
        return sa.literal(utc.strftime("%Y-%m-%d %H:%M:%S.") + f"{utc.microsecond // 1000:03d}")
    return utc.replace(tzinfo=None)


def lowest_checkpoint(positions: Sequence[object]) -> int | None:
    """The smallest integer sequence among checkpoints (None when any poller has none)."""
    lowest: int | None = None
    for cursor in positions:
        if cursor is None:
            return None
        if not isinstance(cursor, int) or isinstance(cursor, bool):
            raise ConfigurationError(
                f"a checkpoint cursor {cursor!r} is not a change-log sequence number; "
                "is that poller reading this change log?"
            )
        lowest = cursor if lowest is None else min(lowest, cursor)
    return lowest
