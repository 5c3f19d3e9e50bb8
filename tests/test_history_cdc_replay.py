"""Replay on a log-based source once its log let the batch go: MariaDB purged the
binary log files that held it. The replay cannot be exact and the source can no
longer say what was there, so ``--verify`` reports it and a delivery is
refused, both naming what made the log let go (the server purged the files;
keep them longer to replay). The byte-for-byte case while the log holds the
batch is in tests/test_history_replay.py.
"""

from __future__ import annotations

import importlib
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from dbtrigger.cli import main
from dbtrigger.history import history_for
from tests.test_cdc_binlog import purge_all_but_newest
from tests.test_history_replay import _cdc_module


def _first_batch_replayable(
    binlog_db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tag: str, rows: int
) -> tuple[str, str, str]:
    """A poller module on a new ``orders`` table (history on, source closed) that
    delivered ``rows`` inserts: its module name, its ``--trigger`` spec and the id of
    its first committed batch."""
    binlog_db.execute("CREATE TABLE orders (id INT PRIMARY KEY, status VARCHAR(20))")
    name = f"binlog_{tag}_{uuid.uuid4().hex[:8]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    spec = _cdc_module(
        tmp_path, name, f"BinlogSource({binlog_db.url!r}, ['orders'], snapshot='never')", "og"
    )
    module = importlib.import_module(name)
    module.trigger.drain(module.handle)
    values = ", ".join(f"({i}, 'new')" for i in range(1, rows + 1))
    binlog_db.execute(f"INSERT INTO orders VALUES {values}")
    module.trigger.drain(module.handle)
    module.trigger.source.close()
    history = history_for(module.trigger.store)
    assert history is not None
    first = next(r for r in history.read("og") if r["type"] == "commit")["batch_id"]
    return name, spec, first


@pytest.mark.binlog
def test_replay_after_the_binary_log_was_purged_is_refused_with_the_reason(
    binlog_db: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name, spec, first = _first_batch_replayable(binlog_db, tmp_path, monkeypatch, "gone", 4)
    argv = ["replay", "og", "--batch", first, "--trigger", spec]
    capsys.readouterr()
    assert main([*argv, "--verify"]) == 0  # held: exact
    assert "mode exact" in capsys.readouterr().out

    purge_all_but_newest(binlog_db)
    # The operator's replay is a process of its own: a fresh import, a new source
    # (this process's source may still hold the events it read).
    monkeypatch.delitem(sys.modules, name)
    code = main([*argv, "--verify"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "purged the binary log files" in out + err
    code = main([*argv, "--yes", "--reason", "rebuild"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "purged the binary log files" in err
    assert sys.modules[name].seen == []  # nothing was delivered


@pytest.mark.binlog
def test_replay_of_a_batch_from_before_cdc_recreate_names_the_recreate_not_a_purge(
    binlog_db: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The log still holds the batch, but its positions are of the reader generation
    # before `cdc recreate`, which reads pass over: the refusal said the server had
    # purged the binary log files, sending the operator after a retention setting.
    name, spec, first = _first_batch_replayable(binlog_db, tmp_path, monkeypatch, "gen", 2)
    assert main(["cdc", "recreate", spec, "--no-snapshot", "--yes"]) == 0
    monkeypatch.delitem(sys.modules, name)
    capsys.readouterr()
    code = main(["replay", "og", "--batch", first, "--trigger", spec, "--verify"])
    out, err = capsys.readouterr()
    assert code != 0, out + err
    assert "created again (dbtrigger cdc recreate) after this batch" in out + err
    assert "purged" not in out + err
