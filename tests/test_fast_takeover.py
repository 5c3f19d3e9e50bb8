"""A worker restarted after its predecessor was killed mid-batch resumes at once.

Before, the lease of a worker killed with SIGKILL (an OOM kill, ``kill -9``,
``os._exit``) was taken over only once it expired: every crash cost a lease
TTL (120 s by default) with nothing delivered, and a crash loop needed
``max_attempts`` TTLs to be recognised. Now each lease records the process
that took it (``lease.process``: host, boot, PID namespace, pid and its start
time, see :mod:`dbtrigger._process`), and a taker on the same machine that
finds that process gone takes the lease at once - through the same
conditional write, counting the death as one failed attempt. Whatever it
cannot prove (another host, boot or container, a live process, a record of
another lease) keeps the TTL.

The workers are real processes (tests/chaos/takeover_worker.py) killed with
SIGKILL mid-batch; each restarted worker runs with the default TTL of 120 s
and must finish within :data:`BOUND`, well under it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from azure.storage.blob import BlobServiceClient

from dbtrigger import FileCheckpointStore, _process
from dbtrigger.cli import main as cli_main
from dbtrigger.errors import ReplayRefusedError
from dbtrigger.replay.batches import ReplayLease
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as L
from dbtrigger.state.document import Lease, StateDocument
from dbtrigger.state.stores.base import CheckpointStore
from tests import test_crash_loop as loop
from tests.azurite import Azurite
from tests.databases import TestDatabase, make_database
from tests.reliability_support import (
    Recorder,
    add_items,
    checkpoint_id,
    items_source,
    items_table,
    make_trigger,
    read_doc,
)
from tests.store_kinds import open_store

ROOT = Path(__file__).resolve().parent.parent
ROWS = range(1, 21)  # batches of 5: row 7 is in the second
HANG = 7
#: Bound on each wait, well under the 120 s lease TTL the restarted workers run with.
BOUND = 45.0


# --- real processes, killed mid-batch --------------------------------------------------


def _store_args(kind: str, tmp_path: Path, azurite: Azurite | None) -> Iterator[list[str]]:
    """The worker's store options for ``kind`` (its database or container made here)."""
    if kind == "sql":
        (tmp_path / "state-db").mkdir()
        for db in make_database("postgresql", tmp_path / "state-db"):
            yield ["--store-kind", "sql", "--store", db.url, "--schema", str(db.schema)]
    else:
        assert azurite is not None
        container = f"t{uuid.uuid4().hex[:20]}"
        service = BlobServiceClient.from_connection_string(azurite.connection_string)
        service.create_container(container)
        try:
            yield [
                "--store-kind",
                "blob",
                "--store",
                azurite.connection_string,
                "--container",
                container,
            ]
        finally:
            service.delete_container(container)
            service.close()


def _start(db: TestDatabase, tmp_path: Path, store: list[str], owner: str, *extra: str) -> Any:
    cmd = [
        sys.executable,
        "-m",
        "tests.chaos.takeover_worker",
        "--db-url",
        db.url,
        "--log",
        str(tmp_path / "handled.log"),
        "--owner",
        owner,
        *store,
        *extra,
    ]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_mid_batch(db: TestDatabase, tmp_path: Path, store: list[str], owner: str) -> int:
    """Start a worker, wait until it hangs in the batch holding row HANG, SIGKILL
    it (reaped, as a supervisor does before it restarts one); its pid."""
    ready = tmp_path / f"{owner}.hanging"
    proc = _start(db, tmp_path, store, owner, "--hang-on", str(HANG), "--ready", str(ready))
    try:
        deadline = time.monotonic() + BOUND
        while not ready.exists():
            if proc.poll() is not None:
                pytest.fail(f"{owner} ended before it hung: {proc.communicate()}")
            assert time.monotonic() < deadline, f"{owner} never reached row {HANG}"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=BOUND)
    assert proc.returncode == -signal.SIGKILL
    return int(proc.pid)


def _run(db: TestDatabase, tmp_path: Path, store: list[str], owner: str, *extra: str) -> Any:
    proc = _start(db, tmp_path, store, owner, *extra)
    try:
        out, err = proc.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{owner} did not finish within {BOUND} s (waiting out the TTL?): {err}")
    return proc.returncode, out, err


def _handled(tmp_path: Path) -> list[int]:
    return [int(line) for line in (tmp_path / "handled.log").read_text().split()]


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("sql", marks=pytest.mark.postgresql),
        pytest.param("blob", marks=pytest.mark.azurite),
    ],
)
def test_a_worker_restarted_after_a_sigkill_mid_batch_resumes_without_waiting_the_ttl(
    kind: str, sqlite_db: TestDatabase, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    azurite = request.getfixturevalue("azurite") if kind == "blob" else None
    for store in _store_args(kind, tmp_path, azurite):
        killed = _kill_mid_batch(sqlite_db, tmp_path, store, "first")
        code, out, err = _run(sqlite_db, tmp_path, store, "second")
        assert code == 0, err
        assert "first_delivery_s=" in out, out
        assert _handled(tmp_path) == list(ROWS), "the batch the dead worker held, then the rest"
        assert f"lease holder first (token 2, pid {killed} on this host)" in err, err
        assert f"pid {killed} no longer exists" in err, err
        assert "counted as failed attempt 1 of max_attempts=5" in err, err


def test_each_death_is_counted_once_when_a_restarted_worker_takes_over_at_once(
    sqlite_db: TestDatabase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    state = FileCheckpointStore(tmp_path / "state")
    store = ["--store-kind", "file", "--store", str(tmp_path / "state")]
    _kill_mid_batch(sqlite_db, tmp_path, store, "first")
    # The restarted worker hangs too: the write that took the lease over counted
    # one death; its own death makes the second, counted by the next one.
    second = _kill_mid_batch(sqlite_db, tmp_path, store, "second")
    doc = read_doc(state)
    assert doc.failure is not None
    assert (doc.failure.attempts, doc.failure.crashes) == (1, 1)
    assert "found no longer running on this host" in doc.failure.last_error
    assert doc.lease is not None
    assert doc.lease.owner_id == "second"
    assert doc.lease.process is not None
    assert doc.lease.process["fencing_token"] == doc.lease.fencing_token == 3
    assert set(doc.lease.process) == {
        "host",
        "boot_id",
        "pid_ns",
        "pid",
        "started",
        "fencing_token",
    }, "no command line, user or environment"
    assert checkpoint_id(state) == 5
    # What an operator sees meanwhile, before any worker was started again.
    assert cli_main(["status", "items", "--store", f"file:{tmp_path / 'state'}"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert f"(its process, pid {second} on this host, is gone: pid {second} no longer" in shown
    assert "a worker started on this machine takes the lease over at once" in shown
    code, out, err = _run(sqlite_db, tmp_path, store, "third")
    assert code == 0, err
    assert "first_delivery_s=" in out, out
    assert _handled(tmp_path) == list(ROWS), "the batch the dead workers held, then the rest"
    assert err.count("is no longer running") == 1, err
    assert f"lease holder second (token 3, pid {second} on this host)" in err, err
    assert "counted as failed attempt 2 of max_attempts=5" in err, err
    assert read_doc(state).failure is None, "the commit cleared the count"


def test_a_crash_loop_is_recognised_without_waiting_a_ttl_per_death(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    # The handler calls os._exit on row 7 every time (tests/chaos/crash_loop_worker.py),
    # with the default TTL: each restart ticks for at most 60 s, under one TTL.
    add_items(sqlite_db, items_table(sqlite_db), loop.ROWS)
    runs = loop._restart_until_settled(
        sqlite_db, tmp_path, restarts=loop.MAX_ATTEMPTS + 2, extra=("--ttl", "120")
    )
    codes = [run.returncode for run in runs]
    assert codes == [1] * loop.MAX_ATTEMPTS + [3], (codes, runs[-1].stderr)
    assert "CrashLoopError" in runs[-1].stderr, runs[-1].stderr
    taken = "".join(run.stderr for run in runs).count("is no longer running")
    assert taken == loop.MAX_ATTEMPTS, "each restart took the dead one's lease at once"
    doc = read_doc(FileCheckpointStore(tmp_path / "state"))
    assert doc.failure is not None
    assert (doc.failure.attempts, doc.failure.crashes) == (loop.MAX_ATTEMPTS, loop.MAX_ATTEMPTS)


def test_a_live_holder_in_another_process_of_this_host_is_not_taken_over(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    add_items(sqlite_db, items_table(sqlite_db), ROWS)
    store = ["--store-kind", "file", "--store", str(tmp_path / "state")]
    ready = tmp_path / "holder.hanging"
    holder = _start(
        sqlite_db, tmp_path, store, "holder", "--hang-on", str(HANG), "--ready", str(ready)
    )
    try:
        deadline = time.monotonic() + BOUND
        while not ready.exists():
            assert holder.poll() is None, holder.communicate()
            assert time.monotonic() < deadline, "the holder never reached its batch"
            time.sleep(0.02)
        code, out, err = _run(sqlite_db, tmp_path, store, "other", "--once")
        assert (code, out.strip()) == (0, "outcome=lease_busy"), (out, err)
        assert "no longer running" not in err, err
        assert holder.poll() is None, "the holder is untouched"
    finally:
        holder.kill()
        holder.communicate(timeout=BOUND)
    doc = read_doc(FileCheckpointStore(tmp_path / "state"))
    assert doc.lease is not None
    assert doc.lease.owner_id == "holder"
    assert doc.failure is None


# --- what counts as proof, in-process ----------------------------------------------

UTC = dt.timezone.utc


def _stat_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _me() -> dict[str, Any]:
    me = _process.this_process()
    assert me is not None, "these tests need a Linux /proc"
    return me


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _record_of(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    return {**_me(), "pid": proc.pid, "started": int(_stat_of(proc.pid)[19])}


def _dead_process() -> dict[str, Any]:
    """The record a lease would hold of a process of this machine that has ended."""
    proc = _sleeper()
    try:
        return _record_of(proc)
    finally:
        proc.kill()
        proc.wait()


def _hold(store: CheckpointStore, process: dict[str, Any] | None, token_offset: int = 0) -> None:
    """Make the items poller's lease live for 2 minutes more, held by
    ``gone-worker``, whose process ``process`` records (None: no record)."""
    stored = store.read("items")
    assert stored is not None
    doc = docmod.loads(stored.data)
    token = (doc.lease.fencing_token if doc.lease is not None else 0) + 1
    now = dt.datetime.now(UTC)
    recorded = None if process is None else {**process, "fencing_token": token + token_offset}
    lease = Lease("gone-worker", token, now, now, now + dt.timedelta(minutes=2), process=recorded)
    store.write("items", docmod.dumps(replace(doc, lease=lease)), if_match=stored.etag)


def _first_batch(db: TestDatabase, store: CheckpointStore) -> tuple[Any, Recorder]:
    add_items(db, items_table(db), ROWS)
    trigger = make_trigger(items_source(db), store, batch_size=5, lease_ttl_seconds=120)
    recorder = Recorder()
    trigger.tick_result(recorder)
    assert recorder.ids == [1, 2, 3, 4, 5]
    return trigger, recorder


STORES = [
    "file",
    "sql-sqlite",
    pytest.param("sql-postgresql", marks=pytest.mark.postgresql),
    pytest.param("sql-mariadb", marks=pytest.mark.mariadb),
    pytest.param("blob", marks=pytest.mark.azurite),
    pytest.param("table", marks=pytest.mark.azurite),
]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStore]:
    yield from open_store(request.param, request, tmp_path)


def test_every_store_keeps_the_record_and_a_gone_holder_is_taken_over_at_once(
    store: CheckpointStore, sqlite_db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    trigger, recorder = _first_batch(sqlite_db, store)
    mine = read_doc(store).lease
    assert mine is not None
    assert mine.process == {**_me(), "fencing_token": mine.fencing_token}, "recorded as taken"
    _hold(store, _dead_process())
    with caplog.at_level("WARNING", logger="dbtrigger"):
        result = trigger.tick_result(recorder)
    assert result.outcome != "lease_busy", result
    assert recorder.ids == list(range(1, 11)), "the dead holder's batch, delivered at once"
    gone = [r for r in caplog.records if getattr(r, "event", None) == "lease_holder_gone"]
    assert len(gone) == 1, caplog.text
    assert "lease holder gone-worker (token 2, pid " in gone[0].getMessage()
    doc = read_doc(store)
    assert doc.lease is not None
    assert doc.lease.process == {**_me(), "fencing_token": doc.lease.fencing_token}


def _other(key: str, value: Any) -> Any:
    def change() -> dict[str, Any]:
        return {**_dead_process(), key: value}

    return change


# (case, the record the live lease holds, the token it was written with, offset)
NOT_PROOF = [
    ("no record: an older version's lease", lambda: None, 0),
    ("another host", _other("host", "elsewhere"), 0),
    ("another boot", _other("boot_id", "00000000-0000-0000-0000-000000000000"), 0),
    ("another PID namespace: another container", _other("pid_ns", "pid:[1]"), 0),
    ("a record of an earlier lease, kept by an older version", _dead_process, -1),
    ("this very process", lambda: {**_me()}, 0),
    ("a pid that is not a number", _other("pid", "123"), 0),
    ("a start time that is not a number", _other("started", True), 0),
]


@pytest.mark.parametrize(("case", "record", "offset"), NOT_PROOF, ids=[c[0] for c in NOT_PROOF])
def test_a_holder_not_proven_gone_keeps_its_lease_until_the_ttl(
    case: str, record: Any, offset: int, sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    del case
    store = FileCheckpointStore(tmp_path / "state")
    trigger, recorder = _first_batch(sqlite_db, store)
    _hold(store, record(), offset)
    assert trigger.tick_result(recorder).outcome == "lease_busy"
    assert recorder.ids == [1, 2, 3, 4, 5]


def test_a_live_process_is_not_gone_and_a_killed_one_is_even_before_it_is_reaped() -> None:
    proc = _sleeper()
    try:
        recorded = _record_of(proc)
        held = _lease_with(recorded)
        assert _process.gone(held) is None, "alive"
        assert _process.gone(replace(held, released=True)) is None, "released: nothing to prove"
        proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + BOUND
        while _stat_of(proc.pid)[0] != "Z":
            assert time.monotonic() < deadline, "the killed process never became a zombie"
            time.sleep(0.01)
        assert _process.gone(held) == f"pid {proc.pid} has exited (a zombie not yet reaped)"
    finally:
        proc.kill()
        proc.wait()
    assert _process.gone(held) == f"pid {proc.pid} no longer exists"
    reused = {**recorded, "started": recorded["started"] - 1, "pid": os.getpid()}
    assert "is now another process" in str(_process.gone(_lease_with(reused)))


def _lease_with(recorded: dict[str, Any]) -> Lease:
    now = dt.datetime.now(UTC)
    return Lease(
        "w", 9, now, now, now + dt.timedelta(minutes=2), process={**recorded, "fencing_token": 9}
    )


def _recorded_as(store: CheckpointStore, key: str, process: dict[str, Any]) -> None:
    """Rewrite the record of ``key``'s lease to name ``process`` (same token)."""
    stored = store.read(key)
    assert stored is not None
    doc = docmod.loads(stored.data)
    assert doc.lease is not None
    recorded = {**process, "fencing_token": doc.lease.fencing_token}
    changed = replace(doc, lease=replace(doc.lease, process=recorded))
    store.write(key, docmod.dumps(changed), if_match=stored.etag)


def test_a_replay_killed_half_way_leaves_a_lease_the_next_replay_takes_at_once(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FileCheckpointStore(tmp_path / "state")
    trigger, _ = _first_batch(sqlite_db, store)
    now = dt.datetime.now(UTC)
    ReplayLease.take(store, trigger, "replay:first", now)
    live = _sleeper()
    try:
        _recorded_as(store, "items.replay", _record_of(live))
        with pytest.raises(ReplayRefusedError, match="another replay of 'items' holds"):
            ReplayLease.take(store, trigger, "replay:second", now)
    finally:
        live.kill()
        live.wait()
    _recorded_as(store, "items.replay", _dead_process())
    with caplog.at_level("WARNING", logger="dbtrigger"):
        taken = ReplayLease.take(store, trigger, "replay:second", now)
    assert taken.token == 2
    assert "the replay of 'items' by replay:first (token 1) is no longer running" in caplog.text


# --- the pure rule and the document -----------------------------------------------------

T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
TTL = dt.timedelta(seconds=120)


def _doc(lease: Lease | None) -> StateDocument:
    return StateDocument("p", "fp", lease=lease)


def test_decide_acquire_takes_a_gone_holders_live_lease_at_once_and_counts_one_death() -> None:
    live = Lease("dead", 4, T0, T0, T0 + TTL, process={"pid": 1, "fencing_token": 4})
    now = T0 + dt.timedelta(seconds=1)
    common: dict[str, Any] = {
        "poller": "p",
        "fingerprint": "fp",
        "owner": "b",
        "now": now,
        "ttl": TTL,
    }
    assert isinstance(L.decide_acquire(_doc(live), **common, count_deaths=True), L.Busy)
    me = {"host": "h", "pid": 2}
    taken = L.decide_acquire(_doc(live), **common, count_deaths=True, holder_gone=True, process=me)
    assert isinstance(taken, L.Acquired)
    assert (taken.taken_early, taken.abandoned) == (live, live)
    failure = taken.document.failure
    assert failure is not None
    assert (failure.attempts, failure.crashes) == (1, 1)
    assert "found no longer running" in failure.last_error
    lease = taken.document.lease
    assert lease is not None
    assert lease.process == {"host": "h", "pid": 2, "fencing_token": 5}
    # Expired anyway: taken as before, not "early".
    late = L.decide_acquire(
        _doc(live), **{**common, "now": T0 + TTL + dt.timedelta(seconds=6)}, holder_gone=True
    )
    assert isinstance(late, L.Acquired)
    assert late.taken_early is None
    assert late.document.lease is not None
    assert late.document.lease.process is None, "no record of a taker that has none"


def test_the_record_is_an_optional_lease_field_every_version_reads_and_keeps() -> None:
    raw: dict[str, Any] = {
        "version": 1,
        "poller_name": "p",
        "source_fingerprint": "fp",
        "checkpoint": None,
        "lease": {
            "owner_id": "w",
            "fencing_token": 3,
            "acquired_at": "2026-11-28T01:00:00.000000Z",
            "heartbeat_at": "2026-11-28T01:00:00.000000Z",
            "expires_at": "2026-11-28T01:02:00.000000Z",
            "released": False,
        },
        "failure": None,
        "journal": [],
    }
    older = docmod.loads(json.dumps(raw))  # written before the record existed
    assert older.lease is not None
    assert older.lease.process is None
    assert "process" not in json.loads(docmod.dumps(older))["lease"]
    recorded = {"host": "h", "pid": 7, "started": 1, "fencing_token": 3, "newer": [1]}
    raw["lease"]["process"] = recorded
    doc = docmod.loads(json.dumps(raw))
    assert doc.lease is not None
    assert doc.lease.process == recorded
    assert json.loads(docmod.dumps(doc))["lease"]["process"] == recorded
    raw["lease"]["process"] = "not an object"  # a later format: kept, never believed
    odd = docmod.loads(json.dumps(raw))
    assert odd.lease is not None
    assert odd.lease.process is None
    assert json.loads(docmod.dumps(odd))["lease"]["process"] == "not an object"
