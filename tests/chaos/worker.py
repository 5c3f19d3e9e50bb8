"""Chaos worker: polls ``items`` until SIGTERM, recording everything it does.

* every batch it is handed goes into ``seen`` (item, version, worker,
  incarnation, batch id, fencing token) before anything else happens;
* some batches are slow on purpose (longer than the lease TTL): the heartbeat
  has to keep the lease, or another worker takes it and the batch is redone;
* at the end of each batch it writes to ``sink`` through a fence (the highest
  fencing token the sink has accepted, kept in ``fence``): a write carrying an
  older token is refused and counted in ``fence_rejections`` - how a sink
  protects itself from an owner that lost its lease without knowing it;
* every tick that ends in an error is recorded in ``outcomes`` with the batch
  id and token, so the test can say which duplicate window each redelivery
  came from;
* with ``--max-concurrency N`` each batch runs as up to N lanes (each lane
  records, is slow and writes through the fence on its own, under the
  batch's one id and token);
* with ``--ack-timeout`` (fan-out) a slow call may outlive its subscriber's
  ack timeout, and ``--hang-subscriber NAME`` sometimes hangs past it
  ignoring ``ctx.cancelled`` (``--hang-probability``, ``--hang-seconds``;
  not once the ``--hang-until`` file exists: the drain), so that subscriber
  is busy while later batches come; every timeout the
  poller decides is recorded in ``timeouts`` (from its own log record).
  ``--dead-letter`` writes dead-lettered events to the ``dead_letters`` table
  (``--max-attempts``, ``--retry-delay`` set how soon);
* with ``--retry-every N`` one row state in N is retried (``ctx.retry``) on
  its first delivery - the same states on every worker - and recorded as
  such in ``seen``; ``--window-max-events`` bounds the settled window.

The state store is a BlobCheckpointStore (connection string from the
``DBTRIGGER_CHAOS_STORAGE`` environment variable) or, with ``--state-dir``,
a FileCheckpointStore.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import sys
import threading
import time

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from dbtrigger import (
    CommitError,
    DbTriggerError,
    FileCheckpointStore,
    LostLeaseError,
    PollTrigger,
    RowChange,
    SqlAlchemySource,
)
from dbtrigger.quarantine import SqlQuarantineSink
from dbtrigger.runtime.context import BatchContext
from dbtrigger.runtime.delivery import Handler
from dbtrigger.runtime.stop_signals import stop_on_signals
from dbtrigger.state.stores.base import CheckpointStore


def make_store(args: argparse.Namespace) -> CheckpointStore:
    if args.state_dir:
        return FileCheckpointStore(args.state_dir)
    from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415

    return BlobCheckpointStore.from_connection_string(
        "%DBTRIGGER_CHAOS_STORAGE%", app_name="chaos", container=args.container
    )


class TimeoutRecorder(logging.Handler):
    """Writes each ``subscriber_timed_out`` the poller logs to ``timeouts``, before
    the batch commits: the accounting explains the redelivery to that subscriber."""

    def __init__(self, engine: sa.Engine, table: sa.Table) -> None:
        super().__init__(logging.WARNING)
        self.engine = engine
        self.table = table

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) != "subscriber_timed_out":
            return
        with self.engine.begin() as conn:
            conn.execute(
                self.table.insert(),
                {"batch_id": record.batch_id, "subscriber": record.subscriber},  # type: ignore[attr-defined]
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--container")
    parser.add_argument("--state-dir")
    parser.add_argument("--poller", default="chaos")
    parser.add_argument("--worker", required=True)
    parser.add_argument("--incarnation", type=int, required=True)
    parser.add_argument("--ttl", type=float, default=1.5)
    parser.add_argument("--slow-probability", type=float, default=0.15)
    parser.add_argument("--slow-seconds", type=float, default=2.5)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--journal-limit", type=int, default=100)
    parser.add_argument("--subscribers", type=int, default=0, help="fan-out: subscribers s1..sN")
    parser.add_argument("--max-concurrency", type=int, default=1)
    parser.add_argument("--ack-timeout", type=float, default=0.0, help="fan-out; 0: default")
    parser.add_argument("--hang-subscriber", default="")
    parser.add_argument("--hang-probability", type=float, default=0.0)
    parser.add_argument("--hang-seconds", type=float, default=0.0)
    parser.add_argument("--hang-until", default="", help="no hang once this file exists")
    parser.add_argument("--dead-letter", action="store_true")
    parser.add_argument("--max-attempts", type=int, default=0, help="0: the default")
    parser.add_argument("--retry-delay", type=float, default=0.0, help="0: the default")
    parser.add_argument("--retry-every", type=int, default=0, help="retry 1 row state in N once")
    parser.add_argument("--window-max-events", type=int, default=0, help="0: the default")
    args = parser.parse_args(argv)

    stop = threading.Event()
    # SIGTERM sets stop from a thread of its own: a handler calling stop.set() on the
    # main thread hangs when it lands inside this loop's stop.wait() (runtime.stop_signals).
    signals = contextlib.ExitStack()
    signals.enter_context(stop_on_signals(stop))
    rng = random.Random(f"{args.worker}/{args.incarnation}")
    engine = sa.create_engine(
        args.db_url, pool_size=2, max_overflow=2 + args.max_concurrency, pool_pre_ping=True
    )
    meta = sa.MetaData(schema=args.schema)
    seen, sink, fence, rejections, outcomes, timeouts = (
        sa.Table(name, meta, autoload_with=engine)
        for name in ("seen", "sink", "fence", "fence_rejections", "outcomes", "timeouts")
    )
    source = SqlAlchemySource(
        url=args.db_url,
        table="items",
        schema=args.schema,
        cursor_column="version",
        pk_columns=["id"],
        # The writer commits in cursor order (one connection, sequence inside
        # the transaction), so no guard is needed, and none may hold the
        # workers back because of unrelated sessions on a shared server.
        visibility="none",
    )

    def make_handler(subscriber: str) -> Handler:
        def handler(events: list[RowChange], ctx: BatchContext) -> None:
            handle(events, ctx, subscriber)

        return handler

    subscribers = {f"s{i + 1}": make_handler(f"s{i + 1}") for i in range(args.subscribers)}
    options: dict[str, object] = {}
    if subscribers and args.ack_timeout > 0:
        options["ack_timeout_seconds"] = args.ack_timeout
        logging.getLogger("dbtrigger").addHandler(TimeoutRecorder(engine, timeouts))
    if args.dead_letter:
        options["quarantine"] = SqlQuarantineSink(
            url=args.db_url, schema=args.schema, table="dead_letters"
        )
    if args.max_attempts:
        options["max_attempts"] = args.max_attempts
    if args.window_max_events:
        options["window_max_events"] = args.window_max_events
    if args.retry_delay:
        options["retry_delay_seconds"] = args.retry_delay
        options["retry_delay_max_seconds"] = max(args.retry_delay, 1.0)
    trigger = PollTrigger(
        name=args.poller,
        source=source,
        checkpoint_store=make_store(args),
        batch_size=args.batch_size,
        max_batches_per_tick=3,
        lease_ttl_seconds=args.ttl,
        owner_id=f"{args.worker}/{args.incarnation}",
        journal_limit=args.journal_limit,
        subscribers=subscribers or None,
        max_concurrency=args.max_concurrency,
        **options,  # type: ignore[arg-type]
    )
    me = {"worker": args.worker, "incarnation": args.incarnation}
    handler = None if subscribers else make_handler("")

    def retry(event: RowChange, ctx: BatchContext) -> bool:
        """The same row states on every worker: retried on their first delivery."""
        every = args.retry_every
        spread = int(event.pk["id"]) * 7919 + int(event.cursor)
        return bool(every) and spread % every == 0 and ctx.attempts(event) == 1

    def handle(events: list[RowChange], ctx: BatchContext, subscriber: str) -> None:
        asked = {e.event_id for e in events if retry(e, ctx)}
        with engine.begin() as conn:
            conn.execute(
                seen.insert(),
                [
                    {
                        "item_id": e.pk["id"],
                        "version": e.cursor,
                        "batch_id": ctx.batch_id,
                        "token": ctx.fencing_token,
                        "subscriber": subscriber,
                        "retried": e.event_id in asked,
                        **me,
                    }
                    for e in events
                ],
            )
        for e in events:
            if e.event_id in asked:
                ctx.retry(e, "chaos: the downstream asked for later")
        if (
            subscriber == args.hang_subscriber
            and rng.random() < args.hang_probability
            and not (args.hang_until and os.path.exists(args.hang_until))
        ):
            time.sleep(args.hang_seconds)  # deaf to ctx.cancelled: busy past its ack timeout
        elif rng.random() < args.slow_probability:
            deadline = time.monotonic() + args.slow_seconds
            while time.monotonic() < deadline and not ctx.cancelled:
                time.sleep(0.05)
        with engine.begin() as conn:
            current = conn.execute(
                sa.select(fence.c.token).where(fence.c.id == 1).with_for_update()
            ).scalar_one()
            if ctx.fencing_token < current:
                conn.execute(
                    rejections.insert(),
                    {"batch_id": ctx.batch_id, "token": ctx.fencing_token, "fence": current, **me},
                )
                return
            conn.execute(fence.update().where(fence.c.id == 1).values(token=ctx.fencing_token))
            conn.execute(
                pg_insert(sink).on_conflict_do_nothing(),
                [
                    {"item_id": e.pk["id"], "version": e.cursor, "token": ctx.fencing_token}
                    for e in events
                ],
            )

    def record(outcome: str, exc: DbTriggerError) -> None:
        with engine.begin() as conn:
            conn.execute(
                outcomes.insert(),
                {
                    "batch_id": exc.batch_id,
                    "token": exc.fencing_token,
                    "outcome": outcome,
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                    **me,
                },
            )

    while not stop.is_set():
        busy = False
        try:
            result = trigger.tick_result(handler)
            busy = result.outcome == "committed" and result.more
        except LostLeaseError as exc:
            record("lost", exc)
        except CommitError as exc:
            record("commit_failed", exc)
        except DbTriggerError as exc:
            record("error", exc)
        if not busy:
            stop.wait(0.02 + rng.random() * 0.08)
    source.close()
    engine.dispose()
    signals.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
