"""The history a running poller keeps: every commit recorded after it lands, holes
from a crash or an outage filled from the journal, failures counted and said
once per outage, and - under SIGKILL and restarts - exactly the committed
batches, no gap, no phantom.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import os
import random
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.cursor import encoded_pk
from dbtrigger.errors import StoreUnavailableError
from dbtrigger.history import FileHistory, HistoryStore, MemoryHistory, SqlHistory, history_for
from dbtrigger.history.records import detail_lines, image_crc
from dbtrigger.history.store import Retention
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.sources.memory import MemorySource
from dbtrigger.state.document import format_time, position_from_json, position_to_json
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.memory import InMemoryCheckpointStore
from tests.azurite import Azurite
from tests.chaos.forked import ForkedProcess, Forker
from tests.databases import TestDatabase

#: Kills per chaos run (DBTRIGGER_HISTORY_CHAOS_KILLS for a longer run) and rows.
#: Random kills after the exact deaths (DEATHS); 4 until the suite outgrew its budget:
#: each is a process start (~1 s of CPU with the Blob SDK), the exact points are the ones
#: that provoke the phantom and the gap. Set it higher for a soak.
KILLS = int(os.environ.get("DBTRIGGER_HISTORY_CHAOS_KILLS", "2"))
ROWS = int(os.environ.get("DBTRIGGER_HISTORY_CHAOS_ROWS", "300"))


class FlakyHistory:
    """A history store whose appends fail while ``down`` (an outage), or once
    ``crash_next`` is set (the process "dies" between a commit and its append)."""

    def __init__(self, inner: HistoryStore) -> None:
        self.inner = inner
        self.down = False
        self.appends = 0

    def append(self, poller: str, records: Sequence[Mapping[str, Any]], *, after_seq: int) -> None:
        if self.down:
            raise StoreUnavailableError("history store unreachable (test)")
        self.appends += 1
        self.inner.append(poller, records, after_seq=after_seq)

    def tail(self, poller: str, count: int) -> list[dict[str, Any]]:
        if self.down:
            raise StoreUnavailableError("history store unreachable (test)")
        return self.inner.tail(poller, count)

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        return self.inner.read(poller, since_seq=since_seq)

    def prune(self, poller: str, retention: Retention, now: dt.datetime) -> int:
        return self.inner.prune(poller, retention, now)

    def describe(self) -> str:
        return "flaky"


def memory_source(rows: int) -> MemorySource:
    return MemorySource(
        [{"id": i, "seq": i, "v": f"row {i}"} for i in range(1, rows + 1)],
        cursor_column="seq",
        pk_columns=["id"],
    )


def commits(history: HistoryStore, poller: str = "orders") -> list[dict[str, Any]]:
    return [r for r in history.read(poller) if r.get("type") == "commit"]


def assert_chain(records: Sequence[Mapping[str, Any]], total_rows: int, last: Any) -> None:
    """Committed batches, each once, each starting where the previous ended."""
    seqs = [int(r["seq"]) for r in records]
    assert seqs == list(range(1, len(seqs) + 1)), "the history's numbers have a hole"
    assert len({r["id"] for r in records}) == len(records), "a record appears twice"
    assert not [r for r in records if r.get("type") == "gap"]
    chain = [r for r in records if r.get("type") == "commit"]
    assert position_from_json(chain[0]["from"]).is_beginning
    for before, after in itertools.pairwise(chain):
        assert after["from"] == before["to"], "a committed batch is missing (gap)"
    assert chain[-1]["to"] == position_to_json(last)
    assert sum(int(r["rows"]) for r in chain) == total_rows, "phantom or missing rows"


def test_every_commit_is_recorded_with_digests_and_event_lines() -> None:
    store = InMemoryCheckpointStore()
    source = memory_source(25)
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=store, batch_size=10)
    seen: list[RowChange] = []
    trigger.drain(seen.extend)
    history = history_for(store)
    assert history is trigger.history is not None
    records = commits(history)
    assert [r["rows"] for r in records] == [10, 10, 5]
    assert [r["seq"] for r in records] == [1, 2, 3]
    lines = detail_lines(records[0])
    assert lines is not None
    assert [line.key for line in lines] == [encoded_pk(e.pk) for e in seen[:10]]
    assert [line.image for line in lines] == [f"{image_crc(e):08x}" for e in seen[:10]]
    assert len(set(records[0]["detail"]["crcs"])) == 10  # every image its own CRC


def test_a_failing_append_is_counted_said_once_and_the_poller_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = InMemoryMetrics()
    history = FlakyHistory(MemoryHistory())
    source = memory_source(60)
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=10,
        metrics=metrics,
        history=history,
    )
    trigger.tick(lambda events: None)
    history.down = True
    with caplog.at_level(logging.DEBUG, logger="dbtrigger"):
        for _ in range(3):
            assert trigger.tick(lambda events: None) == 10  # the commits stand
        failed = [r for r in caplog.records if getattr(r, "event", "") == "history_append_failed"]
        assert [r.levelno for r in failed] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
        assert "the commit stands" in failed[0].getMessage()
        assert metrics.total("history_append_failures_total") == 3
        history.down = False
        caplog.clear()
        assert trigger.tick(lambda events: None) == 10
        recovered = [
            r for r in caplog.records if getattr(r, "event", "") == "history_append_recovered"
        ]
        assert len(recovered) == 1
    # The hole was filled from the journal: every commit, in order.
    assert_chain(list(history.read("orders")), 50, trigger.read_state().position)  # type: ignore[union-attr]
    assert metrics.total("history_appends_total") == 5


def test_a_history_table_that_is_gone_fails_appends_counted_and_the_poller_goes_on(
    db: TestDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """A real failure, not a fake one: the SQL history table disappears (renamed
    away) under a running poller. Its commits stand, each failed append is
    counted by error type and said once; once the table is back, the next append
    fills the hole from the journal."""
    metrics = InMemoryMetrics()
    history = SqlHistory(db.engine, table="orders_history", schema=db.schema)
    store = InMemoryCheckpointStore()
    trigger = PollTrigger(
        name="orders",
        source=memory_source(60),
        checkpoint_store=store,
        batch_size=10,
        metrics=metrics,
        history=history,
    )
    assert trigger.tick(lambda events: None) == 10
    away = db.qualified("orders_history_away") if db.kind == "mariadb" else "orders_history_away"
    db.execute(f"ALTER TABLE {db.qualified('orders_history')} RENAME TO {away}")
    with caplog.at_level(logging.DEBUG, logger="dbtrigger"):
        for _ in range(3):
            assert trigger.tick(lambda events: None) == 10  # the commits stand
    assert store_position(store).cursor == 40
    failed = [r for r in caplog.records if getattr(r, "event", "") == "history_append_failed"]
    assert [r.levelno for r in failed] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "the commit stands" in failed[0].getMessage()
    assert metrics.total("history_append_failures_total", error_type="StoreUnavailableError") == 3
    assert metrics.total("history_appends_total") == 1
    back = db.qualified("orders_history") if db.kind == "mariadb" else "orders_history"
    db.execute(f"ALTER TABLE {db.qualified('orders_history_away')} RENAME TO {back}")
    assert trigger.tick(lambda events: None) == 10
    assert_chain(list(history.read("orders")), 50, store_position(store))
    assert metrics.total("history_appends_total") == 5  # one, then the three missed and this


def test_an_outage_longer_than_the_journal_leaves_a_marked_gap() -> None:
    history = FlakyHistory(MemoryHistory())
    trigger = PollTrigger(
        name="orders",
        source=memory_source(100),
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=5,
        journal_limit=3,
        history=history,
    )
    trigger.tick(lambda events: None)
    history.down = True
    for _ in range(6):
        trigger.tick(lambda events: None)
    history.down = False
    trigger.tick(lambda events: None)
    types = [r["type"] for r in history.read("orders")]
    assert types == ["commit", "gap", "commit", "commit", "commit"]


def test_a_crash_between_commit_and_append_is_filled_in_by_the_next_process() -> None:
    """Process one commits and dies before its append; process two fills it in,
    by its next commit or, with nothing to commit, on an idle tick a while later."""
    store = InMemoryCheckpointStore()
    source = memory_source(20)
    history = FlakyHistory(MemoryHistory())
    first = PollTrigger(
        name="orders", source=source, checkpoint_store=store, batch_size=10, history=history
    )
    first.tick(lambda events: None)
    history.down = True  # the append after this commit never happens
    first.tick(lambda events: None)
    history.down = False
    assert len(commits(history.inner)) == 1

    now = [dt.datetime.now(dt.timezone.utc)]
    second = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=store,
        history=history,
        clock=lambda: now[0],
    )
    assert second.tick(lambda events: None) == 0  # idle: the entry is too fresh to check
    assert len(commits(history.inner)) == 1
    now[0] += dt.timedelta(seconds=60)
    assert second.tick(lambda events: None) == 0
    assert_chain(list(history.inner.read("orders")), 20, store_position(store))
    appends = history.appends
    second.tick(lambda events: None)  # checked once: no more reads or writes
    assert history.appends == appends


def store_position(store: CheckpointStore) -> Any:
    from dbtrigger.state import document as docmod  # noqa: PLC0415

    stored = store.read("orders")
    assert stored is not None
    return docmod.loads(stored.data).position


def test_manual_operations_are_recorded_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dbtrigger.cli import main  # noqa: PLC0415

    store = FileCheckpointStore(tmp_path / "state")
    trigger = PollTrigger(
        name="orders", source=memory_source(15), checkpoint_store=store, batch_size=10
    )
    trigger.drain(lambda events: None)
    args = ["--store", str(tmp_path / "state"), "--backup-dir", str(tmp_path / "bk")]
    assert (
        main(["reset", "orders", "--to-beginning", "--reason", "replay all", "--yes", *args]) == 0
    )
    assert (
        main(
            [
                "reset",
                "orders",
                "--to-cursor",
                "5",
                "--kind",
                "int",
                "--pk",
                "id:int=5",
                "--reason",
                "r",
                "--yes",
                *args,
            ]
        )
        == 0
    )
    history = history_for(store)
    assert history is not None
    records = list(history.read("orders"))
    assert [r["type"] for r in records] == ["commit", "commit", "manual", "manual"]
    assert [r.get("operation") for r in records[2:]] == ["reset", "reset"]
    assert records[3]["after"]["value"] == 5
    assert records[2]["reason"] == "replay all"


# --- SIGKILL and restart --------------------------------------------------------------


def _items(db: TestDatabase, rows: int) -> None:
    table = sa.Table(
        "items",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("v", sa.String(20)),
        schema=db.schema,
    )
    table.create(db.engine)
    with db.engine.begin() as conn:
        conn.execute(
            table.insert(), [{"id": i, "version": i, "v": "x"} for i in range(1, rows + 1)]
        )


def _worker(
    forker: Forker,
    log: Path,
    db: TestDatabase,
    kind: str,
    where: str,
    container: str | None,
    die_at: str | None = None,
) -> ForkedProcess:
    """``python -m tests.chaos.history_worker``, forked from the test's fork server
    (tests/chaos/forked.py): a restart after a kill costs no new interpreter."""
    argv = [
        "--db-url",
        db.url,
        "--store-kind",
        kind,
        "--store",
        where,
    ]
    if db.schema:
        argv += ["--schema", db.schema]
    if container:
        argv += ["--container", container]
    if die_at:
        argv += ["--die-at", die_at]
    log.unlink(missing_ok=True)
    return forker.start(argv, log)


def _committed(store: CheckpointStore) -> int:
    from dbtrigger.state import document as docmod  # noqa: PLC0415

    stored = store.read("items")
    if stored is None:
        return 0
    cp = docmod.loads(stored.data).checkpoint
    return int(cp.position.cursor) if cp is not None else 0


def _wait(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the workers")
        time.sleep(0.1)  # each check reads the store (a Blob request, say)


@pytest.fixture(
    params=[
        "file",
        pytest.param("sql", marks=pytest.mark.postgresql),
        pytest.param("blob", marks=pytest.mark.azurite),
    ]
)
def chaos_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, str, str | None, CheckpointStore]]:
    kind = request.param
    if kind == "file":
        yield kind, str(tmp_path / "state"), None, FileCheckpointStore(tmp_path / "state")
        return
    if kind == "sql":
        from dbtrigger.state.stores.sql import SqlCheckpointStore  # noqa: PLC0415
        from tests.databases import make_database  # noqa: PLC0415

        for state_db in make_database("postgresql", tmp_path):
            store = SqlCheckpointStore(url=state_db.url, schema=state_db.schema)
            yield kind, f"{state_db.url}#{state_db.schema}", None, store
            store.close()
        return
    from azure.storage.blob import BlobServiceClient  # noqa: PLC0415

    from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415

    azurite: Azurite = request.getfixturevalue("azurite")
    container = f"hc{uuid.uuid4().hex[:16]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(container)
    store = BlobCheckpointStore.from_connection_string(
        azurite.connection_string, app_name="chaos", container=container
    )
    try:
        yield kind, azurite.connection_string, container, store
    finally:
        store.close()
        service.delete_container(container)
        service.close()


def _no_phantom_so_far(store: CheckpointStore, history: HistoryStore) -> None:
    """Right after a kill: the history holds committed batches only, in an unbroken
    chain from the beginning (the last commit's record may still be missing: the
    next process fills it in), never one beyond the committed checkpoint."""
    records = list(history.read("items"))
    seqs = [int(r["seq"]) for r in records]
    assert seqs == list(range(1, len(seqs) + 1)), "the history's numbers have a hole"
    assert len({r["id"] for r in records}) == len(records), "a record appears twice"
    chain = [r for r in records if r.get("type") == "commit"]
    if not chain:
        return
    assert position_from_json(chain[0]["from"]).is_beginning
    for before, after in itertools.pairwise(chain):
        assert after["from"] == before["to"], "a committed batch is missing (gap)"
    recorded = int(position_from_json(chain[-1]["to"]).cursor)
    assert recorded <= _committed(store), "a batch is recorded that was never committed"


#: Deaths at exact points (tests/chaos/history_worker.py --die-at), then random kills.
DEATHS = ["write:3", "append:1", "append:3", "write:6", "append:2"]


@pytest.mark.slow
def test_kill_and_restart_leave_exactly_the_committed_batches(
    sqlite_db: TestDatabase, chaos_store: tuple[str, str, str | None, CheckpointStore]
) -> None:
    """SIGKILL at exact points - before a commit lands (a record for it would be a
    phantom), between a commit and its append (a gap unless the journal fills it
    in), half way through a history line (file) - and at random moments, with a
    restart after each: the history ends with exactly the committed batches."""
    kind, _, _, store = chaos_store
    _items(sqlite_db, ROWS)
    history = history_for(store)
    assert history is not None
    rng = random.Random(ROWS * 7 + KILLS)
    deaths: list[str | None] = [*DEATHS, *(["torn:2"] if kind == "file" else []), *[None] * KILLS]
    with Forker("tests.chaos.history_worker") as forker:
        kill_and_restart(forker, sqlite_db, chaos_store, history, deaths, rng)
    # The last process may have died between its last commit and that commit's
    # append: an idle tick a while later (another instance, or a restart) fills it in.
    source = SqlAlchemySource(
        url=sqlite_db.url,
        table="items",
        cursor_column="version",
        pk_columns=["id"],
        visibility="none",
    )
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    PollTrigger(name="items", source=source, checkpoint_store=store, clock=lambda: later).tick(
        lambda events: None
    )
    assert_chain(list(history.read("items")), ROWS, store_position_of(store, "items"))
    source.close()


def kill_and_restart(
    forker: Forker,
    sqlite_db: TestDatabase,
    chaos_store: tuple[str, str, str | None, CheckpointStore],
    history: HistoryStore,
    deaths: list[str | None],
    rng: random.Random,
) -> None:
    """A worker per death (each one killed, or killing itself, and checked right
    after), then one that drains the rest."""
    kind, where, container, store = chaos_store
    log = Path(forker.socket).parent / "worker.log"  # the last one's, for the assertion
    for die_at in deaths:
        before = _committed(store)
        proc = _worker(forker, log, sqlite_db, kind, where, container, die_at)
        try:
            if die_at is None:
                # Let it commit something, then kill it wherever it is.
                _wait(lambda p=proc, b=before: _committed(store) > b or p.poll() is not None)
                time.sleep(rng.uniform(0.0, 0.3))
            else:
                _wait(lambda p=proc: p.poll() is not None)  # it kills itself
        finally:
            proc.kill()
            proc.wait(timeout=30)
        assert proc.returncode == -9, log.read_text(errors="replace")[-2000:]
        _no_phantom_so_far(store, history)
    proc = _worker(forker, log, sqlite_db, kind, where, container)
    try:
        _wait(lambda: _committed(store) == ROWS, timeout=120)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def store_position_of(store: CheckpointStore, name: str) -> Any:
    from dbtrigger.state import document as docmod  # noqa: PLC0415

    stored = store.read(name)
    assert stored is not None
    return docmod.loads(stored.data).position


def test_history_and_status_show_the_retries_waiting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Count, oldest due time and owed subscribers, in status and history (CLI)."""
    from dbtrigger.cli import main  # noqa: PLC0415

    def billing(events: list[RowChange]) -> None:
        pass

    def search(events: list[RowChange], ctx: Any) -> None:
        for event in events:
            if event.pk["id"] == 2:
                ctx.retry(event, "index busy")

    store = FileCheckpointStore(tmp_path / "state")
    trigger = PollTrigger(
        name="orders",
        source=memory_source(5),
        checkpoint_store=store,
        subscribers={"billing": billing, "search": search},
        retry_delay_seconds=600,
        retry_delay_max_seconds=600,
    )
    trigger.tick()
    args = ["--store", str(tmp_path / "state")]
    capsys.readouterr()
    assert main(["status", "orders", "--json", *args]) == 0
    retries = json.loads(capsys.readouterr().out)["window"]["retries"]
    assert (retries["waiting"], retries["owed"]) == (1, {"search": 1})
    assert retries["next_due"] > format_time(dt.datetime.now(dt.timezone.utc))
    assert main(["history", "orders", *args]) == 0
    out = capsys.readouterr().out
    assert "waiting now: 1 event(s)" in out
    assert "owed to search (1)" in out
    assert "billing 5/0/0, search 4/0/1" in out  # per-subscriber counts of the commit


def test_history_shows_a_commit_the_history_store_missed_from_the_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The history store was down for the last commit: ``dbtrigger history`` still
    lists it, from the state document's journal, with ``-`` for its number (and
    ``pending`` in --json) until the poller's next append fills it in."""
    from dbtrigger.cli import main  # noqa: PLC0415
    from dbtrigger.history import FileHistory  # noqa: PLC0415

    history = FlakyHistory(FileHistory(tmp_path / "state"))
    trigger = PollTrigger(
        name="orders",
        source=memory_source(30),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=10,
        history=history,
    )
    trigger.tick(lambda events: None)
    history.down = True
    trigger.tick(lambda events: None)
    args = ["--store", str(tmp_path / "state")]
    capsys.readouterr()
    assert main(["history", "orders", "--json", *args]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["seq"], r["type"], r.get("pending", False)) for r in records] == [
        (1, "commit", False),
        (None, "commit", True),
    ]
    assert main(["history", "orders", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["1", records[0]["at"], "commit"]
    assert lines[2].split()[:3] == ["-", records[1]["at"], "commit"]
    history.down = False
    trigger.tick(lambda events: None)  # the next commit's append fills it in
    assert main(["history", "orders", "--json", *args]) == 0
    assert [(r["seq"], r.get("pending", False)) for r in json.loads(capsys.readouterr().out)] == [
        (1, False),
        (2, False),
        (3, False),
    ]


def test_the_runtime_prunes_by_the_history_store_s_retention(tmp_path: Path) -> None:
    """Retention is the history store's (``FileHistory(..., retention=Retention(...))``):
    the runtime prunes by it after an append, at most once an hour per process, so
    a restart prunes what the previous process let grow; the oldest records go,
    numbering goes on, and the pruning is counted."""
    from dbtrigger.history import FileHistory  # noqa: PLC0415

    kept = Retention(max_age_days=None, max_bytes=2048)

    def history() -> FileHistory:
        return FileHistory(tmp_path / "state", segment_bytes=1024, retention=kept)

    source = memory_source(200)
    store = FileCheckpointStore(tmp_path / "state")
    PollTrigger(
        name="orders", source=source, checkpoint_store=store, batch_size=5, history=history()
    ).drain(lambda events: None)
    assert [r["seq"] for r in history().read("orders")][:1] == [1]  # pruned once, when small
    source.put({"id": 201, "seq": 201, "v": "row 201"})
    metrics = InMemoryMetrics()
    restarted = PollTrigger(
        name="orders", source=source, checkpoint_store=store, history=history(), metrics=metrics
    )
    assert restarted.tick(lambda events: None) == 1
    seqs = [int(r["seq"]) for r in history().read("orders")]
    assert seqs[0] > 1
    assert seqs == list(range(seqs[0], 42))  # 41 commits, the oldest pruned
    assert sum(p.stat().st_size for p in (tmp_path / "state").glob("orders.history.*")) < 4096
    assert metrics.total("history_pruned_total") == seqs[0] - 1


def test_a_history_lost_after_the_journal_filled_begins_again_with_a_gap_record(
    tmp_path: Path,
) -> None:
    """A file history whose directory is removed (or a history turned on late) holds no
    record while the journal has already dropped entries: the records that follow
    begin with a gap record, not as if the poller's first commit were the oldest."""
    store = InMemoryCheckpointStore()
    where = tmp_path / "history"
    trigger = PollTrigger(
        name="orders",
        source=memory_source(100),
        checkpoint_store=store,
        batch_size=5,
        journal_limit=3,
        history=FileHistory(where),
    )
    for _ in range(5):
        trigger.tick(lambda events: None)
    trigger.close()
    shutil.rmtree(where)
    again = PollTrigger(
        name="orders",
        source=memory_source(100),
        checkpoint_store=store,
        batch_size=5,
        journal_limit=3,
        history=FileHistory(where),
    )
    again.tick(lambda events: None)
    again.close()
    records = list(FileHistory(where).read("orders"))
    assert [r["type"] for r in records][:1] == ["gap"], records
    assert records[0]["after_id"] is None
