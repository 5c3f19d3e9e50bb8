"""The poison_batch line's commands, pasted as printed (a new user's first poison row).

A trigger built outside an importable module (a script, a notebook, a test) has no
``MODULE:ATTR``, so the line named its store: ``dbtrigger skip-batch orders --store
file:st --reason 'poison batch' --yes``, which skip-batch refuses ("needs --source
MODULE:ATTR to check that the source still holds exactly the failed batch"). And a
batch at the very start was "batch starting at None".
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, HandlerError, PollTrigger, RowChange
from dbtrigger.testing import MemorySource

MODULE = """
from dbtrigger import FileCheckpointStore, PollTrigger
from dbtrigger.testing import MemorySource

trigger = PollTrigger(
    name="orders",
    source=MemorySource([{{"id": i, "seq": i}} for i in range(10)],
                        cursor_column="seq", pk_columns=["id"]),
    checkpoint_store=FileCheckpointStore({state!r}),
    max_attempts=1,
)
"""


def _poisoned(state: Path, caplog: pytest.LogCaptureFixture) -> str:
    trigger = PollTrigger(
        name="orders",
        source=MemorySource(
            [{"id": i, "seq": i} for i in range(10)], cursor_column="seq", pk_columns=["id"]
        ),
        checkpoint_store=FileCheckpointStore(state),
        max_attempts=1,
    )

    def handler(events: list[RowChange]) -> None:
        raise ValueError("row 3 is corrupt")

    with caplog.at_level(logging.ERROR, logger="dbtrigger"), pytest.raises(HandlerError):
        trigger.tick(handler)
    (line,) = [
        r.getMessage() for r in caplog.records if getattr(r, "event", None) == "poison_batch"
    ]
    return line


def test_the_line_of_a_trigger_without_an_import_path_gives_a_skip_that_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "st"
    line = _poisoned(state, caplog)
    assert line.startswith("batch starting at the beginning has failed 1 times;")
    skip = line.split("Skip (data loss, journaled): ", 1)[1]
    assert skip == (
        "dbtrigger skip-batch orders --source MODULE:ATTR --reason 'poison batch' --yes"
        " (MODULE:ATTR: where this trigger is defined)"
    )
    (tmp_path / "poisoned_app.py").write_text(textwrap.dedent(MODULE.format(state=str(state))))
    command = skip.split(" (MODULE:ATTR")[0].replace("MODULE:ATTR", "poisoned_app:trigger")
    done = subprocess.run(
        [sys.executable, "-m", "dbtrigger.cli", *shlex.split(command)[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skip" in done.stdout


def test_the_status_command_it_prints_runs_as_printed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    line = _poisoned(tmp_path / "st", caplog)
    status = line.split("Inspect: ", 1)[1].split("  Skip", 1)[0]
    assert status.startswith("dbtrigger status orders --store ")
    done = subprocess.run(
        [sys.executable, "-m", "dbtrigger.cli", *shlex.split(status)[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "failing" in done.stdout
