"""``dbtrigger check`` on a trigger whose watched table is not there, as a user meets it.

The usual first-run mistake (a table not created yet, a misspelt ``table=``, the
wrong schema or database) must read as what it is, with what to do: create the
table or correct the name. Before, the polled table and the queue table said
only "does not exist (or is not visible to this user)", and a change log on a
missing table said to install the change log, which fails on the same table.
Every source kind ``check`` handles, on every dialect (the log-based sources:
tests/test_cdc_check_missing_table.py).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.databases import TestDatabase
from tests.doc_cli import dbtrigger_command

#: The trigger each source kind builds over ``nosuch`` (``{url}``, ``{schema}``).
TRIGGERS = {
    "polling": """
        trigger = PollTrigger(
            name="orders",
            source=SqlAlchemySource(url={url!r}, table="nosuch", schema={schema!r},
                                    cursor_column="updated_at", pk_columns=["id"]),
            checkpoint_store=FileCheckpointStore("state"),
        )
        """,
    "changelog": """
        trigger = PollTrigger(
            name="orders",
            source=ChangeLogSource(url={url!r}, table="nosuch", schema={schema!r}),
            checkpoint_store=FileCheckpointStore("state"),
        )
        """,
    "queue": """
        trigger = QueueTrigger(
            name="jobs",
            source=ClaimSource(url={url!r}, table="nosuch", schema={schema!r}, pk_columns=["id"]),
        )
        """,
}


def run_check(tmp_path: Path, db: TestDatabase, kind: str) -> tuple[int, dict[str, Any]]:
    module = f"missing_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "from dbtrigger import ChangeLogSource, FileCheckpointStore, PollTrigger, "
        "SqlAlchemySource\nfrom dbtrigger.queue import ClaimSource, QueueTrigger\n"
        + textwrap.dedent(TRIGGERS[kind].format(url=db.url, schema=db.schema))
    )
    proc = subprocess.run(
        [dbtrigger_command(), "check", f"{module}:trigger", "--json", "--no-store-probe"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("kind", list(TRIGGERS))
def test_a_missing_table_is_named_with_what_to_do(
    db: TestDatabase, tmp_path: Path, kind: str
) -> None:
    code, report = run_check(tmp_path, db, kind)
    assert code == 1, report
    [finding] = [f for f in report["findings"] if f["severity"] == "error"]
    text = finding["message"] + " " + (finding["fix"] or "")
    assert "privilege" not in finding["check"], finding
    assert "nosuch does not exist" in text, finding
    assert "create it" in text, finding
    assert "table=" in text, finding  # or correct the name given
    if kind == "changelog":  # installing cannot help before the table is there
        assert text.index("create it") < text.index("changelog install"), finding
