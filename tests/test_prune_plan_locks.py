"""The change log's prune gives up reading its plan behind a lock, and names the holder.

A prune first counts what it may delete (:func:`~dbtrigger.changelog.operations.plan_prune`:
the readers' registry, then the log), then deletes in bounded transactions whose
give-up words name who holds locks on the log. The plan's reads ran on a plain
connection of the engine: on an application's engine (``ChangeLogSource(engine=...)``,
whose pruner runs after the poller's commit) or the CLI's, behind an ``ALTER TABLE``
of the log queued behind an open transaction, they waited for ever on PostgreSQL
(``lock_timeout = 0``) and a day on MariaDB (``lock_wait_timeout``); with a bound of
the application's own they gave up with the driver's words alone, the holder unnamed.
Now the plan waits at most the prune's bound and gives up as its deletes do.
"""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa

from dbtrigger.changelog import operations as changelog_operations
from dbtrigger.changelog import pruning
from dbtrigger.changelog.ddl import log_table_name
from dbtrigger.errors import RetryableError
from dbtrigger.state.stores.memory import InMemoryCheckpointStore
from tests.databases import TestDatabase
from tests.test_ddl_locks import gave_up, holding, outcome
from tests.test_prune_and_marks_locks import orders_with_log
from tests.test_source_lock_waits import ddl_queued


def holder_words(db: TestDatabase) -> str:
    return "held by backend pid" if db.kind == "postgresql" else "held by connection"


def test_a_prune_on_an_applications_engine_behind_queued_ddl_gives_up_naming_the_holder(
    server_db: TestDatabase,
) -> None:
    db = server_db
    orders_with_log(db, 4)
    log = log_table_name("orders")
    top = db.scalar(f"SELECT max(dbt_seq) FROM {db.qualified(log)}")
    app = sa.create_engine(db.url)  # the application's: no lock bound of dbtrigger's
    try:
        reader = holding(db, f"SELECT * FROM {db.qualified(log)}")
        error = outcome(
            ddl_queued(db, log, reader),
            lambda: changelog_operations.prune(
                app, "orders", schema=db.schema, up_to_seq=top, lock_timeout_seconds=1
            ),
        )
        message = gave_up(error, RetryableError, log)
        assert message.startswith("pruning the change log of orders (reading "), message
        assert holder_words(db) in message, message
        assert "nothing was deleted" in message, message
        assert "SELECT" not in message, message  # no SQL of anyone's
        assert db.scalar(f"SELECT count(*) FROM {db.qualified(log)}") == 4
        assert changelog_operations.prune(app, "orders", schema=db.schema, up_to_seq=top) == 4
    finally:
        app.dispose()


def app_engine(db: TestDatabase, *, own_bound: bool) -> sa.Engine:
    """The application's engine; ``own_bound``: with a lock bound of its own (1 s)."""
    if not own_bound:
        return sa.create_engine(db.url)
    if db.kind == "postgresql":
        return sa.create_engine(db.url, connect_args={"options": "-c lock_timeout=1000"})
    return sa.create_engine(
        db.url, connect_args={"init_command": "SET SESSION lock_wait_timeout = 1"}
    )


@pytest.mark.parametrize("own_bound", [False, True], ids=["unbounded", "own-bound"])
def test_the_pruners_warning_names_the_holder(
    server_db: TestDatabase,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    own_bound: bool,
) -> None:
    """What ``ChangeLogSource(engine=..., prune_passed_by=...)`` logs after a commit:
    with the application's own bound it gave up, in the driver's words alone."""
    db = server_db
    monkeypatch.setattr(pruning, "PRUNE_LOCK_TIMEOUT", 1.0)
    orders_with_log(db, 3)
    log = log_table_name("orders")
    top = db.scalar(f"SELECT max(dbt_seq) FROM {db.qualified(log)}")
    store = InMemoryCheckpointStore()
    pruner = pruning.ChangeLogPruner(passed_by=["reader"], store=store)
    monkeypatch.setattr(pruning, "stored_cursors", lambda store, pollers: ([top], []))
    app = app_engine(db, own_bound=own_bound)
    try:
        reader = holding(db, f"SELECT * FROM {db.qualified(log)}")
        with caplog.at_level(logging.WARNING, logger="dbtrigger.changelog"):
            deleted = outcome(
                ddl_queued(db, log, reader),
                lambda: pruner.run(app, "orders", schema=db.schema, source="orders"),
            )
        assert deleted == 0
        [warning] = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert warning.__dict__["event"] == "changelog_prune_failed"
        message = warning.getMessage()
        assert "waited 1 s for a lock another transaction holds on the table" in message
        assert holder_words(db) in message, message
    finally:
        app.dispose()
