"""Four competing queue workers under SIGKILL and SIGSTOP, on each database.

While the workers drain ``jobs`` (``tests/chaos/queue_worker.py``), a killer
SIGKILLs a random worker every few hundred milliseconds (restarting it at
once) and now and then freezes one with SIGSTOP for longer than the
visibility timeout, so its claim expires and another worker takes the rows
over while it still believes it holds them. Then the backlog is drained
without chaos and the tables are checked:

* every row ends ``done`` - none lost, none dead, none stuck;
* no row was completed by a claim other than its last one (the completion of
  a worker whose claim had expired was fenced off), and no row was completed
  twice;
* every handler call either belongs to the claim that completed the row, or
  the row was claimed again after it (a retry or a re-claim after expiry).

CI-sized by default: 2.5 s of chaos per database, and on until at least three
kills and one freeze happened (bounded): the outcomes the test checks, not a
duration, end it. ``DBTRIGGER_QUEUE_CHAOS_SECONDS`` and ``DBTRIGGER_QUEUE_CHAOS_ROWS``
make it longer;
``DBTRIGGER_QUEUE_CHAOS_FREEZE_SHARE`` (default 0.15) makes more of the chaos
events freezes, the ones that expire claims under a live worker.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import threading
import time
from pathlib import Path

import sqlalchemy as sa

from tests.chaos.forked import ForkedProcess, Forker
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs

WORKER = "tests.chaos.queue_worker"
#: 5 s until the suite outgrew its budget: the kills and freezes asserted are waited
#: for below anyway.
CHAOS_SECONDS = float(os.environ.get("DBTRIGGER_QUEUE_CHAOS_SECONDS", "2.5"))
ROWS = int(os.environ.get("DBTRIGGER_QUEUE_CHAOS_ROWS", "500"))
#: Share of chaos events that freeze a worker instead of killing it.
FREEZE_SHARE = float(os.environ.get("DBTRIGGER_QUEUE_CHAOS_FREEZE_SHARE", "0.15"))
WORKERS = 4
VT = 1.5


def ready_file(logs: Path, worker: int, incarnation: int) -> Path:
    """Created by the worker once it has claimed: a kill during start-up tests nothing."""
    return logs / f"ready.w{worker}.{incarnation}"


def start(
    forker: Forker,
    db: TestDatabase,
    worker: int,
    incarnation: int,
    logs: Path,
    *extra: str,
    vt: float = VT,
) -> ForkedProcess:
    """``python -m tests.chaos.queue_worker``, forked from the test's fork server
    (tests/chaos/forked.py): a restart after a kill costs no new interpreter."""
    argv = [
        "--db-url",
        db.url,
        "--worker",
        f"w{worker}",
        "--incarnation",
        str(incarnation),
        "--vt",
        str(vt),
        "--heartbeat",
        str(vt / 4),
        *extra,
    ]
    if db.schema:
        argv += ["--schema", db.schema]
    argv += ["--ready-file", str(ready_file(logs, worker, incarnation))]
    return forker.start(argv, logs / f"w{worker}.{incarnation}.log")


def make_logs(db: TestDatabase) -> None:
    """The tables the workers record their handler calls and settlements in."""
    db.execute(
        f"CREATE TABLE {db.qualified('calls')} (job_id integer, token varchar(36), "
        "attempt integer, worker varchar(20), incarnation integer)"
    )
    db.execute(
        f"CREATE TABLE {db.qualified('settlements')} (job_id integer, token varchar(36), "
        "outcome varchar(8), worker varchar(20))"
    )
    if db.kind == "sqlite":
        db.execute("PRAGMA journal_mode=WAL")


def test_competing_workers_survive_kills_and_freezes(db: TestDatabase, tmp_path: Path) -> None:
    # MariaDB once recorded a batch completed twice here: a worker frozen between
    # its settlement's lock and its write (issue #12). tests/test_queue_fencing.py
    # replays that interleaving deterministically.
    make_jobs(db, ROWS)
    make_logs(db)
    with Forker(WORKER) as forker:
        competing_workers(forker, db, tmp_path)


def competing_workers(forker: Forker, db: TestDatabase, tmp_path: Path) -> None:
    rng = random.Random(12)
    incarnations = [0] * WORKERS
    procs = [start(forker, db, w, 0, tmp_path) for w in range(WORKERS)]
    kills = freezes = 0
    frozen: set[int] = set()
    lock = threading.Lock()

    def freeze(w: int, proc: ForkedProcess) -> None:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(VT * 1.6)
        proc.send_signal(signal.SIGCONT)
        with lock:
            frozen.discard(w)

    thaws: list[threading.Thread] = []
    warm_up = time.monotonic() + 60
    while time.monotonic() < warm_up and not all(
        ready_file(tmp_path, w, 0).exists() for w in range(WORKERS)
    ):
        time.sleep(0.05)
    deadline = time.monotonic() + CHAOS_SECONDS
    cap = deadline + 60
    # Chaos for CHAOS_SECONDS and until three workers were killed and one frozen
    # (bounded): a loaded machine restarts workers more slowly, so fewer fit in the time.
    while time.monotonic() < deadline or ((kills < 3 or freezes < 1) and time.monotonic() < cap):
        time.sleep(rng.uniform(0.15, 0.45))
        w = rng.randrange(WORKERS)
        with lock:
            if w in frozen or not ready_file(tmp_path, w, incarnations[w]).exists():
                continue
        if rng.random() < FREEZE_SHARE:
            with lock:
                frozen.add(w)
            thread = threading.Thread(target=freeze, args=(w, procs[w]))
            thread.start()
            thaws.append(thread)
            freezes += 1
            continue
        procs[w].kill()
        procs[w].wait()
        incarnations[w] += 1
        procs[w] = start(forker, db, w, incarnations[w], tmp_path)
        kills += 1
    for thread in thaws:
        thread.join()

    jobs = db.qualified("jobs")
    drain_deadline = time.monotonic() + 120
    while time.monotonic() < drain_deadline:
        done = db.scalar(f"SELECT count(*) FROM {jobs} WHERE dbt_status = 'done'")
        if done == ROWS:
            break
        time.sleep(0.3)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(timeout=30)

    with db.engine.connect() as conn:
        final = {
            int(r.id): r
            for r in conn.execute(
                sa.text(f"SELECT id, dbt_status, dbt_claim_token, dbt_attempts FROM {jobs}")
            )
        }
        calls = list(
            conn.execute(sa.text(f"SELECT job_id, token, attempt FROM {db.qualified('calls')}"))
        )
        settlements = list(
            conn.execute(
                sa.text(f"SELECT job_id, token, outcome FROM {db.qualified('settlements')}")
            )
        )
    statuses = collections.Counter(r.dbt_status for r in final.values())
    assert statuses == {"done": ROWS}, (statuses, kills, freezes)

    done_records = collections.Counter(s.job_id for s in settlements if s.outcome == "done")
    assert max(done_records.values(), default=0) <= 1, "a row was completed twice"
    stale = [
        s for s in settlements if s.outcome == "done" and s.token != final[s.job_id].dbt_claim_token
    ]
    assert stale == [], "a completion by a claim that was not the row's last one"

    # A done row is never claimed again, so a call by any other claim than the
    # completing one was followed by a claim. (Attempts do not show it: a
    # failure or expiry shared by several rows gives its attempt back.)
    completing = {(c.job_id, c.token) for c in calls}
    unexplained = [i for i, r in final.items() if (i, r.dbt_claim_token) not in completing]
    assert unexplained == [], "a row was completed by a claim that never called the handler"

    # The chaos really happened: workers died, and rows were claimed again.
    assert kills >= 3
    assert freezes >= 1
    assert len(completing) > ROWS
    outcomes = collections.Counter(s.outcome for s in settlements)
    print(f"{db.kind}: {kills} kills, {freezes} freezes, {len(calls)} handler calls, {outcomes}")


POISON_ROWS = 10
POISON = 3
POISON_VT = 1.0


def test_a_row_that_kills_its_worker_ends_dead_alone(db: TestDatabase, tmp_path: Path) -> None:
    """Issue #20 item 6: one row that kills every worker holding it (``os._exit``,
    as an OOM kill would) must not take the rows claimed with it down too.

    Two workers claim batches of 10; whenever one dies it is restarted. Each
    expired claim's rows are claimed again in halves, so the poison row ends
    up claimed alone and goes dead with an error saying so; the 9 others end
    done.
    """
    make_jobs(db, POISON_ROWS)
    make_logs(db)
    extra = (
        "--crash-on", str(POISON), "--max-attempts", "3", "--batch-size", str(POISON_ROWS),
        "--fail-probability", "0", "--slow-probability", "0",
    )  # fmt: skip
    with Forker(WORKER) as forker:
        crashes, settled = poison_workers(forker, db, tmp_path, extra)
    jobs = db.qualified("jobs")
    with db.engine.connect() as conn:
        final = {
            int(r.id): r
            for r in conn.execute(
                sa.text(f"SELECT id, dbt_status, dbt_attempts, dbt_last_error FROM {jobs}")
            )
        }
        called = {
            int(r[0]) for r in conn.execute(sa.text(f"SELECT job_id FROM {db.qualified('calls')}"))
        }
    statuses = {i: r.dbt_status for i, r in final.items()}
    assert settled == POISON_ROWS, (statuses, crashes)
    assert statuses == {i: "dead" if i == POISON else "done" for i in final}, crashes
    error = final[POISON].dbt_last_error
    assert "without an outcome" in error, error
    assert "isolated as a single row" in error, error
    assert called == set(final)
    assert crashes >= 3  # the poison row's worker died on every delivery


def poison_workers(
    forker: Forker, db: TestDatabase, tmp_path: Path, extra: tuple[str, ...]
) -> tuple[int, int]:
    """Two workers, each restarted whenever it died, until every row settled (bounded):
    (crashes, rows settled)."""
    incarnations = [0, 0]
    procs = [start(forker, db, w, 0, tmp_path, *extra, vt=POISON_VT) for w in range(2)]
    jobs = db.qualified("jobs")
    crashes = 0
    settled = 0
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            settled = int(
                db.scalar(f"SELECT count(*) FROM {jobs} WHERE dbt_status IN ('done', 'dead')")
            )
            if settled == POISON_ROWS:
                break
            for w, proc in enumerate(procs):
                if proc.poll() is not None:
                    crashes += 1
                    incarnations[w] += 1
                    procs[w] = start(forker, db, w, incarnations[w], tmp_path, *extra, vt=POISON_VT)
            time.sleep(0.2)  # a claim takes POISON_VT to expire: no hurry
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=30)
    return crashes, settled
