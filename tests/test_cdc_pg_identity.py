"""PgLogicalSource never publishes a table whose updates PostgreSQL would then refuse.

A table without a replica identity (no primary key under ``DEFAULT``, or ``NOTHING``)
was added to the publication at the source's first read, its snapshot then refused,
and from then on every ``UPDATE`` and ``DELETE`` of it failed in the application
("cannot update table ... does not have a replica identity and publishes updates").
"""

from __future__ import annotations

import uuid

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange
from dbtrigger.cdc import PgLogicalSource
from dbtrigger.errors import SourceDefinitionError
from tests.cdc_servers import CdcDatabase

PUBLISHED = "SELECT count(*) FROM pg_publication_tables WHERE tablename = %s"


def trigger_for(db: CdcDatabase, tables: list[str], snapshot: str = "initial") -> PollTrigger:
    return PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=PgLogicalSource(db.url, tables, snapshot=snapshot),  # create=True
        checkpoint_store=InMemoryCheckpointStore(),
    )


def published(db: CdcDatabase, table: str) -> int:
    with db.connect() as conn:
        row = conn.execute(PUBLISHED, (table,)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    ("ddl", "why"),
    [
        ("CREATE TABLE k (a int, b text)", "no primary key"),
        (
            "CREATE TABLE k (a int PRIMARY KEY, b text); ALTER TABLE k REPLICA IDENTITY NOTHING",
            "REPLICA IDENTITY NOTHING",
        ),
    ],
)
def test_a_table_without_replica_identity_is_refused_before_it_is_published(
    cdc_db: CdcDatabase, ddl: str, why: str
) -> None:
    cdc_db.execute(ddl + "; CREATE TABLE ok (id int PRIMARY KEY); INSERT INTO k VALUES (1, 'x')")
    trigger = trigger_for(cdc_db, ["ok", "k"])
    with pytest.raises(SourceDefinitionError) as refused:
        trigger.drain(lambda events: None)
    trigger.source.close()
    text = str(refused.value)
    assert f"public.k ({why})" in text, text
    assert 'ALTER TABLE "public"."k" REPLICA IDENTITY FULL' in text, text
    assert published(cdc_db, "k") == published(cdc_db, "ok") == 0
    cdc_db.execute("UPDATE k SET b = 'y'; DELETE FROM k")  # the application's writes go on


def test_install_with_full_images_publishes_a_keyless_table_after_setting_full(
    cdc_db: CdcDatabase,
) -> None:
    cdc_db.execute("CREATE TABLE k (a int, b text); INSERT INTO k VALUES (1, 'x')")
    trigger = trigger_for(cdc_db, ["k"], snapshot="never")
    source = trigger.source
    assert isinstance(source, PgLogicalSource)
    source.admin().install(full_images=True)
    assert published(cdc_db, "k") == 1
    cdc_db.execute("UPDATE k SET b = 'y'")
    got: list[RowChange] = []
    trigger.drain(got.extend)
    source.close()
    assert [(e.op, e.before, e.after) for e in got] == [
        ("update", {"a": 1, "b": "x"}, {"a": 1, "b": "y"})
    ]
