"""``dbtrigger backfill`` on the sources that serve one poller, run as a user would.

The backfill's trigger takes the user's source object and binds it to the
backfill's name. A log-based source (PgLogicalSource, BinlogSource) refuses a
second poller: the dry run planned the backfill all the same ("an unknown
number of rows"), and ``--yes`` wrote the backfill's state document and then
stopped on "this PgLogicalSource already serves poller 'orders'", leaving the
document behind (the same command then said "already exists"). Now both are
refused before anything is written, naming ``cdc snapshot``. A change log
registers the backfill as one of its readers, which keeps every row it has not
read from prunes once the backfill is done: said when it catches up, with the
command that forgets it.
"""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore
from dbtrigger.cli import main
from tests.cdc_servers import BinlogDatabase, CdcDatabase


def write_app(root: Path, source: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module defining ``trigger`` (poller ``orders``) over ``source``; its spec."""
    module = f"bfapp_{uuid.uuid4().hex[:8]}"
    (root / f"{module}.py").write_text(
        textwrap.dedent(
            f"""
            from dbtrigger import ChangeLogSource, FileCheckpointStore, PollTrigger
            from dbtrigger.cdc import BinlogSource, PgLogicalSource

            trigger = PollTrigger(
                name="orders", source={source}, checkpoint_store=FileCheckpointStore("state")
            )

            @trigger.handler
            def handle(events):
                pass
            """
        )
    )
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    return f"{module}:trigger"


def backfill(capsys: pytest.CaptureFixture[str], spec: str, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    argv = ["backfill", "orders-bf", "--trigger", spec, "--from-beginning", "--reason", "r"]
    code = main([*argv, *extra])
    out, err = capsys.readouterr()
    return code, out, err


def refused_before_anything_is_written(
    root: Path, spec: str, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for extra in ((), ("--yes",)):
        code, out, err = backfill(capsys, spec, *extra)
        assert code == 2, out + err
        assert f"reads a database log ({kind}), which serves one poller" in err
        assert f"dbtrigger cdc snapshot {spec} --table TABLE" in err
        assert "dry run" not in out
    assert FileCheckpointStore(root / "state").read("orders-bf") is None


@pytest.mark.cdc
@pytest.mark.timeout(180)
def test_a_pg_logical_source_is_refused_naming_cdc_snapshot(
    cdc_db: CdcDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cdc_db.execute("CREATE TABLE orders (id INT PRIMARY KEY, v INT)")
    spec = write_app(tmp_path, f'PgLogicalSource({cdc_db.url!r}, ["public.orders"])', monkeypatch)
    refused_before_anything_is_written(tmp_path, spec, "PgLogicalSource", capsys)


@pytest.mark.binlog
@pytest.mark.timeout(180)
def test_a_binlog_source_is_refused_naming_cdc_snapshot(
    binlog_db: BinlogDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    binlog_db.execute("CREATE TABLE orders (id INT PRIMARY KEY, v INT)")
    source = f'BinlogSource({binlog_db.url!r}, ["orders"], snapshot="never")'
    spec = write_app(tmp_path, source, monkeypatch)
    refused_before_anything_is_written(tmp_path, spec, "BinlogSource", capsys)


def test_a_change_log_backfill_says_it_stays_a_registered_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, v INT)")
    engine.dispose()
    assert main(["changelog", "install", "--url", url, "--table", "orders", "--yes"]) == 0
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO orders VALUES (1, 1), (2, 2), (3, 3)")
    engine.dispose()
    spec = write_app(tmp_path, f'ChangeLogSource(url={url!r}, table="orders")', monkeypatch)

    code, out, err = backfill(capsys, spec, "--yes")
    assert code == 0, out + err
    assert "3 rows delivered" in out
    forget = "dbtrigger changelog readers --url URL --table orders --forget orders-bf --yes"
    assert forget in out
    capsys.readouterr()
    assert main(["changelog", "readers", "--url", url, "--table", "orders"]) == 0
    assert "orders-bf: at sequence 3" in capsys.readouterr().out
    argv = ["changelog", "readers", "--url", url, "--table", "orders", "--forget", "orders-bf"]
    assert main([*argv, "--yes"]) == 0  # the command the note gives runs as written
