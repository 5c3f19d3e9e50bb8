"""``dbtrigger history`` and ``dbtrigger replay`` through the real CLI, on SQLite,
PostgreSQL and MariaDB: a change-log batch comes back byte for byte; a polled
table reports exactly the rows that changed or went since; ``--verify`` finds
nothing when nothing changed; the live checkpoint never moves.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from dbtrigger.changelog import ChangeLogSource, install, prune
from dbtrigger.cli import main
from dbtrigger.history import history_for
from dbtrigger.history.records import image_text
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.runtime.context import BatchContext
from dbtrigger.state.document import parse_time
from tests.databases import TestDatabase


@dataclass
class Calls:
    batches: list[tuple[list[RowChange], BatchContext]] = field(default_factory=list)

    def handler(self, events: list[RowChange], ctx: BatchContext) -> None:
        self.batches.append((list(events), ctx))


@dataclass
class App:
    db: TestDatabase
    trigger: PollTrigger
    calls: Calls
    spec: str
    state: Path

    def cli(self, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([*argv, "--trigger", self.spec])
        out, err = capsys.readouterr()
        return code, out, err

    def records(self) -> list[dict[str, Any]]:
        history = history_for(self.trigger.store)
        assert history is not None
        return list(history.read(self.trigger.name))

    def commits(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if r["type"] == "commit"]


def register(
    trigger: PollTrigger, calls: Calls, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> str:
    module = f"history_app_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    trigger.handler(calls.handler)
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    return f"{module}:trigger"


def orders_table(db: TestDatabase, rows: int = 25) -> sa.Table:
    table = sa.Table(
        "orders",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("amount", sa.Numeric(12, 2)),
        schema=db.schema,
    )
    table.create(db.engine)
    if rows:
        with db.engine.begin() as conn:
            conn.execute(
                table.insert(),
                [
                    {"id": i, "seq": i, "status": "new", "amount": i + 0.5}
                    for i in range(1, rows + 1)
                ],
            )
    return table


@pytest.fixture
def polled(db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[App]:
    orders_table(db)
    source = SqlAlchemySource(
        url=db.url,
        table="orders",
        schema=db.schema,
        cursor_column="seq",
        pk_columns=["id"],
        visibility="none",
    )
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=10,
        max_batches_per_tick=5,
    )
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    yield App(db, trigger, calls, spec, tmp_path / "state")
    source.close()


def test_history_shows_outcomes_batches_and_waiting_retries(
    polled: App, capsys: pytest.CaptureFixture[str]
) -> None:
    polled.trigger.drain(polled.calls.handler)
    first = polled.commits()[0]["batch_id"]
    code, out, _ = polled.cli(capsys, "history", "orders")
    assert code == 0
    assert out.count(" commit ") == 3
    assert "10 accepted" in out
    assert "waiting now: none" in out
    code, out, _ = polled.cli(capsys, "history", "orders", "--batch", first)
    assert code == 0
    assert f"batch        {first}" in out
    assert out.count(" accepted") >= 10  # one line per event
    code, out, _ = polled.cli(capsys, "history", "orders", "--batch", first, "--json")
    assert len(json.loads(out)["detail"]["crcs"]) == 10
    code, out, _ = polled.cli(capsys, "history", "orders", "--since", "2999-01-01T00:00:00Z")
    assert "no history entries yet" in out
    code, out, err = polled.cli(capsys, "history", "orders", "--batch", "nope")
    assert code == 2
    assert "is not in the history" in err


def test_replay_on_a_polled_table_reports_exactly_the_changed_and_the_gone_row(
    polled: App, capsys: pytest.CaptureFixture[str]
) -> None:
    polled.trigger.drain(polled.calls.handler)
    first, second = (r["batch_id"] for r in polled.commits()[:2])
    checkpoint = polled.trigger.read_state().position  # type: ignore[union-attr]
    live_ids = {e.event_id for e in polled.calls.batches[0][0]}

    code, out, _ = polled.cli(capsys, "replay", "orders", "--batch", first, "--verify")
    assert (code, "verify: no drift" in out) == (0, True)

    table = sa.Table(
        "orders", sa.MetaData(), schema=polled.db.schema, autoload_with=polled.db.engine
    )
    with polled.db.engine.begin() as conn:
        conn.execute(table.update().where(table.c.id == 3).values(status="paid", seq=100))
        conn.execute(table.delete().where(table.c.id == 7))
    code, out, _ = polled.cli(capsys, "replay", "orders", "--batch", first, "--verify")
    assert code == 1
    drift = sorted(
        line.split()[1:3] for line in out.splitlines() if line.strip().startswith("drift")
    )
    assert drift == [["changed", "id=3:"], ["gone", "id=7:"]]
    code, out, _ = polled.cli(capsys, "replay", "orders", "--batch", second, "--verify")
    assert code == 0  # the other batch is untouched

    # A dry run delivers nothing; --yes without a reason is refused.
    polled.calls.batches.clear()
    code, out, _ = polled.cli(capsys, "replay", "orders", "--batch", first)
    assert code == 0
    assert "dry run" in out
    assert not polled.calls.batches
    code, _, err = polled.cli(capsys, "replay", "orders", "--batch", first, "--yes")
    assert code == 2
    assert "--reason" in err

    code, out, _ = polled.cli(
        capsys, "replay", "orders", "--batch", first, "--yes", "--reason", "rebuild search"
    )
    assert code == 0, out
    [(events, ctx)] = polled.calls.batches
    assert sorted(int(e.pk["id"]) for e in events) == [1, 2, 3, 4, 5, 6, 8, 9, 10]
    assert next(e for e in events if e.pk["id"] == 3).after["status"] == "paid"  # as it is now
    record = polled.commits()[0]
    assert ctx.replay
    assert ctx.batch_id == first
    assert ctx.now == parse_time(record["committed_at"], "t")
    # The rows that did not change come with the event ids of their live delivery.
    assert {e.event_id for e in events if e.pk["id"] != 3} <= live_ids
    assert len(record["detail"]["crcs"]) == 10
    # The live checkpoint did not move; the replay is in the journal and the history.
    assert polled.trigger.read_state().position == checkpoint  # type: ignore[union-attr]
    last = polled.records()[-1]
    assert (last["type"], last["operation"], last["mode"]) == ("manual", "replay", "reread")
    assert last["drift"] == {"changed": 1, "gone": 1, "added": 0}


def test_replay_of_a_range_and_of_a_pruned_batch(
    polled: App, capsys: pytest.CaptureFixture[str]
) -> None:
    polled.trigger.drain(polled.calls.handler)
    ids = [r["batch_id"] for r in polled.commits()]
    polled.calls.batches.clear()
    code, out, _ = polled.cli(
        capsys,
        "replay",
        "orders",
        "--from-batch",
        ids[0],
        "--to-batch",
        ids[2],
        "--yes",
        "--reason",
        "all of it",
    )
    assert code == 0, out
    assert [len(events) for events, _ in polled.calls.batches] == [10, 10, 5]
    code, _, err = polled.cli(
        capsys, "replay", "orders", "--from-batch", ids[2], "--to-batch", ids[0], "--verify"
    )
    assert code == 2
    assert "swap" in err


# --- the change log: byte for byte ---------------------------------------------------


@pytest.fixture
def logged(db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[App]:
    table = orders_table(db, rows=0)
    install(db.engine, "orders", schema=db.schema)
    with db.engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"id": i, "seq": i, "status": "new", "amount": i + 0.25} for i in range(1, 9)],
        )
        conn.execute(table.update().where(table.c.id == 2).values(status="paid"))
        conn.execute(table.delete().where(table.c.id == 5))
    source = ChangeLogSource(url=db.url, table="orders", schema=db.schema, visibility="none")
    trigger = PollTrigger(
        name="orders-log",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=4,
        max_batches_per_tick=5,
    )
    calls = Calls()
    spec = register(trigger, calls, monkeypatch, tmp_path)
    yield App(db, trigger, calls, spec, tmp_path / "state")
    source.close()


def test_replay_on_the_change_log_returns_the_recorded_events_byte_for_byte(
    logged: App, capsys: pytest.CaptureFixture[str]
) -> None:
    assert logged.trigger.drain(logged.calls.handler) == 10
    live = [list(events) for events, _ in logged.calls.batches]
    ids = [r["batch_id"] for r in logged.commits()]
    # The table moves on; the log's rows of the recorded batches do not.
    table = sa.Table(
        "orders", sa.MetaData(), schema=logged.db.schema, autoload_with=logged.db.engine
    )
    with logged.db.engine.begin() as conn:
        conn.execute(table.update().where(table.c.id == 1).values(status="gone?"))
        conn.execute(table.delete().where(table.c.id == 3))
    code, out, _ = logged.cli(capsys, "replay", "orders-log", "--batch", ids[0], "--verify")
    assert code == 0, out
    assert "mode exact" in out

    logged.calls.batches.clear()
    code, out, _ = logged.cli(
        capsys,
        "replay",
        "orders-log",
        "--from-batch",
        ids[0],
        "--to-batch",
        ids[-1],
        "--yes",
        "--reason",
        "replica rebuild",
    )
    assert code == 0, out
    again = [list(events) for events, _ in logged.calls.batches]
    assert [[e.event_id for e in b] for b in again] == [[e.event_id for e in b] for b in live]
    assert [[image_text(e) for e in b] for b in again] == [[image_text(e) for e in b] for b in live]
    assert [e.op for b in again for e in b].count("delete") == 1
    assert all(ctx.replay for _, ctx in logged.calls.batches)

    # Once the log is pruned past a batch, it cannot be replayed exactly: refused.
    last = logged.trigger.read_state()
    assert last is not None
    prune(logged.db.engine, "orders", schema=logged.db.schema, up_to_seq=int(last.position.cursor))
    code, out, _ = logged.cli(capsys, "replay", "orders-log", "--batch", ids[0], "--verify")
    assert code == 1
    assert "cannot be replayed as it was" in out + _
    code, _, err = logged.cli(
        capsys, "replay", "orders-log", "--batch", ids[0], "--yes", "--reason", "r"
    )
    assert code == 2
    assert "cannot be replayed as it was" in err


def test_replay_refuses_another_trigger_and_a_changed_source(
    polled: App, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    polled.trigger.drain(polled.calls.handler)
    first = polled.commits()[0]["batch_id"]
    code, _, err = polled.cli(capsys, "replay", "other", "--batch", first, "--verify")
    assert code == 2
    assert "not 'other'" in err


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


# --- log-based sources (src/dbtrigger/cdc) -------------------------------------------


def _cdc_module(root: Path, name: str, source: str, poller: str) -> str:
    (root / f"{name}.py").write_text(
        "from dbtrigger import FileCheckpointStore, PollTrigger\n"
        "from dbtrigger.cdc import BinlogSource, PgLogicalSource\n"
        f"store = FileCheckpointStore({str(root / 'state')!r})\n"
        f"trigger = PollTrigger(name={poller!r}, source={source}, batch_size=3,\n"
        "    max_batches_per_tick=10, checkpoint_store=store)\n"
        "seen = []\n"
        "@trigger.handler\n"
        "def handle(events, ctx):\n"
        "    seen.append((list(events), ctx))\n"
    )
    return f"{name}:trigger"


@pytest.mark.binlog
def test_replay_on_the_binary_log_is_byte_for_byte_while_the_log_holds_it(
    binlog_db: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    binlog_db.execute("CREATE TABLE orders (id INT PRIMARY KEY, status VARCHAR(20))")
    name = f"binlog_app_{uuid.uuid4().hex[:8]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    spec = _cdc_module(
        tmp_path, name, f"BinlogSource({binlog_db.url!r}, ['orders'], snapshot='never')", "ob"
    )
    import importlib  # noqa: PLC0415

    module = importlib.import_module(name)
    module.trigger.drain(module.handle)
    binlog_db.execute("INSERT INTO orders VALUES (1, 'new'), (2, 'new'), (3, 'new'), (4, 'new')")
    binlog_db.execute("UPDATE orders SET status = 'paid' WHERE id = 2")
    binlog_db.execute("DELETE FROM orders WHERE id = 3")
    module.trigger.drain(module.handle)
    live = [list(events) for events, _ in module.seen]
    history = history_for(module.trigger.store)
    assert history is not None
    ids = [r["batch_id"] for r in history.read("ob") if r["type"] == "commit"]
    module.seen.clear()
    capsys.readouterr()
    argv = ["replay", "ob", "--from-batch", ids[0], "--to-batch", ids[-1], "--trigger", spec]
    assert main([*argv, "--verify"]) == 0
    assert "mode exact" in capsys.readouterr().out
    assert main([*argv, "--yes", "--reason", "rebuild"]) == 0
    again = [list(events) for events, _ in module.seen]
    assert [[image_text(e) for e in b] for b in again] == [[image_text(e) for e in b] for b in live]
    assert [[e.event_id for e in b] for b in again] == [[e.event_id for e in b] for b in live]


@pytest.mark.cdc
def test_replay_on_a_replication_slot_is_refused_once_the_slot_confirmed_it(
    cdc_db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cdc_db.execute("CREATE TABLE orders (id int PRIMARY KEY, status text)")
    name = f"pg_app_{uuid.uuid4().hex[:8]}"
    poller = f"op_{uuid.uuid4().hex[:6]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    spec = _cdc_module(
        tmp_path, name, f"PgLogicalSource({cdc_db.url!r}, ['orders'], snapshot='never')", poller
    )
    assert main(["cdc", "install", spec, "--yes"]) == 0
    for i in range(1, 8):
        cdc_db.execute(f"INSERT INTO orders VALUES ({i}, 'new')")
    import importlib  # noqa: PLC0415

    module = importlib.import_module(name)
    module.trigger.drain(module.handle)
    history = history_for(module.trigger.store)
    assert history is not None
    first = next(r for r in history.read(poller) if r["type"] == "commit")["batch_id"]
    capsys.readouterr()
    assert main(["replay", poller, "--batch", first, "--trigger", spec, "--verify"]) == 1
    out = capsys.readouterr().out
    assert "cannot be replayed as it was" in out
    assert "a slot cannot be rewound" in out


# --- fan-out, metrics and logs ----------------------------------------------------------


def test_a_fan_out_replay_to_one_subscriber_counted_and_logged(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--subscriber hands the batch to that subscriber only (ctx.subscriber says
    so); a verify, the drift it finds and a delivery are counted
    (replays_total by mode, replay_drift_rows_total by kind,
    replayed_events_total) and logged (replay_drift, replay_delivered)."""
    orders_table(sqlite_db, rows=6)
    billing, search = Calls(), Calls()
    metrics = InMemoryMetrics()
    source = SqlAlchemySource(
        url=sqlite_db.url, table="orders", cursor_column="seq", pk_columns=["id"], visibility="none"
    )
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        batch_size=10,
        subscribers={"billing": billing.handler, "search": search.handler},
        metrics=metrics,
    )
    module = f"history_fan_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    trigger.tick()
    history = history_for(trigger.store)
    assert history is not None
    [batch] = [r["batch_id"] for r in history.read("orders") if r["type"] == "commit"]
    sqlite_db.execute("DELETE FROM orders WHERE id = 4")
    billing.batches.clear()
    search.batches.clear()

    def cli(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["replay", "orders", "--batch", batch, "--trigger", f"{module}:trigger", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        assert cli("--verify")[0] == 1
        code, out, _ = cli("--subscriber", "search", "--yes", "--reason", "reindex")
    assert code == 0, out
    [(events, ctx)] = search.batches
    assert sorted(int(e.pk["id"]) for e in events) == [1, 2, 3, 5, 6]
    assert (ctx.subscriber, ctx.replay, ctx.batch_id) == ("search", True, batch)
    assert billing.batches == []
    assert metrics.total("replays_total", mode="verify") == 1
    assert metrics.total("replays_total", mode="reread") == 1
    assert metrics.total("replayed_events_total") == 5
    assert metrics.total("replay_drift_rows_total", kind="gone") == 2  # the verify, the replay
    assert metrics.total("replay_drift_rows_total", kind="changed") == 0
    logged = [getattr(r, "event", "") for r in caplog.records]
    assert logged.count("replay_drift") == 2
    assert "replay_delivered" in logged
    last = list(history.read("orders"))[-1]
    assert (last["operation"], last["subscriber"], last["events"]) == ("replay", "search", 5)
    code, _, err = cli("--subscriber", "nope", "--yes", "--reason", "r")
    assert code == 2
    assert "no subscriber 'nope' (it has billing, search)" in err
    source.close()
