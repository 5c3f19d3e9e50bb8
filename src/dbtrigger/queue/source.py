"""``ClaimSource``: a table that is a work queue, claimed row by row by competing workers.

Unlike :class:`~dbtrigger.SqlAlchemySource` (which never writes to the source
and follows it with one checkpoint), a claim source *writes its delivery state
onto the queue*: each row is claimed by one worker at a time with a visibility
timeout, and finished as done, retried later or dead. Any number of workers may
claim at once; none needs a lease or a state document.

Two modes:

* ``mode="columns"`` (the "ideal polling table"): the claim columns
  (:mod:`dbtrigger.queue.schema`) live on the user's table. ``dbtrigger queue
  install`` prints (and with ``--yes`` applies) the DDL.
* ``mode="sidecar"``: the user's table is untouched. A
  :class:`~dbtrigger.queue.sidecar.SidecarFeeder` (a keyset poller) copies
  ``(key, cursor)`` of new and changed rows into a claims table, and workers
  claim from there (:mod:`dbtrigger.queue.sidecar`).

The mode chooses a :class:`~dbtrigger.queue.layout.ClaimLayout`, built once
with the source; everything else is the same statements on either table.

Configuration is checked on the first use against the real table, and every
mistake is a :class:`~dbtrigger.errors.ConfigurationError` that says what to
do: missing claim columns (the message prints the install command), claim
columns of a type the claim cannot use, key columns that are not unique
(:mod:`dbtrigger.queue.schema` holds those checks), a ``where`` filter that
touches the claim columns, a MariaDB/MySQL too old for ``SKIP LOCKED``.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from dbtrigger._columns import ColumnWatch, probe_or_none
from dbtrigger._database_url import DatabaseUrl
from dbtrigger._driver_errors import failed_as, short_error
from dbtrigger._engine import LazyEngine, given_connect_args, reflect_table
from dbtrigger._lock_wait import sets_own_lock_bound
from dbtrigger._paste import absolute_sqlite_url
from dbtrigger.errors import (
    CommitError,
    ConfigurationError,
    FetchError,
)
from dbtrigger.names import validate_sql_identifier
from dbtrigger.queue import operations, producer
from dbtrigger.queue.engines import (
    claim_view,
    engine_options,
    prepare_own_engine,
    unit_of_work,
)
from dbtrigger.queue.layout import Claim, ClaimedRow, ClaimLayout, ColumnsLayout, QueueTable
from dbtrigger.queue.lock_waits import change_gives_up, reads
from dbtrigger.queue.operations import QueueCounts
from dbtrigger.queue.producer import RunAfter
from dbtrigger.queue.schema import PREFIX, DialectTime, check_skip_locked, check_unique_key
from dbtrigger.queue.sidecar_table import SidecarLayout
from dbtrigger.queue.statements import (
    ClaimBatch,
    ClaimTable,
    DeadItem,
    Key,
    RetryItem,
    Settled,
)
from dbtrigger.redaction import safe_url_text

Mode = Literal["columns", "sidecar"]
OnDone = Literal["mark", "delete"]

_CLAIM_REFERENCE = re.compile(re.escape(PREFIX), re.IGNORECASE)


def install_command(url: str, table: str, schema: str | None, mode: str = "columns") -> str:
    """The ``dbtrigger queue install`` line that fixes a missing-columns error."""
    parts = ["dbtrigger queue install", f"--url '{absolute_sqlite_url(url)}'", f"--table {table}"]
    if schema:
        parts.append(f"--schema {schema}")
    if mode != "columns":
        parts.append(f"--mode {mode}")
    return " ".join(parts)


class ClaimSource:
    """A queue table for :class:`~dbtrigger.queue.trigger.QueueTrigger`.

    Args:
        url: SQLAlchemy URL (``%APP_SETTING%`` references are resolved).
        table / schema: the queue table (validated identifiers).
        pk_columns: columns that identify a row; a primary key or unique index
            must cover them.
        where: optional filter on the user's own columns (SQL text from
            configuration; ``:name`` placeholders bound from ``parameters``).
            It must not mention the claim columns: the claim manages those.
        mode: ``"columns"`` (claim columns on the table) or ``"sidecar"``
            (a claims table next to it, fed by a :class:`SidecarFeeder`).
        on_done: ``"mark"`` keeps finished rows as ``done`` (prune them with
            ``dbtrigger queue prune``); ``"delete"`` deletes them.
        cursor_column: sidecar mode: the monotonic column the feeder follows
            (as for :class:`~dbtrigger.SqlAlchemySource`; workers do not need it).
        claims_table: sidecar mode: the claims table's name (default
            ``dbtrigger_claims``, in ``schema``; one table serves many queues).
        engine_kwargs: passed to :func:`sqlalchemy.create_engine`; the queue's
            lock bound is merged into their ``connect_args``
            (:func:`~dbtrigger.queue.engines.bounded_connect_args`).
        engine: share an existing engine instead of creating one, as for
            :class:`~dbtrigger.SqlAlchemySource` (``url`` is then only used for
            the name and may be omitted): the passwordless recipe is
            ``engine=entra_id_engine(url)`` (:func:`dbtrigger.azure.entra_id_engine`).
            The source uses it through a view of its own (autocommit on
            PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), so the engine's other
            users see no change; :meth:`close` leaves it open.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        table: str,
        pk_columns: Sequence[str],
        schema: str | None = None,
        where: str | None = None,
        parameters: Mapping[str, Any] | None = None,
        mode: Mode = "columns",
        on_done: OnDone = "mark",
        cursor_column: str | None = None,
        claims_table: str = "dbtrigger_claims",
        engine_kwargs: Mapping[str, Any] | None = None,
        engine: Engine | None = None,
    ) -> None:
        if url is None and engine is None:
            raise ConfigurationError("ClaimSource needs url= or engine=")
        if engine is not None and engine_kwargs:
            raise ConfigurationError(
                "engine_kwargs= configures an engine the source creates; with engine= "
                "configure that engine instead"
            )
        if mode not in ("columns", "sidecar"):
            raise ConfigurationError(f"mode must be 'columns' or 'sidecar', got {mode!r}")
        if on_done not in ("mark", "delete"):
            raise ConfigurationError(f"on_done must be 'mark' or 'delete', got {on_done!r}")
        if isinstance(pk_columns, str) or not pk_columns:
            raise ConfigurationError("pk_columns must be a non-empty list of column names")
        self.table_name = validate_sql_identifier(table, "table")
        self.schema = validate_sql_identifier(schema, "schema") if schema else None
        self.pk_columns = tuple(validate_sql_identifier(c, "pk column") for c in pk_columns)
        clash = [c for c in self.pk_columns if c.lower().startswith(PREFIX)]
        if clash:
            raise ConfigurationError(f"pk columns must not be claim columns: {clash}")
        if where is not None and _CLAIM_REFERENCE.search(where):
            raise ConfigurationError(
                f"where={where!r} refers to a claim column ({PREFIX}...): the claim manages "
                "those (status, attempts, visibility); filter on your own columns only"
            )
        self.where = where
        self.parameters = dict(parameters or {})
        self.mode: Mode = mode
        self.on_done: OnDone = on_done
        if mode == "columns" and cursor_column:
            raise ConfigurationError("cursor_column= is only used with mode='sidecar'")
        self.cursor_column = (
            validate_sql_identifier(cursor_column, "cursor_column") if cursor_column else None
        )
        self.claims_table = validate_sql_identifier(claims_table, "claims_table")
        #: Where the claim state lives (:mod:`dbtrigger.queue.layout`), chosen once.
        self.layout: ClaimLayout = (
            ColumnsLayout()
            if mode == "columns"
            else SidecarLayout(self.claims_table, schema=self.schema, queue_name=self.queue_name)
        )
        self._db_url = DatabaseUrl(url, engine)
        self.shared_engine = engine
        self._time: DialectTime | None = None
        self._engine_kwargs = dict(engine_kwargs or {})
        self._engines_built: LazyEngine | None = None
        self._lock = threading.Lock()
        self._engine_lock = threading.Lock()
        self._target: ClaimTable | None = None
        self._queue: QueueTable | None = None
        #: The user table's columns as the claim statements were built on them.
        self._columns: ColumnWatch | None = None
        self._own_hooked = False

    # --- identity -------------------------------------------------------------------

    @property
    def url(self) -> URL:
        """The database URL, ``%SETTING%`` references resolved (at the first use)."""
        return self._db_url.value

    @property
    def time(self) -> DialectTime:
        """Claim-clock SQL for the dialect (known once the URL is resolved)."""
        if self._time is None:
            self._time = DialectTime(self.url.get_backend_name())
        return self._time

    @property
    def _engines(self) -> LazyEngine:
        if self._engines_built is None:
            with self._engine_lock:
                if self._engines_built is None:
                    shared, dialect = self.shared_engine, self.time.dialect
                    self._engines_built = (
                        LazyEngine(
                            self.url, engine_options(dialect, self._engine_kwargs, self.url.query)
                        )
                        if shared is None
                        else LazyEngine(self.url, engine=claim_view(shared, dialect))
                    )
        return self._engines_built

    @property
    def dialect_name(self) -> str:
        return self.time.dialect

    @property
    def name(self) -> str:
        target = f"{self.schema}.{self.table_name}" if self.schema else self.table_name
        return f"{self.url.get_backend_name()}:{target}"

    @property
    def safe_url(self) -> str:
        return safe_url_text(self.url)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.safe_url,
            "table": self.table_name,
            "schema": self.schema,
            "pk_columns": list(self.pk_columns),
            "where": self.where,
            "mode": self.mode,
            "on_done": self.on_done,
            "cursor_column": self.cursor_column,
            "claims_table": self.layout.claims_table,
        }

    @property
    def queue_name(self) -> str:
        """The queue's name in a sidecar claims table: the (qualified) user table."""
        return f"{self.schema}.{self.table_name}" if self.schema else self.table_name

    def install_hint(self) -> str:
        return install_command(self.safe_url, self.table_name, self.schema, self.mode)

    # --- engine ---------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        engine = self._engines.engine
        if not self._own_hooked and not self.shared_engine:
            with self._engine_lock:
                if not self._own_hooked:
                    prepare_own_engine(engine, self.time.dialect, self._engine_kwargs)
                    self._own_hooked = True
        return engine

    def sets_own_lock_bound(self) -> bool:
        """Do the user's connect arguments or URL set the lock-wait bound of the source's
        own engine (then they are kept, :func:`~dbtrigger._lock_wait.sets_own_lock_bound`)?"""
        given = given_connect_args(self._engine_kwargs)
        return sets_own_lock_bound(self.engine.dialect.name, given, self.url.query)

    def close(self) -> None:
        if self._engines_built is not None:
            self._engines_built.dispose()

    @contextlib.contextmanager
    def transaction(self, *, locking: bool = False) -> Iterator[Connection]:
        """One short unit of work: a READ COMMITTED transaction on MariaDB/MySQL
        (no gap locks), a ``BEGIN IMMEDIATE`` transaction on SQLite, autocommit
        statements on PostgreSQL (each claim/settle statement is atomic alone),
        there too a READ COMMITTED transaction with ``locking`` (row locks that
        must last from one statement to the next)."""
        shared = self.shared_engine is not None
        with unit_of_work(self.engine, self.time.dialect, locking=locking, shared=shared) as work:
            yield work

    # --- shape ----------------------------------------------------------------------

    @property
    def target(self) -> ClaimTable:
        """The claim statements, after the table was checked (once)."""
        if self._target is None:
            with self._lock:
                if self._target is None:
                    with (
                        failed_as(FetchError, f"could not inspect queue {self.name}"),
                        reads(self, f"inspecting queue {self.name}", self._bare_table) as conn,
                    ):
                        self._target = self._resolve(conn)
        return self._target

    @property
    def queue_table(self) -> QueueTable:
        """The checked user table and what the configuration says about it."""
        _ = self.target
        assert self._queue is not None  # noqa: S101 - resolved with the target
        return self._queue

    def reflect(self, conn: Connection, name: str) -> sa.Table:
        return reflect_table(conn, name, self.schema)

    def _resolve(self, conn: Connection) -> ClaimTable:
        check_skip_locked(conn, self.time.dialect)
        # Probed first: a change before the reflection is seen by the next check.
        self._columns = ColumnWatch(probe_or_none(conn, self._bare_table))
        user = self.reflect(conn, self.table_name)
        check_unique_key(user, self.pk_columns)
        self._queue = QueueTable(
            name=self.name,
            user=user,
            pk_columns=self.pk_columns,
            time=self.time,
            filter=self._filter(),
            install_hint=self.install_hint(),
        )
        return self.layout.target(conn, self._queue)

    @property
    def _bare_table(self) -> sa.TableClause:
        return sa.table(self.table_name, schema=self.schema)

    def _columns_changed(self, failure: BaseException | None = None) -> bool:
        """Did the user table's columns change since the claim was built on them?
        If so the next claim reads the definition again. Looked at every
        ``CHECK_SECONDS`` (:mod:`dbtrigger._columns`) and after a failed claim; a
        probe that fails changes nothing."""
        watch = self._columns
        if watch is None:
            return False
        try:
            with reads(self) as conn:
                change = watch.check(conn, self._bare_table)
        except SQLAlchemyError:
            return False
        if change is None:
            return False
        with self._lock:
            self._target = None
        change.report(self.name, failure, read="claimed rows are read")
        return True

    def _filter(self) -> sa.ColumnElement[bool] | None:
        if not self.where:
            return None
        clause = sa.text(self.where)
        names = set(clause._bindparams)
        return sa.and_(
            sa.true(),
            clause.bindparams(**{k: v for k, v in self.parameters.items() if k in names}),
        )

    # --- the worker's operations ----------------------------------------------------

    def claim(self, *, limit: int, token: str, worker: str, visibility: float) -> list[ClaimedRow]:
        """Claim up to ``limit`` rows for ``token`` (visible again after ``visibility`` s)."""
        return self.claim_batch(limit=limit, token=token, worker=worker, visibility=visibility).rows

    def claim_batch(self, *, limit: int, token: str, worker: str, visibility: float) -> Claim:
        """:meth:`claim`, with what the claim learnt (rows left, an expired claim halved).

        On the user table's columns as they are now: a claim that fails because
        they changed (``ALTER TABLE ... DROP COLUMN``) claimed nothing, and runs
        again once on the new definition.
        """
        watch = self._columns
        if watch is not None and watch.due():
            self._columns_changed()
        try:
            return self._claim(limit=limit, token=token, worker=worker, visibility=visibility)
        except SQLAlchemyError as exc:
            failed = exc
            if self._columns_changed(exc):
                try:
                    return self._claim(
                        limit=limit, token=token, worker=worker, visibility=visibility
                    )
                except SQLAlchemyError as again:
                    failed = again
        # The table may have changed under the workers in a way the columns do not
        # show: the next claim reads the definition again (one reflection).
        with self._lock:
            self._target = None
        raise FetchError(
            f"claim on {self.name} failed: {short_error(failed)}; the next claim reads the "
            "table's definition again"
        ) from failed

    def _claim(self, *, limit: int, token: str, worker: str, visibility: float) -> Claim:
        target = self.target
        claim: dict[str, Any] = {
            "limit": limit,
            "token": token,
            "worker": worker,
            "visibility": visibility,
        }
        if target.priority:  # one priority after another, in one transaction
            with self.transaction(locking=True) as conn:
                batch = target.claim_by_priority(conn, **claim)
                if batch.lead is None:
                    return self._claimed(conn, batch)
        else:
            # Sidecar: the user rows are read by a second statement, which may fail
            # (DDL); the claim commits with it, never alone (PostgreSQL autocommits).
            with self.transaction(locking=self.layout.claims_table is not None) as conn:
                first = target.claim(conn, **claim)
                if first is not None and first.lead is None:
                    return self._claimed(conn, first)
            if first is None:  # PostgreSQL, the pick not led by a fresh row
                with self.transaction(locking=True) as conn:
                    batch = target.claim_choosing(conn, **claim)
                    if batch.lead is None:
                        return self._claimed(conn, batch)
            else:
                batch = first
        # An expired claim or a regrouped half leads: claimed whole-group
        # locked, in a transaction holding no other lock (statements.py).
        assert batch.lead is not None  # noqa: S101 - every other case returned
        with self.transaction(locking=True) as conn:
            return self._claimed(conn, target.claim_group(conn, batch.lead, **claim))

    def _claimed(self, conn: Connection, batch: ClaimBatch) -> Claim:
        assert self._queue is not None  # noqa: S101 - resolved by self.target first
        rows = self.layout.rows(conn, batch, self._queue)
        return Claim(rows, batch.more, batch.bisected)

    def extend(self, *, token: str, visibility: float) -> int:
        """Heartbeat: push the claim's expiry on; how many rows it still holds."""
        target = self.target
        with (
            failed_as(FetchError, f"claim extension on {self.name} failed"),
            self.transaction() as conn,
        ):
            return target.extend(conn, token=token, visibility=visibility)

    def settle(
        self,
        *,
        token: str,
        done: Sequence[Key],
        retry: Sequence[RetryItem] = (),
        dead: Sequence[DeadItem] = (),
    ) -> Settled:
        """Record outcomes for rows still held by ``token`` (fenced; see statements)."""
        target = self.target
        failed = f"recording outcomes on {self.name} failed"
        with (
            failed_as(CommitError, failed, "; the claim expires and the rows are claimed again"),
            self.transaction() as conn,
        ):
            return target.settle(
                conn,
                token=token,
                done=done,
                retry=retry,
                dead=dead,
                delete_done=self.on_done == "delete",
            )

    # --- producers ------------------------------------------------------------------

    def enqueue(
        self,
        rows: Iterable[Mapping[str, Any]],
        *,
        run_after: RunAfter = None,
        priority: int | None = None,
    ) -> int:
        """Insert ``rows`` (the user's columns) as new work; how many were inserted.

        ``run_after``: an aware datetime, or a delay (seconds or a timedelta,
        counted on the database's clock): the rows are not claimed before. A
        scheduled row is an ordinary ``ready`` row whose ``dbt_visible_at`` is
        later, so it costs a claim nothing until it is due. ``priority``: on a
        table installed with ``--priority``, higher is claimed first (default
        0). All rows go in one transaction. See :mod:`dbtrigger.queue.producer`.
        """
        return producer.enqueue(self, rows, run_after=run_after, priority=priority)

    def cancel(
        self, keys: Iterable[Any], *, reason: str, dry_run: bool = False
    ) -> producer.Canceled:
        """Take rows off the queue before they run: ``ready`` ones (scheduled or
        waiting for a retry included) and expired claims become ``canceled``.

        ``keys``: key dicts (``{"id": 5}``), or bare values for a one-column
        key. A row a worker holds now is not touched (it is reported as
        running), nor is a finished one. See :mod:`dbtrigger.queue.producer`.
        """
        return producer.cancel(self, keys, reason=reason, dry_run=dry_run)

    # --- operator commands ----------------------------------------------------------

    def counts(self) -> QueueCounts:
        target = self.target  # checked before a connection is taken
        what = f"status of {self.name}"
        with failed_as(FetchError, f"{what} failed"), reads(self, what, target.table) as conn:
            return operations.counts(target, conn)

    def redrive_dead(
        self,
        *,
        note: str,
        limit: int | None = None,
        dry_run: bool = True,
        keys: Sequence[Key] | None = None,
        stranded: bool = False,
    ) -> int:
        target = self.target
        with (
            failed_as(CommitError, f"re-driving dead rows of {self.name} failed"),
            change_gives_up(self, f"re-driving dead rows of {self.name}", target.table),
            self.transaction() as conn,
        ):
            return operations.redrive_dead(
                target,
                conn,
                note=note,
                limit=limit,
                dry_run=dry_run,
                keys=keys,
                stranded=stranded,
            )

    def dead_rows(self, *, limit: int | None = None) -> list[dict[str, Any]]:
        """Dead rows (key, attempts, last error, when): ``dbtrigger dead-letter list``."""
        target = self.target
        with (
            failed_as(FetchError, f"reading dead rows of {self.name} failed"),
            reads(self, f"reading dead rows of {self.name}", target.table) as conn,
        ):
            return operations.dead_rows(target, conn, limit=limit)

    def discard_dead(self, keys: Sequence[Key], *, note: str, delete: bool = False) -> int:
        """Let dead rows go: done for good with ``note`` (or deleted); how many."""
        target = self.target
        with (
            failed_as(CommitError, f"discarding dead rows of {self.name} failed"),
            change_gives_up(self, f"discarding dead rows of {self.name}", target.table),
            self.transaction() as conn,
        ):
            return operations.discard_dead(target, conn, keys, note=note, delete=delete)

    def prune(
        self,
        *,
        older_than_seconds: float,
        chunk: int = 1000,
        statuses: Sequence[str] = ("done",),
        dry_run: bool = True,
    ) -> int:
        """Delete finished rows older than the cutoff, ``chunk`` rows per transaction.

        Short transactions keep locks and (on PostgreSQL) the vacuum horizon
        moving while a large prune runs.
        """
        if chunk < 1:
            raise ConfigurationError(f"chunk must be >= 1, got {chunk}")
        target = self.target
        cutoff = self.time.ago(older_than_seconds)
        total = 0
        after: Key | None = None
        with failed_as(CommitError, f"pruning {self.name} failed"):
            while True:
                with self.transaction() as conn:
                    keys = operations.prune_keys(
                        target, conn, cutoff=cutoff, after=after, limit=chunk, statuses=statuses
                    )
                    if keys and not dry_run:
                        total += operations.delete_finished(target, conn, keys, statuses, cutoff)
                    elif dry_run:
                        total += len(keys)
                if len(keys) < chunk:
                    return total
                after = keys[-1]


# Claim and ClaimedRow are defined with the layouts; importable from here as before.
__all__ = ["Claim", "ClaimSource", "ClaimedRow", "install_command"]
