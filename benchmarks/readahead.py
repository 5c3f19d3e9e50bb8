"""Read-ahead off / always / adaptive (the default), in one process on the same code.

Drains the narrow table (PostgreSQL, memory store, reading handler) with
``PollTrigger(read_ahead=False)``, ``read_ahead="always"`` and
``read_ahead=True`` (adaptive), rotating the order each round, and prints the
median wall and client CPU (this process's, all threads) per row, and each
mode's per-round ratio to off. ``--rtt-ms`` simulates a database across a
network: every fetch first sleeps that long (the GIL released, as a socket
wait releases it). ``--batches-per-tick 1`` ticks one batch at a time, as
``dbtrigger run`` does.

    python -m benchmarks.readahead --batch 100 --rounds 4
    python -m benchmarks.readahead --batch 100 --rounds 4 --rtt-ms 1 --batches-per-tick 1
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.common import LAYOUTS, Dataset, dataset
from dbtrigger import InMemoryCheckpointStore, PollTrigger, SqlAlchemySource
from dbtrigger.cursor import Position

MODES: list[bool | str] = [False, "always", True]
NAMES = {False: "off", "always": "always", True: "adaptive"}


class FarSource(SqlAlchemySource):
    """A source whose every fetch first waits ``rtt`` seconds (a network round trip)."""

    rtt = 0.0

    def fetch(self, after: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        if self.rtt:
            time.sleep(self.rtt)
        return super().fetch(after, limit)


def drain(ds: Dataset, mode: bool | str, args: argparse.Namespace) -> tuple[float, float, str]:
    """Wall and CPU microseconds per row of one drain, and the read-ahead's counts."""
    source = FarSource(
        url=ds.url,
        table=ds.table,
        schema=ds.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
        visibility="auto",
    )
    source.rtt = args.rtt_ms / 1000
    trigger = PollTrigger(
        name="ra" + uuid.uuid4().hex[:8],
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        batch_size=args.batch,
        max_batches_per_tick=args.batches_per_tick,
        read_ahead=mode,
    )
    wall, cpu = time.perf_counter(), time.process_time()
    rows = 0
    while rows < ds.rows:
        rows += trigger.tick(ds.layout.reader)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    ra = trigger._driver.reader.read_ahead  # (its counts, reported)
    counts = f"started {ra.started} used {ra.used} skipped {ra.skipped}" if ra else ""
    trigger.close()
    source.close()
    return wall / rows * 1e6, cpu / rows * 1e6, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--batches-per-tick", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    ds = dataset("postgresql", args.rows, layout=LAYOUTS["narrow"])
    for mode in MODES:  # warm-up
        drain(ds, mode, args)
    runs: dict[bool | str, list[tuple[float, float, str]]] = {mode: [] for mode in MODES}
    for i in range(args.rounds):
        for mode in MODES[i % 3 :] + MODES[: i % 3]:
            runs[mode].append(drain(ds, mode, args))
    for mode in MODES:
        got = runs[mode]
        wall = statistics.median(r[0] for r in got)
        cpu = statistics.median(r[1] for r in got)
        line = f"{NAMES[mode]:8} wall {wall:6.2f} us/row  cpu {cpu:6.2f} us/row  {got[-1][2]}"
        if mode is not False:
            walls = [r[0] / o[0] for r, o in zip(got, runs[False], strict=True)]
            cpus = [r[1] / o[1] for r, o in zip(got, runs[False], strict=True)]
            line += (
                f"  /off wall {statistics.median(walls):.2f} "
                f"{[round(w, 2) for w in walls]} cpu {statistics.median(cpus):.2f}"
            )
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
