"""The claim columns, their statuses, and the per-dialect clock they are compared with.

A queue row carries its delivery state in seven columns, all prefixed
``dbt_`` so they cannot collide with the user's own names:

========================  ==================================================
``dbt_status``            ``ready`` / ``claimed`` / ``done`` / ``dead``
``dbt_attempts``          claims taken so far (counted when a claim is taken,
                          so a worker that dies mid-handler still counts)
``dbt_visible_at``        when the row may be claimed (again)
``dbt_claim_token``       the claim that holds (or completed) the row
``dbt_claimed_by``        the worker id of that claim
``dbt_last_error``        the latest failure, redacted and truncated
``dbt_done_at``           when the row reached ``done``, ``dead`` or ``canceled``
========================  ==================================================

An eighth column is optional: ``dbt_priority`` (an integer, default 0,
installed by ``dbtrigger queue install --priority``). With it, claims take the
highest priority first, and by ``dbt_visible_at`` within one priority.

Why one predicate is enough: a row is claimable when ``dbt_status`` is
``ready`` or ``claimed`` *and* ``dbt_visible_at <= now``. A running claim has
``dbt_visible_at`` in the future (claim time + visibility timeout, pushed on by
the heartbeat), so it is not claimable until it expires; an expired claim is
claimable again without any rescuer process. Finished rows (``done``, ``dead``)
get ``dbt_visible_at`` set to a far-future sentinel, so on a database without
partial indexes (MariaDB/MySQL) a plain index on ``dbt_visible_at`` still keeps
them out of the claim's range scan.

All times are the *database's* clock (``now()``, ``UTC_TIMESTAMP(6)``,
``strftime('now')``), never the workers': workers on hosts with skewed clocks
still agree on when a claim expires.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import ColumnElement

from dbtrigger.errors import ConfigurationError

PREFIX = "dbt_"
STATUS = "dbt_status"
ATTEMPTS = "dbt_attempts"
VISIBLE_AT = "dbt_visible_at"
CLAIM_TOKEN = "dbt_claim_token"  # noqa: S105 - a column name
CLAIMED_BY = "dbt_claimed_by"
LAST_ERROR = "dbt_last_error"
DONE_AT = "dbt_done_at"
#: Optional: claims take higher priorities first (``queue install --priority``).
PRIORITY = "dbt_priority"

#: Every claim column, in the order ``queue install`` adds them.
CLAIM_COLUMNS: tuple[str, ...] = (
    STATUS,
    ATTEMPTS,
    VISIBLE_AT,
    CLAIM_TOKEN,
    CLAIMED_BY,
    LAST_ERROR,
    DONE_AT,
)

READY = "ready"
CLAIMED = "claimed"
DONE = "done"
DEAD = "dead"
#: Taken off the queue by an operator or producer before it ran (final, like done).
CANCELED = "canceled"
STATUSES: tuple[str, ...] = (READY, CLAIMED, DONE, DEAD, CANCELED)
#: Statuses a row ends in: nothing claims it again unless an operator re-drives it.
FINISHED: tuple[str, ...] = (DONE, DEAD, CANCELED)
#: Statuses a claim may take a row from (``claimed`` only once it expired).
CLAIMABLE: tuple[str, ...] = (READY, CLAIMED)

#: Longest ``dbt_last_error`` text kept (the column holds 2000 characters).
ERROR_LIMIT = 2000
#: ``dbt_claimed_by`` column width.
WORKER_ID_LIMIT = 200

SUPPORTED_DIALECTS = frozenset({"postgresql", "mysql", "mariadb", "sqlite"})

_SQLITE_FORMAT = "%Y-%m-%d %H:%M:%f"
_SQLITE_PY_FORMAT = "%Y-%m-%d %H:%M:%S.%f"


class DialectTime:
    """Time expressions on the database clock, and the claim columns' types.

    PostgreSQL uses ``timestamptz``; MariaDB/MySQL ``DATETIME(6)`` holding UTC;
    SQLite text ``YYYY-MM-DD HH:MM:SS.SSS`` in UTC, which sorts and compares
    as time because the format is fixed.
    """

    def __init__(self, dialect: str) -> None:
        if dialect not in SUPPORTED_DIALECTS:
            raise ConfigurationError(
                f"claim queues support PostgreSQL, MariaDB/MySQL and SQLite, not {dialect!r}"
            )
        self.dialect = "mysql" if dialect == "mariadb" else dialect

    def now(self) -> ColumnElement[Any]:
        """The database's current time, in the column's representation."""
        if self.dialect == "postgresql":
            return sa.func.now()
        if self.dialect == "mysql":
            return sa.func.utc_timestamp(sa.literal_column("6"))
        return sa.func.strftime(_SQLITE_FORMAT, "now")

    def plus(self, seconds: float) -> ColumnElement[Any]:
        """``now() + seconds`` (seconds is bound, never rendered into the SQL)."""
        if self.dialect == "postgresql":
            return sa.func.now() + sa.func.make_interval(
                0, 0, 0, 0, 0, 0, sa.bindparam("dbt_secs", float(seconds), type_=sa.Float)
            )
        if self.dialect == "mysql":
            return sa.func.timestampadd(
                sa.literal_column("MICROSECOND"),
                sa.bindparam("dbt_us", round(seconds * 1_000_000), type_=sa.BigInteger),
                sa.func.utc_timestamp(sa.literal_column("6")),
            )
        return sa.func.strftime(
            _SQLITE_FORMAT,
            "now",
            sa.bindparam("dbt_mod", f"{float(seconds):+.3f} seconds", type_=sa.String),
        )

    def plus_params(self, seconds: float) -> dict[str, Any]:
        """The parameter of :meth:`plus` for ``seconds``, to run a statement built
        once with another value (prepared statements take it per execution)."""
        if self.dialect == "postgresql":
            return {"dbt_secs": float(seconds)}
        if self.dialect == "mysql":
            return {"dbt_us": round(seconds * 1_000_000)}
        return {"dbt_mod": f"{float(seconds):+.3f} seconds"}

    def far_future(self) -> Any:
        """The ``dbt_visible_at`` of finished rows: after any real time."""
        if self.dialect == "postgresql":
            return dt.datetime(9999, 12, 31, tzinfo=dt.timezone.utc)
        if self.dialect == "mysql":
            return dt.datetime(9999, 12, 31)
        return "9999-12-31 00:00:00.000"

    def age_seconds(self, column: ColumnElement[Any]) -> ColumnElement[Any]:
        """Seconds from ``column`` to the database's now."""
        if self.dialect == "postgresql":
            return sa.func.extract("epoch", sa.func.now() - column)
        if self.dialect == "mysql":
            return (
                sa.func.timestampdiff(
                    sa.literal_column("MICROSECOND"),
                    column,
                    sa.func.utc_timestamp(sa.literal_column("6")),
                )
                / 1_000_000.0
            )
        return (sa.func.julianday("now") - sa.func.julianday(column)) * 86400.0

    def at(self, moment: dt.datetime) -> Any:
        """A bound value for the aware time ``moment``, in the column's representation
        (a scheduled ``dbt_visible_at``)."""
        moment = moment.astimezone(dt.timezone.utc)
        if self.dialect == "postgresql":
            return moment
        if self.dialect == "mysql":
            return moment.replace(tzinfo=None)
        return moment.strftime(_SQLITE_PY_FORMAT)[:-3]

    def ago(self, seconds: float) -> Any:
        """A bound value for ``now - seconds`` computed here, for ``prune``'s cutoff.

        Prune compares ``dbt_done_at`` with a cutoff; computing the cutoff as an
        expression would work too, but a value makes the dry run and the real run
        agree exactly on which rows they mean.
        """
        return self.at(dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds))

    # --- DDL ------------------------------------------------------------------------

    def time_type(self) -> sa.types.TypeEngine[Any]:
        if self.dialect == "postgresql":
            return sa.DateTime(timezone=True)
        if self.dialect == "mysql":
            return mysql.DATETIME(fsp=6)
        return sa.String(23)

    def now_default(self) -> sa.TextClause:
        if self.dialect == "postgresql":
            return sa.text("now()")
        if self.dialect == "mysql":
            return sa.text("(UTC_TIMESTAMP(6))")
        return sa.text("(strftime('%Y-%m-%d %H:%M:%f', 'now'))")

    def claim_columns(self) -> list[sa.Column[Any]]:
        """Fresh column objects for the claim columns (for DDL)."""
        return [
            sa.Column(STATUS, sa.String(8), nullable=False, server_default=sa.text("'ready'")),
            sa.Column(ATTEMPTS, sa.Integer, nullable=False, server_default=sa.text("0")),
            sa.Column(
                VISIBLE_AT, self.time_type(), nullable=False, server_default=self.now_default()
            ),
            sa.Column(CLAIM_TOKEN, sa.String(36), nullable=True),
            sa.Column(CLAIMED_BY, sa.String(WORKER_ID_LIMIT), nullable=True),
            sa.Column(LAST_ERROR, sa.String(ERROR_LIMIT), nullable=True),
            sa.Column(DONE_AT, self.time_type(), nullable=True),
        ]

    def claimable_index(self, table: sa.Table, name: str) -> sa.Index:
        """The index the claim scans: partial where the dialect has partial indexes.

        PostgreSQL and SQLite index only rows in a claimable status, so the
        index stays as small as the backlog however many finished rows the
        table keeps. MariaDB/MySQL have no partial indexes: the index covers
        every row, but finished rows sit at the far-future end of it, outside
        the claim's ``dbt_visible_at <= now`` range, so a claim never reads them.
        """
        column = table.c[VISIBLE_AT]
        if self.dialect in ("postgresql", "sqlite"):
            where = table.c[STATUS].in_(CLAIMABLE)
            return sa.Index(
                name,
                column,
                postgresql_where=where,
                sqlite_where=where,
            )
        return sa.Index(name, column)

    def priority_column(self) -> sa.Column[Any]:
        """The optional ``dbt_priority`` column (for DDL)."""
        return sa.Column(PRIORITY, sa.Integer, nullable=False, server_default=sa.text("0"))

    def priority_index(self, table: sa.Table, name: str) -> sa.Index:
        """The index a prioritised claim scans: ``(dbt_priority, dbt_visible_at)``,
        partial like :meth:`claimable_index` where the dialect allows.

        A claim reads one priority at a time, highest first: the next priority
        present is one index probe, and the rows of one priority that are due
        now are a range at the start of its part of the index. Rows scheduled
        later (or claimed, or waiting for a retry) sit after that range, so they
        are never read, however many there are.
        """
        columns = (table.c[PRIORITY], table.c[VISIBLE_AT])
        if self.dialect in ("postgresql", "sqlite"):
            where = table.c[STATUS].in_(CLAIMABLE)
            return sa.Index(name, *columns, postgresql_where=where, sqlite_where=where)
        return sa.Index(name, *columns)


#: The fewest characters each text claim column must hold.
_TEXT_LENGTHS = {
    STATUS: len(CANCELED),
    CLAIM_TOKEN: 32,
    CLAIMED_BY: WORKER_ID_LIMIT,
    LAST_ERROR: ERROR_LIMIT,
}


def check_claim_columns(table: sa.Table, time: DialectTime, dialect: Dialect) -> None:
    """Refuse claim columns whose declared type the claim statements cannot use.

    Checked when the queue starts, against the reflected table: a type that
    only fails later fails every settlement instead (SQLite's ``TIMESTAMP``
    makes the driver refuse the claim's text times), or fails in rare cases
    (a ``VARCHAR(100)`` error column, a long worker id), or is quietly wrong
    (PostgreSQL ``timestamp without time zone`` compares with ``now()`` in
    the session's time zone; MySQL ``TIMESTAMP`` stops in 2038, before the
    far-future time of finished rows). A status, attempts, visible-at or priority
    column that allows NULL is refused too: a row with NULL there is never
    claimed (``NULL <= now`` is not true), or fails every claim (``attempts + 1``).

    Raises:
        ConfigurationError: naming each column, its declared type and the
            expected one (what ``dbtrigger queue install`` creates).
    """
    problems = []
    wanted = time.claim_columns()
    if PRIORITY in table.c:
        wanted.append(time.priority_column())
    for want in wanted:
        have = table.c[want.name].type
        why = _type_problem(want.name, have, time.dialect)
        if why is not None:
            problems.append(
                f"{table.name}.{want.name} is declared {_declared(have, dialect)}, expected "
                f"{want.type.compile(dialect=dialect)}: {why}"
            )
        if not want.nullable and table.c[want.name].nullable:
            problems.append(
                f"{table.name}.{want.name} allows NULL, expected NOT NULL (with the default "
                "`queue install` gives it): a row with NULL in it is never claimed, or fails "
                "every claim"
            )
    if problems:
        raise ConfigurationError(
            "claim column(s) of a type the queue cannot use:\n  "
            + "\n  ".join(problems)
            + "\nchange them to the expected types (the ones `dbtrigger queue install` creates)"
        )


def _type_problem(name: str, have: sa.types.TypeEngine[Any], dialect: str) -> str | None:
    untyped = dialect == "sqlite" and isinstance(have, sa.types.NullType)
    if name in _TEXT_LENGTHS:
        if untyped:
            return None
        if not isinstance(have, sa.String) or isinstance(have, sa.Enum):
            return "the claim writes text to it"
        length = getattr(have, "length", None)
        if dialect != "sqlite" and length is not None and length < _TEXT_LENGTHS[name]:
            return f"it holds {length} characters, the claim writes up to {_TEXT_LENGTHS[name]}"
        return None
    if name in (ATTEMPTS, PRIORITY):
        ok = untyped or isinstance(have, sa.Integer)
        return None if ok else "the claim compares whole numbers in it"
    if dialect == "sqlite":
        if untyped or (isinstance(have, sa.String) and not isinstance(have, sa.Enum)):
            return None
        return (
            "on SQLite claim times are text ('YYYY-MM-DD HH:MM:SS.SSS', UTC); with a "
            "date/time or numeric type the driver converts them and every settlement fails"
        )
    if not isinstance(have, sa.DateTime):
        return "the claim stores the database's time in it"
    if dialect == "postgresql" and not have.timezone:
        return "without a time zone it compares with now() in each session's time zone"
    if dialect == "mysql" and isinstance(have, sa.TIMESTAMP):
        return (
            "TIMESTAMP converts through the session time zone and ends in 2038, before "
            "the far-future time of finished rows"
        )
    if dialect == "mysql" and (getattr(have, "fsp", None) or 0) < 6:
        return "without microseconds a claim can expire up to a second early"
    return None


def _declared(have: sa.types.TypeEngine[Any], dialect: Dialect) -> str:
    try:
        return str(have.compile(dialect=dialect))
    except sa.exc.CompileError:
        return "without a type"


def check_unique_key(table: sa.Table, key: Sequence[str]) -> None:
    """Refuse key columns that are missing or that no primary key or unique index covers
    (two rows could then share a claim)."""
    missing = [k for k in key if k not in table.c]
    if missing:
        raise ConfigurationError(
            f"{table.name} has no column(s) {', '.join(missing)}; "
            f"available: {', '.join(sorted(table.c.keys()))}"
        )
    wanted = set(key)
    unique_sets = [{c.name for c in table.primary_key.columns}]
    unique_sets += [{c.name for c in i.columns} for i in table.indexes if i.unique]
    unique_sets += [
        {c.name for c in u.columns} for u in table.constraints if isinstance(u, sa.UniqueConstraint)
    ]
    if not any(s and s <= wanted for s in unique_sets):
        raise ConfigurationError(
            f"pk_columns {list(key)} of {table.name} are not unique: no primary key or "
            "unique index/constraint covers them, so two rows could share a claim. "
            "Add one, or name the table's real key"
        )


def index_name(table: str, what: str = "claimable") -> str:
    """``ix_<table>_dbt_claimable`` (``what``: ``priority`` for the priority index),
    shortened to fit 63 characters."""
    name = f"ix_{table}_dbt_{what}"
    return name if len(name) <= 63 else f"ix_{table[:40]}_dbt_{what}"


def check_skip_locked(conn: sa.Connection, dialect: str) -> None:
    """Refuse a MariaDB/MySQL without ``FOR UPDATE SKIP LOCKED``: there competing
    workers would queue behind each other's claims instead of passing them."""
    if dialect != "mysql":
        return
    version = tuple(conn.dialect.server_version_info or ())
    mariadb = bool(getattr(conn.dialect, "is_mariadb", False))
    needed = (10, 6) if mariadb else (8, 0, 1)
    if version < needed:
        product = "MariaDB" if mariadb else "MySQL"
        have = ".".join(str(v) for v in version)
        want = ".".join(str(v) for v in needed)
        raise ConfigurationError(
            f"{product} {have} has no FOR UPDATE SKIP LOCKED (needs {want} or later): "
            "competing workers would wait on each other's claims. Upgrade the server, "
            "or use the keyset poller (PollTrigger) with a single lease owner"
        )
