"""The PostgreSQL side of the notify wake-up hint: one statement-level trigger.

``dbtrigger wake install --table orders`` puts a trigger on ``orders`` that
runs once per *statement* that inserts, updates or deletes rows (never per
row) and sends a ``NOTIFY`` with no payload on the table's channel.
PostgreSQL delivers identical notifications of one transaction once, at its
commit, so a writing transaction wakes listeners once per table however many
statements and rows it has; a rolled-back one wakes nobody. The trigger
function is shared by every table of a schema (the channel is the trigger's
argument).

Put it on the table a poller reads: the table of a ``SqlAlchemySource``, the
*watched* table of a ``ChangeLogSource`` (its log is written by the same
transactions). A partitioned table: on the parent, for statements that name
the parent.

The hint is best effort by design (:mod:`dbtrigger.wakeup.hints`); what the
trigger costs writers is in docs/operations.md ("Waking a worker").
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from dbtrigger._engine import Bind, connected
from dbtrigger._lock_wait import (
    DEFAULT_WRITE_LOCK_TIMEOUT,
    check_lock_timeout,
    ddl_gives_up,
    lock_wait_bounded,
)
from dbtrigger.errors import ConfigurationError
from dbtrigger.names import quoted_name, shortened, validate_sql_identifier

#: The trigger's name on each table (trigger names are per table in PostgreSQL).
TRIGGER_NAME = "dbt_wake"
#: The shared trigger function, one per schema.
FUNCTION_NAME = "dbt_wake_notify"
#: How long installing or removing the trigger waits for a lock on the table.
INSTALL_LOCK_TIMEOUT = DEFAULT_WRITE_LOCK_TIMEOUT
#: PostgreSQL's limit on identifiers, channel names included.
_MAX_IDENTIFIER = 63


def default_channel(table: str, schema: str | None = None) -> str:
    """``dbt_wake_<schema>_<table>`` (``dbt_wake_<table>`` without a schema),
    shortened with a hash past PostgreSQL's 63 characters."""
    name = f"dbt_wake_{schema}_{table}" if schema else f"dbt_wake_{table}"
    return shortened(name, _MAX_IDENTIFIER)


@dataclass(frozen=True)
class WakePlan:
    """What ``install``/``uninstall`` would run on a table, and the channel."""

    table: str
    schema: str | None
    channel: str
    statements: tuple[str, ...]


def _check(bind: Bind, table: str, schema: str | None) -> None:
    if bind.dialect.name != "postgresql":
        raise ConfigurationError(
            f"the notify wake-up hint is PostgreSQL LISTEN/NOTIFY; this database is "
            f"{bind.dialect.name}. There, use adaptive polling (dbtrigger run --wake adaptive)"
        )
    validate_sql_identifier(table, "table")
    if schema is not None:
        validate_sql_identifier(schema, "schema")


def _names(bind: Bind, table: str, schema: str | None) -> tuple[str, str]:
    """The quoted table and the quoted function, both in ``schema``."""
    quote = bind.dialect.identifier_preparer.quote
    return quoted_name(quote, table, schema), quoted_name(quote, FUNCTION_NAME, schema)


def installed_channel(bind: Bind, table: str, *, schema: str | None = None) -> str | None:
    """The channel the table's wake-up trigger notifies, or None when it has none."""
    _check(bind, table, schema)
    with connected(bind) as conn:
        args = conn.execute(
            sa.text(
                "SELECT t.tgargs FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE NOT t.tgisinternal AND t.tgname = :trigger AND c.relname = :table "
                "AND n.nspname = coalesce(:schema, current_schema())"
            ),
            {"trigger": TRIGGER_NAME, "table": table, "schema": schema},
        ).scalar()
    if args is None:
        return None
    # tgargs: the arguments, each ending in a NUL byte.
    return bytes(args).split(b"\0")[0].decode()


def plan_install(
    bind: Bind, table: str, *, schema: str | None = None, channel: str | None = None
) -> WakePlan:
    """The statements that (re)install the wake-up trigger on ``table``.

    Raises:
        ConfigurationError: not PostgreSQL, an unsafe name, or no such table.
    """
    _check(bind, table, schema)
    channel = validate_sql_identifier(channel or default_channel(table, schema), "channel")
    if len(channel) > _MAX_IDENTIFIER:
        raise ConfigurationError(
            f"channel {channel!r} is longer than PostgreSQL's {_MAX_IDENTIFIER} characters"
        )
    with connected(bind) as conn:
        if not sa.inspect(conn).has_table(table, schema=schema):
            where = f"{schema}.{table}" if schema else table
            raise ConfigurationError(f"no table {where!r} here: check --table and --schema")
    target, function = _names(bind, table, schema)
    statements = (
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $fn$\n"
        "BEGIN\n"
        "  -- dbtrigger wake-up hint: one payload-less NOTIFY per statement, which\n"
        "  -- PostgreSQL delivers once per transaction and channel, at commit\n"
        "  PERFORM pg_notify(TG_ARGV[0], '');\n"
        "  RETURN NULL;\n"
        "END\n"
        "$fn$",
        f"DROP TRIGGER IF EXISTS {TRIGGER_NAME} ON {target}",
        f"CREATE TRIGGER {TRIGGER_NAME} AFTER INSERT OR UPDATE OR DELETE ON {target}\n"
        f"  FOR EACH STATEMENT EXECUTE FUNCTION {function}('{channel}')",
    )
    return WakePlan(table, schema, channel, statements)


def plan_uninstall(bind: Bind, table: str, *, schema: str | None = None) -> WakePlan:
    """The statements that remove the wake-up trigger from ``table`` (and the shared
    function when no other table's trigger uses it). Empty when none is installed."""
    _check(bind, table, schema)
    channel = installed_channel(bind, table, schema=schema)
    if channel is None:
        return WakePlan(table, schema, default_channel(table, schema), ())
    target, function = _names(bind, table, schema)
    with connected(bind) as conn:
        others = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid "
                "JOIN pg_namespace n ON n.oid = p.pronamespace "
                "JOIN pg_class c ON c.oid = t.tgrelid "
                "WHERE p.proname = :function AND n.nspname = coalesce(:schema, current_schema()) "
                "AND NOT (t.tgname = :trigger AND c.relname = :table)"
            ),
            {"function": FUNCTION_NAME, "schema": schema, "trigger": TRIGGER_NAME, "table": table},
        ).scalar_one()
    statements = [f"DROP TRIGGER IF EXISTS {TRIGGER_NAME} ON {target}"]
    if not others:
        statements.append(f"DROP FUNCTION IF EXISTS {function}()")
    return WakePlan(table, schema, channel, tuple(statements))


def apply(bind: Bind, plan: WakePlan, *, lock_timeout_seconds: float | None = None) -> None:
    """Run a plan's statements in one transaction.

    ``DROP TRIGGER`` waits for every transaction open on the table, and while it
    waits every later reader and writer of the table waits behind it: at most
    ``lock_timeout_seconds`` (None: :data:`INSTALL_LOCK_TIMEOUT`, 30 s), then a
    :class:`~dbtrigger.errors.RetryableError` naming the table; nothing changed.
    """
    given = INSTALL_LOCK_TIMEOUT if lock_timeout_seconds is None else lock_timeout_seconds
    seconds = check_lock_timeout(given, "lock_timeout_seconds")
    doing = f"changing the wake-up trigger of {plan.table}"
    with (
        ddl_gives_up(bind.engine, plan.table, plan.schema, seconds, doing),
        connected(bind, begin=True) as conn,
        lock_wait_bounded(conn, seconds),
    ):
        for statement in plan.statements:
            conn.execute(sa.text(statement))


def install(
    bind: Bind,
    table: str,
    *,
    schema: str | None = None,
    channel: str | None = None,
    lock_timeout_seconds: float | None = None,
) -> WakePlan:
    """Install (or replace) the wake-up trigger on ``table``; returns what ran."""
    plan = plan_install(bind, table, schema=schema, channel=channel)
    apply(bind, plan, lock_timeout_seconds=lock_timeout_seconds)
    return plan


def uninstall(
    bind: Bind, table: str, *, schema: str | None = None, lock_timeout_seconds: float | None = None
) -> WakePlan:
    """Remove the wake-up trigger from ``table``; returns what ran."""
    plan = plan_uninstall(bind, table, schema=schema)
    apply(bind, plan, lock_timeout_seconds=lock_timeout_seconds)
    return plan


__all__ = [
    "FUNCTION_NAME",
    "TRIGGER_NAME",
    "WakePlan",
    "apply",
    "default_channel",
    "install",
    "installed_channel",
    "plan_install",
    "plan_uninstall",
    "uninstall",
]
