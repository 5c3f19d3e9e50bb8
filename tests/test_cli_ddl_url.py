"""``--url`` of the DDL commands (``dbtrigger wake``, ``dbtrigger changelog``) is read
as every adapter reads a URL (``_engine.parse_database_url`` and ``create_engine``):
a malformed one, an unknown dialect or a missing driver is a ConfigurationError that
says what to fix and never repeats the password."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from dbtrigger.cli.ddl import url_engine
from dbtrigger.errors import ConfigurationError

SECRET = "s3cretPW-ddl"  # noqa: S105 - a test value that must never be shown


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (f"postgresql+psycopg://app:{SECRET}@db:notaport/shop", "the port is not a number"),
        (f"app:{SECRET}@db/shop", "not a valid database URL (unparsable)"),
        (f"nonsense://app:{SECRET}@db/shop", "SQLAlchemy has no dialect 'nonsense'"),
    ],
)
def test_a_bad_url_is_a_configuration_error_without_the_password(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        url_engine(argparse.Namespace(url=url))
    assert says in str(info.value)
    assert SECRET not in str(info.value)


def test_a_good_url_gives_an_engine() -> None:
    engine = url_engine(argparse.Namespace(url="sqlite://"))
    try:
        assert engine.dialect.name == "sqlite"
    finally:
        engine.dispose()


@pytest.mark.parametrize("command", [["wake", "status"], ["changelog", "check"]])
def test_the_cli_says_so_and_exits_2(command: list[str]) -> None:
    url = f"postgresql+psycopg://app:{SECRET}@db:notaport/shop"
    done = subprocess.run(
        [sys.executable, "-m", "dbtrigger.cli", *command, "--url", url, "--table", "t"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "--url: not a valid database URL (the port is not a number)" in done.stderr
    assert "Traceback" not in done.stderr
    assert SECRET not in done.stderr + done.stdout
