"""Credentials inside a database URL's options never reach a fingerprint, a shown URL,
the state document, a log line or the CLI's output.

The password of a SQL Server URL is often not in the URL's password part but in an
ODBC connection string passed as one option (``mssql+pyodbc:///?odbc_connect=...``,
URL-encoded, ``PWD=...`` among the fields, braced when it holds ``;``). Other
drivers take ``?password=``. Each is planted and looked for in every form it can
take: as written, URL-encoded, braced.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.cli import main
from dbtrigger.redaction import redact, safe_url_text
from tests.databases import TestDatabase

ODBC_PASSWORD = "Odbc-s3cr;et}pw"  # noqa: S105 - a marker: a ';' and a '}' need braces
ROTATED = "rotated-Pw-2"


def odbc_url(password: str = ODBC_PASSWORD, server: str = "tcp:db.example,1433") -> str:
    braced = "{" + password.replace("}", "}}") + "}"
    connection = (
        "DRIVER={ODBC Driver 18 for SQL Server};"
        f"SERVER={server};DATABASE=shop;UID=app;PWD={braced};Encrypt=yes"
    )
    return "mssql+pyodbc:///?odbc_connect=" + quote_plus(connection)


def forms(secret: str) -> list[str]:
    """The secret as it may appear: as written, URL-encoded both ways, and its
    longest piece between the characters that need escaping."""
    pieces = [p for p in secret.replace(";", " ").replace("}", " ").split() if len(p) >= 4]
    return [secret, quote(secret, safe=""), quote_plus(secret), *pieces]


def assert_clean(text: str, secret: str = ODBC_PASSWORD) -> None:
    for form in forms(secret):
        assert form not in text, (form, text)


def odbc_source(password: str = ODBC_PASSWORD, **kwargs: object) -> SqlAlchemySource:
    return SqlAlchemySource(
        url=odbc_url(password),
        table="orders",
        cursor_column="seq",
        pk_columns=["id"],
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_password_inside_odbc_connect_is_neither_fingerprinted_nor_shown() -> None:
    source = odbc_source()
    rotated = odbc_source(password=ROTATED)
    # Not hashed: a rotated password is the same source (it stopped the poller with
    # a FingerprintMismatchError, and its hash sat in every state document).
    assert source.fingerprint() == rotated.fingerprint()
    assert source.source_definition() == rotated.source_definition()
    # A different server is still a different source.
    other = SqlAlchemySource(
        url=odbc_url(server="tcp:other.example,1433"),
        table="orders",
        cursor_column="seq",
        pk_columns=["id"],
    )
    assert other.fingerprint() != source.fingerprint()
    shown = [
        source.safe_url,
        json.dumps(source.describe()),
        json.dumps(source.source_definition()),
        source.name,
    ]
    for text in shown:
        assert_clean(text)
    assert "SERVER%3Dtcp%3Adb.example" in source.safe_url  # the rest still says where


@pytest.mark.parametrize(
    ("value", "masked"),
    [
        ("DRIVER={x};SERVER=h;PWD=abc123;UID=u", "DRIVER={x};SERVER=h;PWD=***;UID=u"),
        ("Server=h;Password={a;b}}c};Database=d", "Server=h;Password=***;Database=d"),
        ("server=h; pwd = abc123 ", "server=h;pwd=***"),
        ("-c search_path=sales", "-c search_path=sales"),  # no credential: as it was
        ("plain", "plain"),
    ],
)
def test_credential_fields_of_an_option_are_masked(value: str, masked: str) -> None:
    from dbtrigger.redaction import without_secret_fields  # noqa: PLC0415 - (new)

    assert without_secret_fields(value)[0] == masked


def test_every_secret_of_a_url_is_found_and_masked_wherever_it_is_echoed() -> None:
    from dbtrigger.redaction import url_secrets  # noqa: PLC0415 - (new)

    url = sa.make_url(
        "postgresql+psycopg://app:url-pw-123@db.example/shop?password=query-pw-456&sslmode=require"
    )
    assert set(url_secrets(url)) == {"url-pw-123", "query-pw-456"}
    assert url_secrets(sa.make_url(odbc_url()))[0] == ODBC_PASSWORD
    odbc_source()  # parsing the URL registers its secrets
    # A driver's error (or an engine's repr) quoting the connection string, in any form.
    for text in (
        f"[08001] login failed; connection string DRIVER={{x}};PWD={{{ODBC_PASSWORD}}}",
        f"Engine(mssql+pyodbc:///?odbc_connect=...PWD%3D{quote_plus(ODBC_PASSWORD)})",
    ):
        assert_clean(redact(text))
    assert "sslmode=require" in safe_url_text(url)
    assert_clean(safe_url_text(url), "query-pw-456")


#: SqlAlchemySource(url=odbc_url(), table="orders", cursor_column="seq",
#: pk_columns=["id"]).accepted_fingerprints() as dbtrigger computed them before the
#: password was taken out (both hashed it): version 2, then version 1.
PREVIOUS_FINGERPRINTS = (
    "sha256:c4a41a1096545453b38d083b9c34e3760029780731381dcd9d80c389549c640d",
    "sha256:8ddd2af64795a3171843d4510a30fc8fe969d5bcde5383f917400eb1697f31c5",
)


def test_a_document_fingerprinted_with_the_odbc_password_is_still_this_sources() -> None:
    """Documents written before this change carry a fingerprint that hashed the
    password: they are still this source's (the next commit writes the new one)."""
    source = odbc_source()
    accepted = source.accepted_fingerprints()
    assert accepted[0] == source.fingerprint()
    for previous in PREVIOUS_FINGERPRINTS:
        assert previous != source.fingerprint()
        assert previous in accepted
        # Under a rotated password it was another fingerprint, never offered now.
        assert previous not in odbc_source(password=ROTATED).accepted_fingerprints()


def test_the_cli_and_the_logs_never_show_a_password_given_as_a_url_option(
    pg: TestDatabase,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A real run on PostgreSQL with ``?password=`` (trust auth ignores it): the
    banner, the state document, status, check and the logs hold no trace of it."""
    secret = "Qp-s3cret-778"  # noqa: S105 - a marker
    pg.execute(f"CREATE TABLE {pg.schema}.orders (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    pg.execute(f"INSERT INTO {pg.schema}.orders VALUES (1, 1), (2, 2)")
    url = sa.make_url(pg.url).update_query_dict({"password": secret})
    source = SqlAlchemySource(
        url=url.render_as_string(hide_password=False),
        table="orders",
        schema=pg.schema,
        cursor_column="seq",
        pk_columns=["id"],
    )
    store = FileCheckpointStore(tmp_path / "state")
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=store)
    caplog.set_level(logging.DEBUG)
    try:
        assert trigger.drain(lambda events: None) == 2
    finally:
        source.close()
    stored = store.read("orders")
    assert stored is not None
    assert_clean(stored.data.decode(), secret)
    for record in caplog.records:
        assert_clean(record.getMessage(), secret)
    assert main(["status", "orders", "--store", str(tmp_path / "state"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert_clean(out + err, secret)


def test_the_worker_banner_does_not_show_the_odbc_password(tmp_path: Path) -> None:
    """``dbtrigger run`` printed the source URL with ``PWD%3D%7BOdbc-s3cr%3Bet...``:
    the shown URL kept every option whose *name* was harmless, ``odbc_connect`` too.
    (Nothing listens on the URL's server: the run ends after the banner.)"""
    (tmp_path / "state").mkdir()
    (tmp_path / "app.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource

            source = SqlAlchemySource(
                url={odbc_url(server="tcp:127.0.0.1,1")!r},
                table="orders", cursor_column="seq", pk_columns=["id"],
            )
            trigger = PollTrigger(
                name="orders", source=source, checkpoint_store=FileCheckpointStore("state")
            )

            @trigger.handler
            def handle(events):
                pass
            """
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from dbtrigger.cli import main; sys.exit(main())",
            "-v",
            "run",
            "app:trigger",
            "--max-ticks",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert "source      mssql:orders at mssql+pyodbc:///?odbc_connect=" in output
    assert "SERVER%3Dtcp%3A127.0.0.1" in output  # where it connects is still said
    assert_clean(output)


def test_a_password_the_url_shows_anyway_does_not_garble_every_line() -> None:
    """postgres:postgres@ registered "postgres" as a secret: every log line then read
    "***ql+psycopg://***@127.0.0.1/shop"."""
    from dbtrigger.redaction import remember_url_secrets  # noqa: PLC0415 - (new)

    remember_url_secrets(sa.make_url("postgresql+psycopg://postgres:postgres@127.0.0.1/shop"))
    line = "connecting to postgresql+psycopg://postgres@127.0.0.1/shop as postgres"
    assert redact(line) == line
    remember_url_secrets(sa.make_url("postgresql+psycopg://app:Real-s3cret@127.0.0.1/shop"))
    assert redact("login app/Real-s3cret refused") == "login app/*** refused"


def test_a_store_built_in_code_registers_its_account_key_and_sas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the CLI's open_store registered a connection string's secrets; a store
    built in function_app.py (from_connection_string, %AzureWebJobsStorage%) did not,
    so an error quoting the key alone went out as it was."""
    from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415
    from dbtrigger.state.stores.table import TableCheckpointStore  # noqa: PLC0415

    blob_key = "QmxvYktleS1mb3ItYS10ZXN0LW9ubHk="
    table_sig = "VGFibGVTaWctZm9yLWEtdGVzdA%3D"
    monkeypatch.setenv(
        "DBT_TEST_STORAGE",
        f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={blob_key};"
        "EndpointSuffix=core.windows.net",
    )
    blob = BlobCheckpointStore.from_connection_string(
        "%DBT_TEST_STORAGE%", container="dbstate", app_name="app"
    )
    assert "acct.blob.core.windows.net" in blob.describe()  # (the client built: at first use)
    store = TableCheckpointStore(
        connection_string=(
            "TableEndpoint=https://acct.table.core.windows.net/;"
            f"SharedAccessSignature=sv=2022-11-02&sig={table_sig}"
        ),
        app_name="app",
    )
    store.describe()  # builds the client
    assert redact(f"signing with {blob_key} failed") == "signing with *** failed"
    assert table_sig not in redact(f"request refused ({table_sig})")
