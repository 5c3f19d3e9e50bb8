"""docs/history.md runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "history.md"


def test_the_python_examples_run_and_print_what_the_page_says() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert blocks
    for block in blocks:
        done = subprocess.run(
            [sys.executable, "-c", block], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        for expected in re.findall(r"^# (\[.*\])$", block, flags=re.MULTILINE):
            assert expected in done.stdout
