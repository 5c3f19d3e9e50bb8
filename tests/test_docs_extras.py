"""README's install-extras table names every extra pyproject.toml declares, and no other."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_readme_lists_every_extra_and_what_it_brings() -> None:
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Install extras", 1)[1].split("\n## ", 1)[0]
    listed: set[str] = set()
    for line in section.splitlines():
        match = re.match(r"\| (`[^|]+`) \| ([^|]+) \| ([^|]+) \|$", line)
        if match:
            names = set(re.findall(r"`([^`]+)`", match.group(1)))
            listed |= names
            assert match.group(2).strip(), line  # what it brings
            assert match.group(3).strip(), line  # what for
    assert listed == extras
