"""A fetched row's event and its ``pk``/``after`` views cost no argument-checking call.

Every delivered row is made into an event, and a handler reads ``e.pk[...]``
and ``e.after[...]`` of each: a view per read. They were made with
``object.__new__(cls)``, a call through ``tp_new_wrapper``'s argument checks;
calling the class itself (``object.__init__`` as the event's ``__init__``)
is type_call and C all the way: about 250 instructions an event and 200 a
read less (benchmarks/README.md, #26). Held here at default settings on
every database: no ``object.__new__`` call a row, and the events read,
compare and refuse changes as before.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import pytest
import sqlalchemy as sa

from dbtrigger import InMemoryCheckpointStore, PollTrigger, RowChange, SqlAlchemySource
from tests.databases import TestDatabase
from tests.test_source_sqlalchemy import insert, make_table

ROWS = 30


def _narrow(db: TestDatabase) -> None:
    table = make_table(
        db,
        "narrow_rows",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
        sa.Column("payload", sa.String(40)),
        index=("updated_at", "id"),
    )
    insert(db, table, [{"id": i, "updated_at": i // 3, "payload": f"p{i}"} for i in range(ROWS)])


def test_events_and_their_views_are_made_without_object_new(db: TestDatabase) -> None:
    _narrow(db)
    source = SqlAlchemySource(
        url=db.url,
        table="narrow_rows",
        schema=db.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
    )
    made: list[str] = []  # the dbtrigger.events function of each object.__new__ call
    read: list[tuple[Any, Any]] = []
    delivered: list[RowChange] = []
    new = object.__new__

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and arg is new and frame.f_code.co_filename.endswith("events.py"):
            made.append(frame.f_code.co_name)

    def handler(events: Sequence[RowChange]) -> None:
        for event in events:
            read.append((event.pk["id"], event.after["payload"]))
        delivered.extend(events)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        trigger = PollTrigger(
            name="narrow",
            source=source,
            checkpoint_store=InMemoryCheckpointStore(),
            batch_size=7,
        )
        for _ in range(ROWS):  # (one batch a tick; bounded)
            if len(read) >= ROWS or not trigger.tick(handler):
                break
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        source.close()
    assert read == [(i, f"p{i}") for i in range(ROWS)]
    # RowShape.for_batch's own copy, once a batch, is all that is left.
    assert [name for name in made if name != "for_batch"] == []
    first = delivered[0]
    built = RowChange(
        event_id=first.event_id,
        op="upsert",
        source=first.source,
        cursor=0,
        pk={"id": 0},
        before=None,
        after={"id": 0, "updated_at": 0, "payload": "p0"},
        metadata=first.metadata,
    )
    assert first == built
    assert repr(first) == repr(built)
    with pytest.raises(TypeError):
        first.pk["id"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        first.after["payload"] = "x"  # type: ignore[index]
    with pytest.raises(AttributeError):
        first.pk = {}  # type: ignore[misc]
