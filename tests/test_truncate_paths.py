"""A change log's ``truncate`` event on every path the runtime has.

PostgreSQL logs a ``TRUNCATE`` as one event with ``op == "truncate"``, no
images and every key value None, alone in its batch. These tests drive one
through the paths an ordinary event takes - the window (retries, per-key
order), lanes, fan-out, dead letters and their replay, the history and
``dbtrigger replay``, CloudEvents - at default settings on a real PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
import logging
import shlex
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, HandlerError, PollTrigger, RowChange
from dbtrigger.changelog import ChangeLogSource, install, prune
from dbtrigger.cli import main
from dbtrigger.errors import ConfigurationError
from dbtrigger.history import history_for
from dbtrigger.history.records import image_text
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.quarantine import JsonLinesQuarantineSink
from dbtrigger.replay.dead_letters import event_of
from dbtrigger.runtime.context import BatchContext
from dbtrigger.sources.base import position_of
from dbtrigger.state.window import key_of
from tests.databases import TestDatabase

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self) -> None:
        self.now += dt.timedelta(minutes=10)  # past any backoff of these tests


@dataclass
class Replica:
    """The replica handler of docs/changes.md; retries the first event of each
    (op, key) in ``retry`` once. ``applied``: (op, key, seq) in the order applied."""

    retry: set[tuple[str, Any]] = field(default_factory=set)
    rows: dict[int, str] = field(default_factory=dict)
    applied: list[tuple[str, Any, int]] = field(default_factory=list)

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        for e in events:
            key = e.pk["id"]
            if (e.op, key) in self.retry:
                self.retry.discard((e.op, key))
                ctx.retry(e, "replica busy")
                continue
            self.applied.append((e.op, key, int(e.cursor)))
            if e.op == "truncate":
                self.rows.clear()
            elif e.op == "delete":
                self.rows.pop(key, None)
            else:
                assert e.after is not None
                self.rows[key] = str(e.after["status"])


def make_orders(db: TestDatabase) -> str:
    db.execute(
        f"CREATE TABLE {db.qualified('orders')} (id INTEGER PRIMARY KEY, status VARCHAR(20))"
    )
    install(db.engine, "orders", schema=db.schema)
    return db.qualified("orders")


def table_rows(db: TestDatabase, orders: str) -> dict[int, str]:
    with db.engine.connect() as conn:
        return {int(r.id): str(r.status) for r in conn.execute(sa.text(f"SELECT * FROM {orders}"))}


def poller(db: TestDatabase, tmp_path: Path, clock: Clock, **kwargs: Any) -> PollTrigger:
    return PollTrigger(
        name="orders-log",
        source=ChangeLogSource(url=db.url, table="orders", schema=db.schema),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        clock=clock,
        **kwargs,
    )


@pytest.mark.parametrize("lanes", [1, 4])
def test_two_truncates_in_a_row_are_both_delivered(
    pg: TestDatabase, tmp_path: Path, lanes: int
) -> None:
    orders = make_orders(pg)
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'a')")
    pg.execute(f"TRUNCATE {orders}")
    pg.execute(f"TRUNCATE {orders}")
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'b')")
    replica = Replica()
    trigger = poller(pg, tmp_path, Clock(), max_concurrency=lanes)
    trigger.drain(replica)
    assert [op for op, _, _ in replica.applied] == ["insert", "truncate", "truncate", "insert"]
    assert replica.rows == table_rows(pg, orders) == {1: "b"}


@pytest.mark.parametrize(
    "options",
    [{}, {"max_concurrency": 4}, {"read_ahead": "always"}],
    ids=["plain", "lanes", "read-ahead"],
)
@pytest.mark.parametrize("retried", [("truncate", None), ("insert", 1)])
def test_a_retried_event_keeps_its_order_with_a_truncate(
    pg: TestDatabase, tmp_path: Path, options: dict[str, Any], retried: tuple[str, Any]
) -> None:
    """A truncate waiting for a retry holds back the insert of key 1 after it (whose
    key is not the truncate's), and an insert of key 1 waiting holds back the
    truncate: each change is applied last in log order, and the replica ends as
    the table."""
    orders = make_orders(pg)
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'a'), (2, 'a')")
    pg.execute(f"TRUNCATE {orders}")
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'b')")
    clock = Clock()
    replica = Replica(retry={retried})
    trigger = poller(pg, tmp_path, clock, **options)
    with pytest.raises(HandlerError, match="wait for a retry"):  # not done: one waits
        trigger.drain(replica, retry_wait_seconds=0)
    assert replica.retry == set()  # it was retried
    clock.advance()
    trigger.drain(replica)
    seqs = [seq for _, _, seq in replica.applied]
    assert sorted(seqs) == [1, 2, 3, 4]
    assert seqs.index(3) == 2, replica.applied  # the truncate after 1 and 2, before 4
    assert replica.rows == table_rows(pg, orders) == {1: "b"}
    assert trigger.read_state().window is None  # type: ignore[union-attr]


def test_fan_out_a_truncate_retried_by_one_subscriber(pg: TestDatabase, tmp_path: Path) -> None:
    orders = make_orders(pg)
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'a')")
    pg.execute(f"TRUNCATE {orders}")
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'b')")
    clock = Clock()
    replica, audit = Replica(retry={("truncate", None)}), Replica()
    trigger = poller(pg, tmp_path, clock, subscribers={"replica": replica, "audit": audit})
    with pytest.raises(HandlerError, match="wait for a retry"):  # not done: one waits
        trigger.drain(retry_wait_seconds=0)
    clock.advance()
    trigger.drain()
    for sub in (replica, audit):
        assert [op for op, _, _ in sub.applied] == ["insert", "truncate", "insert"]
        assert sub.rows == {1: "b"}
    assert table_rows(pg, orders) == {1: "b"}


def test_a_failing_truncate_is_dead_lettered_and_replayed_as_a_truncate(
    pg: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The truncate fails every time: after max_attempts it is set aside alone (the
    bisection of a batch of one), the insert after it flows, and the dead letter
    lists and replays as a truncate, not as a delete of key None."""
    orders = make_orders(pg)
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'a')")
    pg.execute(f"TRUNCATE {orders}")
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'b')")
    dead = tmp_path / "dead.jsonl"
    replica = Replica()
    broken = {"on": True}

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        if broken["on"] and any(e.op == "truncate" for e in events):
            raise RuntimeError("cannot clear the replica")
        replica(events, ctx)

    trigger = poller(
        pg, tmp_path, Clock(), quarantine=JsonLinesQuarantineSink(dead), max_attempts=2
    )
    failed = 0
    with caplog.at_level(logging.WARNING):
        for _ in range(4):
            try:
                trigger.drain(handler)
            except HandlerError:
                failed += 1
    [said] = [
        r.getMessage() for r in caplog.records if getattr(r, "event", "") == "row_quarantined"
    ]
    assert said.startswith("truncate of every row (cursor 2) set aside in file:"), said
    assert failed == 1  # the second attempt sets it aside instead of failing the tick
    assert [op for op, _, _ in replica.applied] == ["insert", "insert"]
    records = JsonLinesQuarantineSink(dead).records()
    assert [(r.pk, r.row) for r in records] == [({"id": None}, None)]
    event = event_of(records[0])
    assert (event.op, dict(event.pk), event.before, event.after) == (
        "truncate",
        {"id": None},
        None,
        None,
    )

    module = types.ModuleType("truncate_app")
    module.trigger = trigger  # type: ignore[attr-defined]
    broken["on"] = False
    trigger.handler(handler)
    monkeypatch.setitem(sys.modules, "truncate_app", module)
    capsys.readouterr()
    assert main(["dead-letter", "list", "orders-log", "--trigger", "truncate_app:trigger"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines()[1:]] == ["(truncate)"], out
    code = main(
        [
            "dead-letter",
            "replay",
            "orders-log",
            "--trigger",
            "truncate_app:trigger",
            "--yes",
            "--reason",
            "replica fixed",
        ]
    )
    assert code == 0, capsys.readouterr()
    assert replica.applied[-1][0] == "truncate"
    assert replica.rows == {}  # the replay cleared it, as the truncate did to the table


def test_a_truncate_batch_is_recorded_and_replayed_byte_for_byte(
    pg: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    orders = make_orders(pg)
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'a')")
    pg.execute(f"TRUNCATE {orders}")
    batches: list[list[RowChange]] = []
    trigger = poller(pg, tmp_path, Clock())
    trigger.handler(lambda events: batches.append(list(events)))
    trigger.drain()
    assert [[e.op for e in b] for b in batches] == [["insert"], ["truncate"]]
    history = history_for(trigger.store)
    assert history is not None
    commits = [r for r in history.read(trigger.name) if r["type"] == "commit"]
    module = types.ModuleType("truncate_history_app")
    module.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "truncate_history_app", module)
    live = batches[1]
    batches.clear()
    capsys.readouterr()
    spec = ["--trigger", "truncate_history_app:trigger"]
    assert main(["history", "orders-log", "--batch", commits[-1]["batch_id"], *spec]) == 0
    shown = capsys.readouterr().out
    assert shown.splitlines()[-1].split()[::2] == ["(truncate)", "accepted"], shown
    code = main(
        [
            "replay",
            "orders-log",
            "--batch",
            commits[-1]["batch_id"],
            "--yes",
            "--reason",
            "rebuild",
            "--trigger",
            "truncate_history_app:trigger",
        ]
    )
    assert code == 0, capsys.readouterr()
    assert [e.event_id for e in batches[0]] == [e.event_id for e in live]
    assert [image_text(e) for e in batches[0]] == [image_text(e) for e in live]
    assert batches[0][0].op == "truncate"


def test_a_truncate_as_a_cloudevent_has_no_subject(pg: TestDatabase, tmp_path: Path) -> None:
    orders = make_orders(pg)
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'a')")
    pg.execute(f"TRUNCATE {orders}")
    got: list[RowChange] = []
    poller(pg, tmp_path, Clock()).drain(got.extend)
    insert, truncate = (e.to_cloudevent() for e in got)
    assert insert.get_subject() == "id=1"
    assert truncate.get_type() == "dbtrigger.row.truncate"
    assert truncate.get_subject() is None  # not "id=None": it concerns every row
    assert truncate.get_data()["pk"] == {"id": None}


def test_a_partitioned_poller_refuses_a_change_log_saying_what_to_use(
    pg: TestDatabase, tmp_path: Path
) -> None:
    """A truncate's key is all None: it hashes to no bucket. The combination is
    refused at construction, naming the way that keeps it."""
    make_orders(pg)
    with pytest.raises(ConfigurationError) as caught:
        PartitionedPoller(
            name="orders-log",
            source=ChangeLogSource(url=pg.url, table="orders", schema=pg.schema),  # type: ignore[arg-type]
            checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        )
    message = str(caught.value)
    assert "ChangeLogSource" in message
    assert "truncate" in message
    assert "max_concurrency" in message


def test_a_truncate_event_cannot_be_built_with_a_key_or_an_image() -> None:
    """What the runtime relies on (a dead letter holds no op: a key of Nones and no
    row is a truncate) holds for events built by hand too."""
    ok = RowChange("e1", "truncate", "s", 5, {"id": None}, None, None)
    assert ok.op == "truncate"
    bad = [
        ("truncate", {"id": 1}, None, None),
        ("truncate", {"id": None}, None, {"id": 1}),
        ("truncate", {"id": None}, {"id": 1}, None),
        ("truncate", {"a": 1, "b": None}, None, None),
        ("delete", {"id": None}, None, None),
        ("insert", {"id": None}, None, {"id": None}),
        ("upsert", {"a": 1, "b": None}, None, {"a": 1}),
    ]
    for op, pk, before, after in bad:
        with pytest.raises(ConfigurationError):
            RowChange("e1", op, "s", 5, pk, before, after)


def test_the_window_lookup_names_log_rows_by_the_events_positions(
    pg: TestDatabase, tmp_path: Path
) -> None:
    """When the window blocks, it looks up the entries a read could not place and
    drops those whose window key the source does not return (windowing.choose).
    ChangeLogSource returned the log's own positions (key ``dbt_seq``), which no
    entry has, so every entry looked up - a waiting truncate's too - counted as
    gone. Now it returns those of the given positions that are still there."""
    orders = make_orders(pg)
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'a')")
    pg.execute(f"TRUNCATE {orders}")
    pg.execute(f"INSERT INTO {orders} VALUES (2, 'b')")
    got: list[RowChange] = []
    poller(pg, tmp_path, Clock()).drain(got.extend)
    source = ChangeLogSource(url=pg.url, table="orders", schema=pg.schema)
    positions = [position_of(e) for e in got]
    assert [dict(p.pk) for p in positions] == [{"id": 1}, {"id": None}, {"id": 2}]
    prune(pg.engine, "orders", schema=pg.schema, up_to_seq=int(got[0].cursor))
    found = source.present(positions)
    assert [key_of(p) for p in found] == [key_of(p) for p in positions[1:]]
    source.close()


def test_a_poison_truncate_without_a_sink_is_skipped_by_the_printed_command(
    pg: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No dead-letter sink: the failing truncate stops the poller (poison_batch), and
    the skip-batch command the line prints skips exactly it; the insert after it flows."""
    orders = make_orders(pg)
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'a')")
    pg.execute(f"TRUNCATE {orders}")
    pg.execute(f"INSERT INTO {orders} VALUES (1, 'b')")
    replica = Replica()

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        if any(e.op == "truncate" for e in events):
            raise RuntimeError("cannot clear the replica")
        replica(events, ctx)

    trigger = poller(pg, tmp_path, Clock(), max_attempts=1)
    trigger.handler(handler)
    module = types.ModuleType("truncate_poison_app")
    module.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "truncate_poison_app", module)
    monkeypatch.chdir(tmp_path)  # skip-batch keeps a backup of the state in the directory
    with caplog.at_level(logging.ERROR), pytest.raises(HandlerError):
        trigger.drain()
    [line] = [r.getMessage() for r in caplog.records if getattr(r, "event", "") == "poison_batch"]
    skip = line.split("Skip (data loss, journaled): ", 1)[1].split(" (MODULE:ATTR")[0]
    argv = shlex.split(skip.replace("MODULE:ATTR", "truncate_poison_app:trigger"))[1:]
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr()
    trigger.drain()
    assert [op for op, _, _ in replica.applied] == ["insert", "insert"]
    assert replica.rows == {1: "b"}
