"""The fenced blocks of README.md and docs/*.md, and the markers that say how each runs.

Every fence names its language. Python (``python``, ``py``) and shell (``bash``,
``sh``, ``console``) blocks are run by tests/test_docs_snippets.py; the others
(``text``, ``json``, ``sql``, ``yaml``, ...) are shown output, formats or DDL.

A block is steered by HTML comments, invisible on the rendered page, right
before its fence (blank lines may separate them):

``<!-- doc-test: skip REASON: why -->``
    the block is not run; REASON is one of :data:`SKIP_REASONS`, and the test
    pins how many blocks each reason covers, so the list cannot grow silently.
``<!-- doc-test: save NAME -->``
    the block is also written to ``NAME`` in the page's directory (a module the
    page's shell blocks import, ``app:trigger``), before it runs.
``<!-- doc-test: exit N[,M] -->``
    a shell block whose commands may also exit with these codes (a dry run that
    reports a problem with exit 1, as the page says).
``<!-- doc-test: output -->``
    a console block whose shown output is what its commands print: each line
    under a ``$`` command is a whole line of that command's output, in order
    (a ``...`` line stands for any lines).

and a comment of its own, anywhere on the page, holds hidden Python run at
that point in the page's namespace (what the reader is told exists: a table,
an app setting, the ``source`` of an earlier paragraph; or a check of what a
block printed)::

    <!-- doc-test: run
    import os
    os.environ["ORDERS_DB_URL"] = f"sqlite:///{os.getcwd()}/shop.db"
    -->
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

PYTHON = frozenset({"python", "py"})
SHELL = frozenset({"bash", "sh", "console"})
SHOWN = frozenset({"text", "json", "sql", "yaml", "ini", "toml"})

#: Why a runnable block may stay unrun. Anything else is a block to make run.
SKIP_REASONS = {
    "azure-cloud": "needs a real Azure subscription, tenant or Functions host",
    "install": "installs the package or the whole test toolchain",
    "covered": "run by a dedicated test named in the marker (a server of its own)",
}

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<body>.*?)\s*-->\s*$")
_RUN_OPEN = re.compile(r"^\s*<!--\s*doc-test:\s*run\s*$")


@dataclass
class Block:
    """One fenced block, or one hidden ``run`` comment (``lang`` "hidden")."""

    page: str
    line: int  # 1-based line of the opening fence (or comment)
    lang: str
    code: str
    skip: tuple[str, str] | None = None  # (reason, why)
    save: str | None = None
    exits: frozenset[int] = frozenset({0})
    output: bool = False

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in PYTHON or self.lang in SHELL or self.lang == "hidden"


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)

    @property
    def name(self) -> str:
        if self.path.is_relative_to(ROOT):
            return self.path.relative_to(ROOT).as_posix()
        return self.path.name


class MarkerError(ValueError):
    """A doc-test comment that does not parse: the page is wrong, not the test."""


def _apply(block: Block, marker: str) -> None:
    verb, _, rest = marker.partition(" ")
    if verb == "skip":
        reason, _, why = rest.partition(":")
        if reason.strip() not in SKIP_REASONS or not why.strip():
            raise MarkerError(f"{block.where}: skip needs one of {sorted(SKIP_REASONS)} and a why")
        block.skip = (reason.strip(), why.strip())
    elif verb == "save" and rest.strip():
        block.save = rest.strip()
    elif verb == "output" and not rest.strip():
        block.output = True
    elif verb == "exit" and rest.strip():
        block.exits = frozenset({0, *(int(code) for code in rest.split(","))})
    else:
        raise MarkerError(f"{block.where}: unknown doc-test marker {marker!r}")


def parse(path: Path) -> Page:
    page = Page(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    pending: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _RUN_OPEN.match(line):
            start, body = i, []
            i += 1
            while i < len(lines) and lines[i].strip() != "-->":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise MarkerError(f"{page.name}:{start + 1}: an unclosed doc-test run comment")
            page.blocks.append(Block(page.name, start + 1, "hidden", "\n".join(body) + "\n"))
            pending = []
        elif marker := _MARKER.match(line):
            pending.append(marker["body"])
        elif fence := _FENCE.match(line):
            indent, mark = len(fence["indent"]), fence["fence"]
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(mark):
                text = lines[i]
                body.append(text[indent:] if not text[:indent].strip() else text.lstrip())
                i += 1
            block = Block(page.name, start + 1, fence["lang"], "\n".join(body) + "\n")
            for text in pending:
                _apply(block, text)
            pending = []
            page.blocks.append(block)
        elif line.strip() and pending:
            raise MarkerError(f"{page.name}:{i + 1}: a doc-test marker not followed by a fence")
        i += 1
    return page


def shell_commands(block: Block) -> list[str]:
    """The commands of a shell block: ``$ `` lines of a console block, else every line.

    A trailing backslash joins the next line; comments and blank lines are dropped.
    """
    commands: list[str] = []
    joined = ""
    for raw in block.code.splitlines():
        line = raw.rstrip()
        if not joined:
            if block.lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
        joined += line.removesuffix("\\") + (" " if line.endswith("\\") else "")
        if not line.endswith("\\"):
            commands.append(joined.strip())
            joined = ""
    return commands


_PRINT = re.compile(r"^print\(.*\)\s+# (?P<shown>.+)$")
_SHOWN = re.compile(r"^# (?P<shown>.+)$")


def printed(block: Block) -> list[str]:
    """What the page says the block's top-level prints show, in order.

    ``print(x)  # 3: the rest explains`` shows ``3``; a comment line right after a
    print shows what it says too (``# {'a': 1}: why`` shows the dict).
    """
    shown: list[str] = []
    after_print = False
    for line in block.code.splitlines():
        match = _PRINT.match(line) or (_SHOWN.match(line) if after_print else None)
        after_print = line.startswith("print(")
        if match is not None:
            shown.append(_value_of(match["shown"]))
    return shown


def _value_of(comment: str) -> str:
    """The shown value of ``3: why`` or ``{'a': 1}: why``: the first prefix before a
    ``: `` that is a Python literal; else the whole comment (``429 from billing``)."""
    for match in re.finditer(": ", comment):
        head = comment[: match.start()]
        try:
            ast.literal_eval(head)
        except (ValueError, SyntaxError):
            continue
        return head
    return comment


def shown_output(block: Block) -> list[list[str]]:
    """Per ``$`` command of a console block, the output lines the page shows under it."""
    shown: list[list[str]] = []
    continued = False
    for line in block.code.splitlines():
        if line.startswith("$ ") or continued:
            if not continued:
                shown.append([])
            continued = line.rstrip().endswith("\\")
        elif shown and line.strip():
            shown[-1].append(line.strip())
    return shown
