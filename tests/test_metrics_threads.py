"""InMemoryMetrics is fed by lane and subscriber threads at once: no lost counts."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from dbtrigger.metrics import InMemoryMetrics

THREADS = 8
PER_THREAD = 20_000


@pytest.fixture
def busy_switching() -> Iterator[None]:
    """Switch threads as often as the interpreter allows, so races show."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _hammer(metrics: InMemoryMetrics, worker: int) -> None:
    for i in range(PER_THREAD):
        metrics.increment("events_total", labels={"poller": "p"})
        metrics.observe("batch_seconds", 0.001)
        metrics.set_gauge("window_events", i, labels={"lane": str(worker)})
        # Readers run while writers add label sets.
        if i % 1000 == 0:
            metrics.total("events_total")
            metrics.gauge("window_events", lane=str(worker))


@pytest.mark.usefixtures("busy_switching")
def test_concurrent_updates_lose_nothing() -> None:
    metrics = InMemoryMetrics()
    threads = [threading.Thread(target=_hammer, args=(metrics, w)) for w in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert metrics.total("events_total") == THREADS * PER_THREAD
    assert len(metrics.observations[("batch_seconds", ())]) == THREADS * PER_THREAD
    assert metrics.gauge("window_events", lane="3") == PER_THREAD - 1
