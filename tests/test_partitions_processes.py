"""Three member processes, one killed, one added, a writer all along: nothing lost.

CI-sized: about 15 s per store. ``DBTRIGGER_SCALEOUT_SECONDS`` lengthens the
writer's run for a longer soak.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger.partitions import layout
from dbtrigger.partitions.member import membership_key
from dbtrigger.state import document
from dbtrigger.state.stores.factory import open_store
from tests.azurite import Azurite
from tests.databases import TestDatabase

ROOT = Path(__file__).resolve().parent.parent
INTERVAL = 0.5
TTL = 2.0
SOAK = float(os.environ.get("DBTRIGGER_SCALEOUT_SECONDS", "4"))

pytestmark = [pytest.mark.postgresql, pytest.mark.slow]


def wait_for(
    what: str, check: Callable[[], bool], timeout: float, show: Callable[[], object] = str
) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}: {show()}")


class Group:
    def __init__(self, pg: TestDatabase, store: str, tmp_path: Path) -> None:
        self.pg = pg
        self.store_spec = store
        self.app = f"scaleout{random.randrange(10**9)}"
        self.store = open_store(store, app=self.app)
        self.tmp = tmp_path
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, member: str) -> None:
        self.procs[member] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.partition_worker",
                self.pg.url,
                self.pg.schema or "",
                self.store_spec,
                member,
                str(self.tmp / f"{member}.out"),
                "--interval",
                str(INTERVAL),
                "--ttl",
                str(TTL),
                "--app",
                self.app,
            ],
            cwd=ROOT,
        )

    def owners(self) -> dict[str, int]:
        stored = self.store.read(membership_key("orders"))
        if stored is None:
            return {}
        doc = layout.loads(stored.data)
        return {name: len(m.owns) for name, m in doc.members.items()}

    def delivered(self) -> set[tuple[int, int]]:
        seen = set()
        for path in self.tmp.glob("*.out"):
            for line in path.read_text().splitlines():
                parts = line.split(",")
                if len(parts) == 2 and parts[1]:
                    seen.add((int(parts[0]), int(parts[1])))
        return seen

    def deliveries(self) -> Counter[tuple[int, int]]:
        """How often each (id, seq) row state was handed to a handler."""
        counts: Counter[tuple[int, int]] = Counter()
        for path in self.tmp.glob("*.out"):
            for line in path.read_text().splitlines():
                parts = line.split(",")
                if len(parts) == 2 and parts[1]:
                    counts[(int(parts[0]), int(parts[1]))] += 1
        return counts

    def checkpoints(self) -> dict[str, int]:
        """Each partition's committed cursor (seq) right now."""
        out = {}
        for key in self.store.list_keys():
            if key.startswith("orders.p"):
                stored = self.store.read(key)
                if stored is not None:
                    doc = document.loads(stored.data)
                    out[key] = doc.position.cursor if doc.checkpoint else 0
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(params=["file", "blob"])
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "file":
        (tmp_path / "state").mkdir()
        yield str(tmp_path / "state")
        return
    azurite: Azurite = request.getfixturevalue("azurite")
    from azure.core.exceptions import ResourceExistsError  # noqa: PLC0415
    from azure.storage.blob import BlobServiceClient  # noqa: PLC0415

    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    with contextlib.suppress(ResourceExistsError):
        service.create_container("db-state")  # the store's default container
    yield azurite.connection_string  # each run has its own app prefix in it


def test_kill_and_join_converge_and_lose_nothing(
    pg: TestDatabase, store_spec: str, tmp_path: Path
) -> None:
    table = pg.qualified("orders")
    pg.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, seq BIGINT NOT NULL)")
    pg.execute(f"CREATE INDEX ON {table} (seq, id)")
    latest: dict[int, int] = {}
    stop = threading.Event()
    seq = [0]

    def write() -> None:
        rng = random.Random(7)
        next_id = 1
        with pg.engine.connect() as conn:
            while not stop.is_set():
                seq[0] += 1
                if latest and rng.random() < 0.3:
                    key = rng.choice(list(latest))
                    conn.execute(
                        sa.text(f"UPDATE {table} SET seq = :s WHERE id = :id"),
                        {"s": seq[0], "id": key},
                    )
                else:
                    key = next_id
                    next_id += 1
                    conn.execute(
                        sa.text(f"INSERT INTO {table} VALUES (:id, :s)"), {"id": key, "s": seq[0]}
                    )
                conn.commit()
                latest[key] = seq[0]
                time.sleep(0.005)

    group = Group(pg, store_spec, tmp_path)
    writer = threading.Thread(target=write)
    regressions: list[str] = []

    def watch() -> None:  # no partition's checkpoint ever moves back
        seen: dict[str, int] = {}
        while not stop.is_set() or not watch_done.is_set():
            for key, cursor in group.checkpoints().items():
                if cursor < seen.get(key, 0):
                    regressions.append(f"{key}: {seen[key]} -> {cursor}")
                seen[key] = max(cursor, seen.get(key, 0))
            if stop.is_set():
                watch_done.set()
            time.sleep(0.1)

    watch_done = threading.Event()
    watcher = threading.Thread(target=watch)
    writer.start()
    watcher.start()
    try:
        took, joined = run_scenario(group)
        time.sleep(SOAK)
        stop.set()
        writer.join()
        expected = set(latest.items())
        wait_for("every row's latest state delivered", lambda: expected <= group.delivered(), 60)
    finally:
        stop.set()
        writer.join()
        watcher.join()
        group.stop()
    delivered = group.delivered()
    assert {i for i, _ in delivered} == set(latest), "an inserted row was never delivered"
    assert not regressions, regressions
    twice = sum(n - 1 for n in group.deliveries().values())
    # Only the killed member's batch in flight comes again (batch_size 50); steals and
    # rebalances let the previous owner finish and commit its tick.
    assert twice <= 50, f"{twice} repeated deliveries"
    print(
        f"takeover {took:.1f}s, join {joined:.1f}s, rows {len(latest)}, "
        f"states {len(delivered)}, repeated {twice}"
    )


def run_scenario(group: Group) -> tuple[float, float]:
    """Three members, kill one, add one: (seconds to take over, seconds to converge)."""
    for name in ("w1", "w2", "w3"):
        group.start(name)
    wait_for(
        "three members with a fair share each",
        lambda: sorted(group.owners().values()) == [2, 3, 3],
        30,
        group.owners,
    )
    assert group.owners()["w2"] >= 2
    group.procs["w2"].send_signal(signal.SIGKILL)
    took = wait_for(
        "the killed member's partitions owned again",
        lambda: "w2" not in group.owners() and sum(group.owners().values()) == 8,
        TTL + INTERVAL * 1.2 + 8,  # slack for a loaded machine
    )
    group.start("w4")
    # Measured from the new member's first heartbeat, not from its process start.
    wait_for("the new member's first heartbeat", lambda: "w4" in group.owners(), 30)
    joined = wait_for(
        "the new member's fair share",
        lambda: sorted(group.owners().values()) == [2, 3, 3],
        2 * INTERVAL * 1.2 + 10,
    )
    return took, joined


def test_scaleout_benchmark_prints_its_tables(pg: TestDatabase, tmp_path: Path) -> None:
    from tests.test_benchmarks_smoke import run_benchmark, table_rows  # noqa: PLC0415

    out = run_benchmark(
        "scaleout",
        ["--workers", "1,2", "--rows", "200", "--handler-ms", "0.5", "--interval", "0.5"],
        pg,
        tmp_path,
    )
    rows = table_rows(out, "Partitioned drain of 200 rows")
    assert [r[0] for r in rows] == ["1", "2"]
    ops = table_rows(out, "Storage operations of one member")
    assert ops[0][1:] == ["6", "0"]  # an idle round: one read per partition, no write
    assert ops[1][1:] == ["1", "1"]  # a balance cycle: one read, one conditional write
