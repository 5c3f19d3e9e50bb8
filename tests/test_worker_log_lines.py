"""What a worker's log says, the way an operator reads it: one INFO line per tick with
where the checkpoint is, quiet states said once and then every few minutes, an outage as
one line per failed tick plus its traceback once, no "caught up" while retries wait, a
first progress line without a made-up rate, a partitioned poller's guard said once.
"""

from __future__ import annotations

import logging
import re
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from dbtrigger import (
    FileCheckpointStore,
    InMemoryCheckpointStore,
    PollTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.cli import main
from dbtrigger.errors import FetchError
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.runtime.progress import DrainProgress
from dbtrigger.runtime.runner import Runner
from dbtrigger.testing import MemorySource
from tests.databases import TestDatabase


def rows(n: int) -> list[dict[str, int]]:
    return [{"id": i, "seq": i} for i in range(1, n + 1)]


def info_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name.startswith("dbtrigger") and r.levelno >= logging.INFO
    ]


def test_one_info_line_per_tick_with_the_checkpoint_and_its_commit_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = MemorySource(rows(1000), cursor_column="seq", pk_columns=["id"])
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=100,
        max_batches_per_tick=10,
    )
    runner = Runner(trigger, lambda events: None, interval_seconds=0, progress=None)
    with caplog.at_level(logging.DEBUG, logger="dbtrigger"):
        runner.run(max_ticks=1, install_signals=False)
    batches = [r for r in caplog.records if getattr(r, "event", None) == "batch_committed"]
    assert len(batches) == 10
    assert all(r.levelno == logging.DEBUG for r in batches)
    lines = [r for r in info_lines(caplog) if getattr(r, "event", None) == "tick"]
    (line,) = lines
    text = line.getMessage()
    assert re.search(
        r"committed 1,000 rows in 10 batches, checkpoint 1000 id=1000 "
        r"\(committed \d\d:\d\d:\d\d\.\d{3}Z\); more pending",
        text,
    ), text
    assert line.checkpoint.startswith("checkpoint 1000 id=1000 (committed ")  # type: ignore[attr-defined]


def test_a_timer_firing_logs_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    """PollTrigger.run() - what a Functions invocation runs - says one line per firing."""
    source = MemorySource(rows(300), cursor_column="seq", pk_columns=["id"])
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=100,
        max_batches_per_tick=10,
    )
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        assert trigger.run(timer=None, handler=lambda events: None) == 300
        assert trigger.run(timer=None, handler=lambda events: None) == 0
    first, second = (r.getMessage() for r in info_lines(caplog))
    assert first.startswith("orders: committed 300 rows in 3 batches, checkpoint 300 id=300")
    assert second.startswith("orders: idle: nothing after the checkpoint 300 id=300")
    assert "next tick" not in second  # the host's timer decides that


def test_timer_firings_say_idle_once_then_every_few_minutes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Functions timer fires every minute: an idle poller must not log 1,440 INFO lines
    a day; it says so once, then at DEBUG, and "still idle" every 5 minutes."""
    source = MemorySource(rows(5), cursor_column="seq", pk_columns=["id"])
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=InMemoryCheckpointStore())
    minutes = iter(range(0, 10_000, 60))
    trigger._quiet.clock = lambda: float(next(minutes))  # a firing a minute
    with caplog.at_level(logging.DEBUG, logger="dbtrigger.runtime"):
        for _ in range(8):
            trigger.run(timer=None, handler=lambda events: None)
    ticks = [r for r in caplog.records if getattr(r, "event", None) == "tick"]
    levels = [logging.getLevelName(r.levelno) for r in ticks]
    assert levels == ["INFO", "INFO", "DEBUG", "DEBUG", "DEBUG", "DEBUG", "INFO", "DEBUG"]
    assert ticks[6].getMessage().startswith("orders: still idle: nothing after the checkpoint")
    assert ticks[6].getMessage().endswith("(for 5m)")


def test_idle_is_said_once_then_every_few_minutes(caplog: pytest.LogCaptureFixture) -> None:
    source = MemorySource(rows(5), cursor_column="seq", pk_columns=["id"])
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=InMemoryCheckpointStore())
    runner = Runner(trigger, lambda events: None, interval_seconds=0, still_quiet_seconds=300)
    minutes = iter(range(0, 10_000, 100))
    runner._quiet.clock = lambda: float(next(minutes))  # 100 s between two ticks
    with caplog.at_level(logging.DEBUG, logger="dbtrigger.runner"):
        runner.run(max_ticks=7, install_signals=False)
    ticks = [r for r in caplog.records if getattr(r, "event", None) == "tick"]
    assert [r.outcome for r in ticks] == ["committed"] + ["idle"] * 6  # type: ignore[attr-defined]
    levels = [logging.getLevelName(r.levelno) for r in ticks]
    assert levels == ["INFO", "INFO", "DEBUG", "DEBUG", "INFO", "DEBUG", "DEBUG"]
    still = ticks[4].getMessage()
    assert "still idle: nothing after the checkpoint 5 id=5" in still
    assert "lag 0 rows" in still
    assert "(for 5m)" in still


class FlakySource(MemorySource):
    """A source whose database is unreachable for ``down`` fetches after the first."""

    def __init__(self, down: int) -> None:
        super().__init__(rows(3), cursor_column="seq", pk_columns=["id"])
        self.calls = 0
        self.down = down

    def fetch(self, after, limit):  # type: ignore[no-untyped-def]
        self.calls += 1
        if 2 <= self.calls <= 1 + self.down:
            try:
                raise ConnectionRefusedError(111, "Connection refused")
            except OSError as exc:
                raise FetchError("fetch from memory:rows failed: connection refused") from exc
        return super().fetch(after, limit)


def write_app(tmp_path: Path, body: str) -> str:
    name = f"loglines_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return name


def test_an_outage_is_one_line_per_failed_tick_and_its_traceback_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    name = write_app(
        tmp_path,
        f"""
        from dbtrigger import FileCheckpointStore, PollTrigger
        from tests.test_worker_log_lines import FlakySource

        # Down for 12 fetches: three ticks of four attempts each (the in-tick retries).
        trigger = PollTrigger(name="orders", source=FlakySource(down=12),
                              checkpoint_store=FileCheckpointStore({str(tmp_path / "state")!r}))

        @trigger.handler
        def handle(events):
            pass
        """,
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["run", f"{name}:trigger", "--max-ticks", "6", "--interval", "0",
                 "--max-backoff", "0"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0
    failed = [line for line in err.splitlines() if "tick failed" in line]
    assert len(failed) == 3
    assert err.count("Traceback (most recent call last)") == 2  # one chain: FetchError + cause
    assert err.count("ConnectionRefusedError") >= 1
    assert "fetch failed" not in err  # the runtime's own record: at -vv only
    assert "retrying" not in err
    assert "recovered after 3 failed ticks in " in err
    sys.modules.pop(name, None)


def test_no_caught_up_while_retries_wait(caplog: pytest.LogCaptureFixture) -> None:
    source = MemorySource(rows(30), cursor_column="seq", pk_columns=["id"])
    trigger = PollTrigger(
        name="orders",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=10,
        retry_delay_seconds=600,
        retry_delay_max_seconds=600,
    )
    reports: list[DrainProgress] = []

    def handle(events: list[RowChange], ctx) -> None:  # type: ignore[no-untyped-def]
        for e in events:
            if e.pk["id"] == 5:
                ctx.retry(e, "downstream 503")

    runner = Runner(
        trigger, handle, interval_seconds=0, progress=reports.append, progress_interval_seconds=0
    )
    with caplog.at_level(logging.INFO, logger="dbtrigger.runner"):
        runner.run(max_ticks=6, install_signals=False)
    assert reports, "the backlog was tracked"
    assert not any(r.caught_up for r in reports)
    idle = [r.getMessage() for r in caplog.records if getattr(r, "outcome", None) == "idle"]
    assert idle
    assert "1 event(s) waiting for a retry, the next due at " in idle[0]


def test_the_first_progress_line_has_no_made_up_rate() -> None:
    first = DrainProgress("orders", delivered=1000, behind=1500, elapsed_seconds=0.0004)
    assert first.describe() == "catching up: 1,000 rows in 0.0s, about 1,500 behind"
    later = DrainProgress("orders", delivered=3000, behind=3000, elapsed_seconds=3.0)
    assert later.describe() == (
        "catching up: 3,000 rows in 3.0s (1,000 rows/s), about 3,000 behind, ETA 0:00:03"
    )
    source = MemorySource(rows(500), cursor_column="seq", pk_columns=["id"])
    trigger = PollTrigger(
        name="orders", source=source, checkpoint_store=InMemoryCheckpointStore(), batch_size=100
    )
    reports: list[DrainProgress] = []
    runner = Runner(trigger, lambda events: None, interval_seconds=0, progress=reports.append)
    runner.run(max_ticks=3, install_signals=False)
    assert reports[0].elapsed_seconds > 0  # measured from the start of the tick that found it


def test_a_partitioned_poller_says_its_guard_once(
    sqlite_db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sqlite_db.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    sqlite_db.execute(
        "INSERT INTO events (id, seq) VALUES (:i, :i)", [{"i": i} for i in range(1, 41)]
    )
    trigger = PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=sqlite_db.url, table="events", cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        partitions=4,
        batch_size=10,
    )
    with caplog.at_level(logging.DEBUG, logger="dbtrigger.sources"):
        trigger.drain(lambda events: None)
    trigger.close()
    said = [r for r in caplog.records if getattr(r, "event", None) == "visibility_mode"]
    assert len(said) >= 4  # every partition decides
    assert [r.levelno for r in said].count(logging.INFO) == 1  # and it is said once


def test_the_line_of_the_tick_a_stop_let_finish_does_not_promise_another(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ctrl-C during a batch of a backlog: its line said "more pending, ticking again
    at once", and the next line said the worker had stopped."""
    source = MemorySource(rows(300), cursor_column="seq", pk_columns=["id"])
    trigger = PollTrigger(
        name="orders", source=source, checkpoint_store=InMemoryCheckpointStore(), batch_size=100
    )
    stop = threading.Event()
    runner = Runner(trigger, lambda events: stop.set(), interval_seconds=5, stop=stop)
    with caplog.at_level(logging.INFO, logger="dbtrigger"):
        stats = runner.run(install_signals=False)
    assert stats.rows == 100  # the batch in flight, committed
    (line,) = [r.getMessage() for r in info_lines(caplog) if getattr(r, "event", None) == "tick"]
    assert "ticking again" not in line, line
    assert "; more pending, left for the next start: stopping" in line, line
