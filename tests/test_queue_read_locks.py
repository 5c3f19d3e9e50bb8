"""A claim queue's status and dead-row reads on an application's engine give up waiting.

``ClaimSource(engine=...)`` shares the application's engine, whose sessions keep
their settings: the bound a queue's own engine sets at connect time is not there.
Its claims and settlements bound their own lock waits (test_queue_settle_locks);
its reads did not. Behind an ``ALTER TABLE`` of the queue table, itself queued
behind an application's open transaction, ``dbtrigger queue status`` and the
dead-row listing waited for ever on PostgreSQL (a day on MariaDB), silently: still
waiting after 25 s. They now give up after the queue's lock bound (lowered to 2 s
here) with a typed error naming the table, who holds locks there and what to do;
the application's sessions keep their own settings. A re-drive of dead rows (a
write, bounded already) now says the same.
"""

from __future__ import annotations

import contextlib
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource
from dbtrigger.cli import main
from dbtrigger.errors import CommitError, DbTriggerError, FetchError
from dbtrigger.queue import engines
from tests.databases import TestDatabase
from tests.test_ddl_locks import holding, outcome
from tests.test_queue_columns import make_jobs
from tests.test_source_lock_waits import ddl_queued

#: The queue's lock bound in these tests.
BOUND = 2


@pytest.fixture
def bound(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(engines, "LOCK_WAIT_SECONDS", BOUND)
    return BOUND


def ddl_queued_on_jobs(db: TestDatabase) -> contextlib.AbstractContextManager[None]:
    """An application's transaction that wrote a job row (row locks: its holder
    can be named on both servers), and this test's ``ALTER TABLE jobs`` queued
    behind it."""
    return ddl_queued(
        db, "jobs", holding(db, f"UPDATE {db.qualified('jobs')} SET payload = payload")
    )


def kill_one_job(db: TestDatabase) -> None:
    db.execute(
        f"UPDATE {db.qualified('jobs')} SET dbt_status = 'dead', dbt_attempts = 3, "
        "dbt_last_error = 'boom' WHERE id = 1"
    )


READS: dict[str, tuple[Callable[[ClaimSource], Any], type[DbTriggerError], str]] = {
    "status": (lambda s: s.counts(), FetchError, "status of "),
    "dead rows": (lambda s: s.dead_rows(), FetchError, "reading dead rows of "),
    "requeue": (
        lambda s: s.redrive_dead(note="retry", dry_run=False),
        CommitError,
        "re-driving dead rows of ",
    ),
}


@pytest.mark.parametrize("first_use", [False, True], ids=["resolved", "first-use"])
@pytest.mark.parametrize("read", list(READS))
def test_a_queue_read_on_a_shared_engine_behind_queued_ddl_gives_up(
    server_db: TestDatabase, bound: int, read: str, first_use: bool
) -> None:
    db = server_db
    make_jobs(db, 3)
    kill_one_job(db)
    shared = sa.create_engine(db.url)
    source = ClaimSource(engine=shared, table="jobs", schema=db.schema, pk_columns=["id"])
    call, error, doing = READS[read]
    if first_use:  # the first read checks the table's shape: that read gives up
        error, doing = FetchError, "inspecting queue "
    writes = error is CommitError
    try:
        if not first_use:  # the table's shape checked, a connection pooled
            assert source.counts().by_status["dead"] == 1
        result = outcome(ddl_queued_on_jobs(db), lambda: call(source))
        assert isinstance(result, error), repr(result)
        message = str(result)
        assert message.startswith(doing), message
        assert f"waited {bound} s for a lock on the table {db.qualified('jobs')}" in message
        holder = "held by backend pid" if db.kind == "postgresql" else "probably held by connection"
        assert holder in message, message
        then = "nothing was changed: run the command again" if writes else "nothing was read"
        assert then in message, message
        assert "ADD COLUMN" not in message, message  # no SQL of anyone's
        # Once the DDL ended it reads; the application's sessions are as they were.
        assert source.counts().by_status["dead"] == 1  # the re-drive changed nothing
        with shared.connect() as conn:
            if db.kind == "postgresql":
                assert conn.exec_driver_sql("SHOW lock_timeout").scalar() == "0"
            else:
                assert conn.exec_driver_sql("SELECT @@lock_wait_timeout").scalar() != BOUND
    finally:
        source.close()
        shared.dispose()


def test_dbtrigger_queue_status_on_a_shared_engine_behind_queued_ddl(
    server_db: TestDatabase,
    bound: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dbtrigger queue status --source app:queue``, the application's queue on its
    own engine: exit 2 with the error's words instead of waiting without a word."""
    db = server_db
    make_jobs(db, 3)
    app = f"sharedapp_{tmp_path.name.replace('-', '_')}"  # a fresh module per database
    (tmp_path / f"{app}.py").write_text(
        textwrap.dedent(
            f"""
            import sqlalchemy as sa
            from dbtrigger import ClaimSource, QueueTrigger

            engine = sa.create_engine({db.url!r})
            source = ClaimSource(engine=engine, table="jobs", schema={db.schema!r},
                                 pk_columns=["id"])
            queue = QueueTrigger(name="jobs", source=source)
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = outcome(
        ddl_queued_on_jobs(db), lambda: main(["queue", "status", "--source", f"{app}:queue"])
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"waited {bound} s for a lock on the table {db.qualified('jobs')}" in err, err
    assert "nothing was read: try again once that transaction and the DDL end" in err, err
    sys.modules.pop(app, None)
