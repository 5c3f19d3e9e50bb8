"""The operator commands on a partitioned poller, through the real CLI.

Each partition dead-letters, commits and journals under its own poller name
(``orders.p064-128``). Before, ``dead-letter`` refused ``--trigger`` naming a
``PartitionedPoller`` ("name the poller's trigger (--trigger MODULE:ATTR) or
its --sink") and ``--sink`` with the group's name found nothing; ``replay``
and ``backfill`` called it "a claim queue". Now ``dead-letter`` given the
group's name acts on every partition's records (each named), given one
partition's name on that one, journaling in the partition's own document;
``replay`` replays one partition's recorded batch; ``backfill`` drains one new
poller over the whole table. (``status`` shows the group; ``history``,
``reset``, ``rewind`` and ``bookmark`` take one partition's name and refuse the
group's with the way to name one.)
"""

from __future__ import annotations

import hashlib
import json
import sys
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.cli import main
from dbtrigger.history import history_for
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.quarantine import JsonLinesQuarantineSink, QuarantineSink, SqlQuarantineSink
from dbtrigger.runtime.context import BatchContext

REJECTED = {3, 7, 11}


@dataclass
class Handler:
    reject: set[int] = field(default_factory=lambda: set(REJECTED))
    seen: list[tuple[RowChange, BatchContext]] = field(default_factory=list)

    def __call__(self, events: list[RowChange], ctx: BatchContext) -> None:
        for event in events:
            self.seen.append((event, ctx))
            if int(event.pk["id"]) in self.reject:
                ctx.reject(event, "downstream refused it")


@dataclass
class App:
    poller: PartitionedPoller
    handler: Handler
    spec: str

    def cli(self, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
        """``dbtrigger VERB... POLLER --trigger THIS [options]`` (once: when ``argv`` has none)."""
        capsys.readouterr()
        named = [] if {"--trigger", "--source"} & set(argv) else ["--trigger", self.spec]
        code = main([*argv[:3], *named, *argv[3:]])
        out, err = capsys.readouterr()
        return code, out, err


def build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sink: QuarantineSink | None, **options: Any
) -> App:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
        for i in range(1, 21):
            conn.exec_driver_sql(f"INSERT INTO orders VALUES ({i}, {i})")
    engine.dispose()
    handler = Handler()
    poller = PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(url=url, table="orders", cursor_column="seq", pk_columns=["id"]),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        partitions=4,
        background=False,
        join_window_seconds=0,
        **({"quarantine": sink} if sink is not None else {}),
        **options,
    )
    if "subscribers" not in options:
        poller.handler(handler)
    module = f"dead_parts_{uuid.uuid4().hex[:8]}"
    mod = types.ModuleType(module)
    mod.orders = poller  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    return App(poller, handler, f"{module}:orders")


@pytest.fixture(params=["file", "sqlite"])
def app(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> App:
    sink: QuarantineSink
    if request.param == "file":
        sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    else:
        sink = SqlQuarantineSink(url=f"sqlite:///{tmp_path / 'dead.db'}")
    built = build(tmp_path, monkeypatch, sink)
    built.poller.balance()  # the only member: it owns every partition
    built.poller.drain()
    built.poller.leave()
    built.poller.close()
    return built


def partition_of_row(row_id: int) -> str:
    """The partition of ``id = row_id`` of four: the first byte of the key's MD5 is its
    bucket (docs/scale-out.md), 64 buckets a partition."""
    lo = hashlib.md5(str(row_id).encode()).digest()[0] // 64 * 64  # noqa: S324 - a bucket
    return f"orders.p{lo:03d}-{lo + 64:03d}"


def test_the_group_lists_every_partition_and_one_partition_its_own(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = app.cli(capsys, "dead-letter", "list", "orders", "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert sorted(x["pk"]["id"] for x in listed) == sorted(REJECTED)
    owners = {x["pk"]["id"]: x["poller"] for x in listed}
    assert all(p.startswith("orders.p") for p in owners.values()), owners
    assert owners == {i: partition_of_row(i) for i in REJECTED}

    code, out, _ = app.cli(capsys, "dead-letter", "list", "orders")
    assert code == 0
    assert out.splitlines()[0].split()[:2] == ["POLLER", "EVENT"]
    assert all(f"{owners[i]} " in out for i in REJECTED), out

    code, out, _ = app.cli(capsys, "dead-letter", "list", owners[7], "--json")
    assert [x["pk"]["id"] for x in json.loads(out)] == [7]

    code, _, err = app.cli(capsys, "dead-letter", "list", "invoices")
    assert code == 2
    assert "not the partitioned poller 'orders'" in err


def test_replay_across_partitions_settles_each_in_its_own_document(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    owners = {
        x["pk"]["id"]: x["poller"]
        for x in json.loads(app.cli(capsys, "dead-letter", "list", "orders", "--json")[1])
    }
    app.handler.reject.clear()  # the downstream takes them now
    app.handler.seen.clear()
    code, out, _ = app.cli(capsys, "dead-letter", "replay", "orders", "--reason", "fixed")
    assert code == 0, out
    assert "dry run" in out
    assert not app.handler.seen

    code, out, err = app.cli(
        capsys, "dead-letter", "replay", "orders", "--reason", "fixed", "--yes"
    )
    assert code == 0, out + err
    assert sorted(e.pk["id"] for e, _ in app.handler.seen) == sorted(REJECTED)
    assert all(ctx.replay for _, ctx in app.handler.seen)
    for i in REJECTED:
        assert f"replay 1 dead letter(s) of {owners[i]!r}" in out
    code, out, _ = app.cli(capsys, "dead-letter", "list", "orders", "--json")
    assert json.loads(out) == []

    history = history_for(app.poller.store)
    assert history is not None
    for i in REJECTED:  # journaled where that partition's own commands read it
        last = list(history.read(owners[i]))[-1]
        assert last["operation"] == "dead_letter_replay"
        assert last["outcomes"]["settled"] == 1


def test_discard_of_one_partition_leaves_the_others(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    owners = {
        x["pk"]["id"]: x["poller"]
        for x in json.loads(app.cli(capsys, "dead-letter", "list", "orders", "--json")[1])
    }
    code, out, err = app.cli(
        capsys, "dead-letter", "discard", owners[11], "--reason", "obsolete", "--yes"
    )
    assert code == 0, out + err
    assert "1 discarded" in out
    left = json.loads(app.cli(capsys, "dead-letter", "list", "orders", "--json")[1])
    assert sorted(x["pk"]["id"] for x in left) == sorted(REJECTED - {11})


def test_a_partitioned_poller_without_a_sink_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    app = build(tmp_path, monkeypatch, None)
    code, _, err = app.cli(capsys, "dead-letter", "list", "orders")
    assert code == 2
    assert "partitioned poller 'orders' has no dead-letter sink (quarantine=)" in err


def test_replay_of_a_recorded_batch_takes_one_partition(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dbtrigger replay`` said "app:orders is a claim queue: it keeps no history to
    replay" of a partitioned poller; a partition's batches are replayed by its name."""
    partition = partition_of_row(7)
    history = history_for(app.poller.store)
    assert history is not None
    [batch] = [r["batch_id"] for r in history.read(partition) if r.get("batch_id")]
    app.handler.seen.clear()
    argv = ["--trigger", app.spec, "--batch", batch, "--reason", "check", "--yes"]
    code, out, err = app.cli(capsys, "replay", partition, *argv)
    assert code == 0, out + err
    assert 7 in {e.pk["id"] for e, _ in app.handler.seen}
    assert {partition_of_row(int(e.pk["id"])) for e, _ in app.handler.seen} == {partition}

    code, _, err = app.cli(capsys, "replay", "orders", *argv)
    assert code == 2
    assert "is the partitioned poller 'orders'" in err
    assert "dbtrigger replay orders.p000-064 ..." in err


def test_backfill_drains_one_new_poller_over_the_whole_table(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    app.handler.seen.clear()
    argv = ["--trigger", app.spec, "--from-beginning", "--reason", "catch up", "--yes"]
    code, out, err = app.cli(capsys, "backfill", "orders-backfill", *argv)
    assert code == 0, out + err
    assert "20 rows delivered" in out
    assert sorted(e.pk["id"] for e, _ in app.handler.seen) == list(range(1, 21))
    state = app.poller.store.read("orders-backfill")
    assert state is not None  # its own document; the partitions' are untouched
    code, _, err = app.cli(capsys, "backfill", "orders.p000-064", *argv)
    assert code == 2
    assert "a backfill needs its own poller name" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["history", "orders"],
        ["reset", "orders", "--to-beginning", "--reason", "r"],
        ["rewind", "orders", "--to-batch", "b", "--reason", "r"],
        ["bookmark", "create", "orders", "before", "--reason", "r"],
        ["clone", "orders", "orders-copy"],
        ["release-lease", "orders"],
        ["skip-batch", "orders", "--reason", "r"],
    ],
    ids=lambda argv: argv[0],
)
def test_the_state_commands_take_one_partition_and_say_so(
    app: App, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, _, err = app.cli(capsys, *argv, "--source", app.spec)
    assert code == 2
    assert "'orders' is a partitioned poller" in err
    assert "dbtrigger reset orders.p000-064 ..." in err


def test_rewind_of_a_partition_checks_its_source(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "the source was not checked (name the trigger with --trigger to check
    it)" with the trigger named; now the partition's own source is checked."""
    partition = partition_of_row(7)
    history = history_for(app.poller.store)
    assert history is not None
    [batch] = [r["batch_id"] for r in history.read(partition) if r.get("batch_id")]
    argv = ["--to-batch", batch, "--reason", "again"]
    code, out, err = app.cli(capsys, "rewind", partition, "--source", app.spec, *argv)
    assert code == 0, out + err
    assert "a polled table: the rows are delivered again as they are now" in out
    assert "not checked" not in out


def test_a_fan_out_group_replays_to_the_named_subscriber(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    billing, search = Handler(reject=set()), Handler(reject={7})
    subscribers = {"billing": billing, "search": search}
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    app = build(tmp_path, monkeypatch, sink, subscribers=subscribers)
    app.poller.balance()
    app.poller.drain()
    app.poller.leave()
    app.poller.close()
    [letter] = json.loads(app.cli(capsys, "dead-letter", "list", "orders", "--json")[1])
    assert (letter["pk"], letter["poller"]) == ({"id": 7}, partition_of_row(7))

    code, _, err = app.cli(capsys, "dead-letter", "replay", "orders", "--reason", "r", "--yes")
    assert code == 2
    assert "--subscriber" in err
    billing.seen.clear()
    search.seen.clear()
    search.reject.clear()
    argv = ["--subscriber", "search", "--reason", "reindexed", "--yes"]
    code, out, err = app.cli(capsys, "dead-letter", "replay", "orders", *argv)
    assert code == 0, out + err
    [(event, ctx)] = search.seen
    assert (event.event_id, ctx.subscriber, ctx.replay) == (letter["event_id"], "search", True)
    assert billing.seen == []


def test_check_verifies_the_table_and_store_of_a_partitioned_poller(
    app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "app:orders is a PartitionedPoller, not a PollTrigger, ..." (exit 2)."""
    capsys.readouterr()
    code = main(["check", app.spec, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    found = {f["check"]: f["severity"] for f in report["findings"]}
    assert (found["definition"], found["store_writable"]) == ("ok", "ok")
    assert report["poller"] == "orders"
