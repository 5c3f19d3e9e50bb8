"""The drain progress bar of ``dbtrigger run`` on a real terminal (a pseudo-terminal).

Attached to a terminal with rich installed, a worker draining a backlog draws
a progress bar (poller, rate, bar, percentage) instead of periodic log lines,
keeps logging above it, removes it when the poller catches up, and says so in
one line. Everything is read from the pty master, as a terminal would show it.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time
from pathlib import Path

import pytest

from tests.databases import TestDatabase
from tests.test_cli_worker import DBTRIGGER, write_module
from tests.test_source_sqlalchemy import insert, naive, orders_table

pytest.importorskip("rich")

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def run_on_a_terminal(args: list[str], cwd: Path, timeout: float = 120) -> tuple[int, str]:
    """Run the console script with stdin/stdout/stderr on a pty; (exit code, screen bytes)."""
    master, slave = pty.openpty()
    env = {
        **os.environ,
        "PYTHONPATH": str(cwd),
        "TERM": "xterm-256color",
        "COLUMNS": "120",
        "LINES": "40",
    }
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [DBTRIGGER, *args], stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", "replace")


def test_a_backlog_drains_under_a_progress_bar(sqlite_db: TestDatabase, tmp_path: Path) -> None:
    insert(
        sqlite_db, orders_table(sqlite_db), [{"id": i, "updated_at": naive(i)} for i in range(30)]
    )
    # A slow handler (6 batches of 5, 0.4 s each) so the bar is drawn several times.
    write_module(
        tmp_path,
        "tty_app",
        sqlite_db.url,
        pollers={"orders": "__import__('time').sleep(0.4)"},
    )
    args = ["run", "tty_app:orders", "--interval", "0", "--max-ticks", "7"]
    code, screen = run_on_a_terminal([*args, "--progress-interval", "0"], tmp_path)
    assert code == 0, screen
    text = ANSI.sub("", screen)
    # The bar: the poller and its rate, the bar itself, a percentage.
    assert re.search(r"orders [\d,]+ rows/s", text), screen
    assert "━" in text, screen
    assert re.search(r"\d+%", text), screen
    # No periodic progress log line on a terminal: the bar replaces them ...
    assert "catching up:" not in text, screen
    # ... and when the backlog is gone, one line says so.
    assert "orders: caught up: 30 rows" in text, screen
    # Logging goes on above the bar.
    assert "orders: committed 5 rows in 1 batch" in text, screen
    assert "orders: stopped after 7 ticks, 30 rows" in text, screen
