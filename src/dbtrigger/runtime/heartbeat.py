"""Keeping a lease alive while a long batch runs.

A lease lives ``lease_ttl_seconds`` from its last write. A handler that runs
longer than that would let another instance take the lease over and deliver
the same batch again (duplicate window W4), and that instance's handler might
be just as slow: the batch would bounce between instances for ever. So while a
tick holds the lease, the trigger's heartbeat thread
(:class:`~dbtrigger.runtime.kernel.KeepAlive`) renews it by compare-and-swap
(``heartbeat_at`` and ``expires_at`` moved forward, nothing else touched);
:class:`Heartbeat` is what one beat does.

Cost: the thread writes only when nothing else has written for a whole
interval. Every commit renews the lease too, so a tick whose batches each
finish within the interval never pays for a heartbeat; only a batch that is
still running after ``interval`` seconds does, one write per interval.

A renewal the store *rejects* means somebody else holds the lease now. The
thread sets the tick's ``lease_lost`` event (handlers see it as
``ctx.cancelled``; an async handler's task is cancelled), stops, and the tick
attempts no commit. A renewal that merely *fails* (store unreachable) is not a
loss yet: the lease may well still be ours, so the thread keeps trying. But
once the expiry of the last renewal that landed has passed without another
one landing, another instance may take the lease over at any moment and
deliver the same batch; this instance then treats the lease as lost (the
handler is cancelled, nothing is committed) and says so at ERROR, rather than
letting its handler run on beside the new owner's.

A handler call that never returns would keep the lease renewed for ever, and
every other worker of the poller would wait behind it. So each call is
watched on the same thread (:class:`CallWatch`): once it has run longer than
the lease TTL - which the contract sizes above the slowest batch, so past it
only the heartbeat keeps the lease - it is reported at WARNING, then at ERROR
after twice as long, four times, ... (at most an hour apart), naming the
batch and that the lease is held for it. With ``handler_timeout_seconds``
the call is given up when it runs out: the heartbeat stops renewing, the
handler is cancelled (``ctx.cancelled``, an async task cancelled) and
whatever it returns is not committed, as on a lost lease; the lease lapses
and another worker delivers the batch again (see docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from types import TracebackType
from typing import Any

from dbtrigger.errors import DbTriggerError, LostLeaseError
from dbtrigger.runtime.call_watch import CallWatch, Watched
from dbtrigger.runtime.kernel import KeepAlive
from dbtrigger.runtime.session import LeaseSession
from dbtrigger.runtime.telemetry import Telemetry
from dbtrigger.state import lease as leasemod
from dbtrigger.state.document import StateDocument, format_time


def default_interval(ttl_seconds: float) -> float:
    """A third of the TTL: two renewals can fail before the lease runs out."""
    return ttl_seconds / 3


@dataclass(eq=False, repr=False)
class Heartbeat:
    """Renews ``session``'s lease every ``interval`` seconds of write silence.

    Use as a context manager around everything the tick does while it holds
    the lease: the beats run on ``keepalive``'s thread, and leaving the block
    waits for a renewal in flight, so the tick's next write never races it for
    the etag. ``interval <= 0`` disables it (the seed's behaviour: a batch
    slower than the TTL can lose its lease).
    """

    session: LeaseSession
    _: KW_ONLY
    interval: float
    ttl: dt.timedelta
    clock: Callable[[], dt.datetime]
    lost: threading.Event
    telemetry: Telemetry
    keepalive: KeepAlive
    #: A handler call running this long is reported (default: the lease TTL).
    warn_after: float | None = None
    #: ``handler_timeout_seconds``: a call running this long is given up (None: never).
    timeout: float | None = None
    renewals: int = field(default=0, init=False)
    failures: int = field(default=0, init=False)
    #: A handler call outlived ``timeout``: the lease is no longer renewed.
    timed_out: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.poller = self.telemetry.poller
        self._key = f"lease-{self.session.token}"
        self._call_key = f"call-{self._key}"
        self._watched: Watched | None = None

    def __enter__(self) -> Heartbeat:
        if self.interval > 0:
            self.keepalive.hold(self._key, self.beat, first_in=self.interval)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.interval > 0:
            self.keepalive.release(self._key)

    def _renew(self) -> bool:
        session = self.session

        def transition(doc: StateDocument) -> StateDocument:
            return leasemod.decide_heartbeat(
                doc, owner=session.owner, token=session.token, now=self.clock(), ttl=self.ttl
            )

        return session.renew(transition, min_idle_seconds=self.interval)

    def _expires_at(self) -> dt.datetime | None:
        """The expiry our last landed write gave the lease (None: not ours)."""
        lease = self.session.document.lease
        if lease is None or lease.owner_id != self.session.owner:
            return None
        return lease.expires_at

    def _give_up(self, cause: DbTriggerError, expires_at: dt.datetime) -> None:
        exc = LostLeaseError(
            f"the lease (token {self.session.token}) expired at "
            f"{format_time(expires_at)} without a renewal landing "
            f"({self.failures} attempt(s) failed, last: {cause}); another instance may "
            "own the batch now, so this one stops: the handler is cancelled and nothing "
            "is committed",
            poller=self.poller,
            fencing_token=self.session.token,
        )
        self.session.lost = True
        self._stop("heartbeat_expired", "%s", exc, reason="expired_without_renewal")

    def _stop(self, event: str, text: str, exc: LostLeaseError, **fields: Any) -> None:
        """The lease is gone for this batch: flag it (the handler is cancelled,
        nothing commits) and report ``event`` with the error."""
        self.lost.set()
        self.telemetry.emit(
            event, text, exc, fencing_token=self.session.token, during="heartbeat", **fields
        )

    @contextlib.contextmanager
    def watching(self, batch_id: str, rows: int) -> Iterator[None]:
        """Watch the handler call(s) on batch ``batch_id`` while the block runs."""
        self.watch(batch_id, rows)
        try:
            yield
        finally:
            self.unwatch()

    def watch(self, batch_id: str, rows: int) -> None:
        """:meth:`watching` without a context manager (the tick's, once a batch):
        watch the handler call(s) on batch ``batch_id`` until :meth:`unwatch`."""
        watched = self._watched
        if watched is None:  # (the same for every batch under this lease)
            token = self.session.token
            watched = self._watched = Watched(
                self.telemetry,
                "poller",
                "batch",
                f"the lease (token {token}) is held for it, so no other worker of the poller "
                "can take the batch over",
                self.warn_after if self.warn_after is not None else self.ttl.total_seconds(),
                self.timeout,
                self.lost,
                self.time_out,
                {"fencing_token": token, "lease_held": True},
            )
        watch = CallWatch(watched, batch_id, rows)
        self.keepalive.hold(self._call_key, watch.beat, first_in=watch.next_in())

    def unwatch(self) -> None:
        self.keepalive.release(self._call_key)

    def time_out(self, watch: CallWatch, ran: float) -> None:
        """``watch``'s call outlived ``timeout``: give the lease up (on the heartbeat thread)."""
        self.timed_out = True
        expires_at = self._expires_at()
        lapse = f"lapses at {format_time(expires_at)}" if expires_at else "lapses"
        exc = LostLeaseError(
            f"the handler call on batch {watch.batch_id} ({watch.rows} rows) has run "
            f"{ran:.1f} s, past handler_timeout_seconds={self.timeout:g}: the lease "
            f"(token {self.session.token}) is no longer renewed and {lapse}, then another "
            "worker delivers the batch again; this call is cancelled (ctx.cancelled) and "
            "nothing it does is committed",
            poller=self.poller,
            batch_id=watch.batch_id,
            fencing_token=self.session.token,
        )
        self.session.lost = True
        self._stop(
            "handler_timeout", "%s", exc, batch_id=watch.batch_id, rows=watch.rows, seconds=ran
        )

    def beat(self) -> float | None:
        """One beat (on the heartbeat thread): renew if nothing was written for
        an interval; seconds until the next beat, or None once the lease is
        lost, given up or released."""
        if self.timed_out:
            return None  # a hung call: the lease lapses
        remaining = self.interval - self.session.idle_seconds()
        if remaining > 0:
            return remaining
        try:
            renewed = self._renew()
        except LostLeaseError as exc:
            self._stop(
                "heartbeat_rejected", "heartbeat rejected, the lease was taken over: %s", exc
            )
            return None
        except DbTriggerError as exc:
            # Unknown outcome or store down: not a loss while the lease
            # lasts. Try again after half an interval (sooner if the lease
            # runs out first); once it has run out, give it up.
            self.failures += 1
            expires_at = self._expires_at()
            if expires_at is not None and self.clock() >= expires_at:
                self._give_up(exc, expires_at)
                return None
            self.telemetry.emit(
                "heartbeat_failed",
                "heartbeat failed (%d in a row), will retry: %s",
                self.failures,
                exc,
                **{**exc.log_fields(), "fencing_token": self.session.token},
            )
            pause = self.interval / 2
            if expires_at is not None:
                until_expiry = (expires_at - self.clock()).total_seconds()
                pause = max(0.0, min(pause, until_expiry))
            return pause
        if not renewed:
            if self.session.released or self.session.lost:
                return None
            return 0.0  # a commit wrote meanwhile; wait out its interval
        self.renewals += 1
        self.failures = 0
        self.telemetry.emit(
            "lease_renewed",
            "lease renewed (token %s)",
            self.session.token,
            fencing_token=self.session.token,
        )
        return max(0.0, self.interval - self.session.idle_seconds())
