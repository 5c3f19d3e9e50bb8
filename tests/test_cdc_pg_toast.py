"""PgLogicalSource: an update that leaves a large (TOASTed) value alone, under
``REPLICA IDENTITY FULL``.

PostgreSQL logs such a value as "unchanged" ('u') in the new row, but whole in the
old row that ``FULL`` writes. The event's ``after`` held :data:`UNCHANGED` for it
even though its ``before`` had the value the update left in place: a consumer
building the row from ``after`` had to know to look there.
"""

from __future__ import annotations

import json
import secrets
import uuid

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import UNCHANGED, PgLogicalSource
from tests.cdc_servers import CdcDatabase


def test_under_full_identity_an_unchanged_toasted_value_is_in_after(
    cdc_db: CdcDatabase,
) -> None:
    cdc_db.execute(
        "CREATE TABLE docs (id int PRIMARY KEY, status text, doc jsonb, note text);"
        "ALTER TABLE docs REPLICA IDENTITY FULL;"
        "CREATE TABLE bare (k int, doc text); ALTER TABLE bare REPLICA IDENTITY FULL;"
        "CREATE TABLE plain (id int PRIMARY KEY, status text, doc text)"
    )
    doc = {"blob": secrets.token_hex(6000)}  # 12 kB that do not compress: stored out of line
    text = secrets.token_hex(6000)
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=PgLogicalSource(cdc_db.url, ["docs", "bare", "plain"], snapshot="never"),
        checkpoint_store=InMemoryCheckpointStore(),
    )
    got: list[RowChange] = []
    trigger.drain(got.extend)
    with cdc_db.connect() as conn:
        conn.execute("INSERT INTO docs VALUES (1, 'new', %s, NULL)", (json.dumps(doc),))
        conn.execute("INSERT INTO bare VALUES (1, %s)", (text,))
        conn.execute("INSERT INTO plain VALUES (1, 'new', %s)", (text,))
        conn.execute("UPDATE docs SET status = 'paid'")
        conn.execute("UPDATE bare SET k = 2")
        conn.execute("UPDATE plain SET status = 'paid'")
    trigger.drain(got.extend)
    trigger.source.close()
    docs, bare, plain = (e for e in got if e.op == "update")
    assert docs.after == {"id": 1, "status": "paid", "doc": doc, "note": None}
    assert docs.before == {**docs.after, "status": "new"}
    assert docs.metadata["unchanged"] == ()
    assert bare.after == {"k": 2, "doc": text}
    assert bare.metadata["unchanged"] == ()
    # DEFAULT identity: the log has the value nowhere, the marker says so.
    assert plain.after is not None
    assert plain.after["doc"] is UNCHANGED
    assert plain.metadata["unchanged"] == ("doc",)
