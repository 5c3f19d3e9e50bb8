"""``dbtrigger run`` parses with a parser that knows ``run`` only, so a worker
process never imports the other commands' modules (claim queues, change logs,
replay, backfill, the backlog endpoint): about a quarter of a cold worker's
import time, paid by every process a Deployment starts. Every other command
does the same with its own group (``COMMANDS``): ``dbtrigger changelog`` does
not even import the runtime."""

from __future__ import annotations

import argparse
import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from dbtrigger.cli.main import COMMANDS, _command_of, build_parser, main

#: The CLI's command modules (and the queue package's commands), and the runtime.
WATCHED = sorted(
    {module for module, _, _ in COMMANDS if module != "dbtrigger.cli.main"}
    | {"dbtrigger.queue.cli", "dbtrigger.runtime.kernel", "dbtrigger.runtime.poller"}
)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["run", "app:orders"], "run"),
        (["-v", "--log-level", "DEBUG", "--settings", "run", "run", "app:x"], "run"),
        (["--log-format=json", "run", "app:x"], "run"),
        (["status", "--trigger", "app:x"], "status"),
        (["--help", "run"], None),
        (["--version"], None),
        ([], None),
    ],
)
def test_the_command_is_found_before_parsing(argv: list[str], command: str | None) -> None:
    assert _command_of(argv) == command


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "app:orders"],
        ["-vv", "run", "a:b", "c:d", "--interval", "0.5", "--max-ticks", "3"],
        ["--log-level", "debug", "run", "app:x", "--wake", "adaptive", "--log-format", "json"],
        ["--no-settings", "run", "app:x", "--handler", "h:f", "-v"],
    ],
)
def test_the_workers_parser_parses_run_as_the_whole_one_does(argv: list[str]) -> None:
    assert vars(build_parser("run").parse_args(argv)) == vars(build_parser().parse_args(argv))


def test_a_worker_imports_no_other_commands_modules() -> None:
    code = (
        "import sys\n"
        "from dbtrigger.cli.main import main\n"
        "assert main(['run', 'no_such_module_here:trigger']) == 2\n"
        "print(sorted(m for m in sys.modules if m.startswith(("
        "'dbtrigger.queue', 'dbtrigger.changelog', 'dbtrigger.replay', 'dbtrigger.cdc', "
        "'dbtrigger.partitions.backlog', 'dbtrigger.partitions.endpoint', "
        "'dbtrigger.cli.backfill', 'dbtrigger.cli.state'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert "cannot import 'no_such_module_here'" in done.stderr


def _choices(parser: argparse.ArgumentParser) -> list[str]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_each_groups_parser_knows_the_commands_its_entry_names() -> None:
    """The table says which module registers which commands; a command a module
    adds and the table does not name would be parsed by the whole parser only."""
    whole: list[str] = []
    for _, _, names in COMMANDS:
        for name in names:
            assert _choices(build_parser(name)) == list(names)
        whole += names
    assert _choices(build_parser()) == whole
    assert _choices(build_parser("no-such-command")) == whole


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--store", "state", "--json"],
        ["-v", "reset", "p", "--store", "s", "--to-beginning", "--reason", "r", "--yes"],
        ["changelog", "install", "--url", "sqlite:///x.db", "--table", "orders"],
        ["queue", "status", "--source", "app:q", "--json"],
        ["--log-format", "json", "demo", "--duration", "1"],
    ],
)
def test_a_groups_parser_parses_its_commands_as_the_whole_one_does(argv: list[str]) -> None:
    command = _command_of(argv)
    assert vars(build_parser(command).parse_args(argv)) == vars(build_parser().parse_args(argv))


def _imported_by(argv: list[str], cwd: Path) -> tuple[str, set[str]]:
    """Run ``main(argv)`` in a fresh interpreter: its exit code and output, and
    which of the ``WATCHED`` modules it imported."""
    code = (
        "import sys\n"
        "from dbtrigger.cli.main import main\n"
        f"rc = main({argv!r})\n"
        "print('rc', rc, file=sys.stderr)\n"
        f"print(sorted(m for m in sys.modules if m in {WATCHED!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr
    *printed, modules = done.stdout.strip().splitlines()
    return "\n".join(printed) + done.stderr, set(eval(modules))  # noqa: S307 - our own print


def test_a_state_command_imports_no_other_commands_modules(tmp_path: Path) -> None:
    output, imported = _imported_by(["status", "--store", str(tmp_path)], tmp_path)
    assert "no pollers in file:" in output.lower()
    assert "rc 0" in output
    assert "dbtrigger.cli.state" in imported
    # The state commands use history's helpers and the queue package's lookup of a
    # claim source; no other command's module.
    others = imported - {"dbtrigger.cli.state", "dbtrigger.cli.history", "dbtrigger.queue.cli"}
    assert others == {"dbtrigger.runtime.kernel", "dbtrigger.runtime.poller"}


def test_a_change_log_command_imports_neither_the_others_nor_the_runtime(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'orders.db'}"
    argv = ["changelog", "install", "--url", url, "--table", "orders"]
    output, imported = _imported_by(argv, tmp_path)
    assert "rc 2" in output  # no table orders there: refused, as any other way of asking
    assert imported == {"dbtrigger.cli.changelog"}


def test_another_command_than_the_one_found_first_is_parsed_by_the_whole_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--sett`` abbreviates ``--settings``: ``history`` is its value, ``status`` the command."""
    assert _command_of(["--sett", "history", "status", "--help"]) == "history"
    with pytest.raises(SystemExit) as exited:
        main(["--sett", "history", "status", "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: dbtrigger status ")


@pytest.mark.parametrize("argv", [["bogus"], ["-", "status"], ["--log-level", "x", "status"]])
def test_errors_before_the_command_are_the_whole_parsers(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert capsys.readouterr().err == error
    if argv[0] != "--log-level":
        assert "'changelog', 'cdc'" in error  # every command listed
        assert "'check')" in error


def test_a_worker_alone_on_its_log_quiets_chatty_loggers_at_the_source() -> None:
    """With only the CLI's handler, azure-core's HTTP logger does not even build its
    records (CPU per store operation); with another handler, or at DEBUG, it does."""
    from dbtrigger.cli.logs import QUIET_LOGGERS, configure_logging  # noqa: PLC0415

    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    chatty = logging.getLogger(QUIET_LOGGERS[0])
    try:
        root.handlers = []
        configure_logging("INFO", stream=io.StringIO())
        assert not chatty.isEnabledFor(logging.INFO)
        configure_logging("DEBUG", stream=io.StringIO())
        assert chatty.isEnabledFor(logging.INFO)
        root.handlers = [logging.NullHandler()]  # a host's, a test's
        configure_logging("INFO", stream=io.StringIO())
        assert chatty.isEnabledFor(logging.INFO)
    finally:
        root.handlers, root.level = saved, level
        chatty.setLevel(logging.NOTSET)
