"""The claim driver: one claim of a :class:`~dbtrigger.QueueTrigger`, start to end.

1. **Claim** up to ``batch_size`` claimable rows with a fresh claim token
   (one statement or transaction, see :mod:`dbtrigger.queue.statements`). The
   claim counts an attempt and hides the rows for
   ``visibility_timeout_seconds``. The rows of a claim that expired without
   an outcome (its worker died) are claimed again in halves
   (:mod:`dbtrigger.queue.pick`); a row isolated that way that has had
   ``max_attempts`` attempts goes dead here, without a handler call.
2. While the handler works, the trigger's heartbeat thread
   (:class:`~dbtrigger.runtime.kernel.KeepAlive`) pushes the claim's expiry
   on every ``heartbeat_interval_seconds``. Once the claim is lost (it holds no
   row any more, or no extension landed for the visibility timeout:
   :mod:`dbtrigger.queue.heartbeat`), ``ctx.cancelled`` turns true and an async
   handler is cancelled.
3. **Settle**: :func:`~dbtrigger.queue.outcome.decide` turns the handler's
   result and marks into done / retry / dead; dead rows are written to the
   ``quarantine`` (dead-letter) sink first (durably), then every outcome is
   recorded in one transaction fenced by the claim token. A row whose claim
   was lost is reported (``claims_lost`` in the result, WARNING
   ``claim_lost``, metric ``queue_rows_total{result="lost"}``), never
   overwritten.

With ``max_concurrency > 1`` the claimed rows are split into lanes
(:func:`dbtrigger.runtime.kernel.split`) that run at once on the trigger's
lane pool, each settled as soon as it finishes. How the handler is called
(shape, sync/async, cancellation) is the delivery kernel's, as for a poller.
"""

from __future__ import annotations

import datetime as dt
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from dbtrigger.errors import (
    CommitError,
    ConfigurationError,
    DbTriggerError,
    LostLeaseError,
    QuarantineError,
)
from dbtrigger.event_identity import EventIds
from dbtrigger.events import RowChange
from dbtrigger.quarantine import QuarantineSink, put_records
from dbtrigger.queue.context import ClaimContext
from dbtrigger.queue.expiries import say_expired
from dbtrigger.queue.health import InFlight
from dbtrigger.queue.heartbeat import ClaimBeat
from dbtrigger.queue.layout import ClaimedRow
from dbtrigger.queue.outcome import EXPIRED_ERROR, Plan, decide, expired_too_often
from dbtrigger.queue.source import ClaimSource
from dbtrigger.queue.statements import DeadItem, Key, Settled
from dbtrigger.runtime import kernel
from dbtrigger.runtime.call_watch import CallWatch, Watched
from dbtrigger.runtime.kernel import Handler, KeepAlive, Lanes
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.state.backoff import Backoff

#: A settlement that wrote nothing (every row it named was lost).
NOTHING_SETTLED = Settled(frozenset(), frozenset(), frozenset())


@dataclass(frozen=True)
class QueueTickResult:
    """What one tick did; ``rows``/``batches``/``outcome``/``more`` as for a poller's tick.

    ``rows`` counts rows completed (done); ``more`` is True when the last
    claim came back full or left claimable rows behind (rows of an expired
    claim are not mixed with others), so the runner claims again at once
    instead of sleeping. ``token`` is the last claim's.
    """

    rows: int
    batches: int
    outcome: str  # "settled", "idle" or "failed"
    more: bool = False
    claimed: int = 0
    retried: int = 0
    dead: int = 0
    claims_lost: int = 0
    token: str | None = None
    settled: tuple[tuple[Key, str], ...] = field(default=(), repr=False)
    #: Rows waiting for a retry (``ready``, tried, not due yet; any worker's) and
    #: when the first is due: counted when the tick leaves nothing claimable
    #: (see :meth:`QueueTrigger.tick_result <dbtrigger.QueueTrigger.tick_result>`).
    waiting_retries: int = 0
    next_retry_at: dt.datetime | None = None
    #: Rows under another live claim then, and when the first claim expires (a
    #: worker at work, or one killed mid-claim: claimable again once it expires).
    claimed_elsewhere: int = 0
    claim_expires_at: dt.datetime | None = None

    @property
    def caught_up(self) -> bool:
        """Nothing claimable now and no row waiting for a retry: a drain is over."""
        return self.outcome == "idle" and not self.more and not self.waiting_retries

    # A queue has no visibility guard and no partitions (the runner asks every trigger).
    @property
    def held_back(self) -> bool:
        return False

    @property
    def held_back_seconds(self) -> float:
        return 0.0

    @property
    def blocking_pid(self) -> int | None:
        return None

    @property
    def failing_partitions(self) -> tuple[str, ...]:
        return ()

    def summary(self, interval: float | None) -> tuple[str, dict[str, object]]:
        del interval  # a queue's line says what it settled, not when it looks again
        more = "; more claimable, claiming again at once" if self.more else ""
        fields: dict[str, object] = {"rows": self.rows, "batches": self.batches}
        waiting = ""
        if self.waiting_retries:
            fields["waiting_retries"] = self.waiting_retries
            due = self.next_retry_at
            waiting = f"; {self.waiting_retries:,} row(s) waiting for a retry" + (
                f", the first due at {due:%H:%M:%S}Z" if due is not None else ""
            )
        if self.claimed_elsewhere and self.claim_expires_at is not None:
            fields["claimed_elsewhere"] = self.claimed_elsewhere
            waiting += (
                f"; {self.claimed_elsewhere:,} row(s) under another claim (a worker at work, or "
                f"one that stopped: claimable again when it expires, the first at "
                f"{self.claim_expires_at:%H:%M:%S}Z)"
            )
        if self.outcome == "idle" and not (self.rows or self.retried or self.dead):
            return f"idle: nothing claimable{waiting}", fields
        # "dead", not "dead-lettered": without a dead-letter sink a dead row stays
        # in the table (dbt_status 'dead'), written nowhere else.
        return (
            f"{self.outcome}: {self.rows:,} row{'s' if self.rows != 1 else ''} done, "
            f"{self.retried} retried, {self.dead} dead{waiting}{more}",
            fields,
        )

    def then(self, later: QueueTickResult) -> QueueTickResult:
        """This claim's result followed by ``later``'s, as one tick's."""
        return QueueTickResult(
            rows=self.rows + later.rows,
            batches=self.batches + later.batches,
            outcome="settled" if "settled" in (self.outcome, later.outcome) else later.outcome,
            more=later.more,
            claimed=self.claimed + later.claimed,
            retried=self.retried + later.retried,
            dead=self.dead + later.dead,
            claims_lost=self.claims_lost + later.claims_lost,
            token=later.token,
            settled=self.settled + later.settled,
            waiting_retries=later.waiting_retries,
            next_retry_at=later.next_retry_at,
            claimed_elsewhere=later.claimed_elsewhere,
            claim_expires_at=later.claim_expires_at,
        )


@dataclass(frozen=True)
class ClaimSettings:
    """The trigger's configuration, as the driver needs it."""

    name: str
    owner_id: str
    batch_size: int
    visibility_timeout: float
    heartbeat_interval: float
    max_attempts: int
    backoff: Backoff
    quarantine: QuarantineSink | None
    #: ``handler_timeout_seconds``: a handler call is given up after it (None: never).
    handler_timeout: float | None = None


def _claim_lost(ctx: ClaimContext) -> None:
    """A cancelled async queue handler returns nothing: its rows were taken
    over, and the fenced settlement reports them lost."""
    del ctx


class ClaimDriver:
    """Claims, delivers and settles batches for one trigger; see the module doc."""

    def __init__(
        self,
        settings: ClaimSettings,
        *,
        source: ClaimSource,
        telemetry: Telemetry,
        keepalive: KeepAlive,
        lanes: Lanes | None,
        seed: int | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self.source = source
        self.telemetry = telemetry
        self.keepalive = keepalive
        self.lanes = lanes
        self._rng = random.Random(seed)  # noqa: S311 - jitter, not security
        self._ids = EventIds(settings.name, source.pk_columns)
        #: The claims whose handler call is running, by token (QueueTrigger.health).
        self.in_flight: dict[str, InFlight] = {}
        self.clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)

    def claim(self, handler: Handler) -> QueueTickResult:
        """Claim one batch, deliver it, settle it (see the module doc)."""
        s = self.settings
        token = uuid.uuid4().hex
        started = time.perf_counter()
        claim = self.source.claim_batch(
            limit=s.batch_size, token=token, worker=s.owner_id, visibility=s.visibility_timeout
        )
        claimed = claim.rows
        seconds = time.perf_counter() - started
        emit = self.telemetry.emit
        if not claimed:
            emit("queue_idle", values={"seconds": seconds})
            return QueueTickResult(0, 0, "idle", token=token)
        emit(
            "queue_claimed",
            "queue %s: claimed %d row(s) as %s",
            self.name,
            len(claimed),
            token,
            batch_id=token,
            rows=len(claimed),
            values={"seconds": seconds},
        )
        tally = _Tally(self, token)
        expired = [r for r in claimed if self._expired(r)]
        live = [r for r in claimed if not self._expired(r)]
        say_expired(emit, self.name, token, claim, expired, s.max_attempts)
        errors: list[DbTriggerError] = []
        if expired:
            dead = [DeadItem(r.key, EXPIRED_ERROR.format(expired=r.attempt - 1)) for r in expired]
            self._perform(token, expired, Plan(dead=dead), tally, errors)
        if live:
            lost = threading.Event()
            given_up = threading.Event()
            tally.unsettled = len(live)
            watch = CallWatch(self._watched(token, lost, given_up), token, len(live))
            self.in_flight[token] = InFlight(token, len(live), self.clock())
            try:
                with (
                    self.keepalive.holding(
                        token,
                        ClaimBeat(
                            name=self.name,
                            token=token,
                            source=self.source,
                            telemetry=self.telemetry,
                            interval=s.heartbeat_interval,
                            visibility=s.visibility_timeout,
                            lost=lost,
                            given_up=given_up,
                            settling=tally.settling,
                        ),
                        first_in=s.heartbeat_interval,
                    ),
                    self.keepalive.holding(f"call-{token}", watch.beat, first_in=watch.next_in()),
                ):
                    self._deliver(handler, token, live, lost, given_up, tally, errors)
            finally:
                self.in_flight.pop(token, None)
        emit(
            "queue_settled",
            "queue %s: claim %s settled: %d done, %d retried, %d dead, %d lost",
            self.name,
            token,
            tally.done,
            tally.retried,
            tally.dead,
            tally.lost,
            batch_id=token,
        )
        if errors:
            raise errors[0]
        return QueueTickResult(
            rows=tally.done,
            batches=1,
            outcome="settled",
            more=claim.more,
            claimed=len(claimed),
            retried=tally.retried,
            dead=tally.dead,
            claims_lost=tally.lost,
            token=token,
            settled=tuple(tally.settled),
        )

    def _expired(self, row: ClaimedRow) -> bool:
        return expired_too_often(row.attempt, self.settings.max_attempts, isolated=row.isolated)

    def _deliver(
        self,
        handler: Handler,
        token: str,
        rows: list[ClaimedRow],
        lost: threading.Event,
        given_up: threading.Event,
        tally: _Tally,
        errors: list[DbTriggerError],
    ) -> None:
        """The handler on the claimed rows, in lanes when configured; each lane settles."""
        events = self._events(token, rows)
        by_id = {e.event_id: r for e, r in zip(events, rows, strict=True)}
        wants_ctx = kernel.wants_context(handler)

        def lane(part: list[RowChange]) -> None:
            self._lane(handler, wants_ctx, token, part, by_id, lost, given_up, tally, errors)

        if self.lanes is None:
            lane(events)
            return
        parts = kernel.split(events, self.lanes.size)
        if len(parts) == 1:
            lane(parts[0])
            return
        for error in self.lanes.each(parts, lane, None):
            if error is not None:
                raise error

    def _events(self, token: str, rows: Sequence[ClaimedRow]) -> list[RowChange]:
        """One event per claimed row. ``pk`` and ``values`` of a :class:`ClaimedRow`
        are dicts built for that row alone, so they are frozen without a copy."""
        source = self.source.name
        ids = self._ids
        name = self.name
        return [
            RowChange._unchecked(
                ids(r.pk, r.cursor),
                "upsert" if r.values is not None else "delete",
                source,
                r.cursor,
                MappingProxyType(r.pk),
                None,
                None if r.values is None else MappingProxyType(r.values),
                MappingProxyType({"queue": name, "claim_token": token, "attempt": r.attempt}),
            )
            for r in rows
        ]

    def _lane(
        self,
        handler: Handler,
        wants_ctx: bool,
        token: str,
        events: list[RowChange],
        by_id: dict[str, ClaimedRow],
        lost: threading.Event,
        given_up: threading.Event,
        tally: _Tally,
        errors: list[DbTriggerError],
    ) -> None:
        rows = [by_id[e.event_id] for e in events]
        ctx = ClaimContext(
            queue_name=self.name,
            claim_token=token,
            owner_id=self.settings.owner_id,
            claimed_at=dt.datetime.now(dt.timezone.utc),
            keys={e.event_id: r.key for e, r in zip(events, rows, strict=True)},
            attempts={e.event_id: r.attempt for e, r in zip(events, rows, strict=True)},
            lost=lost,
        )
        failure: BaseException | None = None
        started = time.perf_counter()
        try:
            kernel.call(handler, events, ctx, wants_ctx, _claim_lost)
        except ConfigurationError:
            ctx.close()
            raise
        except Exception as exc:  # noqa: BLE001 - a handler failure is an outcome, sorted below
            failure = exc
        marks = ctx.close()
        emit = self.telemetry.emit
        emit("queue_handler_returned", values={"seconds": time.perf_counter() - started})
        if given_up.is_set():
            # handler_timeout_seconds ran out while the call ran: the claim was
            # left to expire and its rows go to another worker; record nothing.
            tally.add(token, Plan(done=[r.key for r in rows]), [], NOTHING_SETTLED)
            return
        if failure is not None:
            emit(
                "queue_handler_failed",
                "queue %s: handler failed on %d row(s) of claim %s: %s: %s",
                self.name,
                len(rows),
                token,
                type(failure).__name__,
                failure,
                batch_id=token,
                rows=len(rows),
                error=type(failure).__name__,
            )
        plan = decide(
            [(r.key, r.attempt) for r in rows],
            pks={r.key: r.pk for r in rows},
            marks=marks,
            failure=failure,
            max_attempts=self.settings.max_attempts,
            backoff=self.settings.backoff,
            rng=self._rng,
        )
        tally.to_settle(len(rows))
        self._perform(token, rows, plan, tally, errors)

    def _perform(
        self,
        token: str,
        rows: Sequence[ClaimedRow],
        plan: Plan,
        tally: _Tally,
        errors: list[DbTriggerError],
    ) -> None:
        """Dead-letter first, then one fenced settlement; account for every row."""
        dead = plan.dead
        sink = self.settings.quarantine
        if dead and sink is not None:
            try:
                self._dead_letter(sink, token, rows, dead)
            except QuarantineError as exc:
                self.telemetry.emit(
                    "queue_dead_letter_failed",
                    "queue %s: %d dead row(s) could not be written to %s (%s); they stay "
                    "claimed, expire and are dead-lettered again",
                    self.name,
                    len(dead),
                    sink.describe(),
                    exc,
                    batch_id=token,
                )
                errors.append(exc)
                dead = []
        try:
            settled = self.source.settle(token=token, done=plan.done, retry=plan.retry, dead=dead)
        except CommitError as exc:
            self.telemetry.emit(
                "queue_settle_failed",
                "queue %s: recording the outcomes of %d row(s) of claim %s failed: %s",
                self.name,
                len(rows),
                token,
                exc,
                batch_id=token,
            )
            errors.append(exc)
            return
        tally.add(token, plan, dead, settled)

    def _dead_letter(
        self,
        sink: QuarantineSink,
        token: str,
        rows: Sequence[ClaimedRow],
        dead: Sequence[DeadItem],
    ) -> None:
        by_key = {r.key: r for r in rows}
        doomed = [by_key[item.key] for item in dead]
        events = self._events(token, doomed)
        put_records(
            sink,
            kernel.dead_letter_records(
                [(e, item.error) for e, item in zip(events, dead, strict=True)],
                trigger=self.name,
                attempts={e.event_id: r.attempt for e, r in zip(events, doomed, strict=True)},
                checkpoint={"claim_token": token},
                batch_id=token,
                fencing_token=0,
                owner_id=self.settings.owner_id,
                now=dt.datetime.now(dt.timezone.utc),
            ),
        )

    def _watched(self, token: str, lost: threading.Event, given_up: threading.Event) -> Watched:
        """The claim as its handler call's :class:`CallWatch` sees it."""
        s = self.settings

        def time_out(watch: CallWatch, ran: float) -> None:
            given_up.set()
            lost.set()  # ctx.cancelled; an async handler's task is cancelled
            exc = LostLeaseError(
                f"the handler call on claim {token} ({watch.rows} rows) has run {ran:.1f} s, "
                f"past handler_timeout_seconds={s.handler_timeout:g}: the claim is no longer "
                f"extended, so its rows become claimable within visibility_timeout_seconds="
                f"{s.visibility_timeout:g} and another worker delivers them again; this call "
                "is cancelled (ctx.cancelled) and nothing it does is recorded",
                poller=self.name,
                batch_id=token,
            )
            self.telemetry.emit(
                "handler_timeout", "%s", exc, batch_id=token, rows=watch.rows, seconds=ran
            )

        return Watched(
            self.telemetry,
            "queue",
            "claim",
            "the claim is extended for it, so no other worker can take its rows over",
            s.visibility_timeout,
            s.handler_timeout,
            lost,
            time_out,
            {"claim_held": True},
        )


class _Tally:
    """Counts of one claim's outcomes, shared by its lanes."""

    def __init__(self, driver: ClaimDriver, token: str) -> None:
        self.driver = driver
        self.token = token
        self.done = self.retried = self.dead = self.lost = 0
        self.settled: list[tuple[Key, str]] = []
        self._lock = threading.Lock()
        #: Live rows whose settlement has not begun; ``settling`` is set once none.
        self.unsettled = 0
        self.settling = threading.Event()

    def to_settle(self, rows: int) -> None:
        """A lane's ``rows`` go to their settlement (the heartbeat then knows that a
        claim found holding no row was finished by it, not lost)."""
        with self._lock:
            self.unsettled -= rows
            if self.unsettled <= 0:
                self.settling.set()

    def add(self, token: str, plan: Plan, dead: Sequence[DeadItem], settled: Settled) -> None:
        wanted = [*plan.done, *(r.key for r in plan.retry), *(d.key for d in dead)]
        applied = settled.done | settled.retried | settled.dead
        lost = [k for k in wanted if k not in applied]
        with self._lock:
            self.done += len(settled.done)
            self.retried += len(settled.retried)
            self.dead += len(settled.dead)
            self.lost += len(lost)
            self.settled += [(k, "done") for k in settled.done]
            self.settled += [(k, "retry") for k in settled.retried]
            self.settled += [(k, "dead") for k in settled.dead]
            self.settled += [(k, "lost") for k in lost]
        name = self.driver.name
        emit = self.driver.telemetry.emit
        emit(
            "queue_rows_settled",
            values={
                "done": len(settled.done),
                "retried": len(settled.retried),
                "dead": len(settled.dead),
                "lost": len(lost),
            },
        )
        if lost:
            emit(
                "queue_rows_lost",
                "queue %s: %d row(s) of claim %s were no longer held by it (the claim "
                "expired, or someone else updated or deleted the row meanwhile); their "
                "outcome here was not recorded: %s",
                name,
                len(lost),
                token,
                lost[:10],
                batch_id=token,
                rows=len(lost),
            )
        for item in dead:
            if item.key in settled.dead:
                emit(
                    "queue_row_dead",
                    "queue %s: row %s is dead: %s",
                    name,
                    item.key,
                    item.error,
                    batch_id=token,
                )
