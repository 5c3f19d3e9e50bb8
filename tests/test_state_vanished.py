"""A state document deleted under a running poller is said, at ERROR, not passed over.

None of dbtrigger's commands deletes a document, so one that is gone after this
process read it was removed by hand (or the store now points elsewhere). The
poller then starts over as a new one: rows come again, none is lost - and the
operator is told, with the way back to the old checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbtrigger import FileCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.errors import ConfigurationError


def _table(url: str, rows: int) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, updated_at INTEGER)")
        for i in range(1, rows + 1):
            conn.exec_driver_sql(f"INSERT INTO orders VALUES ({i}, {i})")
    engine.dispose()


def test_a_deleted_state_document_is_said_and_nothing_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    _table(url, 6)
    store = FileCheckpointStore(tmp_path / "state")
    source = SqlAlchemySource(
        url=url, table="orders", cursor_column="updated_at", pk_columns=["id"]
    )
    trigger = PollTrigger(name="orders", source=source, checkpoint_store=store, batch_size=3)
    seen: list[int] = []
    try:
        for _ in range(4):
            trigger.run(handler=lambda events: seen.extend(e.pk["id"] for e in events))
        assert seen == [1, 2, 3, 4, 5, 6]
        assert not [r for r in caplog.records if getattr(r, "event", None) == "state_vanished"]

        store.delete("orders")  # by hand, while the poller runs
        with caplog.at_level(logging.ERROR, logger="dbtrigger"):
            for _ in range(3):
                trigger.run(handler=lambda events: seen.extend(e.pk["id"] for e in events))
    finally:
        trigger.close()
    said = [r for r in caplog.records if getattr(r, "event", None) == "state_vanished"]
    assert len(said) == 1  # once, not on every tick after
    assert said[0].levelno == logging.ERROR
    text = said[0].getMessage()
    assert "orders" in text
    assert "--from-file" in text
    assert seen[6:] == [1, 2, 3, 4, 5, 6]  # started over: delivered again, none lost


def test_start_from_now_does_not_skip_rows_of_a_poller_whose_document_was_deleted(
    tmp_path: Path,
) -> None:
    """The history (beside the store by default) says the poller is not new."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    _table(url, 3)
    state = tmp_path / "state"

    def trigger() -> PollTrigger:
        source = SqlAlchemySource(
            url=url, table="orders", cursor_column="updated_at", pk_columns=["id"]
        )
        store = FileCheckpointStore(state)
        return PollTrigger(name="orders", source=source, checkpoint_store=store, start_from="now")

    seen: list[int] = []
    first = trigger()
    try:
        first.run(handler=lambda events: seen.extend(e.pk["id"] for e in events))  # created
        _insert(url, 4)
        first.run(handler=lambda events: seen.extend(e.pk["id"] for e in events))
    finally:
        first.close()
    assert seen == [4]

    FileCheckpointStore(state).delete("orders")  # lost while no worker ran
    _insert(url, 5)  # written meanwhile: not yet delivered
    again = trigger()
    try:
        with pytest.raises(ConfigurationError, match="has no state document, but its history"):
            again.run(handler=lambda events: seen.extend(e.pk["id"] for e in events))
    finally:
        again.close()
    assert seen == [4]


def _insert(url: str, key: int) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"INSERT INTO orders VALUES ({key}, {key})")
    engine.dispose()
