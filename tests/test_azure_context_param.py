"""A ``context`` parameter annotated ``func.Context``, as every Functions sample writes it.

dbtrigger gives a parameter named ``context`` the :class:`~dbtrigger.BatchContext`
and hides it from the host, so the host's invocation context never reached the
function: ``context.invocation_id`` failed every invocation with an
AttributeError on BatchContext, reported as a handler failure (the batch
redelivered for ever). The annotation says what the person expects, so the
decorator refuses it and says what to write.
"""

from __future__ import annotations

from collections.abc import Iterator

import azure.functions as func
import pytest

from dbtrigger import BatchContext, DbBindings, InMemoryCheckpointStore, RowChange
from dbtrigger.errors import ConfigurationError
from dbtrigger.sources.sqlalchemy import SqlAlchemySource


@pytest.fixture
def source() -> Iterator[SqlAlchemySource]:
    src = SqlAlchemySource(url="sqlite://", table="orders", cursor_column="id", pk_columns=["id"])
    yield src
    src.close()


def test_context_annotated_as_the_hosts_is_refused_saying_what_to_write(
    source: SqlAlchemySource,
) -> None:
    db = DbBindings()
    with pytest.raises(ConfigurationError) as err:

        @db.trigger(arg_name="events", source=source, checkpoint_store=InMemoryCheckpointStore())
        def orders(
            timer: func.TimerRequest, events: list[RowChange], context: func.Context
        ) -> None:
            del timer, events, context

    message = str(err.value)
    assert "BatchContext" in message
    assert "func.Context" in message


def test_a_batch_context_or_no_annotation_is_taken(source: SqlAlchemySource) -> None:
    db = DbBindings()

    @db.trigger(arg_name="events", source=source, checkpoint_store=InMemoryCheckpointStore())
    def typed(timer: func.TimerRequest, events: list[RowChange], context: BatchContext) -> None:
        del timer, events, context

    @db.trigger(arg_name="events", source=source, checkpoint_store=InMemoryCheckpointStore())
    def bare(timer, events, context):  # type: ignore[no-untyped-def]
        del timer, events, context
