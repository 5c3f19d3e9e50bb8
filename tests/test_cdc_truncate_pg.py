"""A ``TRUNCATE`` read by PgLogicalSource is a ``truncate`` event, as a change log's is.

Same shape (op ``truncate``, no images, every key value None, CloudEvent type
``dbtrigger.row.truncate``), in its place among the table's changes, alone in
its batch so that lanes never run it beside another key, recorded by the
history and replayed as it was. Before, it was a WARNING (``cdc_truncate``)
and no event: a downstream copy kept every truncated row.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import PgLogicalSource, pg_control
from dbtrigger.cli import main
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import ConfigurationError
from dbtrigger.history import history_for
from tests.cdc_servers import CdcDatabase


def poller(db: CdcDatabase, tables: list[str], **kw: Any) -> tuple[PollTrigger, PgLogicalSource]:
    source = PgLogicalSource(db.url, tables, snapshot="never", mode=kw.pop("mode", "poll"))
    kw.setdefault("checkpoint_store", InMemoryCheckpointStore())
    trigger = PollTrigger(
        name=kw.pop("name", f"p_{uuid.uuid4().hex[:8]}"),
        source=source,
        batch_size=50,
        max_batches_per_tick=100,
        **kw,
    )
    return trigger, source


@pytest.mark.parametrize("mode", ["poll", "stream"])
def test_a_truncate_is_delivered_in_order_as_a_truncate_event(
    cdc_db: CdcDatabase, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    trigger, source = poller(cdc_db, ["t"], mode=mode)
    trigger.drain(lambda events: None)
    cdc_db.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    cdc_db.execute("TRUNCATE t")
    cdc_db.execute("INSERT INTO t VALUES (3, 'c')")
    got: list[RowChange] = []
    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        trigger.drain(got.extend)
    truncate = assert_truncated_between(got, "public.t")
    assert truncate.metadata["last_in_transaction"] is True
    assert truncate.to_cloudevent().get_subject() is None
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and getattr(r, "event", None) != "cdc_wal_keep_unlimited"
    ]
    assert warned == []  # the server's unbounded WAL keep is the only warning, and not ours
    source.close()


def test_a_truncate_inside_a_transaction_keeps_its_place_and_names_each_table(
    cdc_db: CdcDatabase,
) -> None:
    cdc_db.execute("CREATE TABLE a (id int PRIMARY KEY)")
    cdc_db.execute("CREATE TABLE b (k1 int, k2 text, PRIMARY KEY (k1, k2))")
    trigger, source = poller(cdc_db, ["a", "b"])
    trigger.drain(lambda events: None)
    with cdc_db.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO a VALUES (1)")
        conn.execute("INSERT INTO b VALUES (1, 'x')")
        conn.execute("TRUNCATE a, b")
        conn.execute("INSERT INTO a VALUES (2)")
    batches: list[list[RowChange]] = []
    trigger.drain(lambda events: batches.append(list(events)))
    shapes = [[(e.op, e.metadata["table"], dict(e.pk)) for e in b] for b in batches]
    assert shapes == [
        [("insert", "public.a", {"id": 1}), ("insert", "public.b", {"k1": 1, "k2": "x"})],
        [("truncate", "public.a", {"id": None})],
        [("truncate", "public.b", {"k1": None, "k2": None})],
        [("insert", "public.a", {"id": 2})],
    ]
    assert [e.metadata["ordinal"] for b in batches for e in b] == [1, 2, 3, 4, 5]
    source.close()


def test_lanes_never_run_a_truncate_beside_or_after_a_later_change(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    trigger, source = poller(cdc_db, ["t"], max_concurrency=4)
    trigger.drain(lambda events: None)
    cdc_db.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 12) g")
    cdc_db.execute("TRUNCATE t")
    cdc_db.execute("INSERT INTO t SELECT g, 1 FROM generate_series(1, 12) g")
    assert_truncate_is_a_barrier(trigger, "v")
    source.close()


def assert_truncated_between(got: list[RowChange], table: str) -> RowChange:
    """``got``: inserts 1 and 2, the truncate of ``table``, insert 3; the truncate
    event, shaped as the change log's (no images, every key value None)."""
    assert [(e.op, e.pk["id"]) for e in got] == [
        ("insert", 1),
        ("insert", 2),
        ("truncate", None),
        ("insert", 3),
    ]
    truncate = got[2]
    assert truncate.before is None
    assert truncate.after is None
    assert dict(truncate.pk) == {"id": None}
    assert truncate.metadata["table"] == table
    assert truncate.to_cloudevent().get_type() == "dbtrigger.row.truncate"
    return truncate


def assert_truncate_is_a_barrier(trigger: PollTrigger, column: str) -> None:
    """Drained with lanes: 12 rows at 0, the truncate, 12 rows at 1 in ``column``;
    the truncate's call ran alone, after every call of a row before it and before
    every call of a row after it (the order the lanes' calls finished in)."""
    calls: list[list[tuple[str, Any]]] = []
    lock = threading.Lock()

    def handler(events: list[RowChange]) -> None:
        with lock:
            calls.append([(e.op, None if e.after is None else e.after[column]) for e in events])

    trigger.drain(handler)
    at = next(i for i, c in enumerate(calls) if ("truncate", None) in c)
    assert calls[at] == [("truncate", None)]
    assert {v for c in calls[:at] for _, v in c} == {0}
    assert {v for c in calls[at + 1 :] for _, v in c} == {1}
    assert sum(len(c) for c in calls) == 25


def test_a_truncate_is_recorded_by_the_history(
    cdc_db: CdcDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Recorded as a change log's truncate is; a slot hands each change out once, so
    its replay is refused as any confirmed batch's is (the binlog replays it: see
    tests/test_cdc_truncate_binlog.py)."""
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    store = FileCheckpointStore(tmp_path / "state")
    trigger, source = poller(cdc_db, ["t"], name="cdc-trunc", checkpoint_store=store)
    trigger.drain(lambda events: None)
    cdc_db.execute("INSERT INTO t VALUES (1, 'a')")
    cdc_db.execute("TRUNCATE t")
    cdc_db.execute("INSERT INTO t VALUES (2, 'b')")
    batches: list[list[RowChange]] = []
    trigger.handler(lambda events: batches.append(list(events)))
    trigger.drain()
    assert [[e.op for e in b] for b in batches] == [["insert"], ["truncate"], ["insert"]]
    history = history_for(trigger.store)
    assert history is not None
    commits = [r for r in history.read(trigger.name) if r["type"] == "commit"][-3:]
    module = types.ModuleType("cdc_truncate_app")
    module.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cdc_truncate_app", module)
    capsys.readouterr()
    spec = ["--trigger", "cdc_truncate_app:trigger"]
    assert main(["history", "cdc-trunc", "--batch", commits[1]["batch_id"], *spec]) == 0
    shown = capsys.readouterr().out
    assert shown.splitlines()[-1].split()[::2] == ["(truncate)", "accepted"], shown
    first, last = commits[0]["batch_id"], commits[-1]["batch_id"]
    code = main(
        ["replay", "cdc-trunc", "--from-batch", first, "--to-batch", last, *spec, "--verify"]
    )
    assert code == 1
    assert "a slot cannot be rewound" in capsys.readouterr().out
    source.close()


def test_a_publication_without_truncate_is_named_then_extended(cdc_db: CdcDatabase) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    cdc_db.execute("CREATE PUBLICATION pub_t FOR TABLE t WITH (publish = 'insert, update, delete')")
    cdc_db.execute("SELECT pg_create_logical_replication_slot('s_t', 'pgoutput')")
    with cdc_db.connect() as conn:
        pg_control.ensure(conn, "public")
    strict = PgLogicalSource(
        cdc_db.url, ["t"], slot="s_t", publication="pub_t", snapshot="never", create=False
    )
    findings = {f.check: f for f in strict.self_check()}
    assert findings["publication"].severity == "warning"
    assert "truncate" in findings["publication"].message
    with pytest.raises(ConfigurationError, match="publish = 'insert, update, delete, truncate'"):
        strict.fetch(BEGINNING, 1)
    strict.close()
    source = PgLogicalSource(cdc_db.url, ["t"], slot="s_t", publication="pub_t", snapshot="never")
    source.fetch(BEGINNING, 1)
    assert cdc_db.scalar("SELECT pubtruncate FROM pg_publication WHERE pubname = 'pub_t'")
    findings = {f.check: f for f in source.self_check()}
    assert findings["publication"].severity == "ok", findings["publication"]
    source.close()
