"""One drain of the narrow (or wide) 100k-row PostgreSQL table, for counting its cost.

Made to run under ``valgrind --tool=callgrind``, whose instruction counts the
load of a shared machine does not change: everything runs on the tick's
thread (``read_ahead=False``), one drain per process. Run it once with
``--drains 0`` too: that count (start-up, imports, the data set's check) is
subtracted from the others to leave the drain's own. ``--fake`` drains the
same number of narrow rows from an in-memory stand-in that returns
:class:`~dbtrigger.sources.rows.Rows` tuples, no database: what the runtime
costs around the source. Prints the drain's CPU time too (read that only on
a quiet machine)::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python -m benchmarks.drain_cost --batch 100 --no-history
"""

from __future__ import annotations

import argparse
import bisect
import functools
import time
from typing import Any

import benchmarks.common as bc
from benchmarks.common import LAYOUTS, dataset, dbtrigger_drain, narrow_reading_handler
from dbtrigger import InMemoryCheckpointStore, PollTrigger
from dbtrigger.cursor import Position
from dbtrigger.events import RowChange
from dbtrigger.runtime import bulk
from dbtrigger.sources.rows import Rows, rows_to_events

ROWS = 100_000
COLUMNS = ("id", "updated_at", "payload")


class FakeNarrow:
    """The narrow table's rows in memory, read as a keyset source reads them."""

    name = "fake:narrow"
    cursor_column = "updated_at"
    pk_columns = ("id",)

    def __init__(self) -> None:
        self.tuples = [(i, i // 3, f"payload {i}") for i in range(ROWS)]
        self.keys = [(row[1], row[0]) for row in self.tuples]

    def fingerprint(self) -> str:
        return "sha256:fake-narrow"

    def fetch(self, after: Position, limit: int) -> Rows:
        start = 0
        if not after.is_beginning:
            start = bisect.bisect_right(self.keys, (after.cursor, after.pk["id"]))
        return Rows(COLUMNS, self.tuples[start : start + limit], plain=True)

    def to_events(self, rows: Any, *, poller: str, batch_id: str) -> list[RowChange]:
        return rows_to_events(
            rows,
            cursor_column=self.cursor_column,
            pk_columns=self.pk_columns,
            source=self.name,
            poller=poller,
            batch_id=batch_id,
        )

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--table", choices=sorted(LAYOUTS), default="narrow")
    parser.add_argument("--no-history", action="store_true", help="PollTrigger(history=False)")
    parser.add_argument("--drains", type=int, default=1, help="0: start-up only")
    parser.add_argument("--fake", action="store_true", help="no database (narrow rows)")
    args = parser.parse_args(argv)
    # valgrind runs the drain some 50 times slower: a bulk read's kept rows
    # (batch 100 reads 10 batches a query) would pass their one-second age and be
    # read again, as a drain at native speed does not, and the count would depend
    # on the machine's load. Their age is not what is being counted.
    age, bulk.MAX_AGE_SECONDS = bulk.MAX_AGE_SECONDS, 3600.0
    try:
        _drains(args)
    finally:
        bulk.MAX_AGE_SECONDS = age


def _drains(args: argparse.Namespace) -> None:
    options: dict[str, Any] = {"read_ahead": False}
    if args.no_history:
        options["history"] = False
    for _ in range(args.drains):
        started = time.process_time()
        if args.fake:
            trigger = PollTrigger(
                name="bench",
                source=FakeNarrow(),
                checkpoint_store=InMemoryCheckpointStore(),
                batch_size=args.batch,
                max_batches_per_tick=10**6,
                **options,
            )
            rows = trigger.tick(narrow_reading_handler)
        else:
            ds = dataset("postgresql", ROWS, layout=LAYOUTS[args.table])
            bc.PollTrigger = functools.partial(PollTrigger, **options)  # type: ignore[misc]
            rows = dbtrigger_drain(
                ds,
                args.batch,
                InMemoryCheckpointStore(),
                handler=ds.layout.reader,
                visibility="auto",
            )
        cpu = (time.process_time() - started) * 1e6 / max(rows, 1)
        print(f"{rows} rows, {cpu:.2f} us of CPU a row")
    if not args.drains and not args.fake:
        dataset("postgresql", ROWS, layout=LAYOUTS[args.table])


if __name__ == "__main__":
    main()
