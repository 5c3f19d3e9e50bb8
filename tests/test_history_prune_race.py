"""A history read that races retention reads every record it promised or says the
records went: never a silent hole.

``read`` is a generator that reads a segment (file, blob) or a page (SQL) at a
time; a prune between two of them removes records the read has not reached.
It used to skip them (the next segment, or the next page ``seq > last``), so a
replay of a batch range read commits on either side of the hole as if they were
adjacent. And ``FileHistory.tail`` listed again each time a segment it had
listed could not be opened, with no bound.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.core.exceptions import ServiceRequestError
from azure.data.tables import TableClient
from azure.storage.blob import BlobServiceClient

from dbtrigger.errors import DbTriggerError, StoreUnavailableError
from dbtrigger.history import FileHistory, HistoryStore, Retention, SqlHistory
from dbtrigger.history.blob import BlobHistory
from dbtrigger.history.table import TableHistory
from dbtrigger.state.document import format_time
from tests.azurite import Azurite
from tests.databases import make_database

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
KINDS = [
    "file",
    "sqlite",
    pytest.param("postgresql", marks=pytest.mark.postgresql),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
    pytest.param("blob", marks=pytest.mark.azurite),
]


def rec(n: int) -> dict[str, Any]:
    at = format_time(T0 + dt.timedelta(minutes=n))
    return {"id": f"r{n}", "at": at, "type": "commit", "batch_id": f"b{n}", "rows": n}


@pytest.fixture(params=KINDS)
def history(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HistoryStore]:
    kind = request.param
    if kind == "file":
        yield FileHistory(tmp_path / "state", segment_bytes=1024)
    elif kind == "blob":
        azurite: Azurite = request.getfixturevalue("azurite")
        container = f"h{uuid.uuid4().hex[:20]}"
        service = BlobServiceClient.from_connection_string(azurite.connection_string)
        service.create_container(container)
        try:
            yield BlobHistory(service.get_container_client(container), app="s", segment_bytes=1024)
        finally:
            service.delete_container(container)
            service.close()
    else:
        for db in make_database(kind, tmp_path):
            yield SqlHistory(db.engine, schema=db.schema)


def test_a_read_racing_a_prune_never_skips_records_silently(history: HistoryStore) -> None:
    # Files and blobs: segments of about a dozen records; SQL: pages of 1000.
    total = 1200 if isinstance(history, SqlHistory) else 60
    if isinstance(history, SqlHistory):
        history.append("orders", [rec(n) for n in range(1, total + 1)], after_seq=0)
    else:
        for n in range(1, total + 1):
            history.append("orders", [rec(n)], after_seq=n - 1)
    reading = history.read("orders")
    got = [int(next(reading)["seq"])]
    # Retention takes every record up to the 1100th minute (SQL) / the 40th (segments).
    upto = 1100 if isinstance(history, SqlHistory) else 40
    now = T0 + dt.timedelta(days=1, minutes=upto)
    assert history.prune("orders", Retention(max_age_days=1, max_bytes=None), now) > 0
    failed: DbTriggerError | None = None
    try:
        got += [int(r["seq"]) for r in reading]
    except DbTriggerError as exc:
        failed = exc
    if failed is None:
        assert got == list(range(1, len(got) + 1)), f"a hole after {got[:3]}...: {got[-20:]}"
    else:  # it stopped before the hole and says so
        assert "pruned" in str(failed), failed
        assert "read again" in str(failed).lower(), failed
        assert got == list(range(1, len(got) + 1))
    # Read again: what is kept now, without a hole.
    again = [int(r["seq"]) for r in history.read("orders")]
    assert again == list(range(again[0], total + 1))
    assert again[0] > 1


def test_file_tail_gives_up_on_a_segment_it_cannot_open(tmp_path: Path) -> None:
    history = FileHistory(tmp_path, segment_bytes=1024)
    history.append("orders", [rec(1)], after_seq=0)
    [segment] = tmp_path.glob("orders.history.*.jsonl")
    segment.rename(tmp_path / "orders.history.000000000002.jsonl")
    (tmp_path / segment.name).symlink_to(tmp_path / "gone.jsonl")  # listed, never opens
    with pytest.raises(StoreUnavailableError, match="cannot be opened"):
        history.tail("orders", 5)


@pytest.mark.azurite
def test_a_table_prune_that_fails_half_way_removes_the_oldest_records_only(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Table storage deletes a hundred entities a transaction; a prune whose second
    transaction fails (throttled, the process killed) has removed the first hundred.
    It took them newest first, so the history kept records 1-150 and 251 around a
    hole; it takes them oldest first now, and what it leaves is whole."""
    name = f"h{uuid.uuid4().hex[:20]}"
    client = TableClient.from_connection_string(azurite.connection_string, name)
    client.create_table()
    try:
        history = TableHistory(client, app="s")
        history.append("orders", [rec(n) for n in range(1, 252)], after_seq=0)
        calls = []
        submit = client.submit_transaction

        def second_fails(operations: Any, **kwargs: Any) -> Any:
            calls.append(len(operations))
            if len(calls) == 2:
                raise ServiceRequestError("connection reset by peer")
            return submit(operations, **kwargs)

        monkeypatch.setattr(client, "submit_transaction", second_fails)
        now = T0 + dt.timedelta(days=1, minutes=251)  # every record but the last is old
        with pytest.raises(StoreUnavailableError):
            history.prune("orders", Retention(max_age_days=1, max_bytes=None), now)
        assert calls == [100, 100]
        kept = [int(r["seq"]) for r in history.read("orders")]
        assert kept == list(range(101, 252))
    finally:
        client.delete_table()
        client.close()
