"""A checkpoint written under the earlier fingerprint algorithm is still this source's."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.cursor import Position
from dbtrigger.errors import FingerprintMismatchError
from dbtrigger.state import document
from dbtrigger.state.document import Checkpoint, StateDocument
from tests.databases import TestDatabase


def test_a_document_with_the_legacy_fingerprint_resumes(
    sqlite_db: TestDatabase, tmp_path: Path
) -> None:
    sqlite_db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    sqlite_db.execute("INSERT INTO t VALUES (1, 1), (2, 2), (3, 3)")
    source = SqlAlchemySource(
        url=sqlite_db.url, table="t", cursor_column="seq", pk_columns=["id"], visibility="none"
    )
    current, *older = source.accepted_fingerprints()
    assert current == source.fingerprint()
    assert older, "the earlier algorithm's fingerprint is offered"
    store = FileCheckpointStore(tmp_path / "state")
    now = dt.datetime.now(dt.timezone.utc)

    def write(fingerprint: str) -> None:
        doc = StateDocument(
            poller_name="t",
            source_fingerprint=fingerprint,
            checkpoint=Checkpoint(Position(1, {"id": 1}), None, now),
        )
        existing = store.read("t")
        store.write("t", document.dumps(doc), if_match=existing.etag if existing else None)

    write(older[0])
    trigger = PollTrigger(name="t", source=source, checkpoint_store=store)
    seen: list[int] = []
    assert trigger.drain(lambda events: seen.extend(e.pk["id"] for e in events)) == 2
    assert seen == [2, 3]  # resumed after the stored checkpoint, nothing redelivered

    write("sha256:" + "0" * 64)  # a genuinely different definition is still refused
    with pytest.raises(FingerprintMismatchError):
        trigger.tick(lambda events: None)
