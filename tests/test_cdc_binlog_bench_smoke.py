"""benchmarks/cdc_binlog.py still runs and prints its three tables (no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.cdc_servers import BinlogMariadb

ROOT = Path(__file__).resolve().parent.parent


def test_the_binlog_benchmark_runs_on_tiny_data(binlog_mariadb: BinlogMariadb) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.cdc_binlog",
            "--url",
            binlog_mariadb.url(),
            "--seconds",
            "0.5",
            "--rows",
            "1000",
            "--big",
            "1000",
            "--intervals",
            "0.05",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "commit -> handler latency" in out
    assert "backlog replay" in out
    assert "client memory while one transaction" in out
    assert out.count("BinlogSource ") == 5  # latency, 2 replays, 2 memory


def test_the_lookahead_mode_runs_on_tiny_data(binlog_mariadb: BinlogMariadb) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.cdc_binlog",
            "--url",
            binlog_mariadb.url(),
            "--lookahead",
            "--rows",
            "200",
            "--flushes",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "backlog drain without names in the log" in done.stdout
    assert "names in the log" in done.stdout
    assert "catalog + look-ahead" in done.stdout
