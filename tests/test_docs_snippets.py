"""The docs run as written: every Python and shell block of README.md and docs/*.md.

Each page runs in a process of its own (tests/doc_runner.py) in a directory of
its own, its blocks in order as a reader would paste them, with what the page
says exists made real by hidden ``doc-test: run`` comments (tests/doc_snippets.py).
A page that names ``DOCTEST_PG_URL`` gets a fresh PostgreSQL database, one that
names ``DOCTEST_CDC_URL`` a database on the logical-replication server, one that
names ``DOCTEST_AZURITE`` Azurite's connection string. A Python block prints
what the page says it prints; a console block marked ``doc-test: output`` shows
what its commands print. A block that cannot run here is marked skipped with a
reason in the page itself, and the count per reason is pinned below: a new skip
is a decision made in review, not drift.

Beside the runs, what cannot drift silently either: every fence names its
language, tables are not split by a blank line, every ``dbtrigger COMMAND`` the
docs, messages and docstrings name exists and every option of a synopsis is
taken, the state document shown is the one a poller writes, every log event
the code emits is named in a page, and no page puts a file store on a shared disk.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import BatchContext, InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cli.main import build_parser
from dbtrigger.runtime.telemetry import EVENTS
from dbtrigger.state import document as docmod
from dbtrigger.testing import MemorySource
from tests.azurite import Azurite
from tests.databases import TestDatabase, admin_engine
from tests.doc_cli import dbtrigger_command
from tests.doc_snippets import (
    PAGES,
    PYTHON,
    ROOT,
    SHELL,
    SHOWN,
    SKIP_REASONS,
    Block,
    MarkerError,
    parse,
    printed,
    shell_commands,
    shown_output,
)

RUNNER = Path(__file__).resolve().parent / "doc_runner.py"

#: Blocks left unrun, per reason (tests/doc_snippets.py SKIP_REASONS). Change a
#: number only together with the marker it counts.
SKIPPED = {"azure-cloud": 1, "install": 1, "covered": 5}

PARSED = [parse(path) for path in PAGES]


def _page_ids() -> list[str]:
    return [page.name for page in PARSED if any(b.runnable and not b.skip for b in page.blocks)]


def test_every_fence_names_its_language() -> None:
    known = PYTHON | SHELL | SHOWN
    unnamed = [
        b.where
        for page in PARSED
        for b in page.blocks
        if b.lang != "hidden" and b.lang not in known
    ]
    assert unnamed == [], (
        f"fences with no or an unknown language (one of {sorted(known)}): {unnamed}"
    )


def test_skipped_blocks_are_counted_by_reason() -> None:
    skipped = [b for page in PARSED for b in page.blocks if b.skip]
    for block in skipped:
        assert block.runnable, f"{block.where}: only Python and shell blocks are run or skipped"
    counts = Counter(b.skip[0] for b in skipped if b.skip)
    listing = "\n".join(f"  {b.where}: {b.skip[0]}: {b.skip[1]}" for b in skipped if b.skip)
    assert dict(counts) == {k: v for k, v in SKIPPED.items() if v}, f"skipped blocks:\n{listing}"
    assert set(SKIPPED) == set(SKIP_REASONS)


def test_a_covered_block_names_the_test_that_runs_it() -> None:
    """The named test module reads the page, or runs the script the block runs."""
    for page in PARSED:
        for block in page.blocks:
            if block.skip and block.skip[0] == "covered":
                (test_file,) = re.findall(r"tests/\w+\.py", block.skip[1])
                text = (ROOT / test_file).read_text(encoding="utf-8")
                scripts = re.findall(r"scripts/[\w.-]+", block.code)
                assert Path(page.name).name in text or any(s in text for s in scripts), (
                    f"{block.where}: {test_file} neither reads the page nor runs its script"
                )


def test_tables_are_not_split_by_a_blank_line() -> None:
    """A table row after a blank line that is not a new table's header renders as text."""
    broken = []
    for page in PARSED:
        lines = page.path.read_text(encoding="utf-8").splitlines()
        for i in range(1, len(lines) - 1):
            starts_table = lines[i].startswith("|") and not lines[i - 1].strip()
            if starts_table and not re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip()):
                broken.append(f"{page.name}:{i + 1}")
    assert broken == []


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    names: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                names.add(name)
                names |= {f"{name} {inner}" for inner in _commands(sub)}
    return names


_NAMED = re.compile(r"(?:`|\$ |\()dbtrigger (?!import\b)([a-z][a-z-]+)(?: ([a-z][a-z-]+))?")
_LINE = re.compile(r"^dbtrigger ([a-z][a-z-]+)(?: ([a-z][a-z-]+))?")


def test_every_command_the_docs_and_messages_name_exists() -> None:
    """`dbtrigger state clone` was documented and never existed: the names are checked.

    In prose, code spans, messages and docstrings (`` `dbtrigger x` ``, ``(dbtrigger x``,
    ``$ dbtrigger x``) and at the start of a line of a shell or text block.
    """
    commands = _commands(build_parser())
    named: list[tuple[str, re.Match[str]]] = []
    for path in [*PAGES, *(ROOT / "src").rglob("*.py"), *(ROOT / "examples").glob("*.py")]:
        where = path.relative_to(ROOT).as_posix()
        named += [(where, m) for m in _NAMED.finditer(path.read_text(encoding="utf-8"))]
    for page in PARSED:
        for block in page.blocks:
            if block.lang in SHELL or block.lang == "text":
                for line in block.code.splitlines():
                    if m := _LINE.match(line.strip().removeprefix("$ ")):
                        named.append((block.where, m))
    unknown = set()
    for where, match in named:
        first, second = match[1], match[2]
        groups = {c.split(" ")[1] for c in commands if c.startswith(f"{first} ")}
        if first not in commands or (second and groups and second not in groups):
            unknown.add(f"{where}: {match[0]}")
    assert sorted(unknown) == []


@pytest.fixture
def page_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DBTRIGGER_", "DOCTEST_"))}
    # The pages' `dbtrigger` commands forked from this process's CLI server (started
    # once, tests/doc_cli.py), not from one server a page: its imports cost 2.5 s of CPU.
    env["DOCTEST_CLI_DIR"] = os.path.dirname(dbtrigger_command())
    text = (ROOT / request.node.callspec.params["page"]).read_text(encoding="utf-8")
    if "DOCTEST_CDC_URL" in text:
        env["DOCTEST_CDC_URL"] = request.getfixturevalue("cdc_db").url
    if "DOCTEST_AZURITE" in text:
        azurite: Azurite = request.getfixturevalue("azurite")
        env["DOCTEST_AZURITE"] = azurite.connection_string
    if "DOCTEST_PG_URL" not in text:
        yield env
        return
    admin = admin_engine("postgresql")
    name = f"doc_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    env["DOCTEST_PG_URL"] = admin.url.set(database=name).render_as_string(hide_password=False)
    try:
        yield env
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _job(block: Block) -> dict[str, object]:
    kind = "shell" if block.lang in SHELL else "python"
    return {
        "where": block.where,
        "kind": kind,
        "code": block.code,
        "commands": shell_commands(block) if kind == "shell" else [],
        "exits": sorted(block.exits),
        "save": block.save,
        "expect": printed(block) if kind == "python" else [],
        "shown": shown_output(block) if block.output else None,
    }


@pytest.mark.parametrize("page", _page_ids())
def test_the_page_runs_as_written(page: str, page_env: dict[str, str], tmp_path: Path) -> None:
    (parsed,) = [p for p in PARSED if p.name == page]
    jobs = [_job(b) for b in parsed.blocks if b.runnable and not b.skip]
    work = tmp_path / "work"
    work.mkdir()
    # The pages' own temporary folders (tempfile.mkdtemp() in a snippet) go with the test's.
    (tmp_path / "tmp").mkdir()
    page_env = {**page_env, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "blocks.json").write_text(json.dumps(jobs), encoding="utf-8")
    results_path = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(tmp_path / "blocks.json"), str(results_path)],
        cwd=work,
        env=page_env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    results = json.loads(results_path.read_text(encoding="utf-8")) if results_path.exists() else []
    failed = [r for r in results if not r["ok"]]
    report = "\n\n".join(f"--- {r['where']}\n{r['output'][-3000:]}" for r in failed)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(results) == len(jobs), f"stopped after {len(results)} of {len(jobs)} blocks"
    if failed:
        pytest.fail(f"{len(failed)} of {len(jobs)} blocks failed:\n\n{report}", pytrace=False)


def test_the_markers_and_the_shown_output_parse(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- doc-test: run\nx = 1\n-->\n"
        "<!-- doc-test: save app.py -->\n```python\nprint(x)  # 1: one\nprint({'a': 1})\n"
        "# {'a': 1}: a dict\n```\n\n"
        "<!-- doc-test: exit 1 -->\n<!-- doc-test: output -->\n"
        "```console\n$ dbtrigger x \\\n  --y\nout\n...\n$ # no\n```\n"
        "<!-- doc-test: skip azure-cloud: a tenant -->\n```bash\naz login\n```\n",
        encoding="utf-8",
    )
    hidden, code, shell, skipped = parse(page).blocks
    assert (hidden.lang, hidden.code) == ("hidden", "x = 1\n")
    assert (code.save, printed(code)) == ("app.py", ["1", "{'a': 1}"])
    assert (shell.exits, shell_commands(shell)) == (frozenset({0, 1}), ["dbtrigger x    --y"])
    assert (shell.output, shown_output(shell)) == (True, [["out", "..."], []])
    assert skipped.skip == ("azure-cloud", "a tenant")
    for bad in (
        "<!-- doc-test: skip because: x -->\n```bash\nls\n```\n",
        "<!-- doc-test: skip install -->\n```bash\nls\n```\n",
        "<!-- doc-test: frobnicate -->\n```bash\nls\n```\n",
        "<!-- doc-test: save a.py -->\ntext\n```bash\nls\n```\n",
    ):
        page.write_text(bad, encoding="utf-8")
        with pytest.raises(MarkerError):
            parse(page)


def test_no_page_puts_a_file_store_on_a_shared_disk() -> None:
    """stores.md: never the file store on a shared drive (its locks are local); scale-out.md
    once offered it for members on several machines."""
    said = []
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        for sentence in re.split(r"(?<=[.;])\s", text):
            if re.search(r"file store", sentence, re.I) and re.search(
                r"(shared|network) (disk|drive|file ?system)", sentence, re.I
            ):
                said.append((page.name, sentence))
    assert said, "the pages say where the file store must not go"
    assert [s for s in said if not re.search(r"\b(never|not)\b", s[1], re.I)] == []


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse offers no public walk
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _synopses() -> list[tuple[str, str]]:
    """Each ``dbtrigger ...`` line of a text block, its indented continuation lines joined."""
    found: list[tuple[str, str]] = []
    for page in PARSED:
        for block in page.blocks:
            if block.lang != "text":
                continue
            current: list[str] | None = None
            for line in block.code.splitlines():
                if line.startswith("dbtrigger "):
                    current = [line.strip()]
                    found.append((block.where, ""))
                elif current is not None and line[:1].isspace() and line.strip():
                    current.append(line.strip())
                else:
                    current = None
                if current is not None:
                    found[-1] = (block.where, " ".join(current))
    return found


def test_every_option_of_a_synopsis_is_one_the_command_takes() -> None:
    commands = _subparsers(build_parser())
    wrong = []
    synopses = _synopses()
    assert len(synopses) > 20, "the synopses were not found"
    for where, text in synopses:
        words = text.split()
        command = commands[words[1]]
        inner = _subparsers(command)
        parsers = [command]
        if inner and len(words) > 2:
            parsers = [inner[name] for name in words[2].split("|")]
        taken = {s for p in parsers for a in p._actions for s in a.option_strings}
        for option in re.findall(r"(?<![\w-])--[a-z][a-z-]*", text):
            if option not in taken:
                wrong.append(f"{where}: {' '.join(words[:3])}: {option}")
    assert wrong == []


def _paths(value: object, prefix: str = "") -> set[str]:
    """Every key path of a JSON value (``lease.owner_id``, ``window.pending[].at.kind``)."""
    if isinstance(value, dict):
        return {
            p
            for key, inner in value.items()
            for p in {prefix + key} | _paths(inner, f"{prefix}{key}.")
        }
    if isinstance(value, list):
        return {p for inner in value for p in _paths(inner, f"{prefix}[].")}
    return set()


def test_the_documented_state_document_is_the_one_a_poller_writes() -> None:
    """state-document.md's JSON (journal entries aside) has exactly the fields a poller
    with a retried event writes, and reads back and writes out to the same fields."""
    text = (ROOT / "docs" / "state-document.md").read_text(encoding="utf-8")
    document, window = re.findall(r"```json\n(.*?)```", text, flags=re.DOTALL)[:2]
    shown = json.loads(re.sub(r'"journal": \[.*\]', '"journal": []', document))
    shown.update(json.loads("{" + window + "}"))
    assert json.loads(docmod.dumps(docmod.loads(json.dumps(shown).encode()))) == shown

    store = InMemoryCheckpointStore()
    rows = [{"id": i, "seq": i} for i in range(1, 6)]
    trigger = PollTrigger(
        name="orders",
        source=MemorySource(rows, cursor_column="seq", pk_columns=["id"]),
        checkpoint_store=store,
        retry_delay_seconds=60,
    )

    def handle(events: list[RowChange], ctx: BatchContext) -> None:
        for event in events:
            if event.pk["id"] == 2:
                ctx.retry(event, "429 from billing")

    trigger.tick(handle)  # (a drain would wait for the retry)
    stored = store.read("orders")
    assert stored is not None
    written = json.loads(stored.data)
    written["journal"] = []
    assert _paths(written) == _paths(shown)


def test_every_log_event_is_documented() -> None:
    """An operator reads an ``event`` field and looks it up: every one the code logs is
    named in the docs (operations.md's "Log events" and the pages of their parts)."""
    logged = {spec.log_as or name for name, spec in EVENTS.items() if spec.level is not None}
    for path in (ROOT / "src" / "dbtrigger").rglob("*.py"):
        logged |= set(re.findall(r'"event":\s*"([a-z_]+)"', path.read_text(encoding="utf-8")))
    docs = " ".join(page.read_text(encoding="utf-8") for page in PAGES)
    named = set(re.findall(r"[a-z][a-z_]*", docs))  # the names have underscores: specific
    assert len(logged) > 80, "the events were not found"
    assert sorted(logged - named) == []


def test_the_example_schema_moves_the_cursor_on_every_update(pg: TestDatabase) -> None:
    """examples/function_app.py's tables, run as written: an UPDATE that does not set
    updated_at still moves it (its comment once claimed the DEFAULT did that)."""
    module = ast.parse((ROOT / "examples" / "function_app.py").read_text(encoding="utf-8"))
    doc = ast.get_docstring(module) or ""
    schema = textwrap.dedent(doc.split("::\n", 1)[1])
    with pg.engine.begin() as conn:
        conn.exec_driver_sql(f'SET search_path TO "{pg.schema}"')
        conn.exec_driver_sql(schema)
        conn.exec_driver_sql("INSERT INTO orders (id, status, amount) VALUES (1, 'new', 5)")
    before = pg.scalar(f'SELECT updated_at FROM "{pg.schema}".orders')
    pg.execute(f"UPDATE \"{pg.schema}\".orders SET status = 'paid' WHERE id = 1")
    after = pg.scalar(f'SELECT updated_at FROM "{pg.schema}".orders')
    assert after > before  # type: ignore[operator]
