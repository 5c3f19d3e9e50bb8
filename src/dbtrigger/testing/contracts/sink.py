"""The dead-letter (``QuarantineSink``) contract, run against every implementation.

A sink is where a row goes that the poller will move past: the checkpoint
advances right after ``put`` returns, so a record a sink loses is a row lost.
What every sink must do (see :class:`~dbtrigger.quarantine.QuarantineSink`):

* ``put`` is durable when it returns, and keeps every field of every record
  (row values of every type, long rows, non-ASCII text);
* ``put`` may be called again with the same records (a commit that failed
  after the put): storing them once is best, twice is acceptable, losing them
  is not;
* records are keyed by (poller, event_id): the same event of two pollers is
  two records;
* concurrent ``put`` calls (pollers in threads sharing a sink) lose nothing;
* a sink that cannot store raises :class:`~dbtrigger.errors.QuarantineError`
  (retry next tick), never another exception type, and never returns quietly.

Subclass :class:`SinkContract` and provide two fixtures, ``sink`` (fresh and
empty) and ``unavailable_sink`` (one whose storage is unreachable or
unwritable). The suite reads records back with :meth:`SinkContract.stored`,
which calls ``sink.records()``; override it for a sink that reads back another
way.
"""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from dbtrigger.cursor import Position
from dbtrigger.errors import QuarantineError
from dbtrigger.event_identity import make_event_id
from dbtrigger.events import RowChange
from dbtrigger.quarantine import QuarantineRecord, QuarantineSink
from dbtrigger.testing.contracts._threads import run_together

_AT = dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=dt.timezone.utc)


def make_record(
    n: int,
    *,
    poller: str = "orders",
    row: dict[str, Any] | None = None,
    error: str = "ValueError: no customer id",
) -> QuarantineRecord:
    """Record ``n``: a row that failed alone, as the runtime builds it."""
    pk = {"id": n}
    cursor = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=n)
    event = RowChange(
        event_id=make_event_id(poller, pk, cursor),
        op="upsert",
        source="postgresql:public.orders",
        cursor=cursor,
        pk=pk,
        before=None,
        after=row if row is not None else {"id": n, "customer": None, "total": n * 10},
        metadata={"poller": poller},
    )
    return QuarantineRecord.from_event(
        event,
        poller=poller,
        error=ValueError(error.split(": ", 1)[-1]),
        attempts=3,
        checkpoint=Position(cursor=cursor - dt.timedelta(seconds=1), pk={"id": n - 1}),
        batch_id=f"batch_20240506_070809_7_{n:04d}",
        fencing_token=7,
        owner_id="host-1/4242",
        now=_AT,
    )


def _ids(records: Sequence[QuarantineRecord]) -> Counter[tuple[str, str]]:
    return Counter((r.poller, r.event_id) for r in records)


class SinkContract:
    """The sink contract: inherit and define ``sink`` and ``unavailable_sink`` fixtures."""

    @pytest.fixture
    def sink(self) -> QuarantineSink:
        raise NotImplementedError("define a sink fixture returning a fresh, empty sink")

    @pytest.fixture
    def unavailable_sink(self) -> QuarantineSink:
        raise NotImplementedError(
            "define an unavailable_sink fixture: a sink whose storage cannot be written"
        )

    def stored(self, sink: QuarantineSink) -> list[QuarantineRecord]:
        """Every record the sink holds (override for a sink without ``records()``)."""
        records = getattr(sink, "records", None)
        if records is None:
            raise NotImplementedError(f"{type(sink).__name__} has no records(): override stored()")
        return list(records())

    def assert_same(self, got: QuarantineRecord, want: QuarantineRecord) -> None:
        """Every field survives the round trip (``quarantined_at`` to the second)."""
        assert got.to_json() == want.to_json()

    def _by_id(self, sink: QuarantineSink) -> dict[tuple[str, str], QuarantineRecord]:
        return {(r.poller, r.event_id): r for r in self.stored(sink)}

    # --- the tests ------------------------------------------------------------------

    def test_is_a_quarantine_sink(self, sink: QuarantineSink) -> None:
        assert isinstance(sink, QuarantineSink)
        assert isinstance(sink.describe(), str)
        assert sink.describe()

    def test_empty_put_stores_nothing(self, sink: QuarantineSink) -> None:
        sink.put([])
        assert self.stored(sink) == []

    def test_put_keeps_every_field(self, sink: QuarantineSink) -> None:
        records = [make_record(n) for n in range(1, 4)]
        sink.put(records)
        got = self._by_id(sink)
        assert set(got) == set(_ids(records))
        for record in records:
            self.assert_same(got[(record.poller, record.event_id)], record)

    def test_row_values_of_every_type_round_trip(self, sink: QuarantineSink) -> None:
        row = {
            "id": 1,
            "naive": dt.datetime(2024, 2, 29, 23, 59, 59, 999999),
            "aware": dt.datetime(2024, 2, 29, 23, 59, 59, 1, tzinfo=dt.timezone.utc),
            "day": dt.date(2024, 2, 29),
            "amount": decimal.Decimal("12345678901234567890.123456789"),
            "ratio": 0.1,
            "infinite": float("inf"),
            "ref": uuid.UUID("12345678-1234-5678-1234-567812345678"),
            "blob": b"\x00\xff",
            "flag": True,
            "nothing": None,
            "tags": ["a", 1, None],
            "nested": {"k": [dt.date(2024, 1, 1)]},
            "text": "ünïcødé ✓ 日本",
        }
        record = make_record(1, row=row, error="KeyError: 'ünïcødé'")
        sink.put([record])
        (got,) = self.stored(sink)
        self.assert_same(got, record)

    def test_a_long_row_is_kept_whole(self, sink: QuarantineSink) -> None:
        # Poison rows are often the big ones: a 1 MB text column.
        record = make_record(1, row={"id": 1, "body": "x" * 1_000_000 + "end"})
        sink.put([record])
        (got,) = self.stored(sink)
        self.assert_same(got, record)

    def test_a_repeated_put_loses_nothing(self, sink: QuarantineSink) -> None:
        records = [make_record(n) for n in range(1, 4)]
        sink.put(records)
        sink.put(records)  # the commit after the first put failed; the tick retried
        stored = self.stored(sink)
        copies = _ids(stored)
        assert set(copies) == set(_ids(records))
        assert all(1 <= n <= 2 for n in copies.values()), copies
        want = {(r.poller, r.event_id): r for r in records}
        for got in stored:
            self.assert_same(got, want[(got.poller, got.event_id)])

    def test_later_puts_add_to_earlier_ones(self, sink: QuarantineSink) -> None:
        sink.put([make_record(1)])
        sink.put([make_record(2), make_record(3)])
        assert set(_ids(self.stored(sink))) == set(_ids([make_record(n) for n in (1, 2, 3)]))

    def test_the_same_event_of_two_pollers_is_two_records(self, sink: QuarantineSink) -> None:
        one = make_record(1, poller="billing")
        two = make_record(1, poller="search")
        two = QuarantineRecord.from_json({**two.to_json(), "event_id": one.event_id})
        sink.put([one])
        sink.put([two])
        got = self._by_id(sink)
        assert set(got) == {("billing", one.event_id), ("search", one.event_id)}
        self.assert_same(got[("billing", one.event_id)], one)
        self.assert_same(got[("search", one.event_id)], two)

    def test_concurrent_puts_lose_nothing(self, sink: QuarantineSink) -> None:
        writers, per_writer = 4, 5

        def write(w: int) -> None:
            for n in range(per_writer):
                sink.put([make_record(w * 100 + n)])

        assert run_together(writers, write) == []
        want = {
            make_record(w * 100 + n).event_id for w in range(writers) for n in range(per_writer)
        }
        assert {r.event_id for r in self.stored(sink)} == want

    def test_a_sink_that_cannot_store_raises_quarantine_error(
        self, unavailable_sink: QuarantineSink
    ) -> None:
        with pytest.raises(QuarantineError):
            unavailable_sink.put([make_record(1)])


__all__ = ["SinkContract", "make_record"]
