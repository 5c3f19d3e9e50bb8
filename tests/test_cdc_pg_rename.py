"""PgLogicalSource: a watched table renamed under a running poller.

``pgoutput`` names a change's table as it was named when the change was written,
and the publication follows a renamed table (by OID). The source matched changes
by name only: once pointed at the new name, the changes written before the rename
were skipped without a word, and the error before that said the table was dropped.
"""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RetryPolicy, RowChange
from dbtrigger.cdc import PgLogicalSource
from dbtrigger.errors import SourceDefinitionError
from dbtrigger.state import document
from dbtrigger.state import operations as state_ops
from tests.cdc_servers import CdcDatabase

pytestmark = pytest.mark.timeout(120)


def test_changes_from_before_a_rename_are_read_after_the_source_follows_it(
    cdc_db: CdcDatabase,
) -> None:
    cdc_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    store = InMemoryCheckpointStore()
    name = f"p_{uuid.uuid4().hex[:8]}"

    def poller(table: str) -> PollTrigger:
        source = PgLogicalSource(cdc_db.url, [table], snapshot="never")
        return PollTrigger(
            name=name, source=source, checkpoint_store=store, retry=RetryPolicy.none()
        )

    got: list[RowChange] = []
    before = poller("t")
    before.drain(got.extend)
    cdc_db.execute("INSERT INTO t VALUES (1)")
    before.drain(got.extend)
    cdc_db.execute("INSERT INTO t VALUES (2)")
    cdc_db.execute("ALTER TABLE t RENAME TO t2")
    cdc_db.execute("INSERT INTO t2 VALUES (3)")
    with pytest.raises(SourceDefinitionError, match=r"public\.t was renamed to public\.t2"):
        before.tick(got.extend)
    before.source.close()

    after = poller("t2")  # what the error asks for: tables= the new name, source accepted
    stored = store.read(name)
    assert stored is not None
    accepted = state_ops.accept_source(
        document.loads(stored.data),
        fingerprint=after.source.fingerprint(),
        now=dt.datetime.now(dt.timezone.utc),
        actor="test",
        reason="table renamed",
    )
    store.write(name, document.dumps(accepted), if_match=stored.etag)
    after.drain(got.extend)
    after.source.close()
    assert [(e.pk["id"], e.metadata["table"]) for e in got] == [
        (1, "public.t"),
        (2, "public.t2"),  # before the fix: skipped
        (3, "public.t2"),
    ]


def test_a_rename_during_the_initial_snapshot_names_the_snapshot_to_run_again(
    cdc_db: CdcDatabase,
) -> None:
    # The snapshot request names the old table: after the source follows the new name it
    # is skipped (logged), so the error, which said "none skipped", names the re-read.
    cdc_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t SELECT generate_series(1, 30)"
    )
    source = PgLogicalSource(cdc_db.url, ["t"], snapshot_chunk_size=10)
    trigger = PollTrigger(
        name=f"p_{uuid.uuid4().hex[:8]}",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        retry=RetryPolicy.none(),
    )
    got: list[RowChange] = []
    while not got:
        trigger.tick(got.extend)
    cdc_db.execute("ALTER TABLE t RENAME TO t2")

    def read_on() -> None:
        for _ in range(5):  # a read-ahead may answer first
            trigger.tick(got.extend)

    with pytest.raises(SourceDefinitionError) as caught:
        read_on()
    source.close()
    assert len({e.pk["id"] for e in got}) < 30  # the snapshot was not finished
    assert "dbtrigger cdc snapshot MODULE:TRIGGER --table public.t2 --yes" in str(caught.value)
