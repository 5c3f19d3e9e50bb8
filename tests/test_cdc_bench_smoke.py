"""benchmarks/cdc_pg.py still runs and prints its four tables (no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.cdc_servers import LogicalPostgres

ROOT = Path(__file__).resolve().parent.parent


def test_the_cdc_benchmark_runs_on_tiny_data(logical_pg: LogicalPostgres) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.cdc_pg",
            "--url",
            logical_pg.url(),
            "--seconds",
            "0.5",
            "--rows",
            "1000",
            "--big",
            "1000",
            "--txn",
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
    assert "one transaction of N rows delivered at the defaults" in out
    assert out.count("PgLogicalSource stream") == 6  # latency, 2 replays, 2 memory, 1 txn
