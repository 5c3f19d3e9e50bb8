"""What an operator reads when a command stops, through the installed console script.

An error a person must fix is said once, on the ``error:`` line (exit code 2):
not also by the start-up check, the NULL-cursor probe and the tick's own
ERROR record before it. The details stay available at ``-vv``. A handler that
fails under ``backfill`` shows its traceback once per failing batch.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.databases import TestDatabase
from tests.test_cli_worker import run_cli, write_module
from tests.test_source_sqlalchemy import insert, naive, orders_table


def mentions(stderr: str, text: str) -> list[str]:
    return [line for line in stderr.splitlines() if text in line]


def test_a_missing_database_is_said_once(tmp_path: Path) -> None:
    url = "postgresql+psycopg://postgres@127.0.0.1:5432/dbtrigger_no_such_database"
    write_module(tmp_path, "nodb_app", url, pollers={"orders": "pass"})
    done = run_cli(["run", "nodb_app:orders", "--interval", "0.1"], tmp_path)
    assert done.returncode == 2, done.stderr
    said = mentions(done.stderr, "does not exist")
    assert len(said) == 1, done.stderr
    assert said[0].startswith("error: checking postgresql:orders failed: the database does not")
    assert " ERROR " not in done.stderr
    assert "NULL-cursor probe" not in done.stderr
    assert "Traceback" not in done.stderr


def test_a_tick_that_stops_on_an_operator_error_is_said_once(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    insert(sqlite_db, orders_table(sqlite_db), [{"id": 1, "updated_at": naive(1)}])
    # The table checks pass; the fetch does not.
    (tmp_path / "badwhere_app.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

            orders = PollTrigger(
                name="orders",
                source=SqlAlchemySource(url={sqlite_db.url!r}, table="orders",
                                        cursor_column="updated_at", pk_columns=["id"],
                                        where="no_such_column > 0"),
                checkpoint_store=FileCheckpointStore({str(tmp_path / "state")!r}),
            )

            @orders.handler
            def handle(events):
                pass
            """
        )
    )
    done = run_cli(["run", "badwhere_app:orders", "--interval", "0.1"], tmp_path)
    assert done.returncode == 2, done.stderr
    said = mentions(done.stderr, "no such column")
    assert len(said) == 1, done.stderr
    assert said[0].startswith("error: fetch from sqlite:orders failed")
    assert " ERROR " not in done.stderr
    # The details are one flag away.
    verbose = run_cli(["-vv", "run", "badwhere_app:orders", "--interval", "0.1"], tmp_path)
    assert verbose.returncode == 2
    assert mentions(verbose.stderr, "ERROR dbtrigger.runtime: fetch failed: fetch from sqlite")
    assert len(mentions(verbose.stderr, "error: fetch from sqlite:orders failed")) == 1


def test_backfill_logs_the_handlers_traceback_once_per_failing_batch(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    rows = [{"id": i, "updated_at": naive(i)} for i in range(8)]
    insert(sqlite_db, orders_table(sqlite_db), rows)
    body = 'assert all(e.pk["id"] < 5 for e in events), "order 5 is malformed"'
    write_module(tmp_path, "bf_app", sqlite_db.url, pollers={"orders": body})
    argv = ["backfill", "orders-replay", "--source", "bf_app:orders", "--from-beginning"]
    argv += ["--reason", "test", "--yes", "--max-retries", "3", "--retry-delay", "0.05"]
    done = run_cli(argv, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    # Four attempts of the same batch (rows 5-7): one traceback, with the handler's line.
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    assert 'assert all(e.pk["id"] < 5 for e in events), "order 5 is malformed"' in done.stderr
    assert len(mentions(done.stderr, "backfill: the handler failed on batch")) == 1
    assert len(mentions(done.stderr, "retry 3/3")) == 1
