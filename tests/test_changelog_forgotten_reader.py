"""A change-log reader forgotten (``changelog readers --forget``) while its poller runs.

The poller registers again at its next checkpoint; until then a prune by age
takes rows it has not read, and nothing marks them lost. Before, it registered
again without a word, so the loss was invisible. Now the reader says at WARNING
(``changelog_reader_forgotten``) that it had been forgotten while it ran, and
``--forget`` prints when the reader was last seen, before it is removed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger
from dbtrigger.changelog import ChangeLogSource
from dbtrigger.cli import main
from dbtrigger.errors import ChangeLogDriftError


def test_a_running_reader_forgotten_says_so_when_it_registers_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, v INT)")
    assert main(["changelog", "install", "--url", url, "--table", "orders", "--yes"]) == 0
    source = ChangeLogSource(url=url, table="orders")
    trigger = PollTrigger(
        name="p", source=source, checkpoint_store=FileCheckpointStore(tmp_path / "state")
    )
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO orders VALUES (1, 1)")
        assert trigger.drain(lambda events: None) == 1
        capsys.readouterr()
        forget = ["changelog", "readers", "--url", url, "--table", "orders", "--forget", "p"]
        assert main(forget) == 0
        dry = capsys.readouterr().out
        assert "p was last seen 20" in dry
        assert "forget it only once its poller is stopped for good" in dry
        assert main([*forget, "--yes"]) == 0
        assert "forgot reader p" in capsys.readouterr().out
        with engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO orders VALUES (2, 2)")
        with caplog.at_level(logging.WARNING, logger="dbtrigger"):
            assert trigger.drain(lambda events: None) == 1
        said = [
            r for r in caplog.records if getattr(r, "event", "") == "changelog_reader_forgotten"
        ]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        assert "registered again at sequence 2" in said[0].getMessage()
        assert main(["changelog", "readers", "--url", url, "--table", "orders"]) == 0
        assert "p: at sequence 2" in capsys.readouterr().out
    finally:
        source.close()
        engine.dispose()


def test_uninstall_names_the_pollers_it_leaves_without_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, ``changelog uninstall`` printed only its DROP statements while pollers
    still read the log: the changes written until a re-install reached none of them."""
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, v INT)")
    assert main(["changelog", "install", "--url", url, "--table", "orders", "--yes"]) == 0
    source = ChangeLogSource(url=url, table="orders")
    trigger = PollTrigger(
        name="p", source=source, checkpoint_store=FileCheckpointStore(tmp_path / "state")
    )
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO orders VALUES (1, 1)")
        assert trigger.drain(lambda events: None) == 1
        capsys.readouterr()
        uninstall = ["changelog", "uninstall", "--url", url, "--table", "orders"]
        assert main(uninstall) == 0
        dry = capsys.readouterr().out
        assert "1 poller(s) read this change log: p (at sequence 1, seen 20" in dry
        assert "stops with ChangeLogDriftError" in dry
        assert main([*uninstall, "--yes"]) == 0
        source._next_drift_check = 0.0  # the next drift check is due (60 s later, at worst)
        with pytest.raises(ChangeLogDriftError):
            trigger.tick(lambda events: None)
    finally:
        source.close()
        engine.dispose()
