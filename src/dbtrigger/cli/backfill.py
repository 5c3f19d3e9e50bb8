"""``dbtrigger backfill``: replay a source from a chosen cursor under its own poller name.

A backfill never touches the live poller's state (checkpoint/lease spec,
operational guidelines: "use a separate poller name for backfill"). It creates
a new state document starting at ``--from-beginning`` or ``--from-cursor``,
then ticks a :class:`PollTrigger` of that name - the trigger's own, every
option as given but the few :data:`OVERRIDDEN` (its dead-letter sink,
attempts and retry backoff included), with the same handler - until nothing
is left to deliver (rows the visibility guard holds back and events waiting
for a retry are waited for, as ``drain()`` does), drawing progress on stderr.
Stopped half-way (Ctrl-C or SIGTERM, which also end a wait at once, or a
crash), it resumes from its own checkpoint when run again without ``--from-*``.

Like the other state commands it is a dry run until ``--yes``, and the
creation of its document is journaled with who and why.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TextIO

from dbtrigger.cli.common import (
    Console,
    actor_from_args,
    add_change_options,
    add_cursor_options,
    add_store_options,
    parse_position,
    reason_from_args,
    show_position,
    source_kinds,
    state_store,
    store_from_environment,
    utc_now,
)
from dbtrigger.cli.loading import LoadedTrigger, load_trigger, partitioned_of
from dbtrigger.cli.plan import print_plan
from dbtrigger.cursor import Position
from dbtrigger.errors import ConfigurationError, DbTriggerError, HandlerError, OperatorError
from dbtrigger.runtime.delivery import Handler
from dbtrigger.runtime.drain import DrainWait, tick_until_drained
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.stop_signals import (
    SECOND_SIGNAL_ABANDONS,
    SignalRelay,
    asked_to_stop,
    say_overdue,
    signals_routed_to,
)
from dbtrigger.runtime.subscriber_options import SubscriberCall
from dbtrigger.runtime.trigger import TickResult
from dbtrigger.sources.base import (
    CountsAfter,
    ValidatesDefinition,
    accepted_fingerprints,
    source_definition,
)
from dbtrigger.state import document as docmod
from dbtrigger.state import operations as ops
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore

log = logging.getLogger("dbtrigger.cli")


class Progress:
    """A one-line progress bar: rows done / estimated total, rate, ETA.

    On a terminal the line is redrawn in place (at most ten times a second);
    elsewhere (logs, CI) a full line is written at most every ``log_interval``
    seconds, and once at the end. The total is an estimate taken at the start
    (rows written meanwhile are delivered too), so it grows to ``done`` when
    exceeded rather than showing more than 100%.
    """

    WIDTH = 28

    def __init__(
        self,
        stream: TextIO,
        total: int | None,
        *,
        tty: bool | None = None,
        log_interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.total = total
        self.done = 0
        self.tty = stream.isatty() if tty is None else tty
        self.clock = clock
        self.started = clock()
        self.log_interval = log_interval
        self._last_draw = -float("inf")
        self._drawn: int | None = None  # ``done`` at the last draw

    def render(self) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        rate = self.done / elapsed
        total = None if self.total is None else max(self.total, self.done)
        parts = []
        if total:
            filled = int(self.WIDTH * self.done / total)
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            parts.append(f"[{bar}] {self.done:,}/{total:,} rows {100 * self.done / total:3.0f}%")
        else:
            parts.append(f"{self.done:,} rows")
        parts.append(f"{rate:,.0f} rows/s")
        if total and rate > 0 and self.done < total:
            parts.append(f"ETA {dt.timedelta(seconds=round((total - self.done) / rate))}")
        parts.append(f"elapsed {dt.timedelta(seconds=round(elapsed))}")
        return "  ".join(parts)

    def update(self, rows: int) -> None:
        self.done += rows
        now = self.clock()
        if now - self._last_draw >= (0.1 if self.tty else self.log_interval):
            self._draw()
            self._last_draw = now

    def _draw(self, final: bool = False) -> None:
        self._drawn = self.done
        if self.tty:
            self.stream.write("\r" + self.render() + ("\n" if final else ""))
        else:
            self.stream.write(self.render() + "\n")
        self.stream.flush()

    def finish(self) -> None:
        """End the bar: its final state is on screen exactly once."""
        if self._drawn != self.done:
            self._draw(final=True)
        elif self.tty:
            self.stream.write("\n")
            self.stream.flush()


@contextmanager
def graceful_sigint(stop: threading.Event) -> Iterator[None]:
    """First Ctrl-C or SIGTERM: finish and commit the batch in flight, then stop.
    Second: abandon it.

    The handler takes no lock: the relay's thread sets ``stop`` (a handler that
    set it itself could wait for ever for the lock of a ``stop.wait`` it
    interrupted: :mod:`dbtrigger.runtime.stop_signals`); only the second
    signal's :class:`KeyboardInterrupt` is raised in it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = 0

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal signals
        del signum, frame
        signals += 1
        if signals > 1:
            raise KeyboardInterrupt

    def act(signum: int) -> None:
        asked_to_stop(stop, signum, "finishing the batch in flight, then stopping")

    relay = SignalRelay(
        act,
        name="dbtrigger-backfill-signals",
        overdue=lambda seconds: say_overdue(seconds, again=SECOND_SIGNAL_ABANDONS),
    )
    try:
        with signals_routed_to(on_signal, relay):
            yield
    finally:
        relay.close()


def _load_trigger(args: argparse.Namespace) -> tuple[PollTrigger, Handler]:
    if not args.source:
        raise ConfigurationError(
            "backfill needs --trigger MODULE:ATTR: the PollTrigger or @db.trigger function "
            "whose source and handler the backfill uses"
        )
    loaded = load_trigger(args.source, args.handler)
    group = partitioned_of(loaded.trigger)
    if group is not None and args.new_poller.startswith(f"{group.name}."):
        raise ConfigurationError(
            f"{args.new_poller!r} is a name of partitioned poller {group.name!r} (its partitions "
            "and membership are <name>.*): a backfill needs its own poller name"
        )
    if group is not None and group is loaded.trigger:  # one backfill poller over the table
        whole = PollTrigger(
            name=group.name, source=group.source, checkpoint_store=group.store, **group.options
        )
        handler = None if isinstance(loaded.handler, SubscriberCall) else loaded.handler
        loaded = LoadedTrigger(loaded.spec, whole, handler, loaded.function)
    if not isinstance(loaded.trigger, PollTrigger):
        raise ConfigurationError(f"{args.source} is a claim queue: there is nothing to backfill")
    _refuse_log_source(args.source, loaded.trigger)
    if args.new_poller == loaded.trigger.name:
        raise ConfigurationError(
            "a backfill needs its own poller name; the live poller's state is never touched"
        )
    if loaded.handler is None:  # a fan-out poller (subscribers=) without --handler
        raise ConfigurationError(
            f"{args.source} fans out to subscribers; a backfill replays one handler: "
            "pass --handler MODULE:FUNCTION (e.g. the subscriber that needs the backfill)"
        )
    return loaded.trigger, loaded.handler


def _refuse_log_source(spec: str, trigger: PollTrigger) -> None:
    """A log-based source serves one poller (its slot or binlog reader is that
    poller's): the backfill's trigger would be refused only after the dry run had
    promised it and its document was written. Refused first, naming the way to
    read rows again: a snapshot the live poller delivers."""
    from dbtrigger.cdc.log_source import LogSource  # noqa: PLC0415 - only for this check

    if isinstance(trigger.source, LogSource):
        kind = type(trigger.source).__name__
        raise ConfigurationError(
            f"{spec} reads a database log ({kind}), which serves one poller: a backfill "
            f"under another name would need a source ({trigger.source.OWN}) of its own. To "
            f"deliver a table's rows again, queue a snapshot the live poller reads: `dbtrigger "
            f"cdc snapshot {spec} --table TABLE [--where CONDITION] --yes` (docs/cdc.md)"
        )


def _starting_point(
    args: argparse.Namespace, store: CheckpointStore, trigger: PollTrigger, now: dt.datetime
) -> tuple[Position, StateDocument | None]:
    """Where the backfill starts, and the document to create (None when resuming)."""
    stored = store.read(args.new_poller)
    starting = args.from_beginning or args.from_cursor is not None
    if stored is not None:
        if starting:
            raise ConfigurationError(
                f"poller {args.new_poller!r} already exists; omit --from-* to resume it, "
                "or choose a new name"
            )
        existing = docmod.loads(stored.data)
        if existing.source_fingerprint not in accepted_fingerprints(trigger.source):
            raise ConfigurationError(
                f"poller {args.new_poller!r} was made for a different source definition"
            )
        return existing.position, None
    if not starting:
        raise ConfigurationError(
            f"poller {args.new_poller!r} does not exist: give --from-beginning or "
            "--from-cursor VALUE --pk NAME=VALUE"
        )
    start = Position()
    if not args.from_beginning:
        start = parse_position(
            args.from_cursor,
            args.pk,
            kind=args.kind,
            like=None,
            kinds=lambda: source_kinds(trigger.source),
            flag="--from-cursor",
        )
        if isinstance(trigger.source, ValidatesDefinition):
            trigger.source.validate(start)  # a value its column cannot hold is refused now
    created = ops.create(
        args.new_poller,
        fingerprint=trigger.fingerprint,
        definition=source_definition(trigger.source),
        position=start,
        now=now,
        actor=actor_from_args(args),
        reason=reason_from_args(args),
        operation="backfill",
        details={"backfill_of": trigger.name},
    )
    return start, created


#: The ``PollTrigger`` options a backfill replaces; it takes every other one from
#: the trigger as given (its dead-letter sink, attempts, retry backoff, window
#: bounds, lanes, timeouts, history, metrics, read-ahead: docs/operations.md).
#: A new option is carried unless listed here (tests/test_backfill_settings.py
#: makes whoever adds one say which).
OVERRIDDEN = frozenset(
    {
        # Its own state document, in the store --store names (default the trigger's).
        "name",
        "checkpoint_store",
        # --batch-size (default the trigger's) and --batches-per-tick.
        "batch_size",
        "max_batches_per_tick",
        # A fresh lease owner per process: a fixed owner_id of the trigger would let
        # a second backfill of the same name take the first one's lease as its own.
        "owner_id",
        # Its start is --from-beginning / --from-cursor, in the document it creates.
        "start_from",
        # One handler (--handler for a fan-out trigger), not the subscribers.
        "subscribers",
        "ack_timeout_seconds",
        # One process, one state document: not partitioned (deprecated options).
        "partitions",
        "balance_interval_seconds",
        "member_ttl_seconds",
    }
)


def backfill_trigger(
    trigger: PollTrigger, args: argparse.Namespace, store: CheckpointStore
) -> PollTrigger:
    """The trigger a backfill ticks: ``trigger``'s options, :data:`OVERRIDDEN` replaced."""
    overrides: dict[str, Any] = {
        "name": args.new_poller,
        "checkpoint_store": store,
        "batch_size": args.batch_size or trigger.batch_size,
        "max_batches_per_tick": args.batches_per_tick,
        "owner_id": None,
        "start_from": None,
        "subscribers": None,
        "ack_timeout_seconds": None,
        "partitions": None,
        "balance_interval_seconds": None,
        "member_ttl_seconds": None,
    }
    assert overrides.keys() == OVERRIDDEN  # noqa: S101 - the list and the code say the same
    return PollTrigger(**{**trigger.options, **overrides})


def _drain(
    args: argparse.Namespace,
    worker: PollTrigger,
    handler: Handler,
    progress: Progress,
    console: Console,
) -> bool:
    """Tick until idle (the drain loop of :mod:`dbtrigger.runtime.drain`: rows the
    visibility guard held back and events waiting for a retry are waited for, a
    FetchError or HandlerError past the waits); retry transient failures. Returns
    False when stopped early (a stop ends a wait at once)."""
    stop = threading.Event()
    waits = DrainWait(worker.name, clock=worker.clock, stop=stop, say=console.warn)
    ticks = _Ticks(args, worker, handler, stop, console)
    with graceful_sigint(stop):
        tick_until_drained(ticks, waits, progress=lambda _, result: progress.update(result.rows))
    return not stop.is_set()


@dataclass
class _Ticks:
    """A backfill's ticks: a failed one is tried again (``--max-retries`` in a row,
    ``--retry-delay`` apart), a lease held elsewhere is refused."""

    args: argparse.Namespace
    worker: PollTrigger
    handler: Handler
    stop: threading.Event
    console: Console
    traced: set[tuple[str | None, str]] = field(default_factory=set)

    def __call__(self) -> TickResult:
        failures = 0
        while True:
            try:
                result = self.worker.tick_result(self.handler, should_stop=self.stop.is_set)
            except OperatorError:
                raise
            except DbTriggerError as exc:
                _trace_handler_failure(exc, self.traced)
                failures += 1
                if failures > self.args.max_retries:
                    raise
                self.console.warn(f"tick failed ({exc}); retry {failures}/{self.args.max_retries}")
                self.stop.wait(self.args.retry_delay)
                if self.stop.is_set():  # the failed tick's report: the drain sees the stop
                    return TickResult(0, 0, "failed", error=type(exc).__name__)
                continue
            if result.outcome in ("lease_busy", "lost_race"):
                raise ConfigurationError(
                    f"another process holds the lease of {self.worker.name!r}; "
                    "is this backfill already running?"
                )
            return result


def _trace_handler_failure(exc: DbTriggerError, traced: set[tuple[str | None, str]]) -> None:
    """Log the handler's traceback once per failing batch (not once per retry).

    The runtime's own record of a handler failure is one line; where the
    handler broke is in the traceback, which a person fixing it needs once.
    A batch keeps its id across attempts, so (batch id, error) is the key.
    """
    cause = exc.__cause__
    if not isinstance(exc, HandlerError) or cause is None:
        return
    key = (exc.batch_id, f"{type(cause).__name__}: {cause}")
    if key in traced:
        return
    traced.add(key)
    log.warning(
        "backfill: the handler failed on batch %s: %s: %s",
        exc.batch_id or "?",
        type(cause).__name__,
        cause,
        exc_info=(type(cause), cause, cause.__traceback__),
        extra={"event": "backfill_handler_failed", **exc.log_fields()},
    )


def cmd_backfill(args: argparse.Namespace) -> int:
    trigger, handler = _load_trigger(args)
    if args.store or store_from_environment():
        with state_store(args) as store:
            return _backfill(args, trigger, handler, store)
    return _backfill(args, trigger, handler, trigger.store)


def _backfill(
    args: argparse.Namespace, trigger: PollTrigger, handler: Handler, store: CheckpointStore
) -> int:
    console = Console()
    now = utc_now()
    start, created = _starting_point(args, store, trigger, now)
    counts = trigger.source if isinstance(trigger.source, CountsAfter) else None
    total: int | None = counts.count_after(start) if counts is not None else None
    if created is not None:
        print_plan(console, "backfill", store, None, created, now)
    else:
        console.print(f"resuming backfill {args.new_poller!r} at {show_position(start)}")
    estimate = f"about {total:,}" if total is not None else "an unknown number of"
    console.print(
        f"backfill {args.new_poller!r} of {trigger.source.name} from {show_position(start)}: "
        f"{estimate} rows"
    )
    if not args.yes:
        missing = " --reason TEXT" if args.reason is None else ""
        console.print(
            f"dry run: nothing was written and no handler ran; add{missing} --yes to start"
        )
        return 0
    # Built before its document is written: a trigger the options refuse leaves no
    # document behind that a second try with --from-* would be refused for.
    worker = backfill_trigger(trigger, args, store)
    if created is not None:
        try:  # create-only: another backfill of this name that won is left alone
            store.write(args.new_poller, docmod.dumps(created), if_match=None)
        except BaseException:
            worker.close()
            raise
    progress = Progress(console.err, total)
    try:
        try:
            finished = _drain(args, worker, handler, progress, console)
        finally:
            worker.close()  # its history records written, its threads stopped
    except BaseException:
        progress.finish()
        if created is not None and progress.done == 0:
            _remove_unstarted(store, args.new_poller, created, console)
        raise
    progress.finish()
    if not finished:
        console.print(
            f"stopped after {progress.done:,} rows; run the same command without --from-* to resume"
        )
        return 130
    console.print(f"backfill {args.new_poller!r} caught up: {progress.done:,} rows delivered")
    note = _reader_note(trigger.source, args.new_poller)
    if note is not None:
        console.print(note)
    return 0


def _reader_note(source: Any, name: str) -> str | None:
    """A change log keeps every row a registered reader has not read, and the backfill
    registered under its own name as the live poller does: said once it is done, with
    the command that lets prunes go on (it stays registered, so a resumed backfill
    never finds rows pruned under it)."""
    from dbtrigger.changelog.source import ChangeLogSource  # noqa: PLC0415 - only for this note

    if not isinstance(source, ChangeLogSource):
        return None
    info = source.describe()
    schema = f" --schema {info['schema']}" if info.get("schema") else ""
    return (
        f"note: {name!r} is a registered reader of the change log of {info['watched_table']}: "
        "prunes keep every row it has not read. Once it is done with: `dbtrigger changelog "
        f"readers --url URL --table {info['watched_table']}{schema} --forget {name} --yes`"
    )


def _remove_unstarted(
    store: CheckpointStore, name: str, created: StateDocument, console: Console
) -> None:
    """Delete the document this backfill created when it failed before its first commit.

    Left behind, it made the same command refuse ("already exists") and
    resuming it meant resuming a start that never worked. Only a document
    still at its starting position is removed (conditionally on its etag):
    once a batch was committed, the backfill is resumable and is kept.
    """
    try:
        stored = store.read(name)
        if stored is None or docmod.loads(stored.data).position != created.position:
            return
        store.delete(name, if_match=stored.etag)
    except DbTriggerError as exc:
        console.warn(f"the backfill's state document {name!r} could not be removed: {exc}")
        return
    console.warn(
        f"backfill {name!r} failed before its first commit; its state document was removed "
        "(run the same command again once the cause is fixed)"
    )


def add_backfill_command(sub: Any) -> None:
    backfill = sub.add_parser(
        "backfill", help="drain a separate poller name from a cursor, with a progress bar"
    )
    backfill.add_argument("new_poller", help="the backfill's own poller name")
    backfill.add_argument(
        "--handler",
        metavar="MODULE:FUNCTION",
        help="the handler (default: the trigger's @handler, or the Functions function itself "
        "with its output bindings)",
    )
    start = backfill.add_mutually_exclusive_group()
    start.add_argument(
        "--from-beginning", action="store_true", help="deliver every row of the source"
    )
    start.add_argument("--from-cursor", metavar="VALUE", help="start after (VALUE, --pk)")
    add_cursor_options(backfill, "--from-cursor")
    backfill.add_argument("--batch-size", type=int, help="rows per batch (default: the trigger's)")
    backfill.add_argument(
        "--batches-per-tick", type=int, default=10, help="batches per lease (default 10)"
    )
    backfill.add_argument(
        "--max-retries", type=int, default=3, help="failed ticks in a row before giving up"
    )
    backfill.add_argument(
        "--retry-delay", type=float, default=2.0, help="seconds between retries (default 2)"
    )
    add_store_options(backfill, default_hint="the trigger's own store")
    add_change_options(backfill, lease=False)
    backfill.set_defaults(func=cmd_backfill)


__all__ = [
    "OVERRIDDEN",
    "Progress",
    "add_backfill_command",
    "backfill_trigger",
    "cmd_backfill",
    "graceful_sigint",
]
