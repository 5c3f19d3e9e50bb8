"""``dbtrigger backfill`` stopped by a signal, through the installed console script.

The first SIGTERM (or Ctrl-C) finishes and commits the batch in flight, says
where the backfill stopped and how to resume it, and exits 130. The handler
takes no lock (the relay of :mod:`dbtrigger.runtime.stop_signals` sets the
stop): a handler that set the stop itself could hang for ever on the lock of
a ``stop.wait`` it interrupted, and SIGTERM used to end the process at once,
without the batch committed or a word said.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from dbtrigger import FileCheckpointStore
from dbtrigger.state import document as docmod
from tests.databases import TestDatabase
from tests.test_cli_worker import run_until, write_module
from tests.test_source_sqlalchemy import insert, naive, orders_table

ROWS = 200


def test_sigterm_stops_a_running_backfill_after_its_batch(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(ROWS)])
    # Each batch of 5 says so on stderr and takes a moment: 40 batches outlast the signal.
    body = (
        "import sys, time; print('handled', len(events), file=sys.stderr, flush=True); "
        "time.sleep(0.2)"
    )
    write_module(tmp_path, "backfill_app", sqlite_db.url, pollers={"orders": body})
    args = [
        "backfill", "orders-replay", "--trigger", "backfill_app:orders",
        "--from-beginning", "--batches-per-tick", "1", "--reason", "r", "--yes",
    ]  # fmt: skip
    code, out, err = run_until(args, tmp_path, lambda lines: "handled 5" in lines)
    assert code == 130, err
    assert "run the same command without --from-* to resume" in out, (out, err)
    stopped = int(out.split("stopped after ")[1].split(" rows")[0].replace(",", ""))
    assert 5 <= stopped < ROWS
    # What it said it delivered is committed: the batch in flight finished first.
    stored = FileCheckpointStore(tmp_path / "state").read("orders-replay")
    assert stored is not None
    position = docmod.loads(stored.data).position
    assert position.pk == {"id": stopped - 1}


def test_sigterm_ends_a_backfill_waiting_for_a_retry(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """A backfill whose last event waits for a retry (50 s) waits for it rather than
    saying "caught up" (before: it exited 0 at once, the event undelivered); SIGTERM
    ends the wait at once (bounded: ``run_until`` gives the process 30 s to exit),
    exit 130 with the resume hint."""
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(3)])
    (tmp_path / "retry_app.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

            orders = PollTrigger(
                name="orders",
                source=SqlAlchemySource(url={sqlite_db.url!r}, table="orders",
                                        cursor_column="updated_at", pk_columns=["id"]),
                checkpoint_store=FileCheckpointStore({str(tmp_path / "state")!r}),
            )

            @orders.handler
            def handle(events, ctx):
                for e in events:
                    if e.pk["id"] == 2 and ctx.attempts(e) == 1:
                        ctx.retry(e, "busy", delay_seconds=50)
            """
        )
    )
    args = [
        "backfill", "orders-replay", "--trigger", "retry_app:orders",
        "--from-beginning", "--reason", "r", "--yes",
    ]  # fmt: skip
    code, out, err = run_until(
        args, tmp_path, lambda lines: any("wait for a retry" in x for x in lines)
    )
    assert "1 event(s) wait for a retry" in err, (out, err)
    assert code == 130, (out, err)
    assert "run the same command without --from-* to resume" in out, (out, err)
    assert "caught up" not in out
