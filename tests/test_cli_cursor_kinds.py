"""A cursor typed on the command line takes its type from the column, never from its look.

``reset --to-cursor`` and ``backfill --from-cursor`` without ``--kind`` used to
guess when there was no checkpoint to copy the type from: ``2020-01-01
00:00:02`` became a text checkpoint, which the next tick refused as a false
"type changed". And a backfill that failed left its document behind, so the
same command then refused ("already exists"). Through the installed console
script, on each database.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.databases import TestDatabase
from tests.doc_cli import dbtrigger_command
from tests.test_source_sqlalchemy import insert, naive, orders_table

APP = """
import os
from pathlib import Path
from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

orders = PollTrigger(
    name="orders",
    source=SqlAlchemySource(url={url!r}, table="orders", schema={schema!r},
                            cursor_column="updated_at", pk_columns=["id"]),
    checkpoint_store=FileCheckpointStore({state!r}),
    batch_size=2,
)
SEEN = Path({seen!r})

@orders.handler
def handle(events):
    if os.environ.get("KINDS_FAIL"):
        raise RuntimeError("the sink is down")
    with SEEN.open("a") as fh:
        fh.write("".join(f"{{e.pk['id']}}\\n" for e in events))
"""

#: Row 2's cursor as an operator types it (no zone: the column is naive; SQLite keeps
#: it as this very text).
ROW_2 = "2020-01-01 00:00:02.000000"


class Cli:
    def __init__(self, db: TestDatabase, tmp_path: Path) -> None:
        insert(db, orders_table(db), [{"id": i, "updated_at": naive(i)} for i in range(6)])
        self.dir = tmp_path
        self.state = tmp_path / "state"
        self.seen = tmp_path / "seen.log"
        (tmp_path / "kinds_app.py").write_text(
            APP.format(url=db.url, schema=db.schema, state=str(self.state), seen=str(self.seen))
        )

    def __call__(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DBTRIGGER_")}
        return subprocess.run(
            [dbtrigger_command(), *args],
            capture_output=True,
            text=True,
            cwd=self.dir,
            env={**clean, "PYTHONPATH": str(self.dir), **env},
            timeout=120,
            check=False,
        )

    def delivered(self) -> list[int]:
        return [int(x) for x in self.seen.read_text().split()] if self.seen.exists() else []

    def cursor_kind(self, poller: str) -> str:
        doc = json.loads((self.state / f"{poller}.json").read_text())
        return str(doc["checkpoint"]["cursor"]["kind"])

    def run_until(self, done: Callable[[], bool], timeout: float = 120.0) -> None:
        """``run`` for a few ticks at a time until ``done()`` (bounded). A tick
        counts whether or not it delivered: on MariaDB the visibility guard holds
        every row back while a write transaction of another test on the shared
        server is open that began before the guard's first look (or while its
        transaction list cannot be read fresh), so N ticks may deliver nothing."""
        deadline = time.monotonic() + timeout
        while True:
            ran = self("run", "kinds_app:orders", "--interval", "0", "--max-ticks", "3")
            assert ran.returncode == 0, ran.stdout + ran.stderr
            assert "error:" not in ran.stderr  # (a guessed text checkpoint was refused here)
            if done():
                return
            assert time.monotonic() < deadline, f"not done within {timeout:.0f}s: {ran.stderr}"

    def backfill(self, *more: str, **env: str) -> subprocess.CompletedProcess[str]:
        return self(
            "backfill",
            "orders-bf",
            "--trigger",
            "kinds_app:orders",
            "--reason",
            "replay",
            "--max-retries",
            "0",
            "--retry-delay",
            "0",
            *more,
            **env,
        )


def test_backfill_from_a_cursor_takes_the_type_of_the_column(
    db: TestDatabase, tmp_path: Path
) -> None:
    cli = Cli(db, tmp_path)
    done = cli.backfill("--from-cursor", ROW_2, "--pk", "id=2", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "caught up: 3 rows" in done.stdout
    assert cli.delivered() == [3, 4, 5]
    assert cli.cursor_kind("orders-bf") == (
        "str+pk" if db.kind == "sqlite" else "naive_timestamp+pk"
    )


def test_a_failed_backfill_leaves_nothing_behind(db: TestDatabase, tmp_path: Path) -> None:
    cli = Cli(db, tmp_path)
    if db.kind != "sqlite":  # (SQLite keeps the column as text: any text is a position)
        # A value the column cannot hold is refused before anything is written.
        bad = cli.backfill("--from-cursor", "yesterday", "--pk", "id=2", "--yes")
        assert bad.returncode == 2, bad.stdout + bad.stderr
        assert "yesterday" in bad.stderr
        assert not (cli.state / "orders-bf.json").exists()
    # A handler that fails before the first commit: the document goes again.
    failed = cli.backfill("--from-cursor", ROW_2, "--pk", "id=2", "--yes", KINDS_FAIL="1")
    assert failed.returncode != 0, failed.stdout
    assert "its state document was removed" in failed.stderr
    assert not (cli.state / "orders-bf.json").exists()
    # The same command, once the cause is fixed, starts as asked.
    again = cli.backfill("--from-cursor", ROW_2, "--pk", "id=2", "--yes")
    assert again.returncode == 0, again.stdout + again.stderr
    assert cli.delivered() == [3, 4, 5]


def test_reset_to_a_cursor_without_a_checkpoint_reads_the_column_type(
    db: TestDatabase, tmp_path: Path
) -> None:
    cli = Cli(db, tmp_path)
    cli.run_until((cli.state / "orders.json").exists)  # a checkpoint to reset
    to_start = cli(
        "reset",
        "orders",
        "--to-beginning",
        "--source",
        "kinds_app:orders",
        "--reason",
        "r",
        "--backup-dir",
        str(tmp_path / "backups"),
        "--yes",
    )
    assert to_start.returncode == 0, to_start.stderr
    # No checkpoint to copy the type from, and no source named: refused, not guessed.
    blind = cli(
        "reset", "orders", "--to-cursor", ROW_2, "--pk", "id=2", "--store", "state", "--reason", "r"
    )
    assert blind.returncode == 2
    assert "add --source MODULE:ATTR" in blind.stderr
    reset = cli(
        "reset",
        "orders",
        "--to-cursor",
        ROW_2,
        "--pk",
        "id=2",
        "--source",
        "kinds_app:orders",
        "--reason",
        "skip ahead",
        "--backup-dir",
        str(tmp_path / "backups"),
        "--yes",
    )
    assert reset.returncode == 0, reset.stdout + reset.stderr
    assert cli.cursor_kind("orders") == ("str+pk" if db.kind == "sqlite" else "naive_timestamp+pk")
    before = len(cli.delivered())
    cli.run_until(lambda: len(cli.delivered()) >= before + 3)
    assert cli.delivered()[before:] == [3, 4, 5]
