"""A handler that kills its process on the same batch every time (os._exit,
a segfault, an OOM kill) is counted, and the loop ends.

Such a death records no failed attempt: before, each restarted worker took
the dead owner's lease over once it expired, handed the same batch again
and died again, for ever, with nothing said at WARNING or ERROR. Now the
takeover of a lease left neither released nor renewed counts as a failed
attempt of the batch at the checkpoint (``failure.crashes`` in the state
document), and once ``max_attempts`` such attempts are counted the batch is
not handed over whole again: the poller refuses with a
:class:`~dbtrigger.errors.CrashLoopError` naming the batch and the ways on.

The workers are real processes (tests/chaos/crash_loop_worker.py), restarted
by the test a bounded number of times.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, LostLeaseError
from dbtrigger.cli import main as cli_main
from dbtrigger.cursor import Position
from dbtrigger.state import crashes as C
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as L
from dbtrigger.state.document import Checkpoint, FailureRecord, Lease, StateDocument, evolve
from tests.databases import TestDatabase
from tests.reliability_support import add_items, checkpoint_id, items_table, read_doc

ROOT = Path(__file__).resolve().parent.parent
ROWS = range(1, 21)  # batches of 5: the poison row 7 is in the second
POISON = 7
MAX_ATTEMPTS = 3


def _restart_until_settled(
    db: TestDatabase,
    tmp_path: Path,
    *,
    restarts: int,
    sink: Path | None = None,
    fanout: bool = False,
    poison: str = str(POISON),
    extra: tuple[str, ...] = (),
) -> list[subprocess.CompletedProcess[str]]:
    """Run the worker again each time it dies, at most ``restarts`` times; the
    runs made, the last one having ended on its own (exit 0 or 3) unless the
    bound was reached."""
    runs: list[subprocess.CompletedProcess[str]] = []
    for n in range(restarts):
        cmd = [
            sys.executable,
            "-m",
            "tests.chaos.crash_loop_worker",
            "--db-url",
            db.url,
            "--state",
            str(tmp_path / "state"),
            "--log",
            str(tmp_path / "handled.log"),
            "--poison",
            poison,
            "--owner",
            f"worker-{n}",
            "--max-attempts",
            str(MAX_ATTEMPTS),
            *(["--sink", str(sink)] if sink is not None else []),
            *(["--fanout"] if fanout else []),
            *extra,
        ]
        run = subprocess.run(
            cmd,
            check=False,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        runs.append(run)
        if run.returncode in (0, 3):
            break
    return runs


def _handled(tmp_path: Path) -> set[int]:
    log = tmp_path / "handled.log"
    return {int(line) for line in log.read_text().split()} if log.exists() else set()


def test_a_handler_that_kills_its_process_every_time_is_refused_without_a_sink(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # the reset below writes its backup under the working folder
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    runs = _restart_until_settled(sqlite_db, tmp_path, restarts=MAX_ATTEMPTS + 4)
    codes = [run.returncode for run in runs]
    assert codes[-1] == 3, f"the worker died on every run and nothing stopped it: {codes}"
    # The first run commits the first batch and dies on the second; each death
    # is counted when the next run takes its lease over, and the run after the
    # max_attempts-th death refuses without calling the handler.
    assert codes == [1] * MAX_ATTEMPTS + [3], codes
    refusal = runs[-1].stderr
    assert "CrashLoopError" in refusal, refusal
    assert "killed the process" in refusal, refusal
    assert "--to-cursor 50 --pk id=5" in refusal, "the reset that delivers it again"
    assert "--to-cursor 100 --pk id=10" in refusal, "the reset that steps over it"
    assert "from {'id': 6} at cursor 60 to {'id': 10}" in refusal, "its first and last row"
    store = FileCheckpointStore(tmp_path / "state")
    assert checkpoint_id(store) == 5, "the checkpoint stays before the batch it refuses"
    doc = read_doc(store)
    assert doc.failure is not None
    assert (doc.failure.attempts, doc.failure.crashes) == (MAX_ATTEMPTS, MAX_ATTEMPTS)
    assert _handled(tmp_path) == {1, 2, 3, 4, 5, 6}, "nothing past the poison row was handled"
    warned = "".join(run.stderr for run in runs)  # (WARNING and up reach stderr)
    assert warned.count("stopped without releasing its lease") == MAX_ATTEMPTS, warned
    state = f"file:{tmp_path / 'state'}"
    assert cli_main(["status", "items", "--store", state]) == 0
    shown = capsys.readouterr().out
    assert f"{MAX_ATTEMPTS} attempt(s)" in shown, shown
    assert f"({MAX_ATTEMPTS} ended with its process dead)" in shown, shown
    # The first way on, as printed (the handler fixed: no poison any more): the
    # reset at the checkpoint clears the count, and the batch is delivered again.
    reset = refusal.split("count cleared: ")[1].split(" (the checkpoint")[0]
    argv = shlex.split(reset)[1:]
    assert cli_main(argv) == 0, reset
    assert read_doc(store).failure is None


def test_a_fan_out_subscriber_that_kills_its_process_every_time_is_refused(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    runs = _restart_until_settled(sqlite_db, tmp_path, restarts=MAX_ATTEMPTS + 4, fanout=True)
    codes = [run.returncode for run in runs]
    assert codes == [1] * MAX_ATTEMPTS + [3], codes
    assert "CrashLoopError" in runs[-1].stderr, runs[-1].stderr
    assert checkpoint_id(FileCheckpointStore(tmp_path / "state")) == 5
    billing = (tmp_path / "handled.log.billing").read_text().splitlines()
    assert {int(line.split()[0]) for line in billing} <= set(range(1, 11)), "nothing past it"


def test_with_a_sink_the_row_that_kills_the_process_is_dead_lettered_and_the_rest_delivered(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    sink = tmp_path / "dead-letters.jsonl"
    runs = _restart_until_settled(sqlite_db, tmp_path, restarts=MAX_ATTEMPTS + 5, sink=sink)
    codes = [run.returncode for run in runs]
    assert codes[-1] == 0, f"the worker never got past the row: {codes}"
    # max_attempts deaths of the whole batch, then one more of row 7 handed alone
    # (its id written to the document first): the run after it dead-letters it.
    assert codes == [1] * (MAX_ATTEMPTS + 1) + [0], codes
    assert "killed the process delivering it alone" in runs[-1].stderr, runs[-1].stderr
    letters = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [letter["pk"] for letter in letters] == [{"id": POISON}]
    assert letters[0]["error"].startswith("ProcessDied: "), letters[0]["error"]
    assert _handled(tmp_path) == set(ROWS) - {POISON}, "every other row is delivered"
    store = FileCheckpointStore(tmp_path / "state")
    assert checkpoint_id(store) == ROWS[-1]
    assert read_doc(store).failure is None


def test_the_state_document_keeps_the_count_across_a_write_by_an_older_reader(
    tmp_path: Path,
) -> None:
    raw = {
        "version": 1,
        "poller_name": "p",
        "source_fingerprint": "fp",
        "checkpoint": None,
        "lease": None,
        "failure": {
            "attempts": 2,
            "crashes": 2,
            "probing": "ev-7",
            "first_failed_at": "2026-11-28T01:00:00.000000Z",
            "last_failed_at": "2026-11-28T01:00:05.000000Z",
            "last_error": "x",
            "batch_id": None,
        },
        "journal": [],
    }
    doc = docmod.loads(json.dumps(raw))
    assert doc.failure is not None
    assert doc.failure.crashes == 2
    assert doc.failure.probing == "ev-7"
    written = json.loads(docmod.dumps(doc))["failure"]
    assert (written["crashes"], written["probing"]) == (2, "ev-7")


# --- the pure rules (dbtrigger.state.crashes through decide_acquire), table by table ---

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
TTL = dt.timedelta(seconds=10)
AT = Position(50, {"id": 5})
ELSEWHERE = Position(90, {"id": 9})


def _lease(released: bool = False) -> Lease:
    return Lease("dead", 4, T0, T0, T0 + TTL, released)


def _record(attempts: int, crashes: int, at: Position | None = AT) -> FailureRecord:
    return FailureRecord(attempts, T0, T0, "ValueError: x", "b1", at, crashes=crashes)


def _doc(lease: Lease | None, failure: FailureRecord | None) -> StateDocument:
    checkpoint = Checkpoint(AT, "b0", T0)
    return StateDocument("p", "fp", checkpoint=checkpoint, lease=lease, failure=failure)


# (case, lease left, failure record before, counted: (attempts, crashes) or None)
TAKEOVERS = [
    ("released lease: a clean end", _lease(released=True), None, None),
    ("no lease yet", None, None, None),
    ("abandoned, first death", _lease(), None, (1, 1)),
    ("abandoned, after two deaths", _lease(), _record(2, 2), (3, 3)),
    ("abandoned, after an exception", _lease(), _record(2, 0), (3, 1)),
    ("abandoned, a record of another checkpoint", _lease(), _record(4, 4, ELSEWHERE), (1, 1)),
    ("released after an exception: no death", _lease(released=True), _record(2, 0), (2, 0)),
]


@pytest.mark.parametrize(
    ("case", "lease", "before", "after"), TAKEOVERS, ids=[t[0] for t in TAKEOVERS]
)
def test_a_lease_left_unreleased_counts_as_a_failed_attempt(
    case: str,
    lease: Lease | None,
    before: FailureRecord | None,
    after: tuple[int, int] | None,
) -> None:
    del case
    now = T0 + TTL + dt.timedelta(seconds=6)  # past the expiry and the grace window
    decided = L.decide_acquire(
        _doc(lease, before),
        poller="p",
        fingerprint="fp",
        owner="b",
        now=now,
        ttl=TTL,
        count_deaths=True,
    )
    assert isinstance(decided, L.Acquired)
    failure = decided.document.failure
    counted = None if failure is None else (failure.attempts, failure.crashes)
    assert counted == after
    assert (decided.abandoned is not None) == (lease is not None and not lease.released)
    if decided.abandoned is not None:
        assert failure is not None
        assert failure.from_position == AT
        assert "(dead, token 4)" in failure.last_error


def test_without_count_deaths_the_acquisition_writes_no_failure() -> None:
    now = T0 + TTL + dt.timedelta(seconds=6)
    decided = L.decide_acquire(
        _doc(_lease(), None), poller="p", fingerprint="fp", owner="b", now=now, ttl=TTL
    )
    assert isinstance(decided, L.Acquired)
    assert decided.document.failure is None
    assert decided.abandoned is None


def test_a_commit_clears_the_count_and_an_exception_resets_the_deaths() -> None:
    doc = _doc(Lease("b", 5, T0, T0, T0 + TTL), _record(2, 2))
    committed = L.decide_commit(
        doc,
        owner="b",
        token=5,
        position=ELSEWHERE,
        batch_id="b2",
        row_count=1,
        now=T0,
        ttl=TTL,
        release=True,
    )
    assert committed.failure is None
    failed = L.decide_failure(doc, owner="b", token=5, now=T0, error="ValueError: y", batch_id="b1")
    assert failed.failure is not None
    assert (failed.failure.attempts, failed.failure.crashes) == (3, 0)


# (failure record, max_attempts, verdict)
VERDICTS = [
    (None, 3, C.AfterDeaths.DELIVER),
    (_record(2, 2), 3, C.AfterDeaths.DELIVER),
    (_record(3, 3), 3, C.AfterDeaths.REFUSE),
    (_record(3, 1), 3, C.AfterDeaths.REFUSE),  # the latest attempt died
    (_record(5, 0), 3, C.AfterDeaths.DELIVER),  # exceptions: retried or bisected as before
    (_record(1, 1), 1, C.AfterDeaths.REFUSE),
]


@pytest.mark.parametrize(("failure", "limit", "verdict"), VERDICTS)
def test_a_batch_is_refused_once_max_attempts_are_counted_and_the_latest_died(
    failure: FailureRecord | None, limit: int, verdict: C.AfterDeaths
) -> None:
    assert C.after_deaths(failure, max_attempts=limit) is verdict


def test_with_a_sink_a_batch_that_killed_its_process_is_isolated_not_refused() -> None:
    assert C.after_deaths(_record(3, 1), max_attempts=3, can_isolate=True) is C.AfterDeaths.ISOLATE
    assert C.after_deaths(_record(2, 2), max_attempts=3, can_isolate=True) is C.AfterDeaths.DELIVER
    assert C.after_deaths(_record(4, 0), max_attempts=3, can_isolate=True) is C.AfterDeaths.DELIVER


def test_each_isolation_step_is_recorded_under_the_lease_before_its_call() -> None:
    doc = _doc(Lease("b", 5, T0, T0, T0 + TTL), _record(3, 3))
    later = T0 + dt.timedelta(seconds=4)
    step = L.decide_probe(
        doc, owner="b", token=5, now=later, ttl=TTL, event_id="ev-7", done=("ev-6",)
    )
    assert step.failure is not None
    assert (step.failure.probing, step.failure.done, step.failure.attempts) == (
        "ev-7",
        ("ev-6",),
        3,
    )
    assert step.lease is not None
    assert step.lease.expires_at == later + TTL, "the step renews the lease"
    with pytest.raises(LostLeaseError):
        L.decide_probe(doc, owner="b", token=4, now=later, ttl=TTL, event_id="x", done=())
    # After the last row passed, no row is named: a death before the commit blames none.
    passed = L.decide_probe(
        step, owner="b", token=5, now=later, ttl=TTL, event_id=None, done=("ev-6", "ev-7")
    )
    assert passed.failure is not None
    assert (passed.failure.probing, passed.failure.done) == (None, ("ev-6", "ev-7"))
    # The death during that call is counted by the next owner, the row still named.
    now = later + TTL + dt.timedelta(seconds=6)
    taken = L.decide_acquire(
        evolve(step, lease=Lease("b", 5, T0, later, later + TTL)),
        poller="p",
        fingerprint="fp",
        owner="c",
        now=now,
        ttl=TTL,
        count_deaths=True,
    )
    assert isinstance(taken, L.Acquired)
    failure = taken.document.failure
    assert failure is not None
    assert (failure.attempts, failure.crashes, failure.probing) == (4, 4, "ev-7")


def test_status_counts_the_rows_that_killed_the_process_when_handed_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """While a batch is handed over one row at a time, the rows found killing the
    process (``failure.killed``) are said by status, in words and in --json."""
    store = FileCheckpointStore(tmp_path / "state")
    failure = evolve(_record(4, 4), killed=("ev-7", "ev-9"), probing="ev-10")
    store.write("p", docmod.dumps(_doc(_lease(), failure)), if_match=None)
    assert cli_main(["status", "p", "--store", f"file:{tmp_path / 'state'}"]) == 0
    shown = capsys.readouterr().out
    assert "(4 ended with its process dead)" in shown, shown
    assert "2 row(s) of it killed the process when handed alone" in shown, shown
    assert cli_main(["status", "p", "--store", f"file:{tmp_path / 'state'}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failure"]["killed"] == 2
