"""A file named on the command line (``reset --from-file``, ``partitions reset-layout
--from-file``, ``queue add --file``) is read one way (``_argparse.read_file_option``):
one that is missing is an error naming it, exit 2, never a traceback."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dbtrigger.cli import main
from dbtrigger.errors import ConfigurationError
from dbtrigger.queue.cli_jobs import _rows


def test_reset_from_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "backup.json"
    store = f"file:{tmp_path / 'state'}"
    assert main(["reset", "orders", "--store", store, "--from-file", str(missing)]) == 2
    assert f"cannot read {missing}: No such file or directory" in capsys.readouterr().err


def test_queue_add_from_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "jobs.jsonl"
    url = f"sqlite:///{tmp_path / 'q.db'}"
    assert main(["queue", "add", "--url", url, "--table", "jobs", "--file", str(missing)]) == 2
    assert f"cannot read {missing}: No such file or directory" in capsys.readouterr().err


def test_queue_add_reads_json_lines_of_any_line_ending(tmp_path: Path) -> None:
    given = tmp_path / "jobs.jsonl"
    given.write_bytes(b'{"id": 1}\r\n\r\n{"id": 2, "note": "caf\xc3\xa9 \xe2\x80\xa8 x"}\n')
    rows = list(_rows(argparse.Namespace(row=[json.dumps({"id": 0})], file=str(given))))
    assert rows == [{"id": 0}, {"id": 1}, {"id": 2, "note": "caf\u00e9 \u2028 x"}]
    given.write_bytes(b'{"id": 1}\n{"id": 2}\n[3]\n')
    with pytest.raises(ConfigurationError, match=r"jobs\.jsonl line 3 must be a JSON object"):
        list(_rows(argparse.Namespace(row=[], file=str(given))))
    given.write_bytes(b'{"id": "\xff"}\n')
    with pytest.raises(ConfigurationError, match=r"jobs\.jsonl is not UTF-8 text"):
        list(_rows(argparse.Namespace(row=[], file=str(given))))
