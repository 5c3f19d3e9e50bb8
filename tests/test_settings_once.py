"""``%SETTING%`` is the whole value, read once: a ``%`` inside a URL is the URL's own.

A percent-encoded password (``p%C3%A4ss``) used to be taken for a reference to
the app setting ``C3``: an error naming a setting nobody meant, or, when
``C3`` happened to exist, silently another password. The CLI also read a
store's setting, then read the value again. Real MariaDB logins (a wrong
password is refused there) through the installed console script.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import sqlalchemy as sa

from dbtrigger.errors import ConfigurationError, MissingSettingError
from dbtrigger.settings import references_setting, resolve_setting, setting_name
from dbtrigger.state.stores.factory import open_store
from dbtrigger.state.stores.file import FileCheckpointStore
from tests.databases import TestDatabase
from tests.test_source_sqlalchemy import insert, naive, orders_table

DBTRIGGER = str(Path(sys.executable).with_name("dbtrigger"))
PASSWORD = "pä%ss-C3"  # noqa: S105 - a test account; percent-encoded p%C3%A4%25ss-C3


@pytest.mark.parametrize(
    "value",
    [
        "postgresql+psycopg://app:p%C3%A4ss@db/shop",
        "mysql+pymysql://app:%AB%CD@db/shop",
        "prefix-%NAME%",
        "%NAME%-suffix",
        "%A%%B%",
        "100%",
    ],
)
def test_only_a_whole_value_is_a_reference(value: str) -> None:
    env = {"C3": "other", "AB": "x", "NAME": "y", "A": "a", "B": "b"}
    assert resolve_setting(value, env) == value
    assert resolve_setting(value, {}) == value  # nothing missing either
    assert not references_setting(value)
    assert setting_name(value) is None


def test_a_whole_reference_is_read_once() -> None:
    assert resolve_setting("%OUTER%", {"OUTER": "%INNER%", "INNER": "x"}) == "%INNER%"
    assert setting_name("%Orders:Url%") == "Orders:Url"
    with pytest.raises(MissingSettingError, match="'GONE'"):
        resolve_setting("%GONE%", {})


def test_a_store_setting_is_read_once(tmp_path: Path) -> None:
    # The setting's value is the location; it is not read as a setting again.
    (tmp_path / "%INNER%").mkdir()
    env = {"OUTER": str(tmp_path / "%INNER%"), "INNER": "memory:elsewhere"}
    store = open_store("%OUTER%", environ=env)
    assert isinstance(store, FileCheckpointStore)
    with pytest.raises(ConfigurationError, match="'EMPTY' is empty"):
        open_store("%EMPTY%", environ={"EMPTY": " "})


@pytest.fixture
def encoded_url(mariadb: TestDatabase) -> Iterator[str]:
    """The test database for a MariaDB account whose password needs percent-encoding."""
    user = f"dbt_pct_{uuid.uuid4().hex[:8]}"
    # PyMySQL sends the password as Latin-1 bytes: store the hash of those
    # (mysql_native_password: SHA1(SHA1(password))).
    digest = hashlib.sha1(hashlib.sha1(PASSWORD.encode("latin1")).digest()).hexdigest()  # noqa: S324
    mariadb.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY PASSWORD '*{digest.upper()}'")
    mariadb.execute(f"GRANT ALL ON `{mariadb.schema}`.* TO '{user}'@'%'")
    url = sa.make_url(mariadb.url)
    host = f"{url.host}:{url.port}" if url.port else url.host
    try:
        yield f"{url.drivername}://{user}:{quote(PASSWORD, safe='')}@{host}/{mariadb.schema}"
    finally:
        mariadb.execute(f"DROP USER IF EXISTS '{user}'@'%'")


@pytest.mark.mariadb
@pytest.mark.parametrize("c3", [None, "wrong"], ids=["C3-unset", "C3-set"])
def test_a_percent_encoded_password_reaches_the_database_through_the_cli(
    mariadb: TestDatabase, encoded_url: str, tmp_path: Path, c3: str | None
) -> None:
    assert "%C3%A4%25ss" in encoded_url
    table = orders_table(mariadb)
    insert(mariadb, table, [{"id": i, "updated_at": naive(i)} for i in range(3)])
    setting = f"STATE_URL_{uuid.uuid4().hex[:8]}"
    (tmp_path / "pct_app.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import PollTrigger, SqlAlchemySource, SqlCheckpointStore

            orders = PollTrigger(
                name="orders",
                source=SqlAlchemySource(url={encoded_url!r}, table="orders",
                                        cursor_column="updated_at", pk_columns=["id"]),
                checkpoint_store=SqlCheckpointStore(url="%{setting}%"),
            )

            @orders.handler
            def handle(events):
                pass
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), setting: encoded_url}
    env.pop("C3", None)
    if c3 is not None:
        env["C3"] = c3

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [DBTRIGGER, "--no-settings", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=120,
            check=False,
        )

    ran = cli("run", "pct_app:orders", "--interval", "0", "--max-ticks", "1")
    assert ran.returncode == 0, ran.stderr
    assert "committed 3 rows" in ran.stderr
    assert "'C3'" not in ran.stderr
    shown = cli("status", "orders", "--store", f"%{setting}%")
    assert shown.returncode == 0, shown.stderr
    assert "id=2" in shown.stdout or "'id': 2" in shown.stdout, shown.stdout
    for text in (ran.stderr, ran.stdout, shown.stdout, shown.stderr):
        assert PASSWORD not in text
        assert quote(PASSWORD, safe="") not in text
