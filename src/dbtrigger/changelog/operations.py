"""Install, uninstall and prune a change log: what the CLI commands run.

Each function takes an engine and returns the statements it ran (or would run:
``apply=False`` is the dry run the CLI shows by default). Install and uninstall
run in one transaction where the dialect has transactional DDL (PostgreSQL,
SQLite); on MariaDB/MySQL each DDL statement commits by itself, which is why
every statement is idempotent on its own.

``install``, ``uninstall``, ``plan_install`` and ``drift`` also take an open
:class:`~sqlalchemy.engine.Connection` instead of an engine: they then run in
the caller's transaction, which is how a migration that the triggers would
otherwise stand in the way of (SQLite refuses to drop a column a trigger names)
removes them, alters the table and installs them again with no change
unlogged in between (docs/changes.md, 'When the table changes').
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from dbtrigger._engine import Bind, connected
from dbtrigger._engine import reflect_table as reflect_sa_table
from dbtrigger._lock_wait import (
    DEFAULT_WRITE_LOCK_TIMEOUT,
    bounded_transaction,
    check_lock_timeout,
    ddl_gives_up,
    lock_wait_bounded,
)
from dbtrigger.changelog.ddl import (
    TableInfo,
    existing_triggers,
    foreign_triggers,
    has_index,
    log_ddl,
    log_table_name,
    ours,
    qualified_name,
    reflect_table,
    triggers_named,
    uninstall_ddl,
)
from dbtrigger.changelog.drift import Drift, find_drift, install_command, log_migration
from dbtrigger.changelog.readers import Reader, mark_lost, readers_table_name, registered
from dbtrigger.changelog.triggers import trigger_ddl
from dbtrigger.errors import ConfigurationError
from dbtrigger.names import validate_sql_identifier

#: Rows one prune statement deletes; keeps each transaction (and its locks) short.
DEFAULT_PRUNE_CHUNK = 5000


#: How long a change log install or uninstall waits for a lock on the watched table
#: (a transaction open on it) before it gives up.
INSTALL_LOCK_TIMEOUT = DEFAULT_WRITE_LOCK_TIMEOUT


@dataclass(frozen=True)
class Plan:
    """What an install/uninstall does: the table it is for and its statements."""

    info: TableInfo
    statements: tuple[str, ...]


def _quote(bind: Bind) -> sa.sql.compiler.IdentifierPreparer:
    return bind.dialect.identifier_preparer


def _reflect_refusing_foreign(
    conn: sa.Connection, table: str, schema: str | None, refusal: str
) -> TableInfo:
    """The table, unless a trigger of one of the change log's names exists that the
    change log did not write: never replaced nor dropped, so ``refusal`` (formatted
    with ``names`` and ``table``) is raised as a ConfigurationError."""
    info = reflect_table(conn, table, schema)
    foreign = foreign_triggers(conn, info)
    if foreign:
        raise ConfigurationError(refusal.format(names=", ".join(foreign), table=table))
    return info


def plan_install(bind: Bind, table: str, *, schema: str | None = None) -> Plan:
    """The statements that install the change log of ``table`` (or install it again).

    For a log that exists already, the plan also fits its key columns to the
    table's key (see :func:`dbtrigger.changelog.drift.log_migration`).

    Raises:
        ConfigurationError: the table is missing or has no primary key, or a
            trigger with one of the change log's names exists and was not
            written by it (it is never replaced).
    """
    with connected(bind) as conn:
        info = _reflect_refusing_foreign(
            conn,
            table,
            schema,
            "table {table!r} already has trigger(s) {names} that the change log did not create; "
            "rename or drop them first (they are never replaced)",
        )
        quote = _quote(bind).quote
        migration = log_migration(conn, info, quote)
        skip_index = info.dialect in ("mysql", "mariadb") and has_index(conn, info)
    create, *rest = log_ddl(info, quote)
    if skip_index:
        rest = [s for s in rest if not s.startswith("CREATE INDEX")]
    return Plan(info, (create, *migration, *rest, *trigger_ddl(info, quote)))


def plan_uninstall(
    bind: Bind, table: str, *, schema: str | None = None, drop_log: bool = False
) -> Plan:
    """The statements that remove the change log's triggers (and the log with ``drop_log``).

    Triggers of the same names that the change log did not write are refused,
    as on install.
    """
    with connected(bind) as conn:
        if not sa.inspect(conn).has_table(table, schema=schema):
            return _plan_uninstall_gone(conn, table, schema, drop_log=drop_log)
        info = _reflect_refusing_foreign(
            conn,
            table,
            schema,
            "trigger(s) {names} on {table!r} were not created by the change log; not dropping them",
        )
    return Plan(info, tuple(uninstall_ddl(info, _quote(bind).quote, drop_log=drop_log)))


def _plan_uninstall_gone(
    conn: sa.Connection, table: str, schema: str | None, *, drop_log: bool
) -> Plan:
    """What is left of the change log of a table that is gone: its triggers went with it,
    the log (and PostgreSQL's function) did not.

    Raises:
        ConfigurationError: triggers of the change log's names still exist: the table
            was renamed and they went with it, still writing to this log, so dropping
            the log would fail every write of the renamed table.
    """
    dialect = conn.dialect.name
    validate_sql_identifier(table, "table")
    info = TableInfo(
        dialect=dialect,
        table=table,
        schema=schema if dialect != "sqlite" else None,
        pk=(),
        columns=(),
        mariadb=dialect == "mariadb" or bool(getattr(conn.dialect, "is_mariadb", False)),
    )
    left = sorted(triggers_named(conn, dialect, info.schema, info.trigger_names()))
    if left:
        raise ConfigurationError(
            f"table {table!r} does not exist, but the change log's trigger(s) "
            f"{', '.join(left)} do: the table was renamed and they went with it, writing to "
            f"{info.log_table} still, which is therefore not dropped. Rename the table back "
            f"to {table!r} and uninstall, then rename it (docs/changes.md, 'When the table "
            "changes', renames keeping the log)"
        )
    quote = conn.dialect.identifier_preparer.quote
    statements = []
    if dialect == "postgresql":
        function = qualified_name(info, info.function_name, quote)
        statements.append(f"DROP FUNCTION IF EXISTS {function}()")
    if drop_log:
        statements.append(f"DROP TABLE IF EXISTS {qualified_name(info, info.log_table, quote)}")
        registry = qualified_name(info, readers_table_name(table), quote)
        statements.append(f"DROP TABLE IF EXISTS {registry}")
    return Plan(info, tuple(statements))


def apply(bind: Bind, plan: Plan, *, lock_timeout_seconds: float | None = None) -> None:
    """Run a plan; in one transaction where the dialect allows.

    Its triggers are DDL on the watched table, which waits for every transaction
    open on it (PostgreSQL: for ever, and every later reader and writer of the
    table queues behind the waiting ``DROP TRIGGER``; MariaDB: ``lock_wait_timeout``,
    a day). It waits at most ``lock_timeout_seconds`` (None:
    :data:`INSTALL_LOCK_TIMEOUT`, 30 s), then fails as
    :class:`~dbtrigger.errors.RetryableError` naming the table (PostgreSQL and
    SQLite: nothing changed; MariaDB: the statements before it stay, and the plan
    is idempotent, so running it again completes it).
    """
    given = INSTALL_LOCK_TIMEOUT if lock_timeout_seconds is None else lock_timeout_seconds
    seconds = check_lock_timeout(given, "lock_timeout_seconds")
    info = plan.info
    doing = f"changing the change log triggers of {info.table}"
    with (
        ddl_gives_up(bind.engine, info.table, info.schema, seconds, doing),
        connected(bind, begin=True) as conn,
        lock_wait_bounded(conn, seconds),
    ):
        ddl_transaction(conn)
        for statement in plan.statements:
            conn.exec_driver_sql(statement)


def ddl_transaction(conn: sa.Connection) -> None:
    """SQLite: make the transaction SQLAlchemy began a real one before DDL runs in it.

    Python's sqlite3 opens a transaction before INSERT/UPDATE/DELETE only: a
    ``DROP TRIGGER`` and the ``CREATE TRIGGER`` after it would each commit at
    once, and a write of another connection between the two would go
    unlogged (a re-install, an upgrade, the uninstall-alter-install of a
    migration). ``BEGIN IMMEDIATE`` takes the write lock first, so writers wait
    for the commit; SQLAlchemy's commit or rollback then ends it.
    """
    if conn.dialect.name != "sqlite" or conn.get_isolation_level() == "AUTOCOMMIT":
        return
    raw = conn.connection.dbapi_connection
    if raw is not None and not getattr(raw, "in_transaction", True):
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def install(
    bind: Bind,
    table: str,
    *,
    schema: str | None = None,
    lock_timeout_seconds: float | None = None,
) -> Plan:
    """Create the log table, its index and the triggers (idempotent; also re-installs).
    Waits at most ``lock_timeout_seconds`` for a lock (see :func:`apply`)."""
    plan = plan_install(bind, table, schema=schema)
    apply(bind, plan, lock_timeout_seconds=lock_timeout_seconds)
    return plan


def uninstall(
    bind: Bind,
    table: str,
    *,
    schema: str | None = None,
    drop_log: bool = False,
    lock_timeout_seconds: float | None = None,
) -> Plan:
    plan = plan_uninstall(bind, table, schema=schema, drop_log=drop_log)
    apply(bind, plan, lock_timeout_seconds=lock_timeout_seconds)
    return plan


def is_installed(bind: Bind, table: str, *, schema: str | None = None) -> bool:
    """True when every trigger of the change log is present (and is ours, any version)."""
    with connected(bind) as conn:
        info = reflect_table(conn, table, schema)
        found = existing_triggers(conn, info)
    return len(found) == len(info.trigger_names()) and all(ours(t) for t in found.values())


def drift(bind: Bind, table: str, *, schema: str | None = None) -> Drift:
    """How the installed change log of ``table`` differs from the table now.

    Falsy when in sync; ``drift(...).error()`` is the
    :class:`~dbtrigger.errors.ChangeLogDriftError` to raise otherwise.
    """
    with connected(bind) as conn:
        return find_drift(conn, table, schema)


def log_table(bind: Engine | sa.Connection, table: str, schema: str | None) -> sa.Table:
    """The reflected log table of ``table`` (on ``bind``, a connection of its own of an
    engine).

    Raises:
        ConfigurationError: the change log is not installed (names the command),
            or the watched table is not there either (says so first: installing
            cannot help until it is created or the name corrected).
    """
    name = log_table_name(table)
    install = (
        f"`dbtrigger changelog install --url URL --table {table}"
        + (f" --schema {schema}" if schema else "")
        + " --yes`"
    )
    with contextlib.ExitStack() as stack:
        conn = bind if isinstance(bind, sa.Connection) else stack.enter_context(bind.connect())
        with contextlib.suppress(ConfigurationError):
            return reflect_sa_table(conn, name, schema)
        try:  # "install it" cannot help while the watched table itself is not there
            reflect_sa_table(conn, table, schema)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{exc}; then install its change log with {install}") from None
        raise ConfigurationError(
            f"no change log for table {table!r} (table {name} is missing); install it with "
            f"{install}"
        ) from None


@dataclass(frozen=True)
class PrunePlan:
    """What a prune deletes, and what it keeps or takes from readers that have not read it.

    ``rows``: the rows it deletes. ``kept_unread``: per registered reader, rows
    the age/sequence condition matched that the reader has not read yet, and
    that therefore stay. ``lost``: per reader named in ``drop_unread_of``, the
    unread rows it deletes all the same. ``readers``: the registry (None when
    the log has none: installed by an older dbtrigger).
    """

    rows: int
    kept_unread: dict[str, int]
    lost: dict[str, int]
    readers: tuple[Reader, ...] | None
    #: The highest sequence the prune deletes (None: it deletes nothing).
    top: int | None = None
    #: The age cutoff counted with (UTC; None: no age condition). The delete uses it,
    #: never a later one: ``dbt_changed_at`` need not follow ``dbt_seq`` (transactions
    #: overlap), so a later cutoff could take rows below ``top`` the plan did not count.
    cutoff: dt.datetime | None = None
    #: The readers allowed to lose rows, and the checkpoints standing for registered
    #: positions: the delete re-reads the registry with them, chunk by chunk.
    dropping: tuple[str, ...] = ()
    standing: tuple[tuple[str, int], ...] = ()


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
    drop_unread_of: Sequence[str] = (),
    readers_at: Mapping[str, int] | None = None,
    plan: PrunePlan | None = None,
    lock_timeout_seconds: float | None = None,
) -> int:
    """Delete log rows older than ``older_than`` and/or at or below ``up_to_seq``,
    never a row a registered reader has not read (unless it is in ``drop_unread_of``).

    Works in chunks of ``chunk`` rows, each its own short transaction, so a big
    prune never holds locks for long. Returns the rows deleted (with
    ``apply=False``: the rows that would be); :func:`plan_prune` says what it
    keeps for which reader. Each transaction waits at most
    ``lock_timeout_seconds`` (None: 30 s) for a lock another transaction holds
    on the log (a prune runs after a poller's commit, where an unbounded wait
    would stall the poller without a word), then raises
    :class:`~dbtrigger.errors.RetryableError` naming the holders.

    ``up_to_seq`` is how pruning stays safe for pollers whose state you can
    read: pass the lowest checkpoint of every poller reading the log
    (:mod:`dbtrigger.changelog.pruning` does). On top of it, every
    ``ChangeLogSource`` that serves a poller registers its position next to the
    log (:mod:`dbtrigger.changelog.readers`), and no row above the slowest
    registered position is deleted: an age alone never takes a row from a
    reader. ``drop_unread_of`` names the readers that may lose rows (a
    stopped reader, one that will be re-synced); their registry entry records
    what they lost, and they log it at their next fetch. ``readers_at``: the
    checkpoints read from some readers' own state (``--passed-by``), which
    stand for theirs in the registry (a recorded position may lag behind).

    ``plan``: a :func:`plan_prune` of this table already shown (the CLI's dry
    run); the delete then takes the rows it counted, with its age cutoff and its
    highest sequence, and the other row arguments are not read. Either way each
    chunk re-reads the registry in its own transaction: a reader that registered
    (or moved back) after the plan keeps its unread rows, so the prune may delete
    fewer rows than planned, never more (a row committed below the plan's top
    after it, its sequence taken before, counts against the plan's number).

    Raises:
        ConfigurationError: no condition; ``drop_unread_of`` names a reader that
            is not registered; or only ``older_than`` on a log without a
            registry (installed by an older dbtrigger: install again first).
    """
    if plan is None:
        plan = plan_prune(
            engine,
            table,
            schema=schema,
            older_than=older_than,
            up_to_seq=up_to_seq,
            now=now,
            drop_unread_of=drop_unread_of,
            readers_at=readers_at,
            lock_timeout_seconds=lock_timeout_seconds,
        )
    if not apply:
        return plan.rows
    if chunk < 1:
        raise ConfigurationError(f"chunk must be >= 1, got {chunk}")
    if plan.top is None:
        return 0
    seconds = check_lock_timeout(
        INSTALL_LOCK_TIMEOUT if lock_timeout_seconds is None else lock_timeout_seconds
    )
    doing = f"pruning the change log of {table}"
    name = log_table_name(table)
    with (
        ddl_gives_up(engine, name, schema, seconds, f"{doing} ({name})", _PRUNE_UNCHANGED),
        bounded_transaction(engine, seconds) as conn,
    ):
        log = log_table(conn, table, schema)
    matched = log.c.dbt_seq <= plan.top
    if plan.cutoff is not None:
        matched = sa.and_(matched, log.c.dbt_changed_at < _db_time(engine, plan.cutoff))
    registry = readers_table_name(table)
    lost = [name for name, count in plan.lost.items() if count]
    if lost:  # recorded first: an interrupted prune still tells the readers
        with (
            ddl_gives_up(
                engine, registry, schema, seconds, f"{doing} ({registry})", _PRUNE_UNCHANGED
            ),
            bounded_transaction(engine, seconds) as conn,
        ):
            mark_lost(conn, table, schema, lost, plan.top)
    deleted = 0
    # Never more than the plan counted: a transaction that took a sequence number
    # below ``top`` before the plan and committed after it matches too.
    while deleted < plan.rows:
        take = min(chunk, plan.rows - deleted)
        kept = f"{deleted} row(s) deleted before stay deleted, the rest are kept"
        with (
            ddl_gives_up(
                engine,
                log.name,
                log.schema,
                seconds,
                f"{doing} ({log.name})",
                f"{kept}; {_PRUNE_NEXT}",
            ),
            bounded_transaction(engine, seconds) as conn,
        ):
            # Read in the delete's transaction: a reader registered after the plan counts.
            ceiling = _slowest(registered(conn, table, schema), plan)
            where = matched if ceiling is None else sa.and_(matched, log.c.dbt_seq <= ceiling)
            # The chunk's last sequence number bounds the delete: at most `take`
            # matching rows lie at or below it, whatever the dialect's DELETE allows.
            bound = conn.execute(
                sa.select(log.c.dbt_seq)
                .where(where)
                .order_by(log.c.dbt_seq)
                .offset(take - 1)
                .limit(1)
            ).scalar()
            stmt = sa.delete(log).where(where)
            if bound is not None:
                stmt = stmt.where(log.c.dbt_seq <= bound)
            count = conn.execute(stmt).rowcount or 0
        deleted += count
        if bound is None or count == 0:
            break
    return deleted


#: What a prune that gave up waiting for a lock says comes next.
_PRUNE_NEXT = "the next prune goes on from there. End the transaction left open there"
_PRUNE_UNCHANGED = f"nothing was deleted; {_PRUNE_NEXT}"


def _slowest(readers: Sequence[Reader] | None, plan: PrunePlan) -> int | None:
    """The position of the slowest reader the plan protects (None: no registry or reader)."""
    standing = dict(plan.standing)
    return min(
        (standing.get(r.name, r.seq) for r in readers or () if r.name not in plan.dropping),
        default=None,
    )


def plan_prune(
    engine: Engine,
    table: str,
    *,
    schema: str | None = None,
    older_than: dt.timedelta | None = None,
    up_to_seq: int | None = None,
    now: dt.datetime | None = None,
    drop_unread_of: Sequence[str] = (),
    readers_at: Mapping[str, int] | None = None,
    lock_timeout_seconds: float | None = None,
) -> PrunePlan:
    """What :func:`prune` with the same arguments would delete, keep and take (counted).

    Its reads wait at most ``lock_timeout_seconds`` (None: 30 s) for a lock, as the
    prune's deletes do: behind an ``ALTER TABLE`` of the log queued behind an open
    transaction they waited for ever on PostgreSQL, and a day on MariaDB, on an
    engine with no bound of its own (an application's, the CLI's). Giving up is a
    :class:`~dbtrigger.errors.RetryableError` naming who holds locks on the log.
    """
    if older_than is None and up_to_seq is None:
        raise ConfigurationError("prune needs older_than and/or up_to_seq (refusing to delete all)")
    if isinstance(drop_unread_of, str):
        raise ConfigurationError("drop_unread_of must be a list of reader names")
    seconds = check_lock_timeout(
        INSTALL_LOCK_TIMEOUT if lock_timeout_seconds is None else lock_timeout_seconds
    )
    name = log_table_name(table)
    doing = f"pruning the change log of {table} (reading {name})"
    with (
        ddl_gives_up(engine, name, schema, seconds, doing, _PRUNE_UNCHANGED),
        bounded_transaction(engine, seconds) as conn,
    ):
        # (PostgreSQL's reflection waits behind a queued ALTER of the log too.)
        log = log_table(conn, table, schema)
        conditions: list[sa.ColumnElement[bool]] = []
        cutoff = None
        if older_than is not None:
            cutoff = (now or dt.datetime.now(dt.timezone.utc)) - older_than
            conditions.append(log.c.dbt_changed_at < _db_time(engine, cutoff))
        if up_to_seq is not None:
            conditions.append(log.c.dbt_seq <= up_to_seq)
        matched = sa.and_(*conditions)
        readers = registered(conn, table, schema)
        if readers is None and up_to_seq is None:
            raise ConfigurationError(
                f"the change log of {table} has no reader registry (it was installed by an "
                "older dbtrigger), so an age alone cannot tell which rows its readers still "
                f"need. Upgrade it in place: `{install_command(table, schema)}` (each poller "
                "registers at its next fetch), or prune what named pollers passed "
                "(--passed-by POLLER --store ...)"
            )
        if readers is not None and readers_at:
            readers = [
                dataclasses.replace(r, seq=readers_at[r.name]) if r.name in readers_at else r
                for r in readers
            ]
        names = {r.name for r in readers or ()}
        unknown = sorted(set(drop_unread_of) - names)
        if unknown:
            raise ConfigurationError(
                f"{', '.join(unknown)} is not a registered reader of the change log of {table} "
                f"(registered: {', '.join(sorted(names)) or 'none'}); nothing pruned"
            )
        protected = [r for r in readers or () if r.name not in drop_unread_of]
        ceiling = min((r.seq for r in protected), default=None)
        where = matched if ceiling is None else sa.and_(matched, log.c.dbt_seq <= ceiling)

        def count(condition: sa.ColumnElement[bool]) -> int:
            return int(conn.execute(sa.select(sa.func.count()).where(condition)).scalar_one())

        rows, top = conn.execute(
            sa.select(sa.func.count(), sa.func.max(log.c.dbt_seq)).where(where)
        ).one()
        kept = {r.name: count(sa.and_(matched, log.c.dbt_seq > r.seq)) for r in protected}
        lost = {
            r.name: count(sa.and_(where, log.c.dbt_seq > r.seq))
            for r in readers or ()
            if r.name in drop_unread_of
        }
    return PrunePlan(
        rows=int(rows),
        kept_unread={name: n for name, n in kept.items() if n},
        lost=lost,
        readers=None if readers is None else tuple(readers),
        top=None if top is None else int(top),
        cutoff=cutoff,
        dropping=tuple(drop_unread_of),
        standing=tuple(sorted((readers_at or {}).items())),
    )


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
