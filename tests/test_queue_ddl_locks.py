"""``dbtrigger queue install`` behind an application's transaction open on the table.

The queue's own engine bounds every statement's lock wait (``LOCK_WAIT_SECONDS``,
30 s; the test lowers it to 1 s), so its ``ALTER TABLE`` gave up, but as a bare
``CommitError: DDL on ... failed: LockNotAvailable: canceling statement due to lock
timeout``: not who holds the lock, what was left, or what to do. Now it says all
three, as ``changelog install`` does.
"""

from __future__ import annotations

import pytest

from dbtrigger.cli import main
from dbtrigger.queue import engines
from tests.databases import TestDatabase
from tests.test_ddl_locks import outcome, transaction_on
from tests.test_prune_and_marks_locks import rows_held


def test_queue_install_behind_an_open_transaction_gives_up_and_says_why(
    db: TestDatabase, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(engines, "LOCK_WAIT_SECONDS", 1)
    jobs = db.qualified("jobs")
    db.execute(f"CREATE TABLE {jobs} (id INTEGER PRIMARY KEY, v INTEGER)")
    where = ["--url", db.url, "--table", "jobs", *(["--schema", db.schema] if db.schema else [])]
    install = ["queue", "install", *where, "--yes"]
    code = outcome(transaction_on(db, "jobs"), lambda: main(install))
    assert code == 2, capsys.readouterr()
    error = capsys.readouterr().err
    assert "error: adding the claim columns of jobs waited 1 s for a lock" in error, error
    assert "run the command again once it ends, or end it" in error, error
    if db.kind == "postgresql":
        assert "held by backend pid" in error, error
    assert main(install) == 0  # once it ended
    assert main(install) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_sidecar_uninstall_behind_an_open_transaction_gives_up_and_says_why(
    db: TestDatabase, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dropping the claims table waited behind a transaction that read it (a worker's,
    an operator's) as the install did."""
    monkeypatch.setattr(engines, "LOCK_WAIT_SECONDS", 1)
    db.execute(f"CREATE TABLE {db.qualified('jobs')} (id INTEGER PRIMARY KEY, v INTEGER)")
    where = ["--url", db.url, "--table", "jobs", *(["--schema", db.schema] if db.schema else [])]
    assert main(["queue", "install", *where, "--mode", "sidecar", "--yes"]) == 0
    uninstall = ["queue", "uninstall", *where, "--mode", "sidecar", "--yes"]
    code = outcome(rows_held(db, "dbtrigger_claims"), lambda: main(uninstall))
    assert code == 2, capsys.readouterr()
    error = capsys.readouterr().err
    assert f"error: removing {'' if db.schema is None else db.schema + '.'}jobs from " in error
    assert "dbtrigger_claims waited 1 s for a lock" in error, error
    assert main(uninstall) == 0  # once it ended
    assert "claims table" in capsys.readouterr().out
