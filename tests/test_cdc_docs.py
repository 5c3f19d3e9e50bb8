"""docs/cdc.md runs as written: its example, saved as orders_app.py, against a logical server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.cdc_servers import CdcDatabase

DOC = Path(__file__).resolve().parent.parent / "docs" / "cdc.md"


def example() -> str:
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    return block


def test_the_example_snapshots_then_streams(cdc_db: CdcDatabase, tmp_path: Path) -> None:
    cdc_db.execute(
        "CREATE TABLE orders (id int PRIMARY KEY, status text);"
        "INSERT INTO orders VALUES (1, 'new'), (2, 'new')"
    )
    (tmp_path / "orders_app.py").write_text(example())
    env = {**os.environ, "ORDERS_DB_URL": cdc_db.url}

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
    cdc_db.execute("UPDATE orders SET status = 'paid' WHERE id = 1")
    cdc_db.execute("DELETE FROM orders WHERE id = 2")
    second = run()
    assert [line.split(" ")[0] for line in second] == ["update", "delete"]
    assert "'status': 'paid'" in second[0]
