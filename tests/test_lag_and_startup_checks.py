"""lag_seconds for naive timestamp cursors; the worker's start-up checks."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import textwrap
from pathlib import Path

from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.metrics import InMemoryMetrics
from tests.databases import TestDatabase


def test_lag_seconds_is_set_for_naive_timestamp_cursors(sqlite_db: TestDatabase) -> None:
    sqlite_db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, updated_at DATETIME NOT NULL)")
    an_hour_ago = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)).replace(tzinfo=None)
    sqlite_db.execute(f"INSERT INTO t VALUES (1, '{an_hour_ago:%Y-%m-%d %H:%M:%S.%f}')")
    metrics = InMemoryMetrics()
    trigger = PollTrigger(
        name="t",
        source=SqlAlchemySource(
            url=sqlite_db.url,
            table="t",
            cursor_column="updated_at",
            pk_columns=["id"],
            visibility="none",
        ),
        checkpoint_store=InMemoryCheckpointStore(),
        metrics=metrics,
    )
    assert trigger.tick(lambda events: None) == 1
    lag = metrics.gauge("lag_seconds", poller="t")
    assert lag is not None
    assert 3500 < lag < 3700  # an hour, aged against the database's own clock


def test_the_worker_warns_about_a_missing_index_at_start(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    sqlite_db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    (tmp_path / "app_lag.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

            trigger = PollTrigger(
                name="t",
                source=SqlAlchemySource(url={sqlite_db.url!r}, table="t",
                                        cursor_column="seq", pk_columns=["id"]),
                checkpoint_store=FileCheckpointStore({str(tmp_path / "state")!r}),
            )

            @trigger.handler
            def handle(events):
                pass
            """
        )
    )
    exe = shutil.which("dbtrigger")
    assert exe is not None
    done = subprocess.run(
        [exe, "run", "app_lag:trigger", "--max-ticks", "1", "--log-format", "json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    checks = [r for r in records if r.get("event") == "startup_check"]
    assert checks, done.stderr
    assert any("index" in r.get("message", "").lower() for r in checks), checks
