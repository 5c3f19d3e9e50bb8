"""``event.to_cloudevent()``: a change forwarded as a CloudEvent, as a handler would.

The handler of a real poller on PostgreSQL (aware timestamps, numeric, uuid,
bytea) turns each change into a CloudEvent and sends it in the HTTP
structured mode an Event Grid topic accepts; the receiving side parses it
back with the same SDK. A redelivered batch yields the same ids, which is
what lets a consumer drop the duplicates.
"""

from __future__ import annotations

import base64
import datetime as dt
import importlib
import uuid
from pathlib import Path
from typing import Any

import pytest
from cloudevents.core.bindings import http

from dbtrigger import (
    FileCheckpointStore,
    InMemoryCheckpointStore,
    PollTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.errors import ConfigurationError
from dbtrigger.testing import MemorySource
from tests.databases import TestDatabase


@pytest.mark.postgresql
def test_a_forwarding_handler_sends_what_a_consumer_reads_back(
    pg: TestDatabase, tmp_path: Path
) -> None:
    pg.execute(
        f"CREATE TABLE {pg.qualified('orders')} (id integer PRIMARY KEY, "
        "updated_at timestamptz NOT NULL, amount numeric(12,2), ref uuid, blob bytea)"
    )
    ref = uuid.uuid4()
    at = dt.datetime(2026, 3, 1, 12, 30, tzinfo=dt.timezone.utc)
    pg.execute(
        f"INSERT INTO {pg.qualified('orders')} VALUES (7, :at, 12.50, :ref, :blob)",
        {"at": at, "ref": ref, "blob": b"\x00\xffab"},
    )
    source = SqlAlchemySource(
        url=pg.url, schema=pg.schema, table="orders", cursor_column="updated_at", pk_columns=["id"]
    )
    trigger = PollTrigger(
        name="orders", source=source, checkpoint_store=FileCheckpointStore(tmp_path)
    )
    sent: list[http.HTTPMessage] = []
    fail = [True]

    def forward(events: list[RowChange]) -> None:
        for event in events:
            sent.append(http.to_structured_event(event.to_cloudevent()))
        if fail.pop() if fail else False:
            raise RuntimeError("the bus timed out after the send")  # redelivered

    with pytest.raises(Exception, match="timed out"):
        trigger.tick(forward)
    assert trigger.tick(forward) == 1
    source.close()
    first, again = (http.from_structured_event(m) for m in sent)
    assert first.get_id() == again.get_id()  # a consumer dedupes on source + id
    assert first.get_source() == "/dbtrigger/orders"
    assert first.get_type() == "dbtrigger.row.upsert"
    assert first.get_subject() == "id=7"
    assert first.get_time() == at  # when the row changed: its timestamp cursor
    assert sent[0].headers["content-type"].startswith("application/cloudevents+json")
    data: Any = first.get_data()
    assert data["pk"] == {"id": 7}
    assert data["cursor"] == "2026-03-01T12:30:00+00:00"
    assert data["after"]["amount"] == "12.50"  # decimals as text: no precision lost
    assert data["after"]["ref"] == str(ref)
    assert base64.b64decode(data["after"]["blob"]) == b"\x00\xffab"
    assert data["source"].startswith("postgresql:")


def test_attributes_can_be_named_and_an_integer_cursor_has_no_time() -> None:
    source = MemorySource([{"seq": 1, "tenant": "eu", "id": 5, "name": "x"}],
                          cursor_column="seq", pk_columns=["tenant", "id"])  # fmt: skip
    seen: list[RowChange] = []
    trigger = PollTrigger(name="p", source=source, checkpoint_store=InMemoryCheckpointStore())
    assert trigger.tick(seen.extend) == 1
    (event,) = seen
    ce = event.to_cloudevent(
        source="https://shop.example/orders", type="com.example.order.changed",
        extensions={"tenant": "eu"},
    )  # fmt: skip
    assert (ce.get_source(), ce.get_type(), ce.get_subject()) == (
        "https://shop.example/orders",
        "com.example.order.changed",
        "tenant=eu/id=5",
    )
    assert ce.get_extension("tenant") == "eu"
    assert ce.get_time() is not None  # the SDK's "now": the change has no time of its own
    with pytest.raises(ConfigurationError, match="not a valid CloudEvent"):
        event.to_cloudevent(extensions={"Not-Valid": 1})


def test_without_the_sdk_the_error_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_sdk(name: str, package: str | None = None) -> Any:
        if name.startswith("cloudevents"):
            raise ImportError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_sdk)
    event = RowChange("e1", "upsert", "memory:rows", 1, {"id": 1}, None, {"id": 1})
    with pytest.raises(ConfigurationError, match=r"dbtrigger\[cloudevents\]"):
        event.to_cloudevent()
