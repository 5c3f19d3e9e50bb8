"""A watched table renamed under a BinlogSource, the way a user meets it: through the CLI.

``dbtrigger run`` stops with the error, ``cdc status`` and ``check`` say why and what
to run, the module is changed to the new name, ``dbtrigger reset --accept-source``
accepts it, and ``run`` delivers the changes written under the new name; a drop
stops until the table is created again, and ``cdc snapshot`` reads a name on after
another table was renamed to it. Before, ``run`` read past each without a word
beyond a WARNING.
"""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from dbtrigger.cli import main
from tests.cdc_servers import BinlogDatabase

pytestmark = [pytest.mark.binlog, pytest.mark.timeout(180)]


class App:
    """A module defining the trigger as a user's would; :meth:`write` points it at tables."""

    def __init__(self, db: BinlogDatabase, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.db = db
        self.root = root
        self.state = root / "state"
        self.out = root / "delivered.jsonl"
        self.poller = f"orders_{uuid.uuid4().hex[:6]}"
        self.spec = ""
        monkeypatch.chdir(root)
        monkeypatch.syspath_prepend(str(root))

    def write(self, tables: list[str]) -> str:
        module = f"goneapp_{uuid.uuid4().hex[:8]}"  # a new module: the CLI imports it afresh
        (self.root / f"{module}.py").write_text(
            textwrap.dedent(
                f"""
                import json
                from dbtrigger import FileCheckpointStore, PollTrigger
                from dbtrigger.cdc import BinlogSource

                source = BinlogSource({self.db.url!r}, {tables!r}, snapshot="never")
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
                            out.write(json.dumps([e.op, e.pk.get("id"),
                                e.metadata["table"].split(".")[1]]) + "\\n")
                """
            )
        )
        self.spec = f"{module}:trigger"
        return self.spec

    def delivered(self) -> list[list[Any]]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines()]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def tick(capsys: pytest.CaptureFixture[str], app: App) -> tuple[int, str]:
    code, _, err = run(capsys, "run", app.spec, "--max-ticks", "3", "--interval", "0")
    return code, err


def test_renamed_run_stops_status_and_check_say_why_reset_accept_source_reads_on(
    binlog_db: BinlogDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    binlog_db.execute("CREATE TABLE orders (id INT PRIMARY KEY, status VARCHAR(20))")
    app = App(binlog_db, tmp_path, monkeypatch)
    app.write(["orders"])
    assert tick(capsys, app)[0] == 0
    binlog_db.execute("INSERT INTO orders VALUES (1, 'new')")
    binlog_db.execute("RENAME TABLE orders TO orders_v2")
    binlog_db.execute("INSERT INTO orders_v2 VALUES (2, 'new')")

    code, err = tick(capsys, app)
    assert code == 2, err
    assert "orders was renamed to" in err
    # the command as it is to be run (the worker knows where its trigger is defined)
    assert f"dbtrigger reset {app.poller} --accept-source {app.spec}" in err
    assert app.delivered() == [["insert", 1, "orders"]]
    code, out, _ = run(capsys, "cdc", "status", app.spec)
    assert "delivery is held: watched table" in out
    code, out, _ = run(capsys, "check", app.spec, "--no-store-probe")
    assert code == 1
    assert "renamed to" in out

    app.write(["orders_v2"])  # what the error asks for
    code, err = tick(capsys, app)
    assert code == 2
    assert "--accept-source" in err  # the changed source is refused until accepted
    code, out, err = run(
        capsys,
        "reset",
        app.poller,
        "--accept-source",
        app.spec,
        "--reason",
        "table renamed",
        "--yes",
    )
    assert code == 0, out + err
    code, err = tick(capsys, app)
    assert code == 0, err
    assert app.delivered() == [["insert", 1, "orders"], ["insert", 2, "orders_v2"]]
    code, out, _ = run(capsys, "cdc", "status", app.spec)
    assert "delivery is held" not in out


def test_a_name_another_table_was_renamed_to_reads_on_after_cdc_snapshot(
    binlog_db: BinlogDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    binlog_db.execute("CREATE TABLE orders (id INT PRIMARY KEY, status VARCHAR(20))")
    app = App(binlog_db, tmp_path, monkeypatch)
    app.write(["orders"])
    assert tick(capsys, app)[0] == 0
    binlog_db.execute("DROP TABLE orders")
    binlog_db.execute("CREATE TABLE staged (id INT PRIMARY KEY, status VARCHAR(20))")
    binlog_db.execute("INSERT INTO staged VALUES (5, 'staged')")
    code, err = tick(capsys, app)
    assert code == 2
    assert "orders was dropped" in err
    binlog_db.execute("RENAME TABLE staged TO orders")  # a table under the name again
    code, err = tick(capsys, app)
    assert code == 2
    assert "given to the table that was" in err
    assert f"dbtrigger cdc snapshot {app.spec} --table" in err
    # the drop is passed now (a table is under the name), the rename is not yet
    assert app.delivered() == [["truncate", None, "orders"]]

    table = f"{binlog_db.name}.orders"
    code, out, err = run(capsys, "cdc", "snapshot", app.spec, "--table", table, "--yes")
    assert code == 0, out + err
    assert tick(capsys, app)[0] == 0
    assert app.delivered() == [["truncate", None, "orders"], ["upsert", 5, "orders"]]
