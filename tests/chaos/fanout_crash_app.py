"""A fan-out app whose subscriber ends the process (``os._exit(1)``) mid-batch,
run by ``dbtrigger run tests.chaos.fanout_crash_app:trigger`` in
tests/test_fanout_crash.py.

Two subscribers on one read of ``items``, ten rows a batch, everything else
at its default. ``billing`` takes every event; ``crashy`` ends the process
the first time it reaches row ``FANOUT_CRASH_AT`` (a marker file says it did),
half way through its share of that batch. Each subscriber appends one line a
received event to ``<FANOUT_CRASH_WORK>/<name>.log``, closed at once (so it is
in the file when the process ends).
"""

from __future__ import annotations

import os
from pathlib import Path

from dbtrigger import FileCheckpointStore, PollTrigger, RowChange, SqlAlchemySource

WORK = Path(os.environ["FANOUT_CRASH_WORK"])
CRASH_AT = int(os.environ["FANOUT_CRASH_AT"])


def _record(name: str, event: RowChange) -> None:
    with (WORK / f"{name}.log").open("a") as log:
        log.write(f"{event.pk['id']}\n")


def billing(events: list[RowChange]) -> None:
    for event in events:
        _record("billing", event)


def crashy(events: list[RowChange]) -> None:
    for event in events:
        if event.pk["id"] == CRASH_AT and not (WORK / "crashed").exists():
            (WORK / "crashed").touch()
            os._exit(1)  # the whole process, with billing's thread mid-batch too
        _record("crashy", event)


trigger = PollTrigger(
    name="orders",
    source=SqlAlchemySource(
        url=os.environ["FANOUT_CRASH_DB"], table="items", cursor_column="version", pk_columns=["id"]
    ),
    checkpoint_store=FileCheckpointStore(WORK / "state"),
    subscribers={"billing": billing, "crashy": crashy},
    batch_size=10,
)
