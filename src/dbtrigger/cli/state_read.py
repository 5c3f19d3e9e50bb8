"""``dbtrigger status``: a read-only view of pollers' state, gathered (its words:
cli/status_text.py; ``history``: cli/history.py).

It writes nothing; ``status --source`` also queries the source to measure the
lag behind the checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import re
from collections.abc import Collection
from typing import Any

from dbtrigger._argparse import add_json_option
from dbtrigger._paste import pasteable
from dbtrigger.cli.common import (
    Console,
    LoadedSource,
    add_store_options,
    queue_from_args,
    read_state,
    show_position,
    source_for,
    source_from_args,
    state_store,
    utc_now,
)
from dbtrigger.cli.recreate import missing_note
from dbtrigger.cli.status_text import render_many, render_one
from dbtrigger.durations import human_duration
from dbtrigger.errors import CorruptStateError, DbTriggerError
from dbtrigger.health import held_past_ttl, measure_lag
from dbtrigger.partitions import layout as membership_layout
from dbtrigger.partitions.inspect import group_state
from dbtrigger.partitions.layout import Membership
from dbtrigger.partitions.member import membership_key
from dbtrigger.partitions.source import PartitionSource
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.subscriber_options import renames_of
from dbtrigger.runtime.trigger import gone_holder
from dbtrigger.sources.base import ChecksItself, accepted_fingerprints, source_definition
from dbtrigger.sources.sqlalchemy import SqlAlchemySource
from dbtrigger.state import document as docmod
from dbtrigger.state import fanout, fanout_set, journal
from dbtrigger.state import lease as leasemod
from dbtrigger.state.lease import describe_lease, lease_state
from dbtrigger.state.stores.base import CheckpointStore
from dbtrigger.state.stores.factory import describe_store
from dbtrigger.state.window import Window

#: ``.p000-021`` after a partitioned poller's name: one partition's state document.
PARTITION_KEY = re.compile(r"\.p\d{3}-\d{3}")


# --- status ------------------------------------------------------------------------------


def poller_status(
    store: CheckpointStore,
    poller: str,
    *,
    source: LoadedSource | None,
    now: dt.datetime,
) -> dict[str, Any]:
    """Everything ``status`` shows about one poller, as JSON-able data."""
    out: dict[str, Any] = {"poller": poller}
    trigger = source.trigger if source is not None else None
    spec = trigger.operator_spec() if trigger is not None and trigger.name == poller else None
    try:
        doc, _, _ = read_state(store, poller, spec)
    except DbTriggerError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    cp = doc.checkpoint
    out["checkpoint"] = (
        {
            "cursor": docmod.position_to_json(cp.position),
            "display": show_position(cp.position),
            "last_batch_id": cp.last_successful_batch_id,
            "updated_at": docmod.format_time(cp.updated_at),
            "rows_in_last_batch": cp.row_count,
        }
        if cp is not None
        else None
    )
    lease = doc.lease
    trigger = source.trigger if source is not None else None
    target = trigger.cli_target() if isinstance(trigger, PollTrigger) else f"{poller} --store STORE"
    out["lease"] = _lease_status(lease, now, target, doc) if lease is not None else None
    out["fingerprint"] = doc.source_fingerprint
    failure = doc.failure
    out["failure"] = (
        {
            "batch_id": failure.batch_id,
            "attempts": failure.attempts,
            "first_failed_at": docmod.format_time(failure.first_failed_at),
            "last_failed_at": docmod.format_time(failure.last_failed_at),
            "last_error": failure.last_error,
            "crashes": failure.crashes,
            "killed": len(failure.killed),
        }
        if failure is not None
        else None
    )
    out["since_last_commit_seconds"] = (
        round((now - cp.updated_at).total_seconds(), 3) if cp is not None else None
    )
    lag: dict[str, Any] = {"rows": None, "seconds": None, "note": "pass --source to measure lag"}
    if source is not None:
        matches = doc.source_fingerprint in accepted_fingerprints(source.source)
        out["fingerprint_matches_source"] = matches
        if not matches:
            changed = leasemod.what_changed(doc, source_definition(source.source))
            lag["note"] = (
                "the --source definition differs from this poller's ("
                + (changed or "fingerprint")
                + ")"
            )
        else:
            try:
                measured = measure_lag(source.source, doc.position, now, poller=poller)
                lag = {
                    "rows": measured.rows,
                    "seconds": None if measured.seconds is None else round(measured.seconds, 3),
                    "basis": measured.basis,
                    "note": measured.note,
                }
            except DbTriggerError as exc:
                lag["note"] = f"lag unknown: {type(exc).__name__}: {exc}"
    out["lag"] = lag
    if source is not None:
        out["visibility"] = visibility_status(source)
    out["owed"] = _owed(doc.window, source)
    gone = {e["subscriber"] for e in out["owed"] if e.get("holds_checkpoint")}
    try:
        out["subscribers"] = _subscribers(doc, source)
        out["window"] = window_status(doc.window, now, gone=gone)
    except CorruptStateError as exc:  # every tick fails on it too: that is the news
        return {"poller": poller, "error": f"{type(exc).__name__}: {exc}"}
    if source is not None and isinstance(source.source, ChecksItself):  # e.g. a slot's health
        out["source_findings"] = [
            f._asdict() for f in source.source.self_check() if f.severity != "ok"
        ]
    manual = [e for e in doc.journal if e.get("type") == journal.MANUAL]
    out["journal_entries"] = len(doc.journal)
    out["last_manual_change"] = dict(manual[-1]) if manual else None
    return out


def _lease_status(lease: Any, now: dt.datetime, target: str, doc: Any) -> dict[str, Any]:
    state, age = lease_state(lease, now)
    held = held_past_ttl(doc, now)  # renewed, but one batch longer than its TTL: hung?
    # A holder that was a process of this host and no longer runs: said as the
    # worker started in its place says it, with the release that frees it now.
    gone = ""
    if not lease.released and state != "expired":
        release = f"dbtrigger release-lease {target} --force --reason R --yes"
        gone = gone_holder(lease.owner_id, pasteable(release), lease)
    return {
        "state": state,
        "owner_id": lease.owner_id,
        "fencing_token": lease.fencing_token,
        "expires_at": docmod.format_time(lease.expires_at),
        "renewed_at": docmod.format_time(lease.heartbeat_at),
        "renewed_seconds_ago": round(age, 3),
        "held_without_commit_seconds": None if held is None else round(held, 1),
        "holder_gone": bool(gone),
        "description": describe_lease(lease, now)
        + gone
        + (
            f"; nothing committed under it for {human_duration(held)}: one batch longer "
            "than the lease TTL (a slow or hung handler: its worker logs handler_slow)"
            if held is not None
            else ""
        ),
    }


def window_status(
    window: Window | None, now: dt.datetime, *, gone: Collection[str] = ()
) -> dict[str, Any] | None:
    """The settled window as ``status`` shows it (None: no window in use).

    ``blocking`` says in words what holds the checkpoint and whether the
    window stops new rows: the oldest event waiting for a retry pins the
    checkpoint, and at 75% of its bound (the bound is written with the
    window) no new row goes out until pinned events settle. ``gone``:
    fan-out subscribers the trigger no longer has, with no dead-letter sink
    for their events - an event owed only to them is not delivered at all.
    """
    if window is None:
        return None
    limits = window.bound
    size = window.encoded_size()
    pressure = None if limits is None else limits.under_pressure(window, size)
    pinned = window.pending[0] if window.pending else None
    out: dict[str, Any] = {
        "events": len(window),
        "settled": len(window.settled),
        "pending": len(window.pending),
        "bytes": size,
        "bound": None
        if limits is None
        else {"max_events": limits.max_events, "max_bytes": limits.max_bytes},
        "pressure": pressure,
        "use": None
        if limits is None
        else round(max(len(window) / limits.max_events, size / limits.max_bytes), 4),
        "retries": {
            "waiting": len(window.pending),
            "next_due": docmod.format_time(min(p.not_before for p in window.pending))
            if window.pending
            else None,
            "owed": dict(fanout.owed_by(window.pending)),
        },
        "next_due": docmod.format_time(min(p.not_before for p in window.pending))
        if window.pending
        else None,
        "pinned_by": None
        if pinned is None
        else {
            "cursor": docmod.position_to_json(pinned.position),
            "display": show_position(pinned.position),
            "attempts": pinned.attempts,
            "due": docmod.format_time(pinned.not_before),
            "reason": pinned.reason,
            **({"owed": dict(pinned.owed)} if pinned.owed is not None else {}),
        },
    }
    words = []
    if pinned is not None:
        wait = (pinned.not_before - now).total_seconds()
        when = (
            f"due in {human_duration(wait)}" if wait > 0 else "due now: the next tick delivers it"
        )
        if pinned.owed and set(pinned.owed) <= set(gone):
            when = (
                f"NOT delivered: owed only to {', '.join(sorted(pinned.owed))}, which the "
                "trigger no longer has, with no dead-letter sink (see owed)"
            )
        words.append(
            f"the checkpoint waits for {len(window.pending)} event(s) to be retried; the oldest, "
            f"{show_position(pinned.position)}, has had {pinned.attempts} attempt(s), {when} "
            f"({pinned.reason or 'no reason given'})"
        )
    else:
        words.append("settled events wait above the checkpoint for earlier rows to be handed out")
    if pressure:
        words.append(
            "the window is at 75% of its bound: no new rows go out until pinned events settle "
            "(dead-lettered after max_attempts; or raise window_max_events / window_max_bytes)"
        )
    out["blocking"] = "; ".join(words)
    return out


def visibility_status(source: LoadedSource) -> dict[str, Any] | None:
    """The guard in force on ``source`` (``auto`` decided now), what an exact one
    needs, and what the guard lacks for a missing privilege (with the GRANT)."""
    describe = getattr(source.source, "describe_guard", None)
    if not callable(describe):
        return None
    try:
        out: dict[str, Any] = dict(describe().as_dict())
    except DbTriggerError as exc:
        return {"mode": "unknown", "note": f"{type(exc).__name__}: {exc}"}
    gap = getattr(getattr(source.source, "_guarding", None), "gap", None)
    if gap is not None:
        out["privilege"] = {"message": gap.message, "grant": gap.grant}
    return out


def _owed(window: Window | None, source: LoadedSource | None) -> list[dict[str, Any]]:
    """Fan-out: each subscriber still owed waiting events, and whether the
    trigger (``--source``) still has it - a removed subscriber with no
    dead-letter sink holds the checkpoint until an operator acts."""
    pending = window.pending if window is not None else ()
    trigger = source.trigger if source is not None else None
    names = getattr(trigger, "subscribers", None) if trigger is not None else None
    renames = renames_of(names)  # a former name is the subscriber that took it over
    out = []
    for name, count in fanout.owed_by(pending).items():
        entry: dict[str, Any] = {"subscriber": name, "events": count}
        if name in renames:
            entry["renamed_to"] = renames[name]
        if trigger is not None:
            entry["configured"] = names is not None and renames.get(name, name) in names
            entry["holds_checkpoint"] = not entry["configured"] and trigger.quarantine is None
        out.append(entry)
    return out


def _subscribers(doc: docmod.StateDocument, source: LoadedSource | None) -> dict[str, Any] | None:
    """Fan-out: the subscribers the last run took the lease with and, with
    ``--source``, who joins (starting at the checkpoint) or leaves with the
    trigger as it is now (see dbtrigger.state.fanout_set)."""
    last = fanout_set.recorded(doc)
    if last is None:
        return None
    out: dict[str, Any] = {"last_run": list(last)}
    names = getattr(source.trigger, "subscribers", None) if source is not None else None
    if names is not None:
        renames = renames_of(names)  # declared renamed(formerly=): neither joins nor leaves
        joining, leaving = fanout_set.change([renames.get(n, n) for n in last], names)
        out |= {"trigger": sorted(names), "joining": list(joining), "leaving": list(leaving)}
    return out


def cmd_status(args: argparse.Namespace) -> int:
    queue = queue_from_args(args)
    if queue is not None:  # a claim queue: its rows are its state
        from dbtrigger.queue.cli import print_status  # noqa: PLC0415

        return print_status(queue, as_json=args.json)
    with state_store(args) as store:
        return _status(args, store)


def _status(args: argparse.Namespace, store: CheckpointStore) -> int:
    console = Console()
    source = source_from_args(args)
    now = utc_now()
    docs: list[Membership]
    if args.poller:
        found = _membership(store, membership_key(args.poller))
        names = [] if found is not None else [args.poller]
        docs = [found] if found is not None else []
    else:
        names = store.list_keys()
        docs = [d for d in (_membership(store, name) for name in names) if d is not None]
        # A group's members document and partition documents are shown with the group.
        names = [n for n in names if not any(_in_group(n, d.poller) for d in docs)]
    statuses = [
        poller_status(store, name, source=_partition_of(source, store, name), now=now)
        for name in names
    ]
    if args.poller and statuses and "error" in statuses[0]:  # a deleted document?
        statuses[0]["resume"] = missing_note(args, store)
    groups = [
        group_state(store, doc, now=now, sources=_partition_sources(doc, source)) for doc in docs
    ]
    if args.json:
        shown: list[dict[str, Any]] = [*statuses, *(g.to_json() for g in groups)]
        console.json(shown[0] if args.poller else shown)
    elif not statuses and not groups:
        console.print(f"no pollers in {describe_store(store)}")
    elif args.poller and statuses:
        console.print(render_one(statuses[0], describe_store(store), now))
    else:
        console.print(f"store {describe_store(store)}")
        if statuses:
            console.print(render_many(statuses))
    for group in groups if not args.json else ():
        console.print("\n".join(group.render()))
        if source is None:
            console.print("  (rows behind: pass --source MODULE:ATTR naming the poller)")
    return 1 if any("error" in s for s in statuses) else 0


def _partition_of(
    loaded: LoadedSource | None, store: CheckpointStore, name: str
) -> LoadedSource | None:
    """``--source`` as the poller ``name`` reads it: one partition of the named
    PartitionedPoller reads its own bucket range (its fingerprint and lag are its own)."""
    if loaded is None or loaded.group is None:
        return loaded
    return dataclasses.replace(loaded, source=source_for(loaded, store, name))


def _in_group(key: str, poller: str) -> bool:
    """``key`` is the members document or a partition document of group ``poller``."""
    if key == membership_key(poller):
        return True
    return key.startswith(poller) and bool(PARTITION_KEY.fullmatch(key, len(poller)))


def _partition_sources(
    doc: Membership, loaded: LoadedSource | None
) -> dict[str, PartitionSource] | None:
    """The partitions' sources, when ``--source`` is the group's own table (same fingerprint)."""
    if loaded is None or not isinstance(loaded.source, SqlAlchemySource):
        return None
    if loaded.source.fingerprint() != doc.fingerprint:
        return None
    return {p.id: PartitionSource(loaded.source, p, poller=doc.poller) for p in doc.partitions}


def _membership(store: CheckpointStore, name: str) -> Membership | None:
    """The partition membership document stored under ``name``, if that is one."""
    if not name.endswith(".members"):
        return None
    stored = store.read(name)
    if stored is None:
        return None
    try:
        return membership_layout.loads(stored.data)
    except CorruptStateError:
        return None


def add_read_commands(sub: Any) -> None:
    status = sub.add_parser("status", help="checkpoint, lease, lag and failures of pollers")
    status.add_argument("poller", nargs="?", help="one poller (default: all in the store)")
    add_json_option(status)
    add_store_options(status)  # --source also measures the lag
    status.set_defaults(func=cmd_status)
