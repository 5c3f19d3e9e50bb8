"""Every runtime event, declared once: its log level and the metrics it moves.

The tick reports what happens as ``telemetry.emit("batch_committed", msg,
*args, values={...}, **fields)``. :data:`EVENTS` says what that means: the
record is logged at the declared level (``extra={"event": ..., "poller": ...,
**fields}``, so JSON/structlog users get the fields), and the declared metric
updates are applied, reading their amounts and labels from ``fields`` and
``values`` (numbers the metrics need but the log line does not carry). An
event with no level is metrics-only; one with no updates is log-only.

Keeping the table in one place is what keeps the two views consistent: a
counter cannot be bumped for an event that is not logged, or the other way
round, by a forgotten line at one of many call sites (httpcore's trace hooks
play the same role). ``tests/test_observability.py`` asserts the event
sequences and metric names; ``tests/test_telemetry.py`` checks the table
against :data:`dbtrigger.metrics.METRICS`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dbtrigger.errors import OperatorError
from dbtrigger.metrics import SafeMetrics

log = logging.getLogger("dbtrigger.runtime")


@dataclass(frozen=True)
class Count:
    """Increment counter ``metric`` by ``values[amount]`` (1 without ``amount``).

    ``labels`` are fixed; each name in ``label_keys`` becomes a label whose
    value is taken from the emitted fields/values under the same name.
    """

    metric: str
    amount: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    label_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Observe:
    """Record ``values[key]`` in histogram ``metric``."""

    metric: str
    key: str


@dataclass(frozen=True)
class Gauge:
    """Set gauge ``metric`` to ``const``, or to ``values[key]`` when that is not None.

    Each name in ``label_keys`` becomes a label valued from the emitted
    fields; the gauge is left alone when one of them is None.
    """

    metric: str
    key: str | None = None
    const: float | None = None
    label_keys: tuple[str, ...] = ()


Update = Count | Observe | Gauge


@dataclass(frozen=True)
class EventSpec:
    """``level``: the log level (None: metrics-only); ``updates``: the metrics it
    moves; ``log_as``: the ``event`` field the record carries when it is not the
    table key - two entries that share a public log name but not their metrics
    (the heartbeat's ``lease_lost`` explains a loss the batch then counts)."""

    level: int | None
    updates: tuple[Update, ...] = ()
    log_as: str | None = None


_LOST = (
    Count("batches_total", labels={"result": "lost"}),
    Count("failures_total", labels={"error_type": "LostLeaseError"}),
)
_FAILURE = Count("failures_total", label_keys=("error_type",))
_LAG_FAILED = Count("lag_measurement_failures_total", label_keys=("error_type",))
_HISTORY_FAILED = Count("history_append_failures_total", label_keys=("error_type",))

D, INFO, W, E = logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR

#: A poller's state document read before in this process is gone: none of dbtrigger's
#: commands deletes one (a reset writes it), so a hand, a script or a store now
#: pointing elsewhere did. Without it the poller is a new one and starts over; rows
#: are delivered again, none is lost - but a person should know, and may restore it.
STATE_VANISHED = (
    "the state document of poller %s is gone from its store (this process read it "
    "before): it was deleted by hand, or the store now points elsewhere. The poller "
    "starts over as a new one, so rows it delivered before are delivered again (none "
    "is lost). To go on from the old checkpoint instead, stop the workers and put the "
    "document back: dbtrigger reset POLLER --from-file FILE (the copy a backup or a "
    "command's dbtrigger-backups/ holds)"
)

#: event name -> (log level or None for metrics-only, metric updates).
_HISTORY_OVERFLOW = Count("history_queue_overflow_total", "count")

EVENTS: dict[str, EventSpec] = {
    # tick lifecycle
    "tick_start": EventSpec(D),
    "state_read_error": EventSpec(
        None, (Count("failures_total", labels={"error_type": "FetchError"}),)
    ),
    "state_read_failed": EventSpec(E),
    "state_vanished": EventSpec(E),
    "state_missing": EventSpec(W),
    "start_from_unchecked": EventSpec(W),
    "clock_skew_suspected": EventSpec(W),
    "lease_busy": EventSpec(
        D,
        (Count("lease_acquire_skipped_total"), Count("ticks_total", label_keys=("result",))),
    ),
    "tick_idle": EventSpec(
        D,
        (
            Count("ticks_total", labels={"result": "idle"}),
            Gauge("lag_rows", const=0),  # caught up: nothing after the checkpoint
            Gauge("lag_seconds", const=0.0),
        ),
    ),
    "tick_committed": EventSpec(
        None,
        (Count("ticks_total", labels={"result": "committed"}), Gauge("lag_rows", "lag_rows")),
    ),
    # fetching
    "fetched": EventSpec(None, (Observe("fetch_duration_seconds", "seconds"),)),
    "fetch_error": EventSpec(None, (Count("failures_total", labels={"error_type": "FetchError"}),)),
    "fetch_failed": EventSpec(E),
    "visibility": EventSpec(
        None,
        (
            Gauge("visibility_held_back", "held_back"),
            Gauge("visibility_held_back_seconds", "held_back_seconds"),
            Gauge("visibility_blocking_pid", "blocking_pid"),
        ),
    ),
    "null_check_failed": EventSpec(W),
    # a source holding data until it is checkpointed (a replication slot) failed to release
    "acknowledge_failed": EventSpec(W),
    "null_cursor_probe": EventSpec(None, (Gauge("null_cursor_rows", "count"),)),
    "null_cursor_rows": EventSpec(W),
    # an SQLite date/time cursor holding numbers beside text (numbers sort first)
    "cursor_numbers_before_text": EventSpec(W),
    "serialization_failed": EventSpec(
        E, (Count("failures_total", labels={"error_type": "SerializationError"}),)
    ),
    # the lease
    "lease_acquire_failed": EventSpec(E, (_FAILURE,)),
    "lease_acquired": EventSpec(D),
    "lease_lost": EventSpec(W, _LOST),
    # the heartbeat (runtime/heartbeat.py): a loss it sees is counted once, by
    # the batch that stops on it (lease_lost above)
    "lease_renewed": EventSpec(D, (Count("heartbeats_total"),)),
    "heartbeat_failed": EventSpec(W),
    "heartbeat_rejected": EventSpec(W, log_as="lease_lost"),
    "heartbeat_expired": EventSpec(E, log_as="lease_lost"),
    # a handler call that will not return (runtime/heartbeat.py CallWatch)
    "handler_slow": EventSpec(W),
    "handler_stuck": EventSpec(E),
    "handler_timeout": EventSpec(E),
    "lease_released": EventSpec(D),
    "lease_release_skipped": EventSpec(D),
    "lease_release_failed": EventSpec(W),
    "retried": EventSpec(None, (Count("retries_total", label_keys=("operation", "error_type")),)),
    # a batch
    "redelivery": EventSpec(None, (Count("redelivered_batches_total"),)),
    "rows_skipped_done": EventSpec(INFO),
    "batch_start": EventSpec(D),
    "handler_returned": EventSpec(None, (Observe("handler_duration_seconds", "seconds"),)),
    "handler_failed": EventSpec(
        E,
        (
            Count("batches_total", labels={"result": "failed"}),
            Count("failures_total", labels={"error_type": "HandlerError"}),
        ),
    ),
    "poison_batch": EventSpec(E),
    # the same batch failing again (runtime/poison_report.py): a reminder now and then
    "poison_batch_again": EventSpec(W, log_as="poison_batch"),
    # a lease taken over before it expired, its holder's process found gone (_process.py)
    "lease_holder_gone": EventSpec(W),
    # a lease taken over that its holder neither released nor renewed: the process
    # delivering the batch died (state/crashes.py); and a batch refused for it
    "delivery_died": EventSpec(W, (Count("failures_total", labels={"error_type": "ProcessDied"}),)),
    "crash_loop": EventSpec(E),
    "crash_isolated": EventSpec(W),
    "batch_bisected": EventSpec(W),
    "rows_quarantined": EventSpec(None, (Count("quarantined_total", "count"),)),
    "row_quarantined": EventSpec(W),
    # per batch: DEBUG; the tick's one INFO line is its driver's (dbtrigger run's
    # runner, or PollTrigger.run() for a timer firing)
    "batch_committed": EventSpec(
        D,
        (
            Observe("commit_duration_seconds", "seconds"),
            Observe("batch_size", "rows"),
            Count("batches_total", labels={"result": "committed"}),
            Count("events_total", "rows"),
            Gauge("last_success_timestamp", "timestamp"),
            Gauge("lag_seconds", "lag_seconds"),
            # How lag_seconds was measured (cursor, column:<name>, observed).
            Gauge("lag_basis", const=1, label_keys=("lag_basis",)),
        ),
    ),
    # lag_seconds is measured after the commit: a failure is counted and said
    # once (WARNING), then at DEBUG until a measurement succeeds; never raised
    "lag_measurement_failed": EventSpec(W, (_LAG_FAILED,)),
    "lag_measurement_failed_again": EventSpec(D, (_LAG_FAILED,), log_as="lag_measurement_failed"),
    "commit_failed": EventSpec(
        E, (Count("batches_total", labels={"result": "commit_failed"}), _FAILURE)
    ),
    "batch_partially_committed": EventSpec(D, (Count("events_total", "rows"),)),
    "failure_record_failed": EventSpec(W),
    "failure_uncounted": EventSpec(E, (_FAILURE,)),
    # per-event outcomes (ctx.reject / ctx.retry) and the settled window
    "event_outcomes": EventSpec(
        None,
        (
            Count("event_outcomes_total", "accepted", labels={"outcome": "accepted"}),
            Count("event_outcomes_total", "rejected", labels={"outcome": "rejected"}),
            Count("event_outcomes_total", "failed", labels={"outcome": "failed"}),
        ),
    ),
    "poison_event": EventSpec(E),
    "poison_event_again": EventSpec(W, log_as="poison_event"),
    # fan-out (subscribers=): each subscriber's outcomes, its failures and timeouts
    "subscriber_outcomes": EventSpec(
        None,
        tuple(
            Count(
                "subscriber_outcomes_total",
                outcome,
                labels={"outcome": outcome},
                label_keys=("subscriber",),
            )
            for outcome in ("accepted", "rejected", "failed")
        ),
    ),
    "subscriber_failed": EventSpec(W),
    "subscriber_timed_out": EventSpec(
        W, (Count("ack_timeouts_total", label_keys=("subscriber",)),)
    ),
    # Once per batch while a subscriber is busy; checkpoint_held says it once.
    "subscriber_busy": EventSpec(INFO),
    "subscriber_gone": EventSpec(W),
    "checkpoint_held": EventSpec(W),
    # Fan-out: the subscribers differ from the set the state document recorded.
    "subscriber_joined": EventSpec(W),
    "subscriber_left": EventSpec(INFO),
    # Left while another joined: perhaps an undeclared rename, whose owed events go.
    "subscriber_left_joined": EventSpec(W, log_as="subscriber_left"),
    "subscriber_renamed": EventSpec(INFO),
    "checkpoint_released": EventSpec(INFO),
    "window_changed": EventSpec(
        None, (Gauge("window_events", "events"), Gauge("window_bytes", "bytes"))
    ),
    # Said once per state change (the tick driver remembers the last one), not every tick.
    "window_blocked": EventSpec(W),
    "window_unblocked": EventSpec(INFO),
    "window_withheld": EventSpec(None, (Gauge("window_withheld_rows", "rows"),)),
    "window_entries_gone": EventSpec(INFO),
    "window_lookup_failed": EventSpec(W),
    "window_overflow": EventSpec(W, (Count("window_overflow_total", "count"),)),
    # the durable history (dbtrigger.history): appended after each commit; a
    # failure never undoes the commit, is counted, and said once per outage
    "history_appended": EventSpec(None, (Count("history_appends_total", "count"),)),
    "history_append_failed": EventSpec(W, (_HISTORY_FAILED,)),
    "history_append_failed_again": EventSpec(D, (_HISTORY_FAILED,), log_as="history_append_failed"),
    "history_append_recovered": EventSpec(INFO),
    "history_gap": EventSpec(W),
    "history_overtaken": EventSpec(INFO),
    "history_append_hung": EventSpec(W),
    "history_append_returned": EventSpec(INFO),
    "history_queue_overflow": EventSpec(W, (_HISTORY_OVERFLOW,)),
    "history_queue_overflow_again": EventSpec(
        D, (_HISTORY_OVERFLOW,), log_as="history_queue_overflow"
    ),
    "history_pruned": EventSpec(D, (Count("history_pruned_total", "count"),)),
    "history_prune_failed": EventSpec(W),
    # start positions (PollTrigger(start_from=...)): applied once, at creation
    "start_position": EventSpec(INFO),
    "start_from_ignored": EventSpec(INFO),
    # replays of recorded batches and of dead letters (dbtrigger.replay.batches)
    "replay_delivered": EventSpec(
        INFO,
        (
            Count("replays_total", label_keys=("mode",)),
            Count("replayed_events_total", "rows"),
        ),
    ),
    "replay_drift": EventSpec(
        W, (Count("replay_drift_rows_total", "count", label_keys=("kind",)),)
    ),
    "dead_letter_replayed": EventSpec(
        INFO, (Count("dead_letter_replays_total", "count", label_keys=("result",)),)
    ),
    # claim queues (dbtrigger.queue; logged to the "dbtrigger.queue" logger, and
    # "poller" is the queue's name)
    "queue_index_missing": EventSpec(W),
    "queue_idle": EventSpec(
        None,
        (
            Observe("queue_claim_duration_seconds", "seconds"),
            Count("ticks_total", labels={"result": "idle"}),
        ),
    ),
    "queue_claimed": EventSpec(
        D,
        (
            Observe("queue_claim_duration_seconds", "seconds"),
            Count("queue_claimed_total", "rows"),
        ),
    ),
    "queue_handler_returned": EventSpec(None, (Observe("handler_duration_seconds", "seconds"),)),
    "queue_handler_failed": EventSpec(
        W, (Count("failures_total", labels={"error_type": "HandlerError"}),)
    ),
    "queue_claim_extended": EventSpec(None, (Count("heartbeats_total"),)),
    "queue_claim_extend_failed": EventSpec(
        W, (Count("failures_total", labels={"error_type": "FetchError"}),)
    ),
    "queue_claim_lost": EventSpec(W),
    "queue_claim_bisected": EventSpec(W),
    "queue_claim_expired": EventSpec(W),
    "queue_crash_loop": EventSpec(E),
    "queue_dead_letter_failed": EventSpec(
        E, (Count("failures_total", labels={"error_type": "QuarantineError"}),)
    ),
    "queue_settle_failed": EventSpec(
        E, (Count("failures_total", labels={"error_type": "CommitError"}),)
    ),
    "queue_rows_settled": EventSpec(
        None,
        (
            Count("queue_rows_total", "done", labels={"result": "done"}),
            Count("queue_rows_total", "retried", labels={"result": "retry"}),
            Count("queue_rows_total", "dead", labels={"result": "dead"}),
            Count("queue_rows_total", "lost", labels={"result": "lost"}),
            Count("events_total", "done"),
        ),
    ),
    "queue_rows_lost": EventSpec(W),
    "queue_row_dead": EventSpec(W),
    "queue_settled": EventSpec(D, (Count("ticks_total", labels={"result": "settled"}),)),
    "queue_listening": EventSpec(INFO),
    "queue_listen_failed": EventSpec(W),
    "queue_notified": EventSpec(None, (Count("queue_notifications_total"),)),
    # A poller worker's notify wake-up hint (dbtrigger.wakeup.NotifyHint).
    "wake_listening": EventSpec(INFO),
    "wake_listen_failed": EventSpec(W),
    "wake_notified": EventSpec(None, (Count("wake_notifications_total"),)),
}


class Telemetry:
    """Emits :data:`EVENTS` for one poller (or queue) to a logger and its metrics.

    ``logger`` defaults to ``dbtrigger.runtime``; claim queues pass
    ``dbtrigger.queue`` so their records keep their own logger name.
    """

    def __init__(
        self, poller: str, metrics: SafeMetrics, *, logger: logging.Logger | None = None
    ) -> None:
        self.poller = poller
        self.metrics = metrics
        self.log = logger or log

    def logs(self, event: str) -> bool:
        """Would :meth:`emit` log ``event`` now? For a caller whose fields cost
        more to build than the record is worth when nobody reads it (per batch:
        checkpoint positions as JSON), while its metrics need none of them."""
        level = EVENTS[event].level
        return level is not None and self.log.isEnabledFor(level)

    def emit(
        self,
        event: str,
        msg: str = "",
        *args: Any,
        values: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        """Log ``event`` (attributed to the caller's line) and apply its metrics.

        An exception among ``args`` gives the record and the metrics its
        ``error_type`` (unless one is given)."""
        spec = EVENTS[event]
        error = next((a for a in args if isinstance(a, BaseException)), None) if args else None
        if spec.level is not None and self.log.isEnabledFor(spec.level):
            extra = {"event": spec.log_as or event, "poller": self.poller, **fields}
            if error is not None:
                # Log sinks (the CLI, JSON collectors) can tell a failure a
                # person must fix from one the next tick may not repeat.
                extra.setdefault("error_type", type(error).__name__)
                extra.setdefault("operator_error", isinstance(error, OperatorError))
            self.log.log(spec.level, msg, *args, extra=extra, stacklevel=2)
        if not spec.updates or not self.metrics.enabled:
            return
        data = {**fields, **(values or {})}
        if error is not None:
            data.setdefault("error_type", type(error).__name__)
        for update in spec.updates:
            self._apply(update, data)

    def _apply(self, update: Update, data: Mapping[str, Any]) -> None:
        if isinstance(update, Count):
            amount = data[update.amount] if update.amount is not None else 1
            if not amount:
                return
            labels = {**update.labels, **{k: str(data[k]) for k in update.label_keys}}
            self.metrics.increment(update.metric, amount, labels=labels or None)
        elif isinstance(update, Observe):
            self.metrics.observe(update.metric, data[update.key])
        else:
            value = update.const if update.key is None else data.get(update.key)
            keyed = {k: data.get(k) for k in update.label_keys}
            if value is not None and None not in keyed.values():
                named = {k: str(v) for k, v in keyed.items()}
                self.metrics.set_gauge(update.metric, float(value), labels=named or None)

    def on_retry(self, operation: str, attempt: int, exc: BaseException, wait: float) -> None:
        """A :class:`~dbtrigger.runtime.retry.RetryPolicy` hook: count the retry."""
        del attempt, wait
        self.emit("retried", values={"operation": operation, "error_type": type(exc).__name__})
