"""``dbtrigger replay``: hand a handler exactly the batches the history recorded.

A dry run without ``--yes`` (it reads the source and shows what would be
delivered and what drifted); ``--verify`` compares without delivering (exit 1
on drift); ``--yes --reason ...`` delivers under the replay's own lease. The
live poller's checkpoint never moves. See :mod:`dbtrigger.replay.batches`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from dbtrigger.cli.common import (
    Console,
    actor_from_args,
    add_change_options,
    add_store_options,
    read_state,
    reason_from_args,
    show_position,
    state_store,
    store_from_environment,
    utc_now,
)
from dbtrigger.cli.history import history_of
from dbtrigger.cli.loading import load_trigger
from dbtrigger.errors import ConfigurationError, ReplayRefusedError
from dbtrigger.history import view
from dbtrigger.replay import batches as rp
from dbtrigger.runtime.poller import PollTrigger, default_owner_id
from dbtrigger.sources.base import accepted_fingerprints
from dbtrigger.state.stores.base import CheckpointStore


def _show_key(key: Any) -> str:
    return ", ".join(
        f"{name}={value[1] if isinstance(value, list) else value}" for name, value in key.items()
    )


REREAD_NOTES = {
    "changed": "changed since (delivered as it is now)",
    "gone": "gone (deleted, or no longer matches the source): not delivered",
    "added": "in the range now but not in the batch: not delivered",
}
EXACT_NOTES = {
    "changed": "the log gives back another event for this key",
    "gone": "no longer in the log (pruned)",
    "added": "in the log's range now but not in the batch",
}


def print_plan(console: Console, plan: rp.ReplayPlan) -> None:
    how = (
        "the log's own events, as recorded"
        if plan.mode == "exact"
        else "a polled table: the recorded keys are read as they are NOW"
    )
    console.print(
        f"replay of {plan.poller!r}: {len(plan.batches)} batch(es), mode {plan.mode} ({how})"
    )
    for batch in plan.batches:
        record = batch.record
        same = (
            "identical to the record" if batch.identical else f"{len(batch.drift)} row(s) drifted"
        )
        if not batch.compared:
            same = "no per-event record to compare (digest only: " + (
                "matches)" if batch.identical else "differs)"
            )
        console.print(
            f"  batch {batch.batch_id}  {show_position(record.get('from'))} -> "
            f"{show_position(record.get('to'))}  recorded {record.get('rows')} row(s) at "
            f"{record.get('committed_at')}; delivers {len(batch.events)}; {same}"
        )
        notes = EXACT_NOTES if plan.mode == "exact" else REREAD_NOTES
        for row in batch.drift:
            console.print(f"    drift {row.kind:<8} {_show_key(row.key)}: {notes[row.kind]}")
    for refusal in plan.refusals():
        console.print(f"  cannot replay: {refusal}")


def _handlers(
    trigger: PollTrigger, handler: Callable[..., Any] | None, subscriber: str | None
) -> list[tuple[str | None, Callable[..., Any]]]:
    subscribers = trigger.subscribers
    if subscriber is not None:
        if not subscribers or subscriber not in subscribers:
            raise ConfigurationError(
                f"{trigger.name!r} has no subscriber {subscriber!r}"
                + (f" (it has {', '.join(subscribers)})" if subscribers else "")
            )
        return [(subscriber, subscribers[subscriber])]
    if handler is not None:
        return [(None, handler)]
    if subscribers:
        return list(subscribers.items())
    raise ConfigurationError(f"{trigger.name!r} has no handler; pass --handler MODULE:FUNCTION")


def _records(args: argparse.Namespace, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if args.batch and (args.from_batch or args.to_batch):
        raise ConfigurationError("give --batch ID, or --from-batch A --to-batch B")
    if args.batch:
        return [view.find_batch(records, args.batch)]
    if not (args.from_batch and args.to_batch):
        raise ConfigurationError("replay needs --batch ID, or --from-batch A --to-batch B")
    return view.batch_range(records, args.from_batch, args.to_batch)


def cmd_replay(args: argparse.Namespace) -> int:
    if not args.source:
        raise ConfigurationError(
            "replay needs --trigger MODULE:ATTR: its source is read again and its handler called"
        )
    loaded = load_trigger(args.source, args.handler)
    trigger = loaded.trigger
    if not isinstance(trigger, PollTrigger):
        raise ConfigurationError(f"{args.source} is a claim queue: it keeps no history to replay")
    if args.store or store_from_environment():
        with state_store(args) as store:
            return _replay(args, trigger, loaded.handler, store)
    return _replay(args, trigger, loaded.handler, trigger.store)


def _replay(
    args: argparse.Namespace,
    trigger: PollTrigger,
    handler: Callable[..., Any] | None,
    store: CheckpointStore,
) -> int:
    console = Console()
    poller = args.poller
    if poller != trigger.name:
        raise ConfigurationError(
            f"--trigger names poller {trigger.name!r}, not {poller!r}: the recorded event ids "
            "are the poller's own"
        )
    doc, _, _ = read_state(store, poller)
    if doc.source_fingerprint not in accepted_fingerprints(trigger.source):
        raise ConfigurationError(
            "the --trigger source definition differs from the one this poller recorded "
            "(fingerprint); a replay reads the recorded ranges from the same source"
        )
    records = view.load(history_of(args, store), poller, doc)
    chosen = _records(args, records)
    plan = rp.plan(trigger, chosen, records)
    print_plan(console, plan)
    for batch in plan.batches:
        for kind in ("changed", "gone", "added"):
            count = sum(1 for row in batch.drift if row.kind == kind)
            if count:
                trigger.telemetry.emit(
                    "replay_drift",
                    "replay of %s: batch %s has %d row(s) %s since it was recorded",
                    poller,
                    batch.batch_id,
                    count,
                    kind,
                    batch_id=batch.batch_id,
                    kind=kind,
                    values={"count": count},
                )
    refusals = plan.refusals()
    drifted = any(b.drift or not b.identical for b in plan.batches)
    if args.verify:
        trigger.telemetry.emit("replay_delivered", mode="verify", values={"rows": 0})
        console.print(
            "verify: drift found (see above)" if drifted else "verify: no drift; nothing delivered"
        )
        return 1 if drifted else 0
    if refusals:
        raise ReplayRefusedError("; ".join(refusals))
    if not args.yes:
        console.print("dry run: no handler ran and nothing was written; add --yes --reason ...")
        return 0
    args.reason = reason_from_args(args)  # required with --yes: it is journaled
    targets = _handlers(trigger, handler, args.subscriber)
    now = utc_now()
    owner = f"replay:{default_owner_id()}"
    lease = rp.ReplayLease.take(store, trigger, owner, now)
    outcomes: dict[str, Any] = {"accepted": 0, "rejected": 0, "retried": 0}
    delivered = 0
    try:
        for batch in plan.batches:
            for name, fn in targets:
                result = rp.deliver_batch(
                    trigger,
                    batch,
                    fn,
                    token=lease.token,
                    owner=owner,
                    subscriber=name,
                    started_at=now,
                )
                delivered += result.events
                outcomes["rejected"] += len(result.rejected)
                outcomes["retried"] += len(result.retried)
                outcomes["accepted"] += result.events - len(result.rejected) - len(result.retried)
    finally:
        entry = rp.manual_entry(
            "replay",
            doc_position=doc.position if doc.checkpoint is not None else None,
            actor=actor_from_args(args),
            reason=args.reason,
            now=utc_now(),
            details={
                "mode": plan.mode,
                "batches": [b.batch_id for b in plan.batches],
                "events": delivered,
                "drift": {
                    kind: sum(1 for r in plan.drift if r.kind == kind)
                    for kind in ("changed", "gone", "added")
                },
                "outcomes": outcomes,
                **({"subscriber": args.subscriber} if args.subscriber else {}),
            },
        )
        lease.release(entry, utc_now())
        problem = rp.journal_live(store, poller, entry)
    trigger.telemetry.emit(
        "replay_delivered",
        "replayed %d batch(es) of %s (%s): %d event(s)",
        len(plan.batches),
        poller,
        plan.mode,
        delivered,
        mode=plan.mode,
        values={"rows": delivered},
    )
    console.print(
        f"replayed {len(plan.batches)} batch(es), {delivered} event(s) delivered: "
        f"{outcomes['accepted']} accepted, {outcomes['rejected']} rejected, "
        f"{outcomes['retried']} asked for a retry (a replay does not retry; run it again)"
    )
    if problem:
        console.warn(f"warning: {problem}")
    return 0


def add_replay_command(sub: Any) -> None:
    replay = sub.add_parser(
        "replay", help="deliver recorded batches again (dry run unless --yes; --verify compares)"
    )
    replay.add_argument("poller", help="the poller whose history holds the batches")
    replay.add_argument("--batch", metavar="BATCH_ID", help="one recorded batch")
    replay.add_argument("--from-batch", metavar="BATCH_ID", help="first batch of a range")
    replay.add_argument("--to-batch", metavar="BATCH_ID", help="last batch of a range")
    replay.add_argument(
        "--verify", action="store_true", help="compare with the record, deliver nothing"
    )
    replay.add_argument(
        "--handler", metavar="MODULE:FUNCTION", help="another handler than the trigger's"
    )
    replay.add_argument("--subscriber", help="fan-out: deliver to this subscriber only")
    add_change_options(replay, lease=False)
    add_store_options(replay, default_hint="the trigger's own store")
    replay.set_defaults(func=cmd_replay)


__all__ = ["add_replay_command", "cmd_replay", "print_plan"]
