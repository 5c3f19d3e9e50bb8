"""``dbtrigger backfill`` runs the handler under the trigger's own settings.

The backfill built a ``PollTrigger`` of its own from a handful of the
trigger's options (source, batch size, lease TTL, journal limit) and dropped
the rest: the dead-letter sink (``quarantine=``), ``max_attempts``, the retry
backoff, the window bounds, lanes, history, metrics, read-ahead. A handler
that called ``ctx.reject(event, reason)`` then raised ``ConfigurationError``
("this poller has none") and failed the batch, which stopped the backfill
(no row lost: a misused reject fails the batch even if swallowed); retried events
came back on the default backoff and were dead-lettered (nowhere) after the
default number of attempts. Now the backfill's trigger is the user's trigger
with a listed few options replaced (:data:`dbtrigger.cli.backfill.OVERRIDDEN`),
and a new ``PollTrigger`` option fails :func:`test_every_option_is_carried_or_overridden`
until someone decides which it is.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

from dbtrigger import FileCheckpointStore, PollTrigger, RetryPolicy
from dbtrigger.cli import main
from dbtrigger.cli.backfill import OVERRIDDEN, backfill_trigger
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.state.stores.memory import InMemoryCheckpointStore
from dbtrigger.testing import MemoryQuarantineSink
from tests.databases import TestDatabase
from tests.test_source_sqlalchemy import insert, naive, orders_table, source_for

#: The options a backfill takes from the user's trigger as they are. A new
#: ``PollTrigger`` option belongs here or in ``OVERRIDDEN`` (with its reason in
#: docs/operations.md): the test below fails until it is in one of them.
CARRIED = frozenset(
    {
        "source",
        "lease_ttl_seconds",
        "metrics",
        "clock",
        "journal_limit",
        "null_check_interval_seconds",
        "heartbeat_interval_seconds",
        "retry",
        "quarantine",
        "max_attempts",
        "quarantine_limit",
        "retry_delay_seconds",
        "retry_delay_max_seconds",
        "window_max_events",
        "window_max_bytes",
        "max_concurrency",
        "handler_timeout_seconds",
        "history",
        "read_ahead",
        "bulk_reads",
    }
)


def test_every_option_is_carried_or_overridden() -> None:
    options = set(inspect.signature(PollTrigger).parameters)
    assert not CARRIED & OVERRIDDEN
    assert options == CARRIED | OVERRIDDEN, (
        f"PollTrigger options backfill neither carries nor overrides: "
        f"{sorted(options - CARRIED - OVERRIDDEN)}; options listed that PollTrigger lacks: "
        f"{sorted((CARRIED | OVERRIDDEN) - options)}"
    )


def test_the_backfill_trigger_keeps_every_carried_setting(tmp_path: Path) -> None:
    """Each carried option given a value other than its default comes through as given."""
    source = InMemorySourceStub()
    given: dict[str, Any] = {
        "lease_ttl_seconds": 90,
        "metrics": InMemoryMetrics(),
        "clock": lambda: None,
        "journal_limit": 7,
        "null_check_interval_seconds": 0,
        "heartbeat_interval_seconds": 10,
        "retry": RetryPolicy.none(),
        "quarantine": MemoryQuarantineSink(),
        "max_attempts": 2,
        "quarantine_limit": 3,
        "retry_delay_seconds": 0.5,
        "retry_delay_max_seconds": 9,
        "window_max_events": 50,
        "window_max_bytes": 4096,
        "max_concurrency": 3,
        "handler_timeout_seconds": 30,
        "history": False,
        "read_ahead": False,
        "bulk_reads": False,
    }
    assert set(given) == CARRIED - {"source"}
    defaults = inspect.signature(PollTrigger).parameters
    assert all(given[k] != defaults[k].default for k in given)
    user = PollTrigger(
        name="orders",
        source=source,  # type: ignore[arg-type]
        checkpoint_store=InMemoryCheckpointStore(),
        owner_id="orders-worker-1",
        start_from="beginning",
        **given,
    )
    store = FileCheckpointStore(tmp_path)
    args = argparse.Namespace(new_poller="orders-backfill", batch_size=None, batches_per_tick=10)
    worker = backfill_trigger(user, args, store)
    try:
        for name in CARRIED:
            assert worker.options[name] is user.options[name], name
        assert worker.name == "orders-backfill"
        assert worker.store is store
        assert worker.owner_id != user.owner_id  # two backfills never share a lease owner
        assert worker.options["start_from"] is None  # its start is in its own document
        assert worker.batch_size == user.batch_size
        assert worker.max_batches_per_tick == 10
        assert worker.quarantine is given["quarantine"]
        assert worker.max_attempts == 2
        assert worker.max_concurrency == 3
    finally:
        worker.close()
        user.close()


class InMemorySourceStub:
    """A source that is never read: the options test builds triggers only."""

    name = "stub"

    def fingerprint(self) -> str:
        return "sha256:stub"

    def fetch(self, after: Any, limit: int) -> Any:
        raise AssertionError("not read")


def test_backfill_dead_letters_rejects_and_retries_on_the_triggers_settings(
    db: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reject goes to the trigger's dead-letter sink; a retried event comes back
    on the trigger's backoff (0 s here) and is dead-lettered after its
    ``max_attempts`` (2). Before: the reject raised ConfigurationError ("no
    dead-letter sink") in the handler and the backfill stopped on it."""
    table = orders_table(db)
    insert(db, table, [{"id": i, "updated_at": naive(i)} for i in (1, 2, 3, 4)])
    sink = MemoryQuarantineSink()
    trigger = PollTrigger(
        name="orders",
        source=source_for(db, visibility="none"),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        quarantine=sink,
        max_attempts=2,
        retry_delay_seconds=0,
        retry_delay_max_seconds=0,
    )
    delivered: list[tuple[int, int]] = []

    @trigger.handler
    def handle(events: Any, ctx: Any) -> None:
        for e in events:
            delivered.append((int(e.pk["id"]), ctx.attempts(e)))
            if e.pk["id"] == 2:
                ctx.reject(e, "malformed address")
            elif e.pk["id"] == 3:
                ctx.retry(e, "billing answered 503")

    module = types.ModuleType(f"backfill_settings_{uuid.uuid4().hex[:8]}")
    module.trigger = trigger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.delenv("DBTRIGGER_STORE", raising=False)
    argv = ["backfill", "orders-backfill", "--trigger", f"{module.__name__}:trigger"]
    try:
        code = main([*argv, "--from-beginning", "--reason", "rebuild", "--yes"])
    finally:
        trigger.close()
    assert code == 0
    assert sorted(delivered) == [(1, 1), (2, 1), (3, 1), (3, 2), (4, 1)]
    dead = {int(r.pk["id"]): r for r in sink.records("orders-backfill")}
    assert sorted(dead) == [2, 3]
    assert "malformed address" in str(dead[2].error)
    state = trigger.store.read("orders-backfill")
    assert state is not None
    assert trigger.store.read("orders") is None  # the live poller was never touched
