"""Where a tick's batches come from: the state document it starts from, the
rows of each batch, and the read of the next batch while lanes run.

:class:`BatchReader` does every read of a tick for :class:`~dbtrigger.runtime.tick.TickDriver`:
the state document (checked to be this poller's, its source definition the
configured one), the source's rows after a position (retried under the
tick's :class:`~dbtrigger.runtime.retry.RetryPolicy`, with the garbage
collector paused while the batch is built), the choice of the rows to hand
out against the settled window (:func:`dbtrigger.runtime.windowing.choose`),
and their events. It writes nothing; what a read reports (visibility
guard, NULL cursors, a blocking window) goes through the trigger's telemetry.
"""

from __future__ import annotations

import datetime as dt
import gc
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dbtrigger.cursor import Position
from dbtrigger.errors import (
    CorruptStateError,
    FetchError,
    OperatorError,
    SerializationError,
    StoreError,
    StoreUnavailableError,
)
from dbtrigger.events import RowChange
from dbtrigger.runtime import windowing
from dbtrigger.runtime.bulk import BulkReads
from dbtrigger.runtime.delivery import Delivery
from dbtrigger.runtime.null_probe import NullCursorProbe
from dbtrigger.runtime.prefetch import Prefetch
from dbtrigger.runtime.readahead import ReadAhead, reads_ahead
from dbtrigger.runtime.retry import RetryPolicy
from dbtrigger.runtime.telemetry import STATE_VANISHED, Telemetry
from dbtrigger.runtime.window_report import WindowReport
from dbtrigger.runtime.windowing import Selection
from dbtrigger.runtime.writes import WriterSettings
from dbtrigger.sources.base import (
    LocatesRows,
    ReportsVisibility,
    SourceAdapter,
    VisibilityReport,
    accepted_fingerprints,
    check_reachable,
    position_of,
    source_definition,
)
from dbtrigger.state import lease as leasemod
from dbtrigger.state import window as windowmod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.unreadable import checkpoint_misfit, load_state, unreadable_state
from dbtrigger.state.window import Window

DEFAULT_BOUND = windowmod.Bound()


@dataclass(frozen=True, kw_only=True)
class TickSettings(WriterSettings):
    """The trigger's configuration for the driver (and its state writer's settings)."""

    batch_size: int
    max_batches_per_tick: int
    heartbeat_interval: float
    null_check_interval: float
    retry: RetryPolicy
    bound: windowmod.Bound = DEFAULT_BOUND
    retry_delay: float = 5.0
    retry_delay_max: float = 300.0
    jitter: Callable[[], float] = random.random


def landing(
    position: Position,
    events: Sequence[RowChange],
    selection: Selection,
    settlement: windowmod.Settlement | None,
) -> tuple[Position, Window]:
    """Where a delivered batch leaves the checkpoint and the window."""
    if settlement is None:  # no per-event window in play: the whole batch settled
        return position_of(events[-1]), selection.window
    after = position if settlement.checkpoint is None else settlement.checkpoint
    return after, settlement.window


class BatchReader:
    """Every read of one trigger's ticks; see the module docstring."""

    def __init__(
        self,
        settings: TickSettings,
        *,
        source: SourceAdapter,
        store: CheckpointStore,
        clock: Callable[[], dt.datetime],
        fingerprint: Callable[[], str],
        telemetry: Telemetry,
        delivery: Delivery,
        null_probe: NullCursorProbe,
        cli_source: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self.source = source
        self.store = store
        self.clock = clock
        self.fingerprint = fingerprint
        self.telemetry = telemetry
        self.emit = telemetry.emit
        self.delivery = delivery
        self.null_probe = null_probe
        #: ``module:attribute`` naming the trigger, for commands printed in errors.
        self.cli_source = cli_source
        #: The visibility guard's report on the tick's last fetch (None: none).
        self.visibility: VisibilityReport | None = None
        self._definition: tuple[dict[str, Any] | None] | None = None
        #: Says when the settled window starts or stops blocking progress.
        self.window_report = WindowReport(
            settings.name, settings.bound, telemetry, has_sink=delivery.quarantine is not None
        )
        #: Hand out no more rows than the window can hold as waiting, even when
        #: it is empty (see dbtrigger.state.window.Settlement.unremembered).
        self.reserve = False
        # What the source can do, asked once: a runtime-checkable protocol's
        # isinstance walks the protocol's attributes on every call (about 10 us).
        self._reports = isinstance(source, ReportsVisibility)
        self._locates = isinstance(source, LocatesRows)
        #: Reads the next batch while the handler and the commit run (None: off);
        #: see dbtrigger.runtime.readahead. Used only once the source says it can.
        self.read_ahead: ReadAhead | None = None
        #: One read for several batches of a catch-up (None: off); see dbtrigger.runtime.bulk.
        self.bulk: BulkReads | None = None
        self._reads_ahead: bool | None = None
        self._had_document = False  # read one before: a missing one now vanished
        self.missing: Callable[[], None] | None = None  # else: none at the first read

    def definition(self) -> dict[str, Any] | None:
        """The source's readable definition (kept in the document), computed once."""
        if self._definition is None:
            self._definition = (source_definition(self.source),)
        return self._definition[0]

    def read(self) -> tuple[StateDocument | None, str | None]:
        s = self.settings
        try:
            stored = s.retry.call(
                lambda: self.store.read(self.name),
                operation="state read",
                kinds=(StoreUnavailableError,),
                on_retry=self.telemetry.on_retry,
                fields={"poller": self.name},
            )
        except CorruptStateError as exc:  # a store that cannot decode what it holds
            raise unreadable_state(self.store, self.name, exc, spec=self.cli_source()) from exc
        except OperatorError:
            raise
        except StoreError as exc:
            self.emit("state_read_error")
            raise FetchError(
                f"could not read the state of poller {self.name!r}: {exc}", poller=self.name
            ) from exc
        if stored is None:
            if self._had_document:
                self.emit("state_vanished", STATE_VANISHED, self.name)
            elif self.missing is not None:  # once: is a poller with a history new?
                self.missing = self.missing()
            return None, None
        self._had_document = True
        doc = load_state(self.store, self.name, stored, self.cli_source)  # (called if unreadable)
        if doc.source_fingerprint != self.fingerprint():
            # Only on a mismatch: older fingerprints of the same definition
            # (an earlier algorithm) still name this source.
            also = accepted_fingerprints(self.source)
            if doc.source_fingerprint not in also:
                # A typo (a port nothing listens on) changes the definition too:
                # say first that the configured source cannot be read, and never
                # suggest accepting an endpoint that does not answer.
                check_reachable(
                    self.source,
                    poller=self.name,
                    then="its definition also differs from the one the checkpoint was written "
                    f"for ({leasemod.what_changed(doc, self.definition()) or 'fingerprint'}): "
                    "fix the connection (host, port, database, credentials) first; do not "
                    "accept a definition that cannot be read",
                )
            leasemod.check_fingerprint(
                doc,
                self.fingerprint(),
                also=also,
                spec=self.cli_source(),
                definition=self.definition(),
            )
        return doc, stored.etag

    def fetch(self, position: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        s = self.settings
        started = time.perf_counter()
        try:
            rows = s.retry.call(
                lambda: self._fetch_paused(position, limit),
                operation="fetch",
                kinds=(FetchError,),
                on_retry=self.telemetry.on_retry,
                fields={"poller": self.name},
            )
        except FetchError:
            self.emit("fetch_error")
            raise
        except CorruptStateError as exc:  # a hand-edited tiebreaker without the key columns
            raise checkpoint_misfit(self.store, self.name, exc, self.cli_source()) from exc
        self.emit("fetched", values={"seconds": time.perf_counter() - started})
        self._report_visibility()
        return rows

    def _fetch_paused(self, position: Position, limit: int) -> Sequence[Mapping[str, Any]]:
        read_ahead = self.read_ahead
        # The collector paused (see dbtrigger._gc: the batch's rows are all still
        # alive); gc_paused() written out, as in normalise: twice a batch.
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            if read_ahead is None or read_ahead.always:
                return self.source.fetch(position, limit)
            # Adaptive read-ahead: how long this read waited (on the server, the
            # network) rather than ran, which is what a read-ahead could overlap.
            wall, cpu = time.perf_counter(), time.thread_time()
            rows = self.source.fetch(position, limit)
            read_ahead.observe((time.perf_counter() - wall) - (time.thread_time() - cpu))
            return rows
        finally:
            if paused:
                gc.enable()

    def _report_visibility(self) -> None:
        """Turn the source's visibility-guard report into gauges (and the result).

        A guard that holds rows back (a long transaction may still commit an
        older cursor) is correct behaviour, but an operator needs to see it: the
        gauges say for how long, and which backend is blocking.
        """
        info = self.source.last_fetch_info if self._reports else None  # type: ignore[attr-defined]
        if info is None:
            return
        self.visibility = info
        self.emit(
            "visibility",
            values={
                "held_back": 1.0 if info.held_back else 0.0,
                "held_back_seconds": float(info.held_back_seconds),
                "blocking_pid": info.blocking_pid,
            },
        )

    def normalise(
        self, rows: Sequence[Mapping[str, Any]], batch_id: str, token: int
    ) -> list[RowChange]:
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            return self.source.to_events(rows, poller=self.name, batch_id=batch_id)
        except SerializationError as exc:
            self.emit("serialization_failed", "%s", exc, batch_id=batch_id, fencing_token=token)
            raise
        finally:
            if paused:
                gc.enable()

    def look_ahead(
        self,
        selection: Selection,
        events: list[RowChange],
        position: Position,
        index: int,
        started_at: dt.datetime,
        tag: object,
        *,
        carry: bool,
    ) -> Prefetch | None:
        """Start reading the batch after this one (under ``tag``) before this one
        is handed over: on the read-ahead's thread (:meth:`read_ahead_from`; the
        tick's last batch reads ahead only to ``carry``), or - read-ahead off, or
        a source that cannot be read from another thread - as the returned
        :class:`Prefetch`, which the lanes' wait runs.

        No prefetch when the handler runs on this thread (no lanes, no
        subscribers: nothing can overlap it), when no further batch will be read
        this tick, or when the last read's rest holds it (dbtrigger.runtime.bulk).
        The landing is computed for "every event accepted": no retry, so ``now``
        and the jitter play no part.
        """
        if self.reads_ahead():
            if carry or index + 1 < self.settings.max_batches_per_tick:
                self.read_ahead_from(selection, events, position, started_at, tag)
            return None
        if not self.delivery.overlaps or not selection.more:
            return None
        if index + 1 >= self.settings.max_batches_per_tick or (self.bulk and self.bulk.holds):
            return None
        after, window = self.landing_if_accepted(selection, events, position, started_at)
        return Prefetch(lambda: self.next_batch(after, window, tag=tag), after, window)

    def landing_if_accepted(
        self,
        selection: Selection,
        events: list[RowChange],
        position: Position,
        started_at: dt.datetime,
    ) -> tuple[Position, Window]:
        """Where this batch leaves the checkpoint and the window if every event
        is accepted: where a read of the next batch made before it settles
        starts (a prefetch, a read-ahead). No retry, so ``now`` and the jitter
        play no part."""
        s = self.settings
        accepted = windowing.settle_delivered(
            selection,
            events,
            {},
            now=started_at,
            bound=s.bound,
            backoff=(s.retry_delay, s.retry_delay_max),
            jitter=s.jitter,
        )
        return landing(position, events, selection, accepted)

    def reads_ahead(self) -> bool:
        """Is read-ahead on, for a source that can be read from another thread?
        Asked of the source once, at the first read-ahead, not at construction:
        its dialect may be an app setting resolved at its first fetch."""
        if self.read_ahead is None:
            return False
        if self._reads_ahead is None:
            self._reads_ahead = reads_ahead(self.source)
        return self._reads_ahead

    def read_ahead_from(
        self,
        selection: Selection,
        events: list[RowChange],
        position: Position,
        started_at: dt.datetime,
        tag: object,
    ) -> None:
        """Start reading the batch after this one on the read-ahead's thread.

        From where this batch leaves the checkpoint and the window if every
        event is accepted (as :meth:`look_ahead` computes it for a prefetch),
        tagged ``tag``; :meth:`next_batch` uses it only if asked for exactly
        that read. Nothing
        when read-ahead is off, the source cannot be read from another thread,
        or no rows are likely pending.
        """
        read_ahead = self.read_ahead
        if read_ahead is None or not selection.more or not self.reads_ahead():
            return
        if self.bulk is not None and self.bulk.holds:
            # The rows kept from the last read hold the next batches: read what
            # follows them while they are handed out (once), if that read was full.
            end = self.bulk.rest_end()
            if end is not None and read_ahead.pending is None and read_ahead.wanted():
                read_ahead.start(end, self.read_limit(Window()), tag)
            return
        if self.bulk is not None and read_ahead.pending is not None:
            return  # (the read after the kept rows, started above: this batch was their last)
        if not read_ahead.wanted():
            return
        after, window = self.landing_if_accepted(selection, events, position, started_at)
        read_ahead.start(after, self.read_limit(window), tag)

    def read_limit(self, window: Window) -> int:
        """Rows to read for the next batch: ``batch_size`` and the window's
        entries, or several batches' worth (:mod:`dbtrigger.runtime.bulk`)."""
        limit = self.settings.batch_size + len(window)
        bulk = self.bulk
        plain = not window and not self.reserve
        return bulk.read_limit(limit) if bulk is not None and plain else limit

    def next_batch(
        self,
        position: Position,
        window: Window,
        *,
        tag: object = None,
        max_age: float | None = None,
        full_only: bool = False,
    ) -> Selection | None:
        """Read after ``position`` and choose the next batch (None: nothing to do).

        Without a per-event window this is the plain read of ``batch_size``
        rows. With one, the read also covers the window (its rows come back
        after the checkpoint too) and :func:`dbtrigger.runtime.windowing.choose`
        picks the rows to hand out: new ones, due retries, late arrivals.

        A read-ahead of exactly this read under ``tag`` (at most ``max_age``
        seconds old; with ``full_only``, only one that came back full) stands
        for the read; any other is dropped first.
        """
        s = self.settings
        limit = s.batch_size + len(window)
        # The rest of the last read, if this batch continues it (dbtrigger.runtime.bulk).
        plain = not window and not self.reserve
        rows = self.bulk.take(position, tag, limit, plain=plain) if self.bulk is not None else None
        read = self.read_limit(window)
        flight = None
        if self.read_ahead is not None and rows is None:
            flight = self.read_ahead.take(position, read, tag, max_age=max_age, full_only=full_only)
        held = self.delivery.holding(window)
        if held is None:
            return None  # fan-out: every subscriber is busy (said once, at WARNING)
        if rows is None:
            if flight is not None:
                rows = flight.rows
                assert rows is not None  # noqa: S101 - a flight is used only when it read rows
                self.emit("fetched", values={"seconds": flight.seconds})
                self._report_visibility()
            else:
                rows = self.fetch(position, read)
            if read > limit and self.bulk is not None:
                rows = self.bulk.keep(rows, limit, tag)
        selection, view = windowing.widening(
            rows,
            lambda wider: self.fetch(position, wider),
            lambda rows: self.normalise(rows, "plan", 0),
            window,
            limit=limit,
            batch_size=s.batch_size,
            bound=s.bound,
            now=self.clock(),
            locate=self._locate if self._locates else None,
            hold=held,
            reserve=self.reserve,
        )
        self.window_report.report(view)
        return selection

    def _locate(self, positions: Sequence[Position]) -> Sequence[Position]:
        """The source's lookup of window entries a read could not place; on a
        failure every entry is kept (asked again when the window next blocks)."""
        assert isinstance(self.source, LocatesRows)  # noqa: S101 - checked by the caller
        source = self.source
        try:
            return self.settings.retry.call(
                lambda: source.present(positions),
                operation="window lookup",
                kinds=(FetchError,),
                on_retry=self.telemetry.on_retry,
                fields={"poller": self.name},
            )
        except FetchError as exc:
            self.emit(
                "window_lookup_failed",
                "looking up %d settled-window entries failed (kept; asked again while the "
                "window blocks): %s",
                len(positions),
                exc,
            )
            return positions
