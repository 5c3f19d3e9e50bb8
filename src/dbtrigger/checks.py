"""``dbtrigger check``: what the docs require of a polled table, verified against the real one.

Users get the same few things wrong, and each fails quietly: a key that is not
unique (rows skipped at batch boundaries), a float cursor (rows skipped, one row
forever), a cursor the application forgets to move on update (the update is
never delivered), a missing ``(cursor, pk)`` index (every fetch scans), a
missing privilege for the visibility guard (the poller stops when another role
connects), a store the worker cannot write. :func:`check_trigger` looks at the
table, its constraints, indexes, defaults and triggers, the database privileges
and the store, and returns one :class:`Finding` per question.

Severities: ``error`` means rows can be lost or the poller cannot run at all
(``dbtrigger check`` exits 1); ``warning`` means it runs and delivers, but
slower, later or with a caveat a person should know; ``ok`` says what was
verified. Nothing here changes the table or a live poller's state: the store
probe writes and deletes a key of its own.

:func:`warn_at_start` runs the same checks (without the store probe) for a
worker that is starting, logs every finding that is not ``ok`` and never raises.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from dbtrigger.errors import (
    CasConflictError,
    ChangeLogDriftError,
    DbTriggerError,
    FetchError,
    OperatorError,
)
from dbtrigger.names import quoted_name, trigger_named
from dbtrigger.sources.base import ChecksItself
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.sources.visibility import TransactionHorizon
from dbtrigger.sources.visibility.mariadb import (
    MYSQL_DIALECTS,
    MariaDbHorizon,
    can_read_transactions,
)
from dbtrigger.sources.visibility.privileges import fell_back_for_process, privilege_gap
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.unreadable import load_state

if TYPE_CHECKING:
    from dbtrigger.changelog.source import ChangeLogSource

log = logging.getLogger("dbtrigger.checks")

OK = "ok"
WARNING = "warning"
ERROR = "error"


@dataclass(frozen=True)
class Finding:
    """The answer to one question about a poller's source or store."""

    check: str
    severity: str
    message: str
    fix: str | None = None
    #: The operator error behind an ``error`` finding, when one was raised:
    #: a starting worker stops on it (:func:`warn_at_start`).
    cause: OperatorError | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "severity": self.severity,
            "message": self.message,
            "fix": self.fix,
        }


@dataclass(frozen=True)
class CheckReport:
    """Every finding for one poller; ``ok`` unless a finding is an ``error``."""

    poller: str
    source: str
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == WARNING]

    def to_dict(self) -> dict[str, Any]:
        return {
            "poller": self.poller,
            "source": self.source,
            "ok": self.ok,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "findings": [f.to_dict() for f in self.findings],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_text(self) -> str:
        lines = [f"check {self.poller} ({self.source})"]
        for f in self.findings:
            lines.append(f"  {f.severity.upper():8} {f.check:22} {f.message}")
            if f.fix and f.severity != OK:
                lines.append(f"  {'':8} {'':22} fix: {f.fix}")
        verdict = (
            "no problem found"
            if not self.errors and not self.warnings
            else f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)"
        )
        if self.errors:
            verdict += ": rows can be lost or the poller cannot run"
        lines.append(verdict)
        return "\n".join(lines)


# --- the table -------------------------------------------------------------------------


def _source_definition(source: SqlAlchemySource, position: Any) -> list[Finding]:
    """Reflection, exact types, unique keys and the checkpoint's kinds (the source's own checks)."""
    try:
        source.validate(position)
    except OperatorError as exc:
        check = "source_access" if "permission" in type(exc).__name__.lower() else "definition"
        return [Finding(check, ERROR, str(exc), cause=exc)]
    except FetchError as exc:
        return [Finding("source_access", ERROR, f"cannot reach the source: {exc}")]
    findings = [Finding("definition", OK, "columns exist; cursor and key types compare exactly")]
    note = source.uniqueness_note
    if source.reflected_table() is None:
        findings.append(
            Finding(
                "pk_unique",
                WARNING,
                "query mode: uniqueness of (cursor, pk) cannot be verified; rows sharing a "
                "cursor value and key would be skipped at batch boundaries",
                "make sure the query returns one row per key (e.g. the table's primary key)",
            )
        )
    elif note is not None:
        findings.append(
            Finding("pk_unique", WARNING, f"a view: {note}", "poll the underlying table")
        )
    else:
        findings.append(Finding("pk_unique", OK, "a declared unique key covers the position"))
    return findings


def _index_finding(source: SqlAlchemySource, table: sa.Table) -> Finding:
    cursor = source.cursor_column
    wanted = [cursor, *(c for c in source.pk_columns if c != cursor)]
    pk = [c.name for c in table.primary_key.columns]
    candidates = [[c.name for c in index.columns] for index in table.indexes]
    if pk:
        candidates.append(pk)
    innodb = source.dialect_name in ("mysql", "mariadb")
    for declared in candidates:
        columns = declared
        if innodb and declared[: len(wanted)] == [cursor] and pk == wanted[1:]:
            columns = declared + pk  # InnoDB appends the primary key to every secondary index
        if columns[: len(wanted)] == wanted:
            return Finding("cursor_index", OK, f"index on ({', '.join(wanted)})")
    cols = ", ".join(wanted)
    return Finding(
        "cursor_index",
        WARNING,
        f"no index starts with ({cols}): every fetch sorts or scans the table instead of "
        "reading one batch from an index",
        f"CREATE INDEX ix_{table.name}_cursor_pk ON {table.fullname} ({cols})",
    )


def _nullable_finding(conn: sa.Connection, source: SqlAlchemySource, table: sa.Table) -> Finding:
    column = table.c[source.cursor_column]
    if not column.nullable:
        return Finding("cursor_nullable", OK, f"{column.name} is NOT NULL")
    if source.dialect_name == "sqlite" and _sqlite_rowid(conn, table, column.name):
        return Finding("cursor_nullable", OK, f"{column.name} is the rowid (never NULL)")
    return Finding(
        "cursor_nullable",
        WARNING,
        f"{column.name} allows NULL: such rows are not delivered until they get a value "
        "(reported by the null_cursor_rows gauge and a warning)",
        f"ALTER the column to NOT NULL with a default, or poll COALESCE({column.name}, ...) "
        "in query mode",
    )


def _sqlite_rowid(conn: sa.Connection, table: sa.Table, name: str) -> bool:
    """Whether ``name`` is SQLite's rowid: the table's one ``INTEGER PRIMARY KEY``
    column (declared so exactly), which turns a NULL into the next number. Any other
    key column of SQLite takes NULL; SQLAlchemy reflects both as nullable."""
    quote = conn.dialect.identifier_preparer.quote
    pragma = f"PRAGMA {quote(table.schema) + '.' if table.schema else ''}table_info"
    rows = conn.exec_driver_sql(f"{pragma}({quote(table.name)})")
    keys = [(row[1], str(row[2]).upper()) for row in rows if row[5]]
    return keys == [(name, "INTEGER")]


def _trigger_texts(conn: sa.Connection, source: SqlAlchemySource, table: sa.Table) -> list[str]:
    """The bodies of the table's triggers (empty when the dialect is not known here)."""
    dialect = source.dialect_name
    if dialect == "postgresql":
        rows = conn.execute(
            sa.text(
                "SELECT p.prosrc FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid "
                "WHERE t.tgrelid = to_regclass(:rel) AND NOT t.tgisinternal"
            ),
            {"rel": _quoted_name(conn, table)},
        )
    elif dialect in ("mysql", "mariadb"):
        rows = conn.execute(
            sa.text(
                "SELECT ACTION_STATEMENT FROM information_schema.TRIGGERS "
                "WHERE EVENT_OBJECT_SCHEMA = COALESCE(:schema, DATABASE()) "
                "AND EVENT_OBJECT_TABLE = :table"
            ),
            {"schema": table.schema, "table": table.name},
        )
    elif dialect == "sqlite":
        rows = conn.execute(
            sa.text("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = :t"),
            {"t": table.name},
        )
    else:
        return []
    return [str(r[0] or "") for r in rows]


def _quoted_name(conn: sa.Connection, table: sa.Table) -> str:
    return quoted_name(conn.dialect.identifier_preparer.quote, table.name, table.schema)


def _trigger_fix(name: str) -> str:
    option = "ON UPDATE CURRENT_TIMESTAMP(6)"  # MariaDB/MySQL column option
    return f"a trigger that sets NEW.{name} on every write (MariaDB/MySQL: {option})"


def _filled_by(conn: sa.Connection, source: SqlAlchemySource, table: sa.Table) -> Finding:
    """Who writes the cursor: a sequence, a default, ON UPDATE, a trigger, or the application."""
    column = table.c[source.cursor_column]
    name = column.name
    default = column.server_default
    default_text = ""
    if isinstance(default, sa.DefaultClause):
        arg = default.arg
        default_text = arg.text if isinstance(arg, sa.TextClause) else str(arg)
    sequence = (
        isinstance(default, sa.Identity)
        or "nextval(" in default_text.lower()
        or (column.autoincrement is True and column.primary_key)
        or (
            source.dialect_name == "sqlite"
            and [c.name for c in table.primary_key.columns] == [name]
            and type(column.type).__name__ == "INTEGER"
        )
    )
    assigns = re.compile(rf"\b(new\s*\.\s*)?[`\"]?{re.escape(name)}[`\"]?\s*(:=|=)", re.I)
    by_trigger = any(assigns.search(text) for text in _trigger_texts(conn, source, table))
    on_update = "on update" in default_text.lower()
    w7 = (
        "an UPDATE that does not move the cursor is never delivered (W7); for a "
        "changes feed, poll an updated_at maintained on every write"
    )
    if sequence:
        return Finding(
            "cursor_filled_by_db", OK, f"{name} is assigned by the database (sequence); {w7}"
        )
    if by_trigger or on_update:
        how = "a trigger" if by_trigger else "ON UPDATE"
        return Finding("cursor_filled_by_db", OK, f"{name} is maintained by the database ({how})")
    if default_text:
        return Finding(
            "cursor_filled_by_db",
            WARNING,
            f"{name} has a default ({default_text}) for INSERTs, but nothing in the database "
            f"moves it on UPDATE: {w7}",
            _trigger_fix(name),
        )
    return Finding(
        "cursor_filled_by_db",
        WARNING,
        f"{name} has no default and no trigger: the application fills it. A writer that "
        f"forgets it, or uses its own clock, makes rows arrive late or never; {w7}",
        f"DEFAULT now()/CURRENT_TIMESTAMP(6) plus an update trigger on {name}",
    )


def _privilege_finding(conn: sa.Connection, source: SqlAlchemySource) -> Finding | None:
    """A guard that reads other sessions needs a privilege: PostgreSQL's transaction
    horizon ``pg_read_all_stats``, MariaDB/MySQL's ``PROCESS`` (without it ``auto``
    falls back to a bounded window). The fix is the GRANT for this very account."""
    dialect = source.dialect_name
    if dialect != "postgresql" and dialect not in MYSQL_DIALECTS:
        return None
    guard = source.planned_guard()
    if guard is None:
        return None
    # Planned without a connection, auto assumes PROCESS is missing: ask the server.
    if dialect in MYSQL_DIALECTS and fell_back_for_process(guard) and can_read_transactions(conn):
        return Finding(
            "visibility_privilege",
            OK,
            "the account has PROCESS: auto uses the exact transaction horizon",
        )
    gap = privilege_gap(conn, dialect, guard)
    if gap is None:
        if isinstance(guard, (TransactionHorizon, MariaDbHorizon)):
            return Finding(
                "visibility_privilege",
                OK,
                "the polling account can see every session (transaction horizon)",
            )
        return Finding(
            "visibility_privilege", OK, f"visibility guard {guard.label()} needs no extra privilege"
        )
    severity = ERROR if isinstance(guard, MariaDbHorizon) else WARNING
    return Finding("visibility_privilege", severity, gap.message, gap.grant)


def _changelog_findings(source: ChangeLogSource, position: Any) -> list[Finding]:
    """The log table as any polled table, then its triggers against the watched table."""
    try:
        inner = source.log_source()
    except OperatorError as exc:
        return [Finding("changelog_installed", ERROR, str(exc), cause=exc)]
    findings = [
        dataclasses.replace(
            f,
            message=f"{inner.cursor_column} is assigned by the database for every "
            "insert, update and delete the triggers log: each change is a row of its own",
        )
        if f.check == "cursor_filled_by_db" and f.severity == OK  # not the table's W7
        else f
        for f in check_source(inner, position)
    ]
    if any(f.severity == ERROR for f in findings):
        return findings
    try:
        drift = source.check_drift()
    except ChangeLogDriftError as exc:
        fix = exc.fields.get("fix")
        findings.append(Finding("changelog_triggers", ERROR, str(exc), fix, cause=exc))
        return findings
    except DbTriggerError as exc:
        findings.append(Finding("changelog_triggers", WARNING, f"could not be checked: {exc}"))
        return findings
    for note in drift.notes:
        findings.append(
            Finding(
                "changelog_triggers",
                WARNING,
                note,
                "GRANT TRIGGER ON <table> TO <polling account>, or run `dbtrigger changelog "
                "check` as the account that installed it",
            )
        )
    if not drift.notes:
        findings.append(
            Finding("changelog_triggers", OK, "the change log's triggers match the table")
        )
    return findings


def check_source(source: Any, position: Any = None) -> list[Finding]:
    """Every table check for ``source`` (a :class:`SqlAlchemySource`), as findings."""
    from dbtrigger.changelog.source import ChangeLogSource  # noqa: PLC0415 - avoids a cycle

    if isinstance(source, ChangeLogSource):
        return _changelog_findings(source, position)
    if isinstance(source, ChecksItself):  # e.g. a log source: slot, server settings
        return [Finding(f.check, f.severity, f.message, f.fix) for f in source.self_check()]
    if not isinstance(source, SqlAlchemySource):
        return [
            Finding(
                "definition",
                WARNING,
                f"source type {type(source).__name__}: only SqlAlchemySource tables are checked",
            )
        ]
    findings = _source_definition(source, position)
    if any(f.severity == ERROR for f in findings):
        return findings
    table = source.reflected_table()
    try:
        with source.engine.connect() as conn:
            if table is not None:
                findings.append(_index_finding(source, table))
                findings.append(_nullable_finding(conn, source, table))
                findings.append(_filled_by(conn, source, table))
            privilege = _privilege_finding(conn, source)
            if privilege is not None:
                findings.append(privilege)
    except sa.exc.SQLAlchemyError as exc:
        findings.append(Finding("source_access", WARNING, f"a check query failed: {exc.args[0]}"))
    return findings


# --- the store ---------------------------------------------------------------------------


def probe_key(poller: str) -> str:
    return f"{poller}.check-probe"


def check_store(store: CheckpointStore, poller: str) -> Finding:
    """Write, then delete, a key of the check's own: a live poller's document is never touched."""
    key = probe_key(poller)
    data = json.dumps(
        {"dbtrigger_check_probe": poller, "at": dt.datetime.now(dt.timezone.utc).isoformat()}
    ).encode()
    try:
        try:
            etag = store.write(key, data, if_match=None)
        except CasConflictError:  # left by a check that died between write and delete
            stale = store.read(key)
            if stale is not None:
                store.delete(key, if_match=stale.etag)
            etag = store.write(key, data, if_match=None)
        store.delete(key, if_match=etag)
    except DbTriggerError as exc:
        return Finding(
            "store_writable",
            ERROR,
            f"{store.describe()}: a probe write failed ({type(exc).__name__}: {exc}); the "
            "poller could not commit a checkpoint",
            "check the store's credentials, permissions and reachability",
        )
    return Finding("store_writable", OK, f"{store.describe()}: a probe key was written and deleted")


def _stored_position(store: CheckpointStore, poller: str) -> tuple[Any, Finding | None]:
    try:
        stored = store.read(poller)
        if stored is None:
            return None, None
        return load_state(store, poller, stored).position, None
    except DbTriggerError as exc:
        return None, Finding("state", ERROR, f"the state document cannot be read: {exc}")


# --- entry points ------------------------------------------------------------------------


def check_trigger(trigger: Any, *, probe_store: bool = True) -> CheckReport:
    """All checks for a :class:`~dbtrigger.PollTrigger`: its source, checkpoint and store."""
    source = trigger.source
    position, state_problem = _stored_position(trigger.store, trigger.name)
    findings: list[Finding] = [state_problem] if state_problem else []
    spec = trigger.operator_spec() if hasattr(trigger, "operator_spec") else None
    for f in check_source(source, position):  # a source's commands name MODULE:TRIGGER
        fix = None if f.fix is None else trigger_named(f.fix, spec)
        findings.append(dataclasses.replace(f, message=trigger_named(f.message, spec), fix=fix))
    if probe_store:
        findings.append(check_store(trigger.store, trigger.name))
    return CheckReport(trigger.name, source.name, tuple(findings))


def warn_at_start(
    trigger: Any,
    *,
    logger: logging.Logger | None = None,
    checks: Callable[..., CheckReport] = check_trigger,
    raise_operator_errors: bool = False,
) -> CheckReport | None:
    """Run the checks for a starting worker; log what is not ``ok``.

    Errors are logged at ERROR and warnings at WARNING, one record each with
    ``event="startup_check"``; the worker goes on (its first tick refuses for
    real if the source is unusable). Returns None if the checks themselves failed.

    With ``raise_operator_errors``, a source the checks could not even read
    for a reason a person must fix (a missing database, table or column, a
    refused permission) raises that :class:`~dbtrigger.errors.OperatorError`
    instead, before anything is logged: the worker's first tick would stop on
    the same error, and the operator should read it once, not three times.
    """
    logger = logger or log
    try:
        report = checks(trigger, probe_store=False)
    except Exception as exc:  # noqa: BLE001 - a failed check must never stop the worker
        logger.warning("startup checks for %s could not run: %s", trigger.name, exc)
        return None
    if raise_operator_errors:
        for f in report.findings:
            if f.cause is not None:
                raise f.cause
    for f in report.findings:
        if f.severity == OK:
            continue
        level = logging.ERROR if f.severity == ERROR else logging.WARNING
        fix = f" (fix: {f.fix})" if f.fix else ""
        logger.log(
            level,
            "%s: %s: %s%s",
            report.poller,
            f.check,
            f.message,
            fix,
            extra={"event": "startup_check", "poller": report.poller, "check": f.check},
        )
    return report


def summary(reports: Sequence[CheckReport]) -> int:
    """The exit code for ``dbtrigger check``: 1 when any report has an error."""
    return 0 if all(r.ok for r in reports) else 1


__all__ = [
    "ERROR",
    "OK",
    "WARNING",
    "CheckReport",
    "Finding",
    "check_source",
    "check_store",
    "check_trigger",
    "summary",
    "warn_at_start",
]
