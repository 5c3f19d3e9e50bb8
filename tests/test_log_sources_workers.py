"""Three workers on a change log or a log-based source, as a user first runs them.

docs/changes.md and docs/cdc.md, at default settings: the log installed
(`dbtrigger changelog install` / `dbtrigger cdc install`), a backlog of inserts,
updates and deletes of the same keys, then three `dbtrigger run` started
together while a writer is still committing; the worker delivering when a third
of the changes are in is killed with SIGKILL in the middle of its batch, and
another is started in its place. From the handler's own log: every committed
change is delivered, each key's changes in commit order (an update never before
its insert, the delete last), a change is delivered again only after the kill
(at most the batch in flight), a snapshot row carries the image its key had
just reached, and replaying the log gives the table. The workers' logs say no
ERROR, and a WARNING names the killed worker's pid.

``DBT_LOGW_CHANGES`` sets the number of changes (500 by default: about 15 s a
source, most of it starting processes; 5,000 for a longer run, which adds the
change log on PostgreSQL).
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.cdc.processes import reap
from tests.cdc_servers import BinlogDatabase, CdcDatabase

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.chaos.log_workers_app:trigger"
CHANGES = int(os.environ.get("DBT_LOGW_CHANGES", "500"))
WORKERS = 3


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out ({timeout:g}s) waiting for {what}")
        time.sleep(0.02)


@dataclass
class Setup:
    kind: str  # the app's source: changelog, pglogical, binlog
    url: str


#: The change log on PostgreSQL reads as on the others, with an exact guard: in the
#: longer run only (DBT_LOGW_CHANGES set), to keep the suite's time.
KINDS = ["changelog-sqlite", "changelog-mariadb", "pglogical", "binlog"]
if "DBT_LOGW_CHANGES" in os.environ:
    KINDS.append("changelog-postgresql")


@pytest.fixture(params=KINDS)
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Setup]:
    name: str = request.param
    if name == "changelog-sqlite":
        yield Setup("changelog", f"sqlite:///{tmp_path / 'app.db'}")
    elif name in ("changelog-postgresql", "pglogical"):
        db: CdcDatabase = request.getfixturevalue("cdc_db")
        kind = "changelog" if name.startswith("changelog") else "pglogical"
        yield Setup(kind, db.url)
    else:
        mdb: BinlogDatabase = request.getfixturevalue("binlog_db")
        yield Setup("changelog" if name.startswith("changelog") else "binlog", mdb.url)


class Writer:
    """Commits inserts, updates and deletes of the same keys; ``truth`` in commit order."""

    def __init__(self, url: str, first_key: int, seed: int) -> None:
        self.engine = sa.create_engine(url)
        self.next_key = first_key
        self.random = random.Random(seed)
        self.live: dict[int, int] = {}
        self.dead: dict[int, int] = {}  # deleted keys, with their last version
        self.truth: list[tuple[str, int, int]] = []

    def write(self, count: int, pause: float = 0.0) -> None:
        goal = len(self.truth) + count
        while len(self.truth) < goal:
            saved = (dict(self.live), dict(self.dead), self.next_key)
            try:
                done = self.transaction()
            except sa.exc.OperationalError as exc:
                # InnoDB rolled it back: two lockers met in opposite orders (this
                # writer's rows and a BinlogSource snapshot chunk's shared locks, read in
                # key order). An application retries a deadlock; so does this writer.
                if "Deadlock found" not in str(exc):
                    raise
                self.live, self.dead, self.next_key = saved
                continue
            self.truth.extend(done)
            time.sleep(pause)

    def transaction(self) -> list[tuple[str, int, int]]:
        """One transaction of 1-6 changes, committed; the changes it made."""
        done: list[tuple[str, int, int]] = []
        with self.engine.begin() as conn:
            for _ in range(self.random.randint(1, 6)):
                draw = self.random.random()
                if self.dead and draw < 0.08:  # a deleted key comes back
                    key = self.random.choice(sorted(self.dead))
                    version = self.dead.pop(key) + 1  # each (op, version) once per key
                    conn.execute(
                        sa.text("INSERT INTO items (id, version) VALUES (:k, :v)"),
                        {"k": key, "v": version},
                    )
                    self.live[key] = version
                    done.append(("insert", key, version))
                elif not self.live or draw < 0.35:
                    key, self.next_key = self.next_key, self.next_key + 1
                    conn.execute(
                        sa.text("INSERT INTO items (id, version) VALUES (:k, 1)"), {"k": key}
                    )
                    self.live[key] = 1
                    done.append(("insert", key, 1))
                elif draw < 0.85:
                    key = self.random.choice(sorted(self.live))
                    self.live[key] += 1
                    conn.execute(
                        sa.text("UPDATE items SET version = :v WHERE id = :k"),
                        {"k": key, "v": self.live[key]},
                    )
                    done.append(("update", key, self.live[key]))
                else:
                    key = self.random.choice(sorted(self.live))
                    conn.execute(sa.text("DELETE FROM items WHERE id = :k"), {"k": key})
                    self.dead[key] = self.live.pop(key)
                    done.append(("delete", key, self.dead[key]))
        return done

    def table(self) -> dict[int, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT id, version FROM items"))
            return {int(key): int(version) for key, version in rows}

    def close(self) -> None:
        self.engine.dispose()


class Workers:
    def __init__(self, setup: Setup, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.out = tmp_path / "handler.log"
        self.env = {
            **os.environ,
            "DBT_LOGW_KIND": setup.kind,
            "DBT_LOGW_URL": setup.url,
            "DBT_LOGW_STATE": str(tmp_path / "state"),
            "DBT_LOGW_OUT": str(self.out),
            "DBT_LOGW_EVENT_MS": "2",
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "dbtrigger.cli", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"dbtrigger {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    def start(self) -> None:
        with open(self.tmp_path / f"worker-{len(self.procs)}.log", "wb") as log:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "dbtrigger.cli", "run", APP, "--interval", "0.5"],
                    cwd=ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def delivered(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line]

    def kill_the_one_delivering(self) -> int:
        """SIGKILL the worker that wrote the handler's newest line within the last 20 ms
        (inside a batch: each event takes 2 ms), and start one in its place."""

        def fresh() -> bool:
            return time.time() - self.out.stat().st_mtime < 0.02

        wait_for(fresh, "a worker inside a batch")
        victim = self.delivered()[-1]["pid"]
        process = next(p for p in self.procs if p.pid == victim)
        process.send_signal(signal.SIGKILL)
        process.wait()
        self.start()
        return victim

    def logs(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.tmp_path.glob("worker-*.log")))

    def stop(self) -> None:
        for process in self.procs:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.procs:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                reap(process)


def all_in(truth: list[tuple[str, int, int]], lines: list[dict[str, Any]]) -> bool:
    """Whether each key's last change has been delivered (after those before it)."""
    return not any(w.endswith("never delivered") for w in judge(truth, lines)[0])


def judge(
    truth: list[tuple[str, int, int]], lines: list[dict[str, Any]]
) -> tuple[list[str], collections.Counter[int]]:
    """What went wrong per key, and how many changes each pid delivered again (a cursor
    delivered before)."""
    expected: dict[int, list[tuple[str, int]]] = collections.defaultdict(list)
    for op, key, version in truth:
        expected[key].append((op, version))
    seen: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    again: collections.Counter[int] = collections.Counter()
    cursors: set[str] = set()
    for line in lines:
        if line["cursor"] in cursors:
            again[line["pid"]] += 1
        else:
            cursors.add(line["cursor"])
            seen[line["id"]].append(line)
    wrong: list[str] = []
    for key in sorted(set(seen) - set(expected)):
        wrong.append(f"key {key}: delivered, never written: {seen[key]}")
    for key, changes in expected.items():
        top = -1  # the change of this key delivered last
        for d in seen.get(key, []):
            if d["op"] == "upsert":  # a snapshot row: the image its key has just reached
                if top < 0 or changes[top][0] == "delete" or changes[top][1] != d["v"]:
                    wrong.append(f"key {key}: snapshot {d} after {changes[: top + 1]}")
                continue
            # A delete's image may hold the key only (PostgreSQL's default replica
            # identity): then it is the key's next delete.
            index = next(
                (
                    i
                    for i, (op, version) in enumerate(changes)
                    if i > top
                    and op == d["op"]
                    and (version == d["v"] or (op == "delete" and d["v"] is None))
                ),
                None,
            )
            if index is None:
                wrong.append(f"key {key}: {d} again, or never written ({changes})")
            elif index > top + 1:
                wrong.append(f"key {key}: {d} before {changes[top + 1]} (changes {changes})")
            top = top if index is None else index
        if top < len(changes) - 1:
            wrong.append(f"key {key}: {changes[top + 1 :]} never delivered")
    return wrong, again


def test_three_workers_a_kill_mid_batch_and_a_live_writer_lose_nothing(
    setup: Setup, tmp_path: Path
) -> None:
    workers = Workers(setup, tmp_path)
    writer = Writer(setup.url, 1, seed=7)
    with writer.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE items (id int PRIMARY KEY, version int NOT NULL)"))
    if setup.kind == "changelog":
        workers.cli("changelog", "install", "--url", setup.url, "--table", "items", "--yes")
    else:
        workers.cli("cdc", "install", APP, "--yes")
    backlog = CHANGES * 3 // 5
    writer.write(backlog)
    live = threading.Thread(target=writer.write, args=(CHANGES - backlog, 0.005))
    live.start()
    try:
        for _ in range(WORKERS):
            workers.start()
        wait_for(
            lambda: len(workers.delivered()) >= CHANGES // 3,
            f"a third of the changes delivered\n{workers.logs()}",
        )
        victim = workers.kill_the_one_delivering()
        live.join(timeout=120)
        assert not live.is_alive()
        wait_for(
            lambda: all_in(writer.truth, workers.delivered()),
            f"every change delivered\n{workers.logs()}",
        )
        status = workers.cli("status", "--source", APP)
    finally:
        live.join(timeout=120)
        workers.stop()
        writer.close()
    lines = workers.delivered()
    wrong, again = judge(writer.truth, lines)
    assert wrong == [], "\n".join(wrong[:20])
    # Delivered again: only what the killed worker had been handed (at most its batch
    # of 100), by whoever took over; nothing delivered twice while no one died.
    assert sum(again.values()) <= 100, again
    assert victim not in again, again
    replay: dict[int, int] = {}
    for d in lines:
        if d["op"] == "delete":
            replay.pop(d["id"], None)
        else:
            replay[d["id"]] = d["v"]
    assert replay == writer.table()
    logs = workers.logs()
    for line in logs.splitlines():
        assert " ERROR " not in line, logs
        assert "Traceback" not in line, logs
    warned = [line for line in logs.splitlines() if " WARNING " in line]
    assert any(f"pid {victim}" in line or f"/{victim}/" in line for line in warned), logs
    # What the operator sees once every change is in: caught up (LAG ROWS 0), nothing
    # failing, no window; the dead worker's lease long taken over.
    row = next(line for line in status.splitlines() if line.startswith("items-changes"))
    assert re.search(r"\s0\s+-\s+-\s*$", row), status
    assert "HOLDER GONE" not in row, status
