"""BinlogSource through the runtime's front doors: ``@db.trigger`` in an Azure Functions app
(poll mode), and ``dbtrigger cdc install|status|recreate``, ``run``, ``status``, ``history``,
``check`` and ``reset`` on a module that defines the trigger as a user's would."""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path
from typing import Any

import azure.functions as func
import pytest
from azure.functions.timer import TimerRequest

from dbtrigger import DbBindings, HandlerError, InMemoryCheckpointStore, RowChange
from dbtrigger.cdc import BinlogSource
from dbtrigger.cli import main
from dbtrigger.state import document as docmod
from tests.cdc_servers import BinlogDatabase
from tests.test_cdc_binlog import purge_all_but_newest

EVERY_MINUTE = "0 */1 * * * *"
pytestmark = pytest.mark.timeout(180)


def timer() -> TimerRequest:
    return TimerRequest(past_due=False, schedule_status={}, schedule={"AdjustForDST": True})


def test_a_functions_timer_delivers_binlog_changes_in_commit_order(
    binlog_db: BinlogDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    binlog_db.execute("CREATE TABLE orders (id INT PRIMARY KEY, status VARCHAR(20))")
    monkeypatch.setenv("ORDERS_BINLOG_URL", binlog_db.url)
    store = InMemoryCheckpointStore()
    app = func.FunctionApp()
    db = DbBindings()
    received: list[list[tuple[str, int]]] = []
    fail = {"next": False}

    @app.function_name(name="orders_binlog")
    @app.schedule(schedule=EVERY_MINUTE, arg_name="timer", use_monitor=True)
    @db.trigger(
        arg_name="events",
        source=BinlogSource("%ORDERS_BINLOG_URL%", ["orders"], snapshot="never"),
        checkpoint_store=store,
        schedule=EVERY_MINUTE,
        batch_size=3,
        max_batches_per_tick=10,
    )
    def orders_binlog(timer: func.TimerRequest, events: list[RowChange]) -> None:
        if fail["next"]:
            fail["next"] = False
            raise RuntimeError("downstream unavailable")
        received.append([(e.op, e.pk["id"]) for e in events])

    (function,) = app.get_functions()
    invoke = function.get_user_function()
    invoke(timer=timer())  # first firing: the reader is recorded at the log's end
    assert binlog_db.scalar("SELECT reader FROM dbtrigger_cdc_binlog") == "orders_binlog"
    binlog_db.execute("INSERT INTO orders VALUES (1, 'new'), (2, 'new'), (3, 'new'), (4, 'new')")
    binlog_db.execute("UPDATE orders SET status = 'paid' WHERE id = 2")
    binlog_db.execute("DELETE FROM orders WHERE id = 3")
    fail["next"] = True
    with pytest.raises(HandlerError):
        invoke(timer=timer())
    assert received == []
    invoke(timer=timer())
    assert received == [
        [("insert", 1), ("insert", 2), ("insert", 3)],
        [("insert", 4), ("update", 2), ("delete", 3)],
    ]
    state = docmod.loads(store.read("orders_binlog").data)  # type: ignore[union-attr]
    assert state.checkpoint is not None
    assert str(state.checkpoint.position.cursor).endswith("#0000000001")  # the delete's commit


class App:
    def __init__(self, db: BinlogDatabase, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.db = db
        self.module = f"binlogapp_{uuid.uuid4().hex[:8]}"
        self.state = root / "state"
        self.out = root / "delivered.jsonl"
        self.poller = f"orders_{uuid.uuid4().hex[:6]}"
        (root / f"{self.module}.py").write_text(
            textwrap.dedent(
                f"""
                import json
                from dbtrigger import FileCheckpointStore, PollTrigger
                from dbtrigger.cdc import BinlogSource

                source = BinlogSource({db.url!r}, ["orders"], snapshot="never")
                trigger = PollTrigger(
                    name={self.poller!r},
                    source=source,
                    checkpoint_store=FileCheckpointStore({str(self.state)!r}),
                    batch_size=10,
                )

                @trigger.handler
                def handle(events):
                    with open({str(self.out)!r}, "a") as out:
                        for e in events:
                            out.write(json.dumps({{"op": e.op, "pk": dict(e.pk),
                                "snapshot": e.metadata["snapshot"]}}) + "\\n")
                """
            )
        )
        monkeypatch.chdir(root)
        monkeypatch.syspath_prepend(str(root))

    @property
    def spec(self) -> str:
        return f"{self.module}:trigger"

    def delivered(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines()]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_install_run_status_history_check_purge_recreate_and_reset(
    binlog_db: BinlogDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    binlog_db.execute("CREATE TABLE orders (id INT PRIMARY KEY, status VARCHAR(40))")
    app = App(binlog_db, tmp_path, monkeypatch)
    code, out, _ = run(capsys, "cdc", "install", app.spec)
    assert code == 0
    assert "dry run" in out
    assert "server_id" in out
    code, out, _ = run(capsys, "cdc", "install", app.spec, "--yes")
    assert code == 0, out
    assert "recorded reader" in out
    binlog_db.execute(
        "INSERT INTO orders VALUES " + ", ".join(f"({i}, 'new')" for i in range(1, 26))
    )
    binlog_db.execute("UPDATE orders SET status = 'paid' WHERE id <= 5")
    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "5", "--interval", "0")
    assert code == 0, err
    assert [d["op"] for d in app.delivered()] == ["insert"] * 25 + ["update"] * 5

    store = str(app.state)
    code, out, _ = run(capsys, "status", app.poller, "--store", store)
    assert code == 0
    assert "#0000000005" in out  # the 5th change of the update's transaction
    code, out, _ = run(capsys, "history", app.poller, "--store", store, "--json")
    assert sum(e["rows"] for e in json.loads(out) if e["type"] == "commit") == 30
    code, out, _ = run(capsys, "check", app.spec, "--no-store-probe")
    assert code == 0, out
    code, out, _ = run(capsys, "cdc", "status", app.spec)
    assert code == 0, out
    assert "binlog_format" not in out or "ROW" in out
    assert "reader" in out

    binlog_db.execute("INSERT INTO orders VALUES (26, 'lost in the gap')")
    purge_all_but_newest(binlog_db)
    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "3", "--interval", "0")
    assert code == 2
    assert "purged" in err
    assert "dbtrigger cdc recreate" in err
    code, _, err = run(capsys, "cdc", "recreate", app.spec, "--yes")
    assert code == 2
    assert "--snapshot" in err
    code, out, _ = run(capsys, "cdc", "recreate", app.spec, "--snapshot", "--yes")
    assert code == 0, out
    assert "snapshot of 1 table(s) queued" in out
    before = len(app.delivered())
    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "10", "--interval", "0")
    assert code == 0, err
    again = app.delivered()[before:]
    assert all(d["snapshot"] for d in again)
    assert sorted(d["pk"]["id"] for d in again) == list(range(1, 27))  # the gap is covered

    code, out, _ = run(
        capsys,
        "reset",
        app.poller,
        "--store",
        store,
        "--to-beginning",
        "--reason",
        "replay",
        "--yes",
    )
    assert code == 0, out
    binlog_db.execute("INSERT INTO orders VALUES (27, 'after the reset')")
    before = len(app.delivered())
    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "5", "--interval", "0")
    assert code == 0, err
    # From the beginning: from where the reader was (re)created, the snapshot and what followed.
    replay = app.delivered()[before:]
    assert [d["pk"]["id"] for d in replay][-1] == 27
    assert sum(d["snapshot"] for d in replay) == 26
