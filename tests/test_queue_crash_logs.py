"""A row that kills its queue worker: every death said at WARNING, the give-up at ERROR.

One worker process (tests/chaos/queue_worker.py, ``--crash-on``) is restarted
each time the row kills it, until every row is ``done`` or ``dead`` (bounded).
The claim of an expired claim's rows is halved until the row is alone
(tests/test_queue_chaos.py checks the outcome on every database); here, on
SQLite, what the workers' logs say about it: an operator reading only WARNING
and up must see each death of a worker, and the row's end as an ERROR.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.chaos.forked import ForkedProcess, Forker
from tests.databases import TestDatabase
from tests.test_queue_chaos import WORKER, make_logs, start
from tests.test_queue_columns import make_jobs

ROWS = 8
POISON = 3
MAX_ATTEMPTS = 2
VT = 0.6


def _run_until_settled(
    forker: Forker, db: TestDatabase, logs: Path, poison: tuple[int, ...], lanes: int
) -> tuple[list[ForkedProcess], dict[int, tuple[str, str | None]]]:
    """Restart the worker whenever it died, until every row is done or dead (bounded)."""
    extra = (
        "--crash-on", ",".join(map(str, poison)), "--max-attempts", str(MAX_ATTEMPTS),
        "--batch-size", str(ROWS), "--fail-probability", "0", "--slow-probability", "0",
        "--lanes", str(lanes),
    )  # fmt: skip
    jobs = db.qualified("jobs")
    runs = [start(forker, db, 0, 0, logs, *extra, vt=VT)]
    final: dict[int, tuple[str, str | None]] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with db.engine.connect() as conn:
                final = {
                    int(r.id): (r.dbt_status, r.dbt_last_error)
                    for r in conn.execute(
                        sa.text(f"SELECT id, dbt_status, dbt_last_error FROM {jobs}")
                    )
                }
            if all(status in ("done", "dead") for status, _ in final.values()):
                break
            if runs[-1].poll() is not None:
                assert len(runs) < 20, f"the worker keeps dying: {logs / f'w0.{len(runs) - 1}.log'}"
                runs.append(start(forker, db, 0, len(runs), logs, *extra, vt=VT))
            time.sleep(0.05)
    finally:
        runs[-1].send_signal(signal.SIGTERM)
        runs[-1].wait(timeout=30)
    return runs, final


@pytest.mark.parametrize(
    ("poison", "lanes"),
    [((POISON,), 1), ((POISON, 6), 1), ((POISON,), 3)],
    ids=["one row", "two rows", "one row on 3 lanes"],
)
def test_each_death_is_a_warning_and_the_row_given_up_an_error(
    sqlite_db: TestDatabase, tmp_path: Path, poison: tuple[int, ...], lanes: int
) -> None:
    make_jobs(sqlite_db, ROWS)
    make_logs(sqlite_db)
    with Forker(WORKER) as forker:
        runs, final = _run_until_settled(forker, sqlite_db, tmp_path, poison, lanes)
    statuses = {i: status for i, (status, _) in final.items()}
    assert statuses == {i: "dead" if i in poison else "done" for i in range(1, ROWS + 1)}
    deaths = sum(1 for run in runs if run.returncode == 3)
    assert deaths == len(runs) - 1, [run.returncode for run in runs]
    lines = [
        line
        for i in range(len(runs))
        for line in (tmp_path / f"w0.{i}.log").read_text().splitlines()
        if line.startswith(("WARNING ", "ERROR "))
    ]
    # Each death is found by the next claim of its rows: at WARNING (the claim
    # halved, or its one row claimed alone again), but for the last death of each
    # poison row: at ERROR, with the row made dead for it.
    said = [
        line
        for line in lines
        if line.startswith(("WARNING queue_claim_bisected ", "WARNING queue_claim_expired "))
    ]
    assert len(said) == deaths - len(poison), "\n".join(lines)
    errors = sorted(line for line in lines if line.startswith("ERROR "))
    assert len(errors) == len(poison), "\n".join(lines)
    for row, error in zip(sorted(poison), errors, strict=True):
        assert error.startswith("ERROR queue_crash_loop "), error
        assert f"row ({row},) is dead" in error, error
        assert "dbtrigger queue retry --dead" in error, error
