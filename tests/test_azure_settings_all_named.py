"""A new Function App whose numeric ``%SETTING%`` options are all missing.

Each invocation named only the first missing one; in Azure every change to
the app settings restarts the app, so a person learnt of the next one only
after that restart and the timer's next firing. One error now names every
numeric setting that is missing or malformed.
"""

from __future__ import annotations

import pytest
from azure.functions.timer import TimerRequest

from dbtrigger import DbBindings, InMemoryCheckpointStore, RowChange, SqlAlchemySource
from dbtrigger.settings import DeferredSettingError


def test_every_missing_numeric_setting_is_named_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DBT_ALL_BATCH", "DBT_ALL_TICK", "DBT_ALL_TTL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DBT_ALL_TICK", "ten")
    db = DbBindings()
    source = SqlAlchemySource(
        url="sqlite://", table="orders", cursor_column="id", pk_columns=["id"]
    )

    @db.trigger(
        arg_name="events",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size="%DBT_ALL_BATCH%",
        max_batches_per_tick="%DBT_ALL_TICK%",
        lease_ttl_seconds="%DBT_ALL_TTL%",
    )
    def orders(timer: object, events: list[RowChange]) -> None:
        del timer, events

    with pytest.raises(DeferredSettingError) as err:
        orders(timer=TimerRequest(past_due=False, schedule_status={}, schedule={}))
    message = str(err.value)
    for named in ("DBT_ALL_BATCH", "DBT_ALL_TICK", "'ten'", "DBT_ALL_TTL"):
        assert named in message
    source.close()
