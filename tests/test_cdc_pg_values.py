"""PgLogicalSource: a column of a domain type carries its base type's value.

pgoutput (and a snapshot chunk) names a column by its declared type; a domain
(``CREATE DOMAIN order_id AS integer``) was no type the reader converts, so its
values came as text: a domain-typed primary key was ``'1'`` in ``pk``, where a
query of the row (and a cursor poller of the table) gives 1.
"""

from __future__ import annotations

import datetime as dt
import decimal
import uuid

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import PgLogicalSource
from tests.cdc_servers import CdcDatabase


def test_domain_typed_columns_carry_their_base_type_s_values(cdc_db: CdcDatabase) -> None:
    cdc_db.execute(
        "CREATE DOMAIN order_id AS integer CHECK (VALUE > 0);"
        "CREATE DOMAIN positive_id AS order_id;"  # a domain over a domain
        "CREATE DOMAIN price AS numeric(12, 2);"
        "CREATE DOMAIN stamp AS timestamptz;"
        "CREATE TABLE t (id positive_id PRIMARY KEY, n int, p price, at stamp, o order_id)"
    )
    cdc_db.execute("INSERT INTO t VALUES (1, 1, 3.25, '2026-01-01 00:00:00+05', 7)")
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=PgLogicalSource(cdc_db.url, ["t"], snapshot="initial"),
        checkpoint_store=InMemoryCheckpointStore(),
    )
    got: list[RowChange] = []
    trigger.drain(got.extend)  # the snapshot
    cdc_db.execute("UPDATE t SET n = 2")
    cdc_db.execute("DELETE FROM t")
    trigger.drain(got.extend)
    trigger.source.close()
    row = {
        "id": 1,
        "p": decimal.Decimal("3.25"),
        "at": dt.datetime(2025, 12, 31, 19, tzinfo=dt.timezone.utc),
        "o": 7,
    }
    assert [(e.op, dict(e.pk)) for e in got] == [
        ("upsert", {"id": 1}),
        ("update", {"id": 1}),
        ("delete", {"id": 1}),
    ]
    snapshot, update, _ = got
    for image in (snapshot.after, update.after):
        assert image is not None
        assert {k: v for k, v in image.items() if k != "n"} == row
        assert type(image["id"]) is int


def test_a_generated_column_is_in_no_event_snapshot_ones_included(cdc_db: CdcDatabase) -> None:
    # pgoutput does not publish generated columns: a row's snapshot event had the column
    # and each change of it after lacked the key, one row in two shapes.
    cdc_db.execute(
        "CREATE TABLE g (id int PRIMARY KEY, a int, twice int GENERATED ALWAYS AS (a * 2) "
        "STORED); INSERT INTO g VALUES (1, 1)"
    )
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=PgLogicalSource(cdc_db.url, ["g"], snapshot="initial"),
        checkpoint_store=InMemoryCheckpointStore(),
    )
    got: list[RowChange] = []
    trigger.drain(got.extend)
    cdc_db.execute("UPDATE g SET a = 5")
    trigger.drain(got.extend)
    trigger.source.close()
    assert [(e.op, dict(e.after or {})) for e in got] == [
        ("upsert", {"id": 1, "a": 1}),
        ("update", {"id": 1, "a": 5}),
    ]
