"""``dbtrigger run`` parses with a parser that knows ``run`` only, so a worker
process never imports the other commands' modules (claim queues, change logs,
replay, backfill, the backlog endpoint): about a quarter of a cold worker's
import time, paid by every process a Deployment starts."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

from dbtrigger.cli.main import _command_of, build_parser


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
