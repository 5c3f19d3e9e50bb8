"""What a trigger is to whoever drives it: ``dbtrigger run``, a Functions timer, a test.

Every trigger - :class:`~dbtrigger.PollTrigger`,
:class:`~dbtrigger.partitions.PartitionedPoller`,
:class:`~dbtrigger.QueueTrigger` - satisfies :class:`Trigger`, so the worker
loop (:mod:`dbtrigger.runtime.runner`) drives any of them without knowing
which (no import of the queue, no probing for methods), and its one log line
per tick is the tick's own :meth:`TickReport.summary`.

The options the triggers share are named once, here and in their
constructors: ``owner_id``, ``max_batches_per_tick``, ``quarantine``,
``retry_delay_seconds`` / ``retry_delay_max_seconds``, ``max_attempts``,
``max_concurrency``, ``heartbeat_interval_seconds``; a test lists them
(``tests/test_trigger_names.py``) and fails when the two triggers diverge.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from dbtrigger import _process
from dbtrigger.runtime.kernel import Handler

if TYPE_CHECKING:
    from typing_extensions import Self

    from dbtrigger.state.document import Lease


#: Batches per tick unless configured: one. A tick is then short and its
#: length predictable (one fetch or claim, one handler call, one commit or
#: settlement), which is what a Functions invocation under ``functionTimeout``
#: and a lease TTL or visibility timeout sized for one batch need; a worker
#: (``dbtrigger run``) loses little, because it ticks again at once while
#: batches come back full (for a poller the cost is one state read and one
#: lease write per batch: 1 read + 2 writes per batch instead of 1.1 writes at
#: 10). A trigger on a Functions timer should raise it to catch up between
#: firings (the example uses 10: a 10,000-row backlog at batch_size 100 drains
#: in 10 one-minute firings instead of 100), with batches x handler time well
#: inside functionTimeout.
DEFAULT_MAX_BATCHES_PER_TICK = 1


def default_owner_id() -> str:
    """``host/pid/random``: unique per trigger object, readable in ``status``."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def gone_holder(owner: str | None, release: str | None = None, lease: Lease | None = None) -> str:
    """What to say of a lease holder that was a process of this host no longer running.

    A worker killed (``kill -9``, a crash, a closed terminal) leaves its lease
    unreleased. When ``lease`` records a process of this machine that provably
    died (:mod:`dbtrigger._process`), a worker started here takes it over at
    once, and this says so. Otherwise the lease lapses a TTL later and the one
    started in its place waits that long, told only "lease held by ... until
    ...": going by the owner id alone, the pid may be another container's (a
    shared host name), so it says what it sees, and ``release``, the command
    that frees the lease (its poller and store filled in).
    """
    command = release or "dbtrigger release-lease POLLER --force --reason R --yes"
    why = _process.gone(lease) if lease is not None else None
    if why is not None and lease is not None and lease.process is not None:
        return (
            f" (its process, pid {lease.process.get('pid')} on this host, is gone: {why}; "
            f"a worker started on this machine takes the lease over at once, or `{command}` "
            "frees it now)"
        )
    host, _, rest = (owner or "").partition("/")
    pid_text = rest.partition("/")[0]
    ours = os.name == "posix" and host == socket.gethostname()
    if not ours or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return ""
    try:
        os.kill(int(pid_text), 0)  # signal 0: only asks whether it exists (POSIX)
    except ProcessLookupError:
        return (
            f" (pid {pid_text} is not running on this host: a worker that stopped without "
            f"releasing its lease; it lapses then, or `{command}` frees it now)"
        )
    except OSError:  # alive, another user's
        return ""
    return ""


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _for_how_long(seconds: float) -> str:
    from dbtrigger.runtime.quiet import for_how_long  # noqa: PLC0415 - a tiny leaf module

    return for_how_long(max(seconds, 0.0))


def _more_text(interval: float | None) -> str:
    """A worker ticks again at once; a timer firing (``interval`` None) does not:
    its rows wait for the next firing, and the line in Application Insights says so."""
    if interval is None:
        return "; more pending, left for the next tick (raise max_batches_per_tick to take more)"
    from dbtrigger.runtime.quiet import MORE_AT_ONCE  # noqa: PLC0415 - a tiny leaf module

    return MORE_AT_ONCE


@runtime_checkable
class TickReport(Protocol):
    """What one tick did, as the worker loop reads it."""

    @property
    def rows(self) -> int: ...

    @property
    def batches(self) -> int: ...

    @property
    def outcome(self) -> str: ...

    @property
    def more(self) -> bool:
        """Rows are likely pending: tick again at once instead of sleeping."""
        ...

    @property
    def caught_up(self) -> bool:
        """Nothing left to deliver: no row pending, none held back, none waiting
        for a retry (a worker's drain is over; its "caught up" line says so)."""
        ...

    @property
    def held_back(self) -> bool:
        """The visibility guard withheld rows (a queue never does)."""
        ...

    @property
    def held_back_seconds(self) -> float:
        """How long the guard has held them."""
        ...

    @property
    def failing_partitions(self) -> tuple[str, ...]:
        """A partitioned member's partitions whose last tick failed (else none)."""
        ...

    def summary(self, interval: float | None) -> tuple[str, dict[str, Any]]:
        """The text of the worker's log line for this tick (``interval``: the
        sleep that follows an idle tick; None for a timer firing) and its
        structured fields."""
        ...


@runtime_checkable
class Trigger(Protocol):
    """What ``dbtrigger run`` drives."""

    @property
    def name(self) -> str: ...

    @property
    def default_handler(self) -> Handler | None:
        """The handler registered with ``@trigger.handler``, if any."""
        ...

    @property
    def last_result(self) -> TickReport | None:
        """The last tick's result; a tick that raised leaves one with outcome
        ``"failed"`` counting what it completed before failing."""
        ...

    def tick_result(
        self, handler: Handler, *, should_stop: Callable[[], bool] | None = None
    ) -> TickReport:
        """One tick: up to ``max_batches_per_tick`` batches; ``should_stop`` is
        asked between batches."""
        ...

    def rows_behind(self) -> int | None:
        """Rows still to deliver, if the source can count them cheaply (progress lines)."""
        ...

    def wait_for_work(self, seconds: float, stop: threading.Event) -> bool:
        """The worker's idle sleep: up to ``seconds``, ended early by ``stop`` or
        by a wake-up hint (then True)."""
        ...

    def close(self) -> None:
        """Release the trigger's threads (lanes, heartbeat, listener); it may tick again."""
        ...


class ClosesOnExit(ABC):
    """``with trigger:``: the trigger is closed on the way out (its lanes,
    heartbeat thread, listener), however the block ends."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


Outcome = Literal["committed", "idle", "lease_busy", "lost_race", "failed"]


@dataclass(frozen=True)
class TickResult:
    """What one poller tick did. ``more`` is True when it stopped with rows likely pending.

    ``holder`` and ``lease_until`` say who holds the lease and until when
    (``lease_busy``); ``held_back``, ``held_back_seconds`` and
    ``blocking_pid`` are the visibility guard's report when it withheld rows
    on this tick's last fetch; ``error`` names the exception of a ``failed``
    tick (see :attr:`PollTrigger.last_result`), whose ``rows`` and
    ``batches`` count what it committed before failing.
    """

    rows: int
    batches: int
    outcome: Outcome
    more: bool = False
    holder: str | None = None
    lease_until: dt.datetime | None = None
    #: ``dbtrigger release-lease ...`` for this poller, when ``holder`` is a process
    #: of this host that no longer runs (``lease_busy``).
    release_command: str | None = None
    #: ``holder`` is this very trigger (its owner id): an earlier tick of it still
    #: runs in this process, as when a Functions timer fires again before the
    #: invocation before it ended (``lease_busy``).
    own_tick: bool = False
    #: Seconds since ``holder`` last renewed the lease, when it has missed a
    #: renewal (not renewed for half its TTL: killed, hung or cut off from the
    #: store), else None (``lease_busy``).
    not_renewed_seconds: float | None = None
    #: Seconds ``holder`` has held the lease, renewed, with no commit under it, when
    #: that is longer than its TTL (one batch past it: a slow or hung handler), else
    #: None (``lease_busy``).
    held_past_ttl_seconds: float | None = None
    held_back: bool = False
    held_back_seconds: float = 0.0
    blocking_pid: int | None = None
    error: str | None = None
    #: The checkpoint the tick left (None before the first commit) and when it
    #: was committed: consecutive lines then show the worker moving.
    checkpoint: Any = None
    committed_at: dt.datetime | None = None
    #: Events of the settled window still waiting for a retry, and the next due.
    waiting_retries: int = 0
    next_retry_at: dt.datetime | None = None
    #: Rows after the checkpoint the settled window kept back on the last read
    #: (it is full, or at its 75% mark, behind events waiting for a retry): an
    #: idle tick with rows waiting, never "nothing after the checkpoint".
    window_withheld: int = 0
    #: A partitioned member's tick: how many partitions it owned, each with a
    #: checkpoint of its own (None: a poller with one checkpoint, ``checkpoint``).
    partitions: int | None = None
    #: A partitioned member's partitions whose last tick failed: each backs off on
    #: its own, so the member's next round is due at the usual pace.
    failing_partitions: tuple[str, ...] = ()
    #: A partitioned member's partitions whose lease is still held by their previous
    #: owner (a live member finishing its batch in flight): their rows wait for it.
    handover: tuple[str, ...] = ()

    @property
    def holder_gone(self) -> bool:
        """``holder`` was a process of this host that no longer runs (``lease_busy``)."""
        return self.outcome == "lease_busy" and bool(gone_holder(self.holder))

    @property
    def caught_up(self) -> bool:
        """Nothing left to deliver now: idle, no event waits for a retry, no row held
        back, no partition waiting for its previous owner's batch."""
        return (
            self.outcome == "idle"
            and not self.more  # (a member's round with a partition taken over mid-tick)
            and not self.held_back
            and not self.waiting_retries
            and not self.window_withheld
            and not self.failing_partitions
            and not self.handover
        )

    def where(self) -> str:
        """``checkpoint 2026-...Z id=400 (committed 14:40:01.120Z)``: the position it left."""
        if self.partitions is not None:
            return f"checkpoints of its {self.partitions} partition(s)"
        cp = self.checkpoint
        at = self.committed_at
        when = f" (committed {at.strftime('%H:%M:%S.%f')[:-3]}Z)" if at is not None else ""
        # A commit that settled events without passing one (a fan-out subscriber
        # retrying the first rows) leaves the beginning: it once read "checkpoint None".
        if cp is None or getattr(cp, "is_beginning", False):
            return f"checkpoint (beginning){when}"
        parts = [str(cp.cursor.isoformat() if isinstance(cp.cursor, dt.datetime) else cp.cursor)]
        parts += [f"{k}={v}" for k, v in cp.pk.items()]
        return f"checkpoint {' '.join(parts)}{when}"

    def retries_text(self) -> str:
        if not self.waiting_retries:
            return ""
        due = (
            f", the next due at {self.next_retry_at:%H:%M:%S}Z"
            if self.next_retry_at is not None
            else ""
        )
        return f"; {self.waiting_retries} event(s) waiting for a retry{due}"

    def _busy_text(self, nxt: str) -> str:
        """Who holds the lease until when, and whether it is still renewed."""
        holder = self.holder or "another owner"
        until = (
            f" until {self.lease_until:%Y-%m-%dT%H:%M:%SZ}" if self.lease_until is not None else ""
        )
        gone = gone_holder(self.holder, self.release_command)
        if self.own_tick:
            holder += " (this trigger's own tick, still running in this process)"
        stale = ""
        if self.not_renewed_seconds is not None and not gone:
            stale = (
                f" (NOT RENEWED for {_for_how_long(self.not_renewed_seconds)}: its holder "
                "was killed, hangs or lost the store; this worker takes the lease over "
                "once it lapses)"
            )
        if self.held_past_ttl_seconds is not None and not stale:
            stale = (
                f" (renewed, but nothing committed under it for "
                f"{_for_how_long(self.held_past_ttl_seconds)}: one batch longer than the lease "
                "TTL, a slow or hung handler; its worker logs handler_slow, and the lease is "
                "not taken over while it is renewed)"
            )
        return f"lease held by {holder}{until}{gone}{stale}{nxt}"

    def summary(self, interval: float | None) -> tuple[str, dict[str, Any]]:
        """The line for this tick; ``interval`` None (a timer firing): no "next tick"."""
        nxt = f"; next tick in {interval:g}s" if interval is not None else ""
        if self.outcome == "committed":
            text = (
                f"committed {self.rows:,} row{'s' if self.rows != 1 else ''} in {self.batches} "
                f"batch{'es' if self.batches != 1 else ''}, {self.where()}"
                + self.retries_text()
                + (_more_text(interval) if self.more else "")
            )
        elif self.outcome == "idle":
            ago = ""
            if self.committed_at is not None:
                age = (utc_now() - self.committed_at).total_seconds()
                ago = f", last commit {_for_how_long(age)} ago"
            text = (
                f"idle: nothing after the {self.where()}; lag 0 rows{ago}{self.retries_text()}{nxt}"
            )
            if self.waiting_retries or self.failing_partitions or self.handover:
                # Rows after the checkpoint wait for their turn: never "nothing after"
                # nor "lag 0 rows" (`dbtrigger status` counts them behind).
                failing = ", ".join(self.failing_partitions)
                handover = ", ".join(self.handover)
                text = (
                    f"idle: nothing due after the {self.where()}{ago}{self.retries_text()}"
                    + (f"; partition(s) {failing} failing, backing off" if failing else "")
                    + (
                        f"; partition(s) {handover} still leased by their previous owner, "
                        "finishing a batch"
                        if handover
                        else ""
                    )
                    + nxt
                )
            if self.partitions == 0:
                text = f"standby: this member owns no partition (each has an owner){nxt}"
            if self.window_withheld:
                text = (
                    f"idle: rows after the {self.where()} held back by the settled window "
                    f"({self.window_withheld:,} in the last read) until the events it pins "
                    f"settle (the window_blocked warning names them){self.retries_text()}{nxt}"
                )
            if self.held_back:
                who = f" by pid {self.blocking_pid}" if self.blocking_pid is not None else ""
                text = (
                    f"idle: rows held back by the visibility guard{who} for "
                    f"{self.held_back_seconds:.0f}s (a transaction that may precede them is "
                    f"still open){nxt}"
                )
        elif self.outcome == "lease_busy":
            text = self._busy_text(nxt)
        elif self.outcome == "lost_race":
            text = f"another instance, or an overlapping tick of this one, took the lease{nxt}"
        else:
            text = f"{self.outcome}: {self.rows} rows"
        fields: dict[str, Any] = {"rows": self.rows, "batches": self.batches}
        if self.checkpoint is not None:
            fields["checkpoint"] = self.where()
        if self.committed_at is not None:
            fields["committed_at"] = self.committed_at.isoformat()
        if self.waiting_retries:
            fields["waiting_retries"] = self.waiting_retries
        if self.holder is not None:
            fields["holder"] = self.holder
        if self.lease_until is not None:
            fields["lease_until"] = self.lease_until.isoformat()
        if self.not_renewed_seconds is not None:
            fields["not_renewed_seconds"] = round(self.not_renewed_seconds, 1)
        if self.held_past_ttl_seconds is not None:
            fields["held_past_ttl_seconds"] = round(self.held_past_ttl_seconds, 1)
        if self.window_withheld:
            fields["window_withheld"] = self.window_withheld
        if self.held_back:
            fields["held_back_seconds"] = self.held_back_seconds
            fields["blocking_pid"] = self.blocking_pid
        return text, fields
