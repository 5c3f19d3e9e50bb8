"""``dbtrigger dead-letter list|show|replay|discard`` through the real CLI, on the
JSON-lines sink and the SQL sink (SQLite, PostgreSQL, MariaDB), and a claim
queue's dead rows through the same verbs: a rejected row replayed through the
same handler settles once; discard is a dry run until ``--yes`` and keeps the
evidence unless ``--delete``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, FileCheckpointStore, PollTrigger, QueueTrigger, RowChange
from dbtrigger.cli import main
from dbtrigger.history import history_for
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.quarantine import JsonLinesQuarantineSink, QuarantineSink, SqlQuarantineSink
from dbtrigger.runtime.context import BatchContext
from dbtrigger.testing import MemorySource
from tests.databases import TestDatabase


@dataclass
class Handler:
    """Rejects the ids in ``reject`` (a downstream that refuses them, for now)."""

    reject: set[int] = field(default_factory=set)
    seen: list[tuple[RowChange, BatchContext]] = field(default_factory=list)

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        for event in events:
            self.seen.append((event, ctx))
            if int(event.pk["id"]) in self.reject:
                ctx.reject(event, "downstream refused it")


@dataclass
class App:
    trigger: PollTrigger
    handler: Handler
    sink: QuarantineSink
    spec: str
    metrics: InMemoryMetrics

    def cli(self, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([*argv[:2], "orders", "--trigger", self.spec, *argv[2:]])
        out, err = capsys.readouterr()
        return code, out, err


@pytest.fixture(
    params=[
        "file",
        "sqlite",
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ]
)
def app(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[App]:
    sink: QuarantineSink
    if request.param == "file":
        sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    else:
        from tests.databases import make_database  # noqa: PLC0415

        gen = make_database(request.param, tmp_path)
        db: TestDatabase = next(gen)
        sink = SqlQuarantineSink(engine=db.engine, schema=db.schema)
    metrics = InMemoryMetrics()
    handler = Handler(reject={3, 7})
    trigger = PollTrigger(
        name="orders",
        source=MemorySource(
            [{"id": i, "seq": i, "v": f"row {i}"} for i in range(1, 11)],
            cursor_column="seq",
            pk_columns=["id"],
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        quarantine=sink,
        metrics=metrics,
    )
    trigger.handler(handler)
    module = f"dead_app_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    trigger.drain(handler)
    yield App(trigger, handler, sink, f"{module}:trigger", metrics)
    if request.param != "file":
        next(gen, None)  # drops the test's schema


def test_list_and_show(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = app.cli(capsys, "dead-letter", "list")
    assert code == 0
    assert [line.split()[1] for line in out.splitlines()[1:]] == ["id=3", "id=7"]
    code, out, _ = app.cli(capsys, "dead-letter", "list", "--json")
    letters = json.loads(out)
    assert [x["state"] for x in letters] == ["dead", "dead"]
    code, out, _ = app.cli(capsys, "dead-letter", "show", "--id", letters[0]["event_id"][:10])
    [shown] = json.loads(out)
    assert shown["error"] == "EventRejected: downstream refused it"
    assert shown["row"]["v"] == "row 3"
    code, _, err = app.cli(capsys, "dead-letter", "show", "--id", "abc")
    assert code == 2
    assert "8+" in err or "at least 8" in err
    code, out, _ = app.cli(capsys, "dead-letter", "list", "--since", "2999-01-01T00:00:00Z")
    assert "no dead letters" in out


def test_replay_through_the_same_handler_settles_once(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    [first, _] = json.loads(app.cli(capsys, "dead-letter", "list", "--json")[1])
    wanted = first["event_id"]
    app.handler.reject.clear()  # the downstream takes them now
    app.handler.seen.clear()

    code, out, _ = app.cli(capsys, "dead-letter", "replay", "--id", wanted, "--reason", "fixed")
    assert code == 0
    assert "dry run" in out
    assert not app.handler.seen
    code, _, err = app.cli(capsys, "dead-letter", "replay", "--id", wanted, "--yes")
    assert code == 2  # --reason is required with --yes
    assert "--reason is required" in err
    assert not app.handler.seen

    code, out, _ = app.cli(
        capsys, "dead-letter", "replay", "--id", wanted, "--reason", "fixed", "--yes"
    )
    assert code == 0, out
    [(event, ctx)] = app.handler.seen
    assert event.event_id == wanted
    assert event.pk == {"id": 3}
    assert event.after is not None
    assert event.after["v"] == "row 3"
    assert ctx.replay
    assert app.metrics.total("dead_letter_replays_total", result="settled") == 1

    # Settled: not listed any more, kept as evidence with its mark, and not replayed twice.
    listed = json.loads(app.cli(capsys, "dead-letter", "list", "--json")[1])
    assert [x["pk"] for x in listed] == [{"id": 7}]
    everything = json.loads(app.cli(capsys, "dead-letter", "list", "--all", "--json")[1])
    assert [x["state"] for x in everything] == ["replayed", "dead"]
    code, out, _ = app.cli(
        capsys, "dead-letter", "replay", "--id", wanted, "--reason", "again", "--yes"
    )
    assert code == 0
    assert "replayed already" in out
    assert len(app.handler.seen) == 1

    # Journaled in the poller's state document and its history.
    history = history_for(app.trigger.store)
    assert history is not None
    last = list(history.read("orders"))[-1]
    assert (last["operation"], last["event_ids"], last["outcomes"]["settled"]) == (
        "dead_letter_replay",
        [wanted],
        1,
    )


def test_a_replay_rejected_again_stays_dead(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = app.cli(capsys, "dead-letter", "replay", "--reason", "try", "--yes")
    assert code == 1  # both rejected again
    assert "2 rejected again" in out
    listed = json.loads(app.cli(capsys, "dead-letter", "list", "--json")[1])
    assert [x["state"] for x in listed] == ["replay_rejected", "replay_rejected"]


def test_discard_needs_yes_and_keeps_the_evidence_unless_told(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    [first, second] = json.loads(app.cli(capsys, "dead-letter", "list", "--json")[1])
    code, out, _ = app.cli(
        capsys, "dead-letter", "discard", "--id", first["event_id"], "--reason", "obsolete"
    )
    assert code == 0
    assert "dry run" in out
    assert len(json.loads(app.cli(capsys, "dead-letter", "list", "--json")[1])) == 2
    code, out, _ = app.cli(
        capsys, "dead-letter", "discard", "--id", first["event_id"], "--reason", "obsolete", "--yes"
    )
    assert code == 0
    kept = {r.event_id for r in app.sink.records("orders")}  # type: ignore[attr-defined]
    assert kept == {first["event_id"], second["event_id"]}  # the evidence is kept
    assert [
        x["state"] for x in json.loads(app.cli(capsys, "dead-letter", "list", "--all", "--json")[1])
    ] == ["discarded", "dead"]
    code, _, _ = app.cli(
        capsys,
        "dead-letter",
        "discard",
        "--id",
        second["event_id"],
        "--reason",
        "gone",
        "--delete",
        "--yes",
    )
    assert code == 0
    kept = {r.event_id for r in app.sink.records("orders")}  # type: ignore[attr-defined]
    assert kept == {first["event_id"]}


# --- a claim queue's dead rows ----------------------------------------------------------


def test_queue_dead_rows_through_the_same_verbs(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dbtrigger.queue import ddl  # noqa: PLC0415

    sqlite_db.execute("CREATE TABLE jobs (id integer PRIMARY KEY, payload varchar(40))")
    sqlite_db.execute(
        "INSERT INTO jobs (id, payload) VALUES (:i, :p)",
        [{"i": i, "p": f"job {i}"} for i in range(1, 6)],
    )
    with sqlite_db.engine.begin() as conn:
        ddl.apply(
            conn, ddl.install_columns(conn, sa.Table("jobs", sa.MetaData(), autoload_with=conn))
        )
    source = ClaimSource(url=sqlite_db.url, table="jobs", pk_columns=["id"])
    rejecting = {2, 4}

    def handle(events: list[RowChange], ctx: Any) -> None:
        for e in events:
            if e.pk["id"] in rejecting:
                ctx.reject(e, "malformed")

    queue = QueueTrigger(name="jobs", source=source, batch_size=5, seed=1)
    queue.handler(handle)
    queue.drain(handle)
    module = f"dead_queue_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.queue = queue  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    spec = f"{module}:queue"

    def cli(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        code = main([*argv[:2], "jobs", "--trigger", spec, *argv[2:]])
        return code, capsys.readouterr().out

    code, out = cli("dead-letter", "list")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["2", "4"]
    code, out = cli("dead-letter", "replay", "--id", "2", "--reason", "fixed")
    assert "dry run" in out
    code, out = cli("dead-letter", "replay", "--id", "2", "--reason", "fixed", "--yes")
    assert code == 0
    rejecting.clear()
    assert queue.drain(handle) == 1  # row 2 delivered again, and done
    code, out = cli("dead-letter", "discard", "--id", "4", "--reason", "obsolete", "--yes")
    assert code == 0
    with sqlite_db.engine.connect() as conn:
        status = dict(conn.execute(sa.text("SELECT id, dbt_status FROM jobs")).all())
    assert status == {1: "done", 2: "done", 3: "done", 4: "done", 5: "done"}
    code, out = cli("dead-letter", "list")
    assert "no dead rows" in out
    source.close()


# --- fan-out: one named subscriber ------------------------------------------------------


def test_a_fan_out_replay_goes_to_the_named_subscriber_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The subscriber that rejected an event gets it again; the others, which took
    it the first time, do not see it twice. Without --subscriber a fan-out
    poller's dead letters are refused (which subscriber would be a guess)."""
    billing = Handler()
    search = Handler(reject={3})
    trigger = PollTrigger(
        name="orders",
        source=MemorySource(
            [{"id": i, "seq": i, "v": f"row {i}"} for i in range(1, 6)],
            cursor_column="seq",
            pk_columns=["id"],
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        quarantine=JsonLinesQuarantineSink(tmp_path / "dead.jsonl"),
        subscribers={"billing": billing, "search": search},
    )
    module = f"dead_fan_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    trigger.tick()
    assert [int(e.pk["id"]) for e, _ in billing.seen] == [1, 2, 3, 4, 5]

    def cli(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["dead-letter", argv[0], "orders", "--trigger", f"{module}:trigger", *argv[1:]])
        out, err = capsys.readouterr()
        return code, out, err

    [letter] = json.loads(cli("list", "--json")[1])
    assert letter["pk"] == {"id": 3}
    code, _, err = cli("replay", "--reason", "index fixed", "--yes")
    assert code == 2
    assert "--subscriber" in err
    assert "of these 1 dead letter(s): --subscriber search for 1" in err  # who rejected it
    billing.seen.clear()
    search.seen.clear()
    search.reject.clear()
    code, out, _ = cli("replay", "--subscriber", "search", "--reason", "index fixed", "--yes")
    assert code == 0, out
    [(event, ctx)] = search.seen
    assert (event.event_id, ctx.subscriber, ctx.replay) == (letter["event_id"], "search", True)
    assert billing.seen == []  # billing took it the first time: not handed it again
    assert json.loads(cli("list", "--json")[1]) == []
    code, _, err = cli("replay", "--subscriber", "nope", "--reason", "r", "--yes", "--again")
    assert code == 2
    assert "no subscriber 'nope'" in err
    # --again hands a settled one to it once more (no --id needed), still to it alone.
    code, out, _ = cli(
        "replay", "--subscriber", "search", "--reason", "reindex", "--yes", "--again"
    )
    assert code == 0, out
    assert [e.event_id for e, _ in search.seen] == [letter["event_id"]] * 2
    assert billing.seen == []


def test_two_replays_at_once_hand_a_dead_letter_over_once(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator replays while another's replay of the same dead letters is still
    in its handler: the second is refused (the poller's replay lease is held) and
    the event is handed over once; run again afterwards, it finds it settled."""
    inside, go_on = threading.Event(), threading.Event()
    handed: list[str] = []

    def slow(events: list[RowChange], ctx: BatchContext) -> None:
        handed.extend(e.event_id for e in events)
        inside.set()
        assert go_on.wait(60)

    app.trigger.handler(slow)
    argv = ["dead-letter", "replay", "orders", "--trigger", app.spec, "--reason", "fixed", "--yes"]
    codes: list[int] = []
    first = threading.Thread(target=lambda: codes.append(main(argv)))
    first.start()
    try:
        assert inside.wait(60)
        capsys.readouterr()
        assert main(argv) == 2
        assert "another replay of 'orders' holds" in capsys.readouterr().err
    finally:
        go_on.set()
        first.join(60)
    assert codes == [0]
    assert main(argv) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert sorted(handed) == sorted(
        {e.event_id for e, _ in app.handler.seen if e.pk["id"] in (3, 7)}
    )


@dataclass
class Retrying(Handler):
    """Also asks for a retry of the ids in ``retry``."""

    retry: set[int] = field(default_factory=set)

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        super().__call__(events, ctx)
        for event in events:
            if int(event.pk["id"]) in self.retry:
                ctx.retry(event, "index busy")


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_a_fan_out_dead_letter_names_its_subscribers_and_a_replay_settles_only_theirs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kind: str,
) -> None:
    """Billing rejects 3 and 4; search asked for a retry of 3 and took 4. Both
    dead letters name who did not take them, as a field of the record. A replay
    to search hands it 3 only (it took 4: no second copy), and 3 stays dead for
    billing, whose share a replay to search must not settle; a replay to billing
    then hands it both."""
    billing = Handler(reject={3, 4})
    search = Retrying(retry={3})
    sink: QuarantineSink = (
        JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
        if kind == "file"
        else SqlQuarantineSink(url=f"sqlite:///{tmp_path / 'dead.db'}")
    )
    trigger = PollTrigger(
        name="orders",
        source=MemorySource(
            [{"id": i, "seq": i, "v": f"row {i}"} for i in range(1, 6)],
            cursor_column="seq",
            pk_columns=["id"],
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        quarantine=sink,
        subscribers={"billing": billing, "search": search},
    )
    module = f"dead_fan_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    trigger.tick()
    records = {int(r.pk["id"]): r for r in sink.records("orders")}  # type: ignore[attr-defined]
    assert sorted(records) == [3, 4]
    assert records[3].subscribers == {
        "billing": "downstream refused it",
        "search": "index busy",
    }
    assert records[4].subscribers == {"billing": "downstream refused it"}

    def cli(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        code = main(["dead-letter", argv[0], "orders", "--trigger", f"{module}:trigger", *argv[1:]])
        return code, capsys.readouterr().out

    def listed(*argv: str) -> list[int]:
        return sorted(int(x["pk"]["id"]) for x in json.loads(cli("list", "--json", *argv)[1]))

    assert listed("--subscriber", "search") == [3]
    assert listed("--subscriber", "billing") == [3, 4]
    billing.seen.clear()
    search.seen.clear()
    search.retry.clear()
    code, out = cli("replay", "--subscriber", "search", "--reason", "index fixed", "--yes")
    assert code == 0, out
    # Settled for search alone: the line says billing still owes it (it said "settled").
    assert "settled for search; still dead for billing" in out, out
    assert "1 settled for search, 0 rejected again, 0 failed; 1 of them still dead" in out, out
    assert "replay again once fixed" not in out  # nothing failed
    assert [int(e.pk["id"]) for e, _ in search.seen] == [3]  # not 4: it took 4
    assert billing.seen == []
    assert listed() == [3, 4]  # 3 still waits for billing
    assert {x["waiting_for"][0] for x in json.loads(cli("list", "--json")[1])} == {"billing"}
    assert listed("--subscriber", "search") == []
    code, out = cli("list")
    assert "SUBSCRIBERS" in out.splitlines()[0]
    assert [line.split()[5] for line in out.splitlines()[1:]] == ["billing", "billing"]
    billing.reject.clear()
    code, out = cli("replay", "--subscriber", "billing", "--reason", "billing fixed", "--yes")
    assert code == 0, out
    assert sorted(int(e.pk["id"]) for e, _ in billing.seen) == [3, 4]
    assert listed() == []
    assert [int(e.pk["id"]) for e, _ in search.seen] == [3]


def test_dead_letters_written_before_the_subscribers_field_still_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A JSON line without ``subscribers`` and a SQL table without its column: the
    records read back (their subscribers from the error text, given the names);
    a sink that may create tables adds the column, one that may not says so."""
    from dbtrigger import replay  # noqa: PLC0415
    from dbtrigger.quarantine import QuarantineRecord  # noqa: PLC0415

    old = {
        "poller": "orders",
        "event_id": "e" * 16,
        "source": "s",
        "pk": {"id": 3},
        "cursor": 3,
        "row": {"id": 3},
        "error": "EventRejected: billing: refused; search: busy",
        "attempts": 1,
        "checkpoint": {},
        "batch_id": "b",
        "fencing_token": 1,
        "owner_id": "o",
        "quarantined_at": "2026-11-27T10:00:00Z",
    }
    path = tmp_path / "dead.jsonl"
    path.write_text(json.dumps(old) + "\n", encoding="utf-8")
    file_sink = JsonLinesQuarantineSink(path)
    (record,) = file_sink.records()
    assert record.subscribers is None
    (letter,) = replay.dead_letters.dead_letters(file_sink, "orders", known=["billing", "search"])
    assert letter.owed == ("billing", "search")
    url = f"sqlite:///{tmp_path / 'dead.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # the table as dbtrigger created it before the column
        columns = ", ".join(
            f"{c.name} TEXT" for c in SqlQuarantineSink(url=url, create_table=False).table.c
        ).replace(", subscribers_json TEXT", "")
        conn.exec_driver_sql(f"CREATE TABLE dbtrigger_quarantine ({columns})")
    engine.dispose()
    fixed = QuarantineRecord.from_json({**old, "subscribers": {"billing": "refused"}})
    caplog.set_level(logging.WARNING, logger="dbtrigger")
    kept = SqlQuarantineSink(url=url, create_table=False)
    kept.put([fixed])
    assert [r.subscribers for r in kept.records()] == [None]
    assert "ALTER TABLE dbtrigger_quarantine ADD COLUMN subscribers_json" in caplog.text
    added = SqlQuarantineSink(url=url)
    added.put(
        [QuarantineRecord.from_json({**old, "event_id": "f" * 16, "subscribers": {"a": "x"}})]
    )
    assert [r.subscribers for r in added.records()] == [None, {"a": "x"}]
    kept.close()
    added.close()


def test_a_marks_table_that_cannot_name_the_subscriber_refuses_a_subscribers_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay to one subscriber is marked for it alone. If the SQL sink's marks
    table lacks the subscriber column and it cannot be added, such a mark is
    refused (QuarantineError with the ALTER TABLE to run) rather than written as
    the whole letter's, which would settle the other subscribers' share unseen."""
    import datetime as dt  # noqa: PLC0415

    from dbtrigger.errors import QuarantineError  # noqa: PLC0415
    from dbtrigger.replay import dead_letters as dl  # noqa: PLC0415

    sink = SqlQuarantineSink(url=f"sqlite:///{tmp_path / 'dead.db'}")
    monkeypatch.setattr(dl, "add_column", lambda *a, **k: (False, "ALTER TABLE x ADD ..."))
    marks = dl.SqlMarks(sink)
    at = dt.datetime(2026, 11, 27, tzinfo=dt.timezone.utc)
    marks.add([dl.Mark("orders", "e" * 16, "discarded", at, "me", "why")])  # a whole mark
    with pytest.raises(QuarantineError, match="ALTER TABLE x ADD"):
        marks.add([dl.Mark("orders", "e" * 16, "replayed", at, "me", "why", "", "search")])
    assert [m.action for m in marks.read()] == ["discarded"]
    sink.close()
