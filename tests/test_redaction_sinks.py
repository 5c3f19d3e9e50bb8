"""No secret reaches a sink of text: logs (ours and the HTTP stack's under
``-vv``), the state document, quarantine records, CLI output.

Secrets are planted where they really come from: a handler's exception text
quoting a token and a database URL, a SAS connection string given to the CLI.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import logging
import os
import pkgutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from azure.storage.blob import BlobServiceClient

import dbtrigger
from dbtrigger import (
    BatchContext,
    FileCheckpointStore,
    HandlerError,
    PollTrigger,
    RowChange,
    Runner,
    SqlAlchemySource,
    redaction,
)
from dbtrigger.cli import main
from dbtrigger.dbio import DbWriter
from dbtrigger.quarantine import JsonLinesQuarantineSink, QuarantineRecord
from dbtrigger.redaction import LOGGER_NAMES, RedactingFilter, redact
from dbtrigger.state import document as docmod
from dbtrigger.state.stores.factory import redact as factory_redact
from tests.azurite import Azurite
from tests.databases import TestDatabase
from tests.test_store_files_safety import _doc_bytes, _portal_sas_string

# Made-up credentials, planted to be looked for.
API_KEY = "sk-live-51HcQpLkq0x"
TOKEN = "ya29.a0AfH6SMBx-token"  # noqa: S105
DB_PASSWORD = "p@ss-w0rd!"  # noqa: S105
HANDLER_ERROR = (
    f"upstream refused: api_key={API_KEY} headers={{'access_token': '{TOKEN}'}} "
    f"while writing to postgresql://app:{DB_PASSWORD}@db.internal:5432/shop"
)
SECRETS = (API_KEY, TOKEN, DB_PASSWORD, "w0rd")


def _assert_clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("call failed api_key=abc123xyz", "abc123xyz"),
        ("X-Api-Key: abc123xyz", "abc123xyz"),
        ('{"access_token": "abc.def.ghi"}', "abc.def.ghi"),
        ("refresh_token=abc123xyz&x=1", "abc123xyz"),
        ("client_secret=abc123xyz;", "abc123xyz"),
        ("DB_PASSWORD=abc123xyz", "abc123xyz"),
        ("BlobEndpoint=https://a/;SharedAccessSignature=sv=2022&ss=b&sig=abc%2Bxyz", "abc%2Bxyz"),
        ("SharedAccessSignature=sv=2022&se=2030-01-01&sp=rw", "se=2030-01-01&sp=rw"),
        ("GET /c/b?sv=2022&sig=abc%2Bxyz HTTP/1.1", "abc%2Bxyz"),
        ("sig=abc%2Bxyz", "abc%2Bxyz"),
        ("redis://:abc123xyz@cache:6379/0", "abc123xyz"),
        ("postgresql://u:abc@123xyz@h/db", "123xyz"),
        ("Authorization: Bearer abc123xyz", "abc123xyz"),
        ("password: abc123xyz", "abc123xyz"),
        ("token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.sigpart", "eyJzdWIiOiIxMjM0In0"),
        # ODBC connection strings: a braced value may hold ';' and '}}'...
        ("login failed: Server=h;PWD={se;cret}}x9};UID=u", "cret}}x9"),
        ("Password={abc def}", "def"),
        # ...and inside a URL they are URL-encoded (?odbc_connect=...).
        ("mssql+pyodbc:///?odbc_connect=SERVER%3Dh%3BPWD%3Dabc123xyz%3BUID%3Du", "abc123xyz"),
        ("odbc_connect=DRIVER%3D%7Bx%7D%3BPWD%3D%7Bse%3Bcret%7D%7Dx9%7D", "cret"),
        ("conn=a%3Db%3Bkey%3Dabc123xyz", "abc123xyz"),
        # Only a call is code: a value that merely holds a dot or a bracket is masked.
        ("key=abc.123xyz", "123xyz"),
        ("token=abc123xyz)", "abc123xyz"),
        ("password=(abc123xyz", "abc123xyz"),
    ],
)
def test_redact_catches_common_credential_spellings(text: str, secret: str) -> None:
    assert secret not in redact(text)
    assert factory_redact is redact  # the old import path still works


@pytest.mark.parametrize(
    ("known", "text", "secret"),
    [
        ("secret", "client_secret=abc123xyz;", "abc123xyz"),
        ("password", "password=hunter22 retrying", "hunter22"),
        ("Pass", "Server=h;Password=abc123xyz;UID=u", "abc123xyz"),
    ],
)
def test_a_known_secret_inside_a_field_name_does_not_unmask_the_field(
    monkeypatch: pytest.MonkeyPatch, known: str, text: str, secret: str
) -> None:
    """A password that is also part of a credential field's name (a dev database's
    password "secret"), masked first, left "client_***=abc123xyz": the field no longer
    looked like one, and its value was logged. A suite run showed it when an earlier
    test in the worker had registered the password "secret"."""
    monkeypatch.setattr(redaction, "_SECRETS", {known})
    assert secret not in redact(text)
    assert known not in redact(text)


@pytest.mark.parametrize(
    "text",
    [
        "lease held by funcapp/instance-1 (token 42) until 2026-01-01T00:00:00Z",
        "fencing_token=42 batch_id=b_1 rows=10",
        "checkpoint 2026-01-01T00:00:00.000000Z id=5",
        "odbc_connect=SERVER%3Dh%3BDATABASE%3Dshop%3BUID%3Dapp",
        # A traceback quotes the handler's source: the README's own handler line.
        "    upsert_somewhere(event.pk, event.after, key=event.dedup_key())",
        "    token = tokens.issue(ctx.poller)",
    ],
)
def test_redact_leaves_ordinary_operational_text_alone(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setattr(redaction, "_SECRETS", set())  # not what earlier tests registered
    assert redact(text) == text


def test_every_dbtrigger_logger_carries_the_redacting_filter() -> None:
    for module in pkgutil.walk_packages(dbtrigger.__path__, "dbtrigger."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    names = [
        name
        for name, logger in logging.root.manager.loggerDict.items()
        if name.split(".")[0] == "dbtrigger" and isinstance(logger, logging.Logger)
    ]
    assert names
    for name in names:
        assert name in LOGGER_NAMES, f"{name}: add it to dbtrigger.redaction.LOGGER_NAMES"
        assert any(isinstance(f, RedactingFilter) for f in logging.getLogger(name).filters)


def _failing_poller(db: TestDatabase, tmp_path: Path) -> tuple[PollTrigger, FileCheckpointStore]:
    metadata = sa.MetaData(schema=db.schema)
    table = sa.Table(
        "events",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, nullable=False),
    )
    metadata.create_all(db.engine)
    with db.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "seq": i} for i in range(1, 4)])
    store = FileCheckpointStore(tmp_path / "state")
    source = SqlAlchemySource(
        url=db.url, table="events", schema=db.schema, cursor_column="seq", pk_columns=["id"]
    )
    return PollTrigger(name="orders", source=source, checkpoint_store=store), store


def test_handler_exception_text_is_redacted_in_state_logs_and_status(
    sqlite_db: TestDatabase,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trigger, store = _failing_poller(sqlite_db, tmp_path)

    def handler(events: list[RowChange]) -> None:
        raise RuntimeError(HANDLER_ERROR)

    caplog.set_level(logging.DEBUG)
    with pytest.raises(HandlerError):
        trigger.tick(handler)

    stored = store.read("orders")
    assert stored is not None
    _assert_clean(stored.data.decode())
    failure = docmod.loads(stored.data).failure
    assert failure is not None
    assert "upstream refused" in failure.last_error  # the useful part stays

    ours = [r for r in caplog.records if r.name.startswith("dbtrigger")]
    assert any("upstream refused" in r.getMessage() for r in ours)
    for record in ours:
        _assert_clean(record.getMessage())
        _assert_clean(json.dumps(vars(record), default=str))

    assert main(["status", "orders", "--store", str(tmp_path / "state")]) == 0
    out, err = capsys.readouterr()
    assert "upstream refused" in out
    _assert_clean(out + err)


def test_quarantine_records_hold_no_secret(tmp_path: Path) -> None:
    event = RowChange(
        event_id="e1",
        op="upsert",
        source="events",
        cursor=1,
        pk={"id": 1},
        before=None,
        after={"id": 1},
    )
    record = QuarantineRecord.from_event(
        event,
        poller="orders",
        error=RuntimeError(HANDLER_ERROR),
        attempts=3,
        checkpoint=dbtrigger.cursor.Position(),
        batch_id="b",
        fencing_token=1,
        owner_id="o",
        now=dt.datetime.now(dt.timezone.utc),
    )
    sink = JsonLinesQuarantineSink(tmp_path / "q.jsonl")
    sink.put([record])
    text = (tmp_path / "q.jsonl").read_text()
    assert "upstream refused" in text
    _assert_clean(text)


@pytest.mark.azurite
def test_cli_debug_logs_never_show_a_sas_signature(azurite: Azurite, tmp_path: Path) -> None:
    connection, sas = _portal_sas_string(azurite)
    signature = dict(p.split("=", 1) for p in sas.split("&"))["sig"]
    container = f"t{uuid.uuid4().hex[:20]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(container)
    try:
        store = dbtrigger.state.stores.factory.open_store(
            connection, container=container, app="shop"
        )
        store.write("orders", _doc_bytes(), if_match=None)
        env = {
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
            "DBTRIGGER_STORE": connection,  # not on the command line
        }
        done = subprocess.run(
            [
                *(sys.executable, "-m", "dbtrigger.cli", "-vv", "status", "orders"),
                *("--container", container, "--app", "shop"),
            ],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
    finally:
        service.delete_container(container)
        service.close()
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "urllib3.connectionpool" in output  # the transport's debug log did run
    assert "/state/shop/orders.json" in output
    assert signature not in output
    assert "sig=" not in output.replace("sig=***", "").replace("sig=REDACTED", "")


def test_a_rejected_or_retried_events_reason_is_redacted_in_the_history(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    """ctx.reject / ctx.retry with an exception quoting a URL or a token: the dead-letter
    sink and the state document masked it, the history record kept it verbatim."""
    trigger, _ = _failing_poller(sqlite_db, tmp_path)
    trigger = PollTrigger(
        name="orders",
        source=trigger.source,
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        quarantine=JsonLinesQuarantineSink(tmp_path / "dead.jsonl"),
        history=True,
    )

    def handler(events: list[RowChange], ctx: BatchContext) -> None:
        ctx.reject(events[0], RuntimeError(HANDLER_ERROR))
        ctx.retry(events[1], f"refused: access_token={TOKEN}")

    trigger.tick(handler)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")]
    assert any(".history." in p.name for p in written)
    texts = {p.name: p.read_text() for p in written}
    assert any("upstream refused" in t for name, t in texts.items() if ".history." in name)
    for text in texts.values():
        _assert_clean(text)


def test_a_failing_sinks_error_is_masked_before_it_is_cut() -> None:
    """A known secret that straddles the message's 300-character cut is masked whole,
    not cut first and left half visible."""
    from dbtrigger.errors import QuarantineError  # noqa: PLC0415
    from dbtrigger.quarantine import put_records  # noqa: PLC0415
    from dbtrigger.redaction import remember_secret  # noqa: PLC0415

    secret = "Zq9kNwn-sEcrEt-straddling-the-cut-77"  # noqa: S105 - the value to be masked
    remember_secret(secret)

    class Failing:
        def put(self, records: object) -> None:
            raise RuntimeError("x" * 270 + " " + secret + " tail")  # the cut falls inside it

        def describe(self) -> str:
            return "failing sink"

    with pytest.raises(QuarantineError) as info:
        put_records(Failing(), [object()])  # type: ignore[list-item]
    message = str(info.value)
    assert "Zq9kNwn" not in message
    assert "failed to store 1 record(s): RuntimeError: xxx" in message


def test_a_failed_writes_row_values_stay_out_of_the_logged_traceback(
    db: TestDatabase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler's output write that fails (a duplicate key) is logged with its
    traceback, chained SQLAlchemy error included: the row being written (here a
    value no pattern can recognise as a credential) must not ride along in it."""
    trigger, _ = _failing_poller(db, tmp_path)
    db.execute(f"CREATE TABLE {db.qualified('notes')} (id INTEGER PRIMARY KEY, body VARCHAR(64))")
    db.execute(f"INSERT INTO {db.qualified('notes')} (id, body) VALUES (1, 'first')")
    personal = "card-" + uuid.uuid4().hex  # made here: no source line of the test shows it
    writer = DbWriter(url=db.url, table="notes", schema=db.schema)

    def handler(events: list[RowChange]) -> None:
        writer.insert(data={"id": 1, "body": personal})

    caplog.set_level(logging.DEBUG)
    try:
        stats = Runner(trigger, handler, interval_seconds=0, max_backoff_seconds=0).run(
            max_ticks=1, install_signals=False
        )
    finally:
        writer.close()
    assert stats.failures == 1
    traced = [r for r in caplog.records if r.exc_info or r.exc_text]
    assert traced, "the failed tick's traceback is logged once"
    for record in caplog.records:
        text = logging.Formatter().format(record)
        assert personal not in text
    assert any("IntegrityError" in logging.Formatter().format(r) for r in traced)
