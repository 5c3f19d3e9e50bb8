"""``@db.queue_trigger``: a claim queue drained by a Functions timer."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from dbtrigger import ClaimContext, ClaimSource, DbBindings, RowChange
from dbtrigger.azure import binding_of
from dbtrigger.errors import ConfigurationError
from tests.databases import TestDatabase
from tests.test_queue_columns import make_jobs, rows


def claim_source(db: TestDatabase) -> ClaimSource:
    return ClaimSource(url=db.url, table="jobs", schema=db.schema, pk_columns=["id"])


def test_sync_function_drains_a_bounded_number_of_batches(sqlite_db: TestDatabase) -> None:
    make_jobs(sqlite_db, 25)
    db = DbBindings()
    seen: list[tuple[Any, int, str]] = []
    source = claim_source(sqlite_db)

    @db.queue_trigger(arg_name="events", source=source, batch_size=5, max_batches_per_tick=3)
    def send(timer: object, events: list[RowChange], context: ClaimContext) -> None:
        for e in events:
            seen.append((timer, e.pk["id"], context.queue_name))

    assert list(inspect.signature(send).parameters) == ["timer"]
    assert db.queues["send"] is binding_of(send).queue_trigger
    send("tick")
    assert len(seen) == 15
    assert {s[0] for s in seen} == {"tick"}
    assert {s[2] for s in seen} == {"send"}
    send(timer="tock")
    send("again")
    assert sorted(s[1] for s in seen) == list(range(1, 26))
    assert {r["dbt_status"] for r in rows(sqlite_db).values()} == {"done"}
    source.close()


def test_async_function(sqlite_db: TestDatabase) -> None:
    make_jobs(sqlite_db, 7)
    db = DbBindings()
    seen: list[int] = []
    source = claim_source(sqlite_db)

    @db.queue_trigger(
        arg_name="batch", source=source, batch_size=3, name="mail", max_batches_per_tick=10
    )
    async def send(timer: object, batch: list[RowChange]) -> None:
        await asyncio.sleep(0)
        seen.extend(e.pk["id"] for e in batch)

    asyncio.run(send(None))
    assert sorted(seen) == list(range(1, 8))
    assert "mail" in db.queues
    source.close()


def test_bad_decorations(sqlite_db: TestDatabase) -> None:
    make_jobs(sqlite_db, 1)
    db = DbBindings()
    source = claim_source(sqlite_db)

    with pytest.raises(ConfigurationError, match="has no parameter 'events'"):

        @db.queue_trigger(arg_name="events", source=source, max_batches_per_tick=1)
        def wrong(timer: object, rows: list[RowChange]) -> None: ...

    @db.queue_trigger(arg_name="events", source=source, name="q", max_batches_per_tick=1)
    def first(timer: object, events: list[RowChange]) -> None: ...

    with pytest.raises(ConfigurationError, match="two queue triggers are named 'q'"):

        @db.queue_trigger(arg_name="events", source=source, name="q", max_batches_per_tick=1)
        def second(timer: object, events: list[RowChange]) -> None: ...

    with pytest.raises(ConfigurationError, match="max_batches_per_tick"):
        db.queue_trigger(arg_name="events", source=source, max_batches_per_tick=0)
    source.close()


def test_the_old_decorator_spellings_still_work_and_warn(
    sqlite_db: TestDatabase, tmp_path: Any
) -> None:
    """``dead_letter=`` is ``quarantine=``; a left-out ``max_batches_per_tick`` is
    still 10 batches per firing, with a warning that it becomes 1 (as on @db.trigger)."""
    from dbtrigger.quarantine import JsonLinesQuarantineSink  # noqa: PLC0415

    make_jobs(sqlite_db, 25)
    db = DbBindings()
    source = claim_source(sqlite_db)
    sink = JsonLinesQuarantineSink(tmp_path / "dead.jsonl")
    seen: list[int] = []
    with pytest.warns(DeprecationWarning, match="is deprecated|default becomes 1") as caught:

        @db.queue_trigger(arg_name="events", source=source, batch_size=2, dead_letter=sink)
        def send(timer: object, events: list[RowChange]) -> None:
            seen.extend(e.pk["id"] for e in events)

    said = " ".join(str(w.message) for w in caught)
    assert "dead_letter=...) is deprecated: use quarantine=" in said
    assert "the default becomes 1, as on @db.trigger" in said
    assert db.queues["send"].quarantine is sink
    send(None)
    assert len(seen) == 20  # ten batches of two in one firing, as before
    with pytest.raises(ConfigurationError, match="both dead_letter= and quarantine="):
        db.queue_trigger(arg_name="events", source=source, dead_letter=sink, quarantine=sink)
    source.close()
