"""A table that is not there is one ConfigurationError, however it is reached: the
keyset source, the claim queue and the helper they share (``_engine.reflect_table``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import ClaimSource, SqlAlchemySource
from dbtrigger._engine import reflect_table
from dbtrigger.changelog.operations import plan_install
from dbtrigger.dbio import DbReader, DbWriter
from dbtrigger.errors import ConfigurationError
from dbtrigger.output import OutputTarget

#: The diagnosis, then what to do (create it, correct the name, grant access).
MISSING = re.escape(
    "does not exist (or is not visible to this user); create it, or correct the name given "
    "(table=, schema=, the URL's database), or grant this user SELECT on it"
)


def test_reflect_table_reads_a_table_and_names_a_missing_one(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE jobs (id integer PRIMARY KEY, v text)"))
            assert list(reflect_table(conn, "jobs", None).c.keys()) == ["id", "v"]
            with pytest.raises(ConfigurationError, match=rf"^table main\.nope {MISSING}"):
                reflect_table(conn, "nope", "main")
            with pytest.raises(ConfigurationError, match=rf"^table sqlite:nope {MISSING}"):
                reflect_table(conn, "nope", None, shown="sqlite:nope")
    finally:
        engine.dispose()


def test_both_sources_say_the_same_of_a_missing_table(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    keyset = SqlAlchemySource(url=url, table="nope", cursor_column="id", pk_columns=["id"])
    claims = ClaimSource(url=url, table="nope", pk_columns=["id"])
    try:
        with pytest.raises(ConfigurationError, match=rf"^table sqlite:nope {MISSING}$"):
            keyset.fetch(None, 10)
        with pytest.raises(ConfigurationError, match=rf"^table nope {MISSING}$"):
            claims.counts()
    finally:
        keyset.close()
        claims.close()


def test_a_relative_sqlite_path_says_which_file_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's ``sqlite:///shop.db`` run from another directory: SQLite made an empty
    ``shop.db`` there and the error said only that the table does not exist."""
    monkeypatch.chdir(tmp_path)
    source = SqlAlchemySource(
        url="sqlite:///shop.db", table="orders", cursor_column="id", pk_columns=["id"]
    )
    try:
        with pytest.raises(ConfigurationError) as info:
            source.fetch(None, 10)
    finally:
        source.close()
    message = str(info.value)
    assert message.startswith(f"table sqlite:orders {MISSING.replace(chr(92), '')}; ")
    assert f"shop.db is relative to the working directory, so this is {tmp_path / 'shop.db'}" in (
        message
    )
    assert "sqlite:////abs/path.db" in message


def test_the_output_tables_say_it_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DbWriter / DbReader / db.output (OutputTarget) reflect through the same helper (TableHandle
    had its own copy, which named neither the file nor the fix), keeping their noun."""
    monkeypatch.chdir(tmp_path)
    writer = DbWriter(url="sqlite:///shop.db", table="orders")
    reader = DbReader(url="sqlite:///shop.db", table="orders")
    out = OutputTarget(url="sqlite:///shop.db", table="orders")
    try:
        calls = [
            ("table", lambda: writer.insert(data={"id": 1})),
            ("table", lambda: reader.get(pk={"id": 1})),
            ("output table", lambda: out.write([{"id": 1}])),
        ]
        for noun, call in calls:
            with pytest.raises(ConfigurationError) as info:
                call()
            message = str(info.value)
            assert message.startswith(f"{noun} sqlite:orders {MISSING.replace(chr(92), '')}; ")
            assert f"so this is {tmp_path / 'shop.db'}" in message
    finally:
        writer.close()
        reader.close()
        out.close()


def test_the_change_log_says_it_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """changelog install reflects through the same helper; its own copy said only
    'table orders does not exist (or is not visible)'."""
    monkeypatch.chdir(tmp_path)
    engine = sa.create_engine("sqlite:///shop.db")
    try:
        with pytest.raises(ConfigurationError) as info:
            plan_install(engine, "orders")
    finally:
        engine.dispose()
    message = str(info.value)
    assert message.startswith(f"table orders {MISSING.replace(chr(92), '')}; "), message
    assert f"so this is {tmp_path / 'shop.db'}" in message
