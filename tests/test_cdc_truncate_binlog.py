"""A ``TRUNCATE`` read by BinlogSource is a ``truncate`` event, as a change log's is.

The binlog carries it as a statement: it becomes one event (op ``truncate``,
no images, every key value None) in its place among the table's changes,
alone in its batch (lanes never run it beside another key), and a replay of
a range that holds it gives it back as it was. Before, it was a WARNING
(``cdc_truncate``) and no event.
"""

from __future__ import annotations

import importlib
import logging
import uuid
from pathlib import Path

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import BinlogSource
from dbtrigger.cli import main
from dbtrigger.history import history_for
from dbtrigger.history.records import image_text
from tests.cdc_servers import BinlogDatabase
from tests.test_cdc_binlog import make_table, trigger
from tests.test_cdc_truncate_pg import assert_truncate_is_a_barrier, assert_truncated_between
from tests.test_history_replay import _cdc_module

pytestmark = [pytest.mark.binlog, pytest.mark.timeout(120)]


def test_a_truncate_is_delivered_in_order_as_a_truncate_event(
    binlog_db: BinlogDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    table = make_table(binlog_db)
    other = binlog_db.server.create_database()  # a table of the same name elsewhere
    binlog_db.server.execute(f"CREATE TABLE {table} (id INT PRIMARY KEY)", None, other)
    source = BinlogSource(binlog_db.url, [table], snapshot="never")
    t = trigger(source)
    t.drain(lambda events: None)
    binlog_db.execute(f"INSERT INTO {table} VALUES (1, 'a', 1), (2, 'b', 2)")
    binlog_db.execute(f"TRUNCATE TABLE {table}")
    binlog_db.server.execute(f"TRUNCATE TABLE {table}", None, other)  # not the watched one
    binlog_db.execute(f"INSERT INTO {table} VALUES (3, 'c', 3)")
    got: list[RowChange] = []
    with caplog.at_level(logging.WARNING, logger="dbtrigger"):
        t.drain(got.extend)
    assert_truncated_between(got, f"{binlog_db.name}.{table}")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    source.close()


def test_lanes_never_run_a_truncate_beside_or_after_a_later_change(
    binlog_db: BinlogDatabase,
) -> None:
    table = make_table(binlog_db)
    source = BinlogSource(binlog_db.url, [table], snapshot="never")
    t = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=50,
        max_concurrency=4,
    )
    t.drain(lambda events: None)
    values = ", ".join(f"({i}, 'x', 0)" for i in range(1, 13))
    binlog_db.execute(f"INSERT INTO {table} VALUES {values}")
    binlog_db.execute(f"TRUNCATE {table}")
    binlog_db.execute(f"INSERT INTO {table} VALUES {values.replace(', 0)', ', 1)')}")
    assert_truncate_is_a_barrier(t, "n")
    source.close()


def test_a_range_holding_a_truncate_is_replayed_exactly(
    binlog_db: BinlogDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    binlog_db.execute("CREATE TABLE orders (id INT PRIMARY KEY, status VARCHAR(20))")
    name = f"binlog_trunc_{uuid.uuid4().hex[:8]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    spec = _cdc_module(
        tmp_path, name, f"BinlogSource({binlog_db.url!r}, ['orders'], snapshot='never')", "ot"
    )
    module = importlib.import_module(name)
    module.trigger.drain(module.handle)
    binlog_db.execute("INSERT INTO orders VALUES (1, 'new'), (2, 'new')")
    binlog_db.execute("TRUNCATE TABLE orders")
    binlog_db.execute("INSERT INTO orders VALUES (3, 'new')")
    module.trigger.drain(module.handle)
    live = [list(events) for events, _ in module.seen]
    assert [[e.op for e in b] for b in live] == [["insert", "insert"], ["truncate"], ["insert"]]
    history = history_for(module.trigger.store)
    assert history is not None
    ids = [r["batch_id"] for r in history.read("ot") if r["type"] == "commit"]
    module.seen.clear()
    capsys.readouterr()
    argv = ["replay", "ot", "--from-batch", ids[0], "--to-batch", ids[-1], "--trigger", spec]
    assert main([*argv, "--verify"]) == 0
    assert "mode exact" in capsys.readouterr().out
    assert main([*argv, "--yes", "--reason", "rebuild"]) == 0
    again = [list(events) for events, _ in module.seen]
    assert [[e.op for e in b] for b in again] == [["insert", "insert"], ["truncate"], ["insert"]]
    assert [[image_text(e) for e in b] for b in again] == [[image_text(e) for e in b] for b in live]
    assert [[e.event_id for e in b] for b in again] == [[e.event_id for e in b] for b in live]
