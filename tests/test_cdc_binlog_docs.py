"""The MariaDB/MySQL example of docs/cdc.md runs as written against a binlog server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.cdc_servers import BinlogDatabase

DOC = Path(__file__).resolve().parent.parent / "docs" / "cdc.md"


def example() -> str:
    (block,) = re.findall(r"```py\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    return block


def test_the_binlog_example_snapshots_then_follows_the_log(
    binlog_db: BinlogDatabase, tmp_path: Path
) -> None:
    binlog_db.execute("CREATE TABLE orders (id INT PRIMARY KEY, status VARCHAR(20))")
    binlog_db.execute("INSERT INTO orders VALUES (1, 'new'), (2, 'new')")
    (tmp_path / "orders_app.py").write_text(example())
    env = {**os.environ, "ORDERS_DB_URL": binlog_db.url}

    def run() -> list[str]:
        done = subprocess.run(
            [sys.executable, "orders_app.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    first = run()  # the rows already there, read by the initial snapshot
    assert [line.split(" ", 2)[:2] for line in first] == [["upsert", "{'id':"]] * 2
    binlog_db.execute("UPDATE orders SET status = 'paid' WHERE id = 1")
    binlog_db.execute("DELETE FROM orders WHERE id = 2")
    second = run()
    assert [line.split(" ")[0] for line in second] == ["update", "delete"]
    assert "'status': 'paid'" in second[0]
