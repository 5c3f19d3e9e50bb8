"""What a long history costs the commands that read it.

``dbtrigger history`` without --all, --since or --batch shows the last 20
records, and reads only the newest ones for them: at 128 MiB of history (half
the default retention) reading it all took 10 s and 1.8 GB of memory, for 20
lines. What it shows, the earlier count it prints and the gaps it marks are
those of reading everything. A rewind's plan looked each commit up in the list
of commits: its dry run took 77 s at 39,000 records (3 s now), and it read
every commit's per-event detail, which it does not use but for the first batch
(465 MB of memory for 78 MB of history; 211 MB without).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dbtrigger.history import FileHistory, load
from dbtrigger.history.positions import plan_rewind
from dbtrigger.history.view import load_last, with_detail


class CountingHistory(FileHistory):
    """Counts the records its reads give."""

    given = 0

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        for record in super().read(poller, since_seq=since_seq):
            self.given += 1
            yield record


def test_the_last_records_are_read_without_the_rest(tmp_path: Path) -> None:
    history = CountingHistory(tmp_path, segment_bytes=1024)
    for n in range(1, 401):
        history.append("orders", [{"id": f"r{n}", "type": "manual", "n": n}], after_seq=n - 1)
    # A record lost near the end (removed by hand) is marked as when reading all.
    lost = '"id":"r395"'
    (segment,) = [p for p in tmp_path.glob("*.jsonl") if lost in p.read_text()]
    lines = segment.read_text().splitlines(True)
    segment.write_text("".join(line for line in lines if lost not in line))
    history.given = 0
    last, earlier = load_last(history, "orders", None, 20)
    assert history.given <= 60  # the newest 40, a segment's worth more, and the first
    everything = load(history, "orders")
    assert last == everything[-20:]
    assert [r["type"] for r in last].count("gap") == 1
    assert earlier == len(everything) - 20


def test_a_short_history_is_read_whole(tmp_path: Path) -> None:
    history = FileHistory(tmp_path)
    history.append("orders", [{"id": f"r{n}", "type": "manual"} for n in range(5)], after_seq=0)
    assert load_last(history, "orders", None, 20) == (load(history, "orders"), 0)
    assert load_last(history, "orders", None, 3) == (load(history, "orders")[-3:], 2)
    assert load_last(history, "nobody", None, 20) == ([], 0)


class Probe:
    """A value that counts how often records holding it are compared."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        Probe.compared += 1
        return True

    __hash__ = None  # type: ignore[assignment]


def _position(n: int) -> dict[str, Any]:
    kinds = {"id": "int"}
    return {"kind": "int+pk", "value": n, "tiebreaker": {"id": n}, "tiebreaker_kinds": kinds}


def test_a_rewind_plan_compares_each_commit_a_bounded_number_of_times() -> None:
    count = 2000
    records = [
        {"probe": Probe(), "seq": n, "id": f"r{n}", "type": "commit", "batch_id": f"b{n}",
         "at": f"2026-01-01T00:00:{n % 60:02d}Z", "from": _position(n - 1), "to": _position(n),
         "rows": 1}
        for n in range(1, count + 1)
    ]  # fmt: skip
    Probe.compared = 0
    rewind = plan_rewind(records, to_batch="b10")
    assert len(rewind.batches) == count - 9
    assert Probe.compared < 4 * count


def test_a_load_without_details_reads_one_back(tmp_path: Path) -> None:
    history = FileHistory(tmp_path)
    detail = {"format": 2, "crcs": [1, 2, 3]}
    history.append(
        "orders",
        [{"id": f"r{n}", "type": "commit", "batch_id": f"b{n}", "detail": detail} for n in (1, 2)],
        after_seq=0,
    )
    light = load(history, "orders", details=False)
    assert [("detail" in r, r.get("detail_unread")) for r in light] == [(False, True)] * 2
    assert with_detail(history, "orders", light[1]) == load(history, "orders")[1]
