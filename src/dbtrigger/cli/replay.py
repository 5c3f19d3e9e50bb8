"""``dbtrigger replay``: hand a handler exactly the batches the history recorded.

A dry run without ``--yes`` (it reads the source and shows what would be
delivered and what drifted); ``--verify`` compares without delivering (exit 1
on drift); ``--yes --reason ...`` delivers under the replay's own lease. The
live poller's checkpoint never moves. See :mod:`dbtrigger.replay.batches`.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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
from dbtrigger.cli.loading import as_partition, load_trigger
from dbtrigger.errors import ConfigurationError, HandlerError, ReplayRefusedError
from dbtrigger.history import view
from dbtrigger.history.store import HistoryStore
from dbtrigger.replay import batches as rp
from dbtrigger.runtime.poller import PollTrigger, default_owner_id
from dbtrigger.sources.base import accepted_fingerprints
from dbtrigger.state.document import StateDocument
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
        if batch.recovered:
            same = "no per-event record to compare (recorded from the journal: its history "
            same += "append was lost); " + (
                f"the log gives back {len(batch.events)} event(s) in its range, "
                + ("as many as it delivered" if batch.whole else "not as many as it delivered")
                if plan.mode == "exact"
                else "delivered as its range reads now, unchecked"
            )
        elif not batch.compared:
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
    loaded = as_partition(load_trigger(args.source, args.handler), args.poller, "replay")
    trigger = loaded.trigger
    if not isinstance(trigger, PollTrigger):
        raise ConfigurationError(f"{args.source} is a claim queue: it keeps no history to replay")
    if args.store or store_from_environment():
        with state_store(args) as store:
            return _replay(args, trigger, loaded.handler, store)
    return _replay(args, trigger, loaded.handler, trigger.store)


def _plan(
    args: argparse.Namespace, trigger: PollTrigger, store: CheckpointStore, doc: StateDocument
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], rp.ReplayPlan]:
    """The history's records, those chosen and their plan. The whole history is read
    without the commits' per-event detail (most of its size: with it, 1.9 GB of
    memory at the default retention's 256 MiB for one batch), then the detail of
    the batches chosen, and of the commits before them that the comparison looks
    at, again."""
    history = history_of(args, store)
    records = view.load(history, args.poller, doc, details=False)
    chosen = view.with_details(history, args.poller, _records(args, records))
    return records, chosen, rp.plan(trigger, chosen, records, _detail_reader(history, args.poller))


def _detail_reader(
    history: HistoryStore | None, poller: str
) -> Callable[[Mapping[str, Any]], Mapping[str, Any]]:
    """A record with its detail, read again once (a commit before a batch replayed)."""
    read: dict[str, dict[str, Any]] = {}

    def detail(record: Mapping[str, Any]) -> Mapping[str, Any]:
        if not record.get("detail_unread"):
            return record
        key = str(record.get("id"))
        if key not in read:
            read[key] = view.with_detail(history, poller, record)
        return read[key]

    return detail


def _said_operations(
    console: Console, records: Sequence[Mapping[str, Any]], chosen: Sequence[Mapping[str, Any]]
) -> None:
    """Say what operators did to the poller inside the range (``skip-batch``, ``reset``,
    ``rewind``, ...: rows skipped or delivered twice live are so in the replay, which
    hands over the recorded batches as they were delivered) and each source definition
    it adopted (``reset --accept-source``) after the first batch replayed: the batches
    before it were read under the old one and are read again under today's (a row the
    new definition no longer matches is ``gone``)."""
    where = view.positions_of(records)
    at = [where[c.get("id")] for c in chosen if c.get("id") in where]
    if not at:
        return
    for index in range(at[0] + 1, len(records)):
        record = records[index]
        if record.get("type") != "manual" or not record.get("after"):
            continue
        before = [c for c, i in zip(chosen, at, strict=False) if i < index]
        what = (
            f"{record.get('operation')} at {record.get('at')} by {record.get('actor')} "
            f"({record.get('reason')!r})"
        )
        if record.get("fingerprint_after"):
            console.print(
                f"note: the source definition changed after batch {before[-1].get('batch_id')} "
                f"({what}): {len(before)} batch(es) recorded under the old one are read under "
                "the definition as it is now"
            )
        elif index < at[-1] and record.get("before") != record.get("after"):
            console.print(
                f"note: after batch {before[-1].get('batch_id')}, {what} moved the checkpoint "
                f"{show_position(record.get('before'))} -> {show_position(record.get('after'))}: "
                "the replay hands over the recorded batches as they were delivered"
            )


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
            "(fingerprint); a replay reads the recorded ranges from the same source. Name the "
            "trigger as the poller runs now; if the change is meant, the poller adopts it with "
            f"dbtrigger reset {poller} --accept-source {args.source} --reason TEXT (a replay "
            "then reads the ranges under the new definition, and says so)"
        )
    records, chosen, plan = _plan(args, trigger, store, doc)
    print_plan(console, plan)
    _said_operations(console, records, chosen)
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
    unchecked = [b for b in plan.batches if b.recovered]
    drifted = any(b.drift or not (b.identical or b.recovered) for b in plan.batches)
    if args.verify:
        trigger.telemetry.emit("replay_delivered", mode="verify", values={"rows": 0})
        if drifted:
            console.print("verify: drift found (see above)")
        elif unchecked:
            console.print(
                f"verify: no drift found, but {len(unchecked)} batch(es) could not be checked "
                "(recorded from the journal, without a per-event record)"
            )
        else:
            console.print("verify: no drift; nothing delivered")
        return 1 if drifted or unchecked else 0
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
    run = _Run()
    try:
        _deliver_all(trigger, plan, targets, run, token=lease.token, owner=owner, now=now)
    finally:
        entry = rp.manual_entry(
            "replay",
            doc_position=doc.position if doc.checkpoint is not None else None,
            actor=actor_from_args(args),
            reason=args.reason,
            now=utc_now(),
            details={
                "mode": plan.mode,
                "batches": run.done,
                "events": run.delivered,
                "drift": {
                    kind: sum(1 for r in plan.drift if r.kind == kind)
                    for kind in ("changed", "gone", "added")
                },
                "outcomes": run.outcomes,
                **({"subscriber": args.subscriber} if args.subscriber else {}),
                **run.unfinished(plan),
            },
        )
        lease.release(entry, utc_now())
        problem = rp.journal_live(store, poller, entry, _own_history(trigger, store))
    trigger.telemetry.emit(
        "replay_delivered",
        "replayed %d batch(es) of %s (%s): %d event(s)",
        len(run.done),
        poller,
        plan.mode,
        run.delivered,
        mode=plan.mode,
        values={"rows": run.delivered},
    )
    outcomes = run.outcomes
    console.print(
        f"replayed {len(run.done)} of {len(plan.batches)} batch(es), {run.delivered} event(s) "
        f"delivered: {outcomes['accepted']} accepted, {outcomes['rejected']} rejected, "
        f"{outcomes['retried']} asked for a retry (a replay does not retry; run it again)"
    )
    if problem:
        console.warn(f"warning: {problem}")
    if run.failed is not None:
        raise _failure(args, plan, run)
    return 0


def _own_history(
    trigger: PollTrigger, store: CheckpointStore
) -> HistoryStore | Literal[False] | None:
    """Where the replay's record goes: the trigger's own history (none with
    ``history=False``), unless ``--store`` named another store (the one beside it)."""
    if store is not trigger.store:
        return None
    return trigger.history if trigger.history is not None else False


@dataclass
class _Run:
    """What a replay delivered so far: the batches every target took, events, outcomes,
    and the batch (and subscriber) whose handler raised, with what it raised."""

    done: list[str] = field(default_factory=list)
    delivered: int = 0
    outcomes: dict[str, int] = field(
        default_factory=lambda: {"accepted": 0, "rejected": 0, "retried": 0}
    )
    failed: tuple[str, str | None, Exception] | None = None

    def unfinished(self, plan: rp.ReplayPlan) -> dict[str, Any]:
        """The journal's word on the batches not delivered (none when all were)."""
        rest = [b.batch_id for b in plan.batches if b.batch_id not in self.done]
        if not rest:
            return {}
        out: dict[str, Any] = {"not_delivered": rest}
        if self.failed is not None:
            batch_id, subscriber, exc = self.failed
            out["failed"] = {
                "batch_id": batch_id,
                "error": f"{type(exc).__name__}: {exc}"[:200],
                **({"subscriber": subscriber} if subscriber else {}),
            }
        return out


def _deliver_all(
    trigger: PollTrigger,
    plan: rp.ReplayPlan,
    targets: Sequence[tuple[str | None, Callable[..., Any]]],
    run: _Run,
    *,
    token: int,
    owner: str,
    now: dt.datetime,
) -> None:
    """Hand each planned batch to each target in order; stop at the first handler
    that raises (``run.failed``): the batches after it are not delivered."""
    for batch in plan.batches:
        for name, fn in targets:
            try:
                result = rp.deliver_batch(
                    trigger, batch, fn, token=token, owner=owner, subscriber=name, started_at=now
                )
            except Exception as exc:  # noqa: BLE001 - said, journaled, and the replay stops
                run.failed = (batch.batch_id, name, exc)
                return
            run.delivered += result.events
            run.outcomes["rejected"] += len(result.rejected)
            run.outcomes["retried"] += len(result.retried)
            run.outcomes["accepted"] += result.events - len(result.rejected) - len(result.retried)
        run.done.append(batch.batch_id)


def _failure(args: argparse.Namespace, plan: rp.ReplayPlan, run: _Run) -> HandlerError:
    """What the operator is told when a handler raised: which batch, what was
    delivered, and the command that goes on from there (a replay keeps no position
    of its own: the failed batch is delivered whole again)."""
    assert run.failed is not None  # noqa: S101 - called when one failed
    batch_id, subscriber, exc = run.failed
    last = plan.batches[-1].batch_id
    who = f" (subscriber {subscriber!r})" if subscriber else ""
    again = f"dbtrigger replay {args.poller} " + (
        f"--batch {batch_id}" if batch_id == last else f"--from-batch {batch_id} --to-batch {last}"
    )
    if subscriber and not args.subscriber:
        again += f" (--subscriber {subscriber} for that subscriber alone)"
    error = HandlerError(
        f"the handler{who} raised on batch {batch_id} ({type(exc).__name__}: {exc}); "
        f"{len(run.done)} batch(es) before it were delivered and are journaled, it and the "
        f"{len(plan.batches) - len(run.done) - 1} after it were not. Fix the cause, then go on "
        f"with: {again} --trigger {args.source} --yes --reason ..."
    )
    error.__cause__ = exc
    return error


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
