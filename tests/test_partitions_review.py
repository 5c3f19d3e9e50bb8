"""Partitioned workers as a new user meets them: ``dbtrigger run`` at defaults (but
a halved balance interval, see BALANCE_SECONDS), the cases people hit first (a paused
member, a partition key that changes, skewed keys).

Outcomes only, each waited for with a bound: every row's latest state is delivered,
no partition's checkpoint moves back, per key the deliveries come in cursor order,
and the only repeats are what the docs allow (a stalled member's batch in flight).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.errors import DbTriggerError
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.partitions.cadence import default_ttl
from tests.databases import TestDatabase
from tests.test_partitions_processes import (
    ROOT,
    RowWriter,
    Workers,
    fair,
    wait_for,
    wait_latest_delivered,
)

#: The members' balance interval in these cases: half the default, so the member
#: TTL (its default multiple of the interval) is 5 s instead of 10. The cases are
#: about what happens once a member or the store was away past the TTL, not about
#: its length: a shorter one provokes the same takeovers in half the wait.
#: tests/test_partitions_processes.py runs every setting at its default.
BALANCE_SECONDS = 1.5
MEMBER_TTL = default_ttl(BALANCE_SECONDS)


def per_key_in_order(workers: Workers) -> list[str]:
    """Within each process's output, a key's cursors never go down."""
    bad = []
    for path in workers.out.glob("*.out"):
        last: dict[int, int] = {}
        for line in path.read_text().splitlines():
            key, _, seq = line.partition(",")
            if not seq:
                continue
            k, s = int(key), int(seq)
            if s < last.get(k, 0):
                bad.append(f"{path.name}: key {k} {last[k]} then {s}")
            last[k] = s
    return bad


def pause_outside_store_locks(proc: subprocess.Popen[bytes], state: Path) -> None:
    """SIGSTOP ``proc`` at a moment it holds none of the file store's locks.

    A member frozen inside a store write keeps its ``flock`` and everyone's reads
    and writes of that document fail (StoreUnavailableError, as documented): a
    different case from a member paused between writes, which this test is about.
    Paused at random, it froze inside the membership write now and then.
    """
    for _ in range(200):
        proc.send_signal(signal.SIGSTOP)
        if not any(_locked(lock) for lock in state.glob("*.lock")):
            return
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.02)
    pytest.fail("the member held a store lock at every one of 200 tries to pause it")


def _locked(lock: Path) -> bool:
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


#: Where the paused-member case runs: PostgreSQL by default (CI time; the
#: fencing that refuses the late commit is the store's, not the database's),
#: SQLite and MariaDB too with DBTRIGGER_REVIEW_DBS=postgresql,mariadb,sqlite
#: (each held in the review that added these tests).
REVIEW_DBS = os.environ.get("DBTRIGGER_REVIEW_DBS", "postgresql").split(",")


@pytest.mark.slow
@pytest.mark.parametrize(
    "db",
    [pytest.param(k, marks=[getattr(pytest.mark, k)] if k != "sqlite" else []) for k in REVIEW_DBS],
    indirect=True,
)
def test_a_member_paused_past_its_ttl_commits_nothing_after_the_others_took_over(
    db: TestDatabase, tmp_path: Path
) -> None:
    rows = 3000
    table = db.qualified("orders")
    db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, seq BIGINT NOT NULL)")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (id, seq) VALUES (:id, :id)"),
            [{"id": i} for i in range(1, rows + 1)],
        )
    (tmp_path / "state").mkdir()
    workers = Workers(db, str(tmp_path / "state"), tmp_path)
    workers.env["DBT_SCALEOUT_HANDLER_MS"] = "3"
    workers.env["DBT_SCALEOUT_BALANCE_SECONDS"] = str(BALANCE_SECONDS)
    regressions: list[str] = []
    done = threading.Event()

    def watch() -> None:
        seen: dict[str, int] = {}
        while not done.is_set():
            try:
                points = workers.checkpoints()
            except DbTriggerError:  # a file lock held by the paused member: read again
                points = {}
            for key, cursor in points.items():
                if cursor < seen.get(key, 0):
                    regressions.append(f"{key}: {seen[key]} -> {cursor}")
                seen[key] = max(cursor, seen.get(key, 0))
            done.wait(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for name in ("w1", "w2", "w3"):
            workers.start(name)
        wait_for("three fair shares", lambda: workers.shares() == fair(3), 90, workers.show)
        wait_for("w1 to deliver", lambda: workers.got_work("w1"), 60, workers.show)
        pause_outside_store_locks(workers.procs["w1"], tmp_path / "state")
        try:
            wait_for(
                "the paused member's partitions owned by the others",
                lambda: workers.shares() == fair(2),
                90,
                workers.show,
            )
            # the others go on delivering w1's partitions for a while
            time.sleep(2)
        finally:
            workers.procs["w1"].send_signal(signal.SIGCONT)
        expected = {(i, i) for i in range(1, rows + 1)}
        wait_for(
            "every row delivered",
            lambda: expected <= set(workers.deliveries()),
            120,
            lambda: f"{len(expected - set(workers.deliveries()))} missing\n{workers.show()}",
        )
        wait_for("w1 back in the group", lambda: len(workers.shares()) == 3, 60, workers.show)
    finally:
        done.set()
        watcher.join()
        workers.stop()
    assert not regressions, regressions
    assert not per_key_in_order(workers)
    twice = sum(n - 1 for n in workers.deliveries().values())
    assert twice <= 100, f"{twice} repeated deliveries"


def _nullable_key_table(db: TestDatabase) -> None:
    table = db.qualified("orders")
    db.execute(f"CREATE TABLE {table} (ext VARCHAR(20) UNIQUE, seq INTEGER NOT NULL)")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {table} (ext, seq) VALUES (:ext, :seq)"),
            [{"ext": f"k{i}", "seq": i} for i in range(1, 21)] + [{"ext": None, "seq": 21}],
        )


def _source(db: TestDatabase) -> SqlAlchemySource:
    return SqlAlchemySource(
        url=db.url, table="orders", schema=db.schema, cursor_column="seq", pk_columns=["ext"]
    )


def test_a_null_key_is_refused_as_the_plain_poller_refuses_it(
    db: TestDatabase, tmp_path: Path
) -> None:
    """A NULL key hashes to NULL in SQL: the row was in no partition's range, so
    every partition went past it and it was never delivered, with no error. The
    plain poller refuses such a row (SerializationError, naming it); so must a
    partition."""
    _nullable_key_table(db)
    plain = PollTrigger(
        name="plain", source=_source(db), checkpoint_store=FileCheckpointStore(tmp_path / "a")
    )
    with pytest.raises(DbTriggerError) as plain_error:
        plain.tick(lambda events: None)
    poller = PartitionedPoller(
        name="orders",
        source=_source(db),
        checkpoint_store=FileCheckpointStore(tmp_path / "b"),
        partitions=4,
        join_window_seconds=0,
        background=False,
    )
    seen: list[str] = []
    with pytest.raises(DbTriggerError) as error:
        poller.drain(lambda events: seen.extend(e.pk["ext"] for e in events))
    assert type(error.value) is type(plain_error.value), error.value


_CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


def escaped_exceptions(logs: str) -> list[str]:
    """The exception types that ended the tracebacks in ``logs``.

    A cause chained under a dbtrigger error (``raise FetchError(...) from exc``)
    is printed first, as its own block followed by "The above exception was the
    direct cause...": it says why the outage happened (a store directory that
    became a file) and did not escape. Only an exception whose block is not
    followed by such a line reached the runner.
    """
    lines = logs.splitlines()
    escaped: list[str] = []
    for i, line in enumerate(lines):
        match = re.match(r"([\w.]+(?:Error|Exception))\b", line)
        if match is None:
            continue
        chained = False
        for after in lines[i + 1 :]:
            if after.strip() in _CHAINED:
                chained = True
                break
            if after.startswith("Traceback") or re.match(r"\d{4}-\d\d-\d\d ", after):
                break  # the next traceback or log line: this block ended the chain
        if not chained:
            escaped.append(match.group(1))
    return escaped


def test_escaped_exceptions_skips_chained_causes() -> None:
    logs = (
        "2026-11-26 22:33:10,001 WARNING dbtrigger.runner: orders: tick failed\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in read\n'
        "NotADirectoryError: [Errno 20] Not a directory: 'state/orders.json'\n"
        "\n"
        "The above exception was the direct cause of the following exception:\n"
        "\n"
        "Traceback (most recent call last):\n"
        "dbtrigger.errors.FetchError: could not read the state of poller 'orders'\n"
        "2026-11-26 22:33:11,001 ERROR dbtrigger.runner: orders: tick failed (unexpected)\n"
        "Traceback (most recent call last):\n"
        "KeyError: 'id'\n"
    )
    assert escaped_exceptions(logs) == ["dbtrigger.errors.FetchError", "KeyError"]


@pytest.mark.postgresql
@pytest.mark.slow
def test_ddl_an_unreachable_store_and_regroups_while_members_run_or_are_down(
    pg: TestDatabase, tmp_path: Path
) -> None:
    rows = 2000
    table = pg.qualified("orders")
    pg.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, seq BIGINT NOT NULL)")
    pg.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, {rows}) g")
    state = tmp_path / "state"
    state.mkdir()
    workers = Workers(pg, str(state), tmp_path)
    workers.env["DBT_SCALEOUT_HANDLER_MS"] = "2"
    workers.env["DBT_SCALEOUT_BALANCE_SECONDS"] = str(BALANCE_SECONDS)
    rows_writer = RowWriter(pg, table, rows, seed=3)
    latest = rows_writer.latest
    stop = rows_writer.stop

    def cli(*argv: str) -> str:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "dbtrigger.cli",
                *argv,
                "--trigger",
                "benchmarks.scaleout_app:trigger",
            ],
            check=False,
            # From tmp_path, so the regroup's backups (dbtrigger-backups/ in the
            # working directory) are not written into the checkout.
            cwd=tmp_path,
            env={
                **workers.env,
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
                ),
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    writer = threading.Thread(target=rows_writer.run)
    try:
        for name in ("w1", "w2", "w3"):
            workers.start(name)
        writer.start()
        wait_for("three fair shares", lambda: workers.shares() == fair(3), 90, workers.show)
        pg.execute(f"ALTER TABLE {table} ADD COLUMN note VARCHAR(20)")
        print(cli("partitions", "split", "--yes", "--reason", "review"))
        wait_for("shares after split", lambda: sum(workers.shares()) == 24, 90, workers.show)
        # the store away for longer than the member TTL
        away = tmp_path / "away"
        state.rename(away)
        state.write_text("not a directory")
        time.sleep(MEMBER_TTL + 3)
        state.unlink()
        away.rename(state)
        assert all(p.poll() is None for p in workers.procs.values()), workers.show()
        wait_for("three members again", lambda: len(workers.shares()) == 3, 90, workers.show)
        for name in ("w1", "w2", "w3"):
            workers.signal(name, signal.SIGKILL)
        print(cli("partitions", "merge", "--yes", "--reason", "review", "--force"))
        for name in ("w1", "w2"):
            workers.start(name)
        time.sleep(2)
        stop.set()
        writer.join()
        wait_latest_delivered(workers, latest, 120)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()
        workers.stop()
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("w*.log"))
    raised = escaped_exceptions(logs)
    assert all(name.startswith("dbtrigger.errors.") for name in raised), raised
    assert not per_key_in_order(workers)


def _pid_listening_for(port: int) -> int:
    """The Azurite process this test started (its command line names the port)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(port).encode() in argv and any(b"azurite" in a for a in argv):
                return int(entry.name)
    raise AssertionError(f"no Azurite process on port {port}")


@pytest.mark.postgresql
@pytest.mark.slow
def test_blob_store_paused_then_a_member_paused_on_blob(pg: TestDatabase, tmp_path: Path) -> None:
    """Azurite frozen (SIGSTOP) for longer than the member TTL, then a member frozen:
    every row delivered, checkpoints never move back, only dbtrigger errors logged."""
    from azure.storage.blob import BlobServiceClient  # noqa: PLC0415

    from tests.azurite import start_azurite  # noqa: PLC0415

    rows = 2000
    table = pg.qualified("orders")
    pg.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, seq BIGINT NOT NULL)")
    pg.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, {rows}) g")
    started = start_azurite()
    azurite = next(started)
    try:
        BlobServiceClient.from_connection_string(azurite.connection_string).create_container(
            "db-state"
        )
        workers = Workers(pg, azurite.connection_string, tmp_path)
        workers.env["DBT_SCALEOUT_HANDLER_MS"] = "4"
        workers.env["DBT_SCALEOUT_BALANCE_SECONDS"] = str(BALANCE_SECONDS)
        node = _pid_listening_for(azurite.blob_port)
        try:
            for name in ("w1", "w2", "w3"):
                workers.start(name)
            wait_for("three fair shares", lambda: workers.shares() == fair(3), 90, workers.show)
            os.kill(node, signal.SIGSTOP)
            try:
                time.sleep(MEMBER_TTL + 3)  # the outage itself: longer than the member TTL
            finally:
                os.kill(node, signal.SIGCONT)
            wait_for("three members again", lambda: workers.shares() == fair(3), 120, workers.show)
            workers.procs["w2"].send_signal(signal.SIGSTOP)
            try:
                wait_for("w2's partitions taken", lambda: workers.shares() == fair(2), 90)
            finally:
                workers.procs["w2"].send_signal(signal.SIGCONT)
            expected = {(i, i) for i in range(1, rows + 1)}
            wait_for(
                "every row delivered",
                lambda: expected <= set(workers.deliveries()),
                120,
                lambda: f"{len(expected - set(workers.deliveries()))} missing\n{workers.show()}",
            )
            assert all(p.poll() is None for p in workers.procs.values()), workers.show()
        finally:
            workers.stop()
    finally:
        started.close()
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("w*.log"))
    raised = escaped_exceptions(logs)
    assert all(name.startswith("dbtrigger.errors.") for name in raised), raised
    assert not per_key_in_order(workers)
