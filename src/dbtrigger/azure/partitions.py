"""Partitioned polling on Azure Functions: a timer coordinator and a queue-triggered worker.

A Functions timer runs on one instance at a time (the host guards it with a
storage lock), so a timer alone cannot spread partitions over instances. The
platform's own scale-out is queue-triggered functions. So
:func:`register_partitioned` registers two functions on the app:

* ``<name>_coordinator`` (timer): for every partition that has rows after its
  checkpoint and is not being processed right now (no live lease), it puts one
  message ``{"poller": ..., "partition": ..., "generation": ...}`` on a Storage
  Queue;
* ``<name>`` (queue trigger): takes one message, and ticks that partition until
  it is caught up or ``time_budget_seconds`` is spent. The partition's own
  lease keeps two invocations from processing it at once (the second one's
  tick skips), and its checkpoint makes a message that arrives late or twice
  harmless.

The Functions host scales the queue function out over instances as the queue
grows, so partitions with work are processed in parallel. Nothing here imports
``azure.functions``; the queue client (``azure-storage-queue``) is imported
when the coordinator first runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from dbtrigger.azure.schedule import checked_schedule
from dbtrigger.cursor import BEGINNING
from dbtrigger.errors import ConfigurationError, ContentionError
from dbtrigger.partitions.member import PartitionedPoller
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.runtime.kernel import wants_context
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.settings import resolve_setting, setting_name
from dbtrigger.state import operations as ops

log = logging.getLogger("dbtrigger.partitions")

#: Enqueues one message body; the default sends it to the Storage Queue.
Enqueue = Callable[[str], None]


def partitioned(trigger: PollTrigger | PartitionedPoller) -> PartitionedPoller:
    if isinstance(trigger, PartitionedPoller):
        return trigger
    if not isinstance(trigger.partitioned, PartitionedPoller):
        raise ConfigurationError(
            f"poller {trigger.name!r} has no partitions: construct it with partitions=N"
        )
    return trigger.partitioned


def pending_partitions(poller: PartitionedPoller) -> list[tuple[str, int]]:
    """``(partition id, rows pending)`` for each partition with work and no live lease."""
    now = poller.clock()
    out = []
    generation, triggers = poller.partition_triggers()
    del generation
    for pid, trigger in triggers.items():
        state = trigger.read_state()
        if state is not None and ops.live_lease(state, now) is not None:
            continue  # an invocation is on it right now
        source = trigger.source
        assert isinstance(source, PartitionSource)  # noqa: S101 - built by the poller
        pending = source.count_after(state.position if state is not None else BEGINNING)
        if pending:
            out.append((pid, pending))
    return out


def coordinate(poller: PartitionedPoller, enqueue: Enqueue) -> int:
    """One coordinator run: a message per partition with work; how many were sent."""
    generation, _ = poller.partition_triggers()
    sent = 0
    for pid, pending in pending_partitions(poller):
        enqueue(json.dumps({"poller": poller.name, "partition": pid, "generation": generation}))
        sent += 1
        log.info(
            "partition %s of %s has %d row(s) pending: queued",
            pid,
            poller.name,
            pending,
            extra={"event": "partition_queued", "poller": poller.name, "partition": pid},
        )
    return sent


def work(
    poller: PartitionedPoller,
    body: str | bytes,
    handler: Callable[..., Any],
    *,
    time_budget_seconds: float,
    monotonic: Callable[[], float] = time.monotonic,
) -> int:
    """Process the partition a queue message names; rows committed."""
    try:
        message = json.loads(body)
        pid = str(message["partition"])
        name = str(message["poller"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(f"not a dbtrigger partition message: {body!r}") from exc
    if name != poller.name:
        raise ConfigurationError(
            f"a message for poller {name!r} reached the function of {poller.name!r}"
        )
    _, triggers = poller.partition_triggers()
    trigger = triggers.get(pid)
    if trigger is None:
        log.info(
            "partition %s of %s is gone (the partitions were regrouped): message dropped",
            pid,
            poller.name,
            extra={"event": "partition_message_stale", "poller": poller.name},
        )
        return 0
    deadline = monotonic() + time_budget_seconds
    total = 0
    try:
        while monotonic() < deadline:
            try:
                result = trigger.tick_result(handler, should_stop=lambda: monotonic() >= deadline)
            except ContentionError:
                break  # another invocation holds it: that one finishes the work
            total += result.rows
            if not result.more:  # caught up (or the tick's batches were all it could do)
                break
    finally:
        trigger.flush_history()  # the host may freeze the process once this returns
    return total


def storage_queue(connection: str, queue_name: str) -> Enqueue:
    """An :data:`Enqueue` onto a Storage Queue, base64-encoded as the Functions host expects.

    ``connection`` is the name of the app setting holding the connection string
    (``AzureWebJobsStorage``), as in the queue trigger's own ``connection``. A
    failed send raises what the Blob and Table stores raise for the same
    failure (:mod:`dbtrigger._azure_errors`).
    """
    client: Any = None

    def enqueue(body: str) -> None:
        nonlocal client
        try:
            from azure.core.exceptions import ResourceExistsError  # noqa: PLC0415
            from azure.storage.queue import QueueClient, TextBase64EncodePolicy  # noqa: PLC0415

            from dbtrigger import _azure_errors as azure_errors  # noqa: PLC0415
        except ImportError as exc:
            raise ConfigurationError(
                'partitioned Functions need azure-storage-queue: pip install "dbtrigger[azure]"'
            ) from exc

        def credential() -> str:  # a refusal names the setting and its SAS's expiry
            return azure_errors.credential_words(client, f"app setting {connection!r}")

        if client is None:
            client = QueueClient.from_connection_string(
                resolve_setting(f"%{connection}%"),
                queue_name,
                message_encode_policy=TextBase64EncodePolicy(),
            )
            with (
                azure_errors.mapped(
                    azure_errors.QUEUE, f"creating queue {queue_name}", credential=credential
                ),
                contextlib.suppress(ResourceExistsError),
            ):
                client.create_queue()
        where = f"sending a message to queue {queue_name}"
        with azure_errors.mapped(azure_errors.QUEUE, where, write=True, credential=credential):
            client.send_message(body)

    return enqueue


def register_partitioned(
    app: Any,
    fn: Callable[..., Any],
    trigger: PollTrigger | PartitionedPoller,
    *,
    schedule: str,
    queue_name: str,
    connection: str = "AzureWebJobsStorage",
    time_budget_seconds: float = 240.0,
    enqueue: Enqueue | None = None,
) -> tuple[Callable[..., None], Callable[..., int]]:
    """Register ``<fn>_coordinator`` (timer) and ``<fn>`` (queue trigger) on ``app``.

    ``fn`` is the handler: ``fn(events)`` or ``fn(events, context)``. Returns the
    two plain functions (the app holds the registered ones).
    """
    poller = partitioned(trigger)
    send = enqueue or storage_queue(connection, queue_name)
    handler = fn if wants_context(fn) else (lambda events, ctx: fn(events))
    base = fn.__name__

    def coordinator(timer: Any) -> None:
        del timer
        if setting_name(schedule):  # missing or malformed: this function fails, not the app
            checked_schedule(schedule)
        coordinate(poller, send)

    def worker(msg: Any) -> int:
        body = msg.get_body() if hasattr(msg, "get_body") else msg
        return work(poller, body, handler, time_budget_seconds=time_budget_seconds)

    coordinator.__name__ = coordinator.__qualname__ = f"{base}_coordinator"
    worker.__name__ = worker.__qualname__ = base
    try:
        import azure.functions as func  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigurationError("register_partitioned needs the azure-functions package") from exc
    coordinator.__annotations__ = {"timer": func.TimerRequest, "return": None}
    worker.__annotations__ = {"msg": func.QueueMessage, "return": None}
    app.schedule(schedule=schedule, arg_name="timer", use_monitor=True)(coordinator)
    app.queue_trigger(arg_name="msg", queue_name=queue_name, connection=connection)(worker)
    return coordinator, worker
