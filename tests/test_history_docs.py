"""docs/history.md runs as written: its blocks in order, in an empty directory.

Python blocks run as a reader would paste them (a block after
``<!-- doc-test: save NAME -->`` is also saved as ``NAME``: the ``app.py`` the
shell commands name), and print what the page says they print. Every ``$``
command of a ``console`` block runs in a shell and prints what the page shows,
up to what differs from one run to the next (times, batch ids, owner ids,
durations, column widths): the batch ids a command shows stand for the ones
this run made, and later commands use those. A ``<!-- doc-test: exit N -->``
marker allows that exit status too (a verify that found drift exits 1). Every
option of every synopsis (``text`` blocks) is one the command takes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dbtrigger.cli.main import build_parser
from tests.doc_cli import dbtrigger_command

DOC = Path(__file__).resolve().parent.parent / "docs" / "history.md"
BASH = shutil.which("bash") or "/bin/bash"

_BLOCK = re.compile(
    r"(?P<markers>(?:^<!-- doc-test: [^>]*-->\n\s*)*)^```(?P<lang>\w*)\n(?P<body>.*?)^```",
    re.MULTILINE | re.DOTALL,
)
_MARKER = re.compile(r"<!-- doc-test: (\w+) ([^>]*?) -->")
_BATCH = re.compile(r"batch_\d{8}_\d{6}_\d+_\d{4}")
_VARIES = [
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z"), "<time>"),
    (re.compile(r"\S+/\d+/[0-9a-f]{8}\b"), "<owner>"),
    (re.compile(r"\d+(\.\d+)? ms\b"), "<ms>"),
    # a file store is named by its absolute path (a command pasted elsewhere finds it)
    (re.compile(r"file:/(?:home/me/shop|tmp/pytest-of-\S+?/test_[^/]+)/"), "file:<dir>/"),
]


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    markers: dict[str, str]


def blocks() -> list[Block]:
    text = DOC.read_text(encoding="utf-8")
    return [
        Block(m["lang"], m["body"], dict(_MARKER.findall(m["markers"])))
        for m in _BLOCK.finditer(text)
    ]


def normal(text: str) -> list[str]:
    out = []
    for raw in text.strip("\n").splitlines():
        line = _BATCH.sub("<batch>", raw)
        for pattern, placeholder in _VARIES:
            line = pattern.sub(placeholder, line)
        out.append(re.sub(r" +", " ", line).rstrip())
    return out


def transcript(body: str) -> list[tuple[str, str]]:
    """A console block's ``$`` commands, each with the output shown after it."""
    out: list[tuple[str, str]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], ""))
        else:
            command, shown = out[-1]
            out[-1] = (command, shown + line + "\n")
    return out


def test_the_page_runs_in_order_and_prints_what_it_shows(tmp_path: Path) -> None:
    # `dbtrigger` is the console script's main() forked from one server that imported
    # the CLI once (tests/doc_cli.py: short commands, no signal): a fifth of the CPU.
    cli = os.path.dirname(dbtrigger_command())
    env = {
        **os.environ,
        "PATH": os.pathsep.join(
            [cli, str(Path(sys.executable).parent), os.environ.get("PATH", "")]
        ),
        "COLUMNS": "200",
    }
    env.pop("DBTRIGGER_STORE", None)
    batches: dict[str, str] = {}  # a batch id the page shows -> the one this run made
    ran = {"python": 0, "console": 0}
    for block in blocks():
        if block.lang == "python":
            if "save" in block.markers:
                (tmp_path / block.markers["save"]).write_text(block.body, encoding="utf-8")
            done = subprocess.run(
                [sys.executable, "-c", block.body],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert done.returncode == 0, f"{block.body}\n{done.stderr}"
            for expected in re.findall(r"^# (\[.*\])$", block.body, flags=re.MULTILINE):
                assert expected in done.stdout, block.body
            ran["python"] += 1
        elif block.lang == "console":
            allowed = {0, *(int(c) for c in block.markers.get("exit", "").split(",") if c)}
            for written, shown in transcript(block.body):
                command = written
                for page_id, ours in batches.items():
                    command = command.replace(page_id, ours)
                done = subprocess.run(
                    [BASH, "-c", command],
                    cwd=tmp_path,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                )
                assert done.returncode in allowed, f"$ {command}\n{done.stdout}{done.stderr}"
                assert normal(done.stdout) == normal(shown), f"$ {command}\n{done.stdout}"
                page_ids, our_ids = _BATCH.findall(shown), _BATCH.findall(done.stdout)
                batches.update(zip(page_ids, our_ids, strict=True))
                ran["console"] += 1
    assert ran["python"] >= 5
    assert ran["console"] >= 4


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    for word in words:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[word]
    return parser


def synopses() -> list[str]:
    out = []
    for block in blocks():
        if block.lang != "text":
            continue
        for line in block.body.splitlines():
            if line.startswith("dbtrigger "):
                out.append(line)
            elif line.startswith(" ") and out:
                out[-1] += " " + line.strip()
    return out


@pytest.mark.parametrize("synopsis", synopses())
def test_every_option_of_a_synopsis_is_taken(synopsis: str) -> None:
    words = []
    for token in synopsis.split()[1:]:
        if not re.fullmatch(r"[a-z][a-z-]*", token):
            break
        words.append(token)
    command = _subparser(build_parser(), words)
    taken = {s for a in command._actions for s in a.option_strings}
    shown = set(re.findall(r"--[a-z][a-z-]*", synopsis))
    assert shown <= taken, f"{synopsis}: {sorted(shown - taken)} not taken"
