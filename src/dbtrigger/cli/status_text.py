"""The words of ``dbtrigger status``: a poller's status (the dicts
:mod:`dbtrigger.cli.state_read` gathers, also printed as ``--json``) as text, one
poller in full (:func:`render_one`) or several as a table (:func:`render_many`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from dbtrigger.cli.common import text_table, utc_now
from dbtrigger.durations import human_duration
from dbtrigger.sources.lag import COLUMN
from dbtrigger.state import document as docmod


def _window_text(window: Mapping[str, Any] | None) -> str:
    if window is None:
        return "none (every event up to the checkpoint settled, none above it)"
    bound = window["bound"]
    text = (
        f"{window['events']} events ({window['pending']} waiting for a retry, "
        f"{window['settled']} settled), {window['bytes']} bytes"
    )
    if bound is not None:
        text += f" of {bound['max_events']} events / {bound['max_bytes']} bytes"
        text += f" ({window['use']:.0%} used)"
    if window["pressure"]:
        text += " - AT PRESSURE: no new rows go out"
    return text


def _retries_text(retries: Mapping[str, Any], now: dt.datetime) -> str:
    due = retries["next_due"]
    wait = (docmod.parse_time(due, "due") - now).total_seconds() if due else 0.0
    when = f"in {human_duration(wait)}" if wait > 0 else "now: the next tick delivers it"
    text = f"{retries['waiting']} event(s) waiting for a retry; the next is due at {due} ({when})"
    if retries["owed"]:
        owed = ", ".join(f"{name} {n}" for name, n in sorted(retries["owed"].items()))
        text += f"; owed to {owed}"
    return text


def _visibility_text(visibility: Mapping[str, Any]) -> str:
    if "note" in visibility:
        return f"unknown ({visibility['note']})"
    text = f"{visibility['mode']} ({visibility['strength']}): {visibility['guarantee']}"
    if visibility.get("needs"):
        text += f"; exact needs: {visibility['needs']}"
    privilege = visibility.get("privilege")
    if privilege:
        text += f"; {privilege['message']}. Fix: {privilege['grant']}"
    return text


def _subscribers_text(subscribers: Mapping[str, Any]) -> str:
    text = f"{', '.join(subscribers['last_run'])} (the last run's)"
    if subscribers.get("joining"):
        text += (
            f"; joining with the trigger: {', '.join(subscribers['joining'])} - handed the "
            "events read from then on only, not the rows up to the checkpoint (backfill "
            "them: dbtrigger backfill --handler)"
        )
    if subscribers.get("leaving"):
        text += f"; leaving: {', '.join(subscribers['leaving'])}"
    return text


def _owed_text(owed: Sequence[Mapping[str, Any]], spec: str) -> str:
    parts = []
    for entry in owed:
        text = f"{entry['subscriber']} {entry['events']} event(s)"
        if entry.get("holds_checkpoint"):
            text += (
                " - HOLDS THE CHECKPOINT: no such subscriber any more and no dead-letter "
                f"sink; add it back to subscribers=, or pass quarantine=... to {spec} (they "
                "are then dead-lettered), or move the checkpoint past them with dbtrigger "
                "reset (data loss, journaled)"
            )
        elif entry.get("renamed_to"):
            text += f" (renamed: {entry['renamed_to']} takes them over at its next tick)"
        elif entry.get("configured") is False:
            text += " (no such subscriber any more: dead-lettered when next due)"
        parts.append(text)
    return "; ".join(parts)


def render_one(status: Mapping[str, Any], store: str, now: dt.datetime | None = None) -> str:
    now = now or utc_now()
    if "error" in status:
        resume = f"\n{status['resume']}" if status.get("resume") else ""
        return f"poller       {status['poller']}\nerror        {status['error']}{resume}"
    cp = status["checkpoint"]
    lease = status["lease"]
    failure = status["failure"]
    lag = status["lag"]
    lines = [
        ("poller", status["poller"]),
        ("store", store),
        ("checkpoint", cp["display"] if cp else "(beginning: nothing committed yet)"),
        (
            "last batch",
            f"{cp['last_batch_id'] or '(manual change)'} at {cp['updated_at']}" if cp else "-",
        ),
        ("lease", lease["description"] if lease else "no lease"),
    ]
    if lag["rows"] is None and lag["seconds"] is None:
        lag_text = f"unknown ({lag['note']})"
    else:
        lag_text = "? rows" if lag["rows"] is None else f"{lag['rows']} rows"
        if lag["rows"] == 0:
            lag_text += " (caught up)"  # no "oldest pending 0.0s": nothing is pending
        elif lag["seconds"] is not None:
            lag_text += f", oldest pending {human_duration(lag['seconds'])}"
            basis = lag.get("basis")
            if basis and basis.startswith(COLUMN):
                lag_text += f" (by {basis[len(COLUMN) :]})"
        if lag["note"]:
            lag_text += f" ({lag['note']})"
    lines.append(("lag", lag_text))
    fingerprint = status["fingerprint"]
    if "fingerprint_matches_source" in status:
        fingerprint += (
            " (matches --source)"
            if status["fingerprint_matches_source"]
            else " (DIFFERS from --source)"
        )
    lines.append(("fingerprint", fingerprint))
    for finding in status.get("source_findings") or []:
        lines.append((f"source {finding['severity']}", f"{finding['check']}: {finding['message']}"))
    if failure:
        lines.append(
            (
                "failing",
                f"batch {failure['batch_id'] or 'at the checkpoint'}: {failure['attempts']} "
                f"attempt(s) since {failure['first_failed_at']}"
                + (
                    f" ({failure['crashes']} ended with its process dead)"
                    if failure.get("crashes")
                    else ""
                )
                + (
                    f"; {failure['killed']} row(s) of it killed the process when handed alone "
                    "(dead-lettered as ProcessDied, never handed over again)"
                    if failure.get("killed")
                    else ""
                )
                + f"; last error: {failure['last_error']}",
            )
        )
    else:
        lines.append(("failing", "none"))
    window = status.get("window")
    lines.append(("window", _window_text(window)))
    if window is not None and window["retries"]["waiting"]:
        lines.append(("retries", _retries_text(window["retries"], now)))
    if window is not None:
        lines.append(("blocking", window["blocking"]))
    visibility = status.get("visibility")
    if visibility is not None:
        lines.append(("visibility", _visibility_text(visibility)))
    if status.get("subscribers"):
        lines.append(("subscribers", _subscribers_text(status["subscribers"])))
    if status.get("owed"):
        lines.append(("owed", _owed_text(status["owed"], "the trigger")))
    manual = status["last_manual_change"]
    if manual:
        lines.append(
            (
                "last manual",
                f"{manual.get('operation')} by {manual.get('actor')} at {manual.get('at')}: "
                f"{manual.get('reason')}",
            )
        )
    lines.append(("journal", f"{status['journal_entries']} entries (dbtrigger history)"))
    return "\n".join(f"{k:<12} {v}" for k, v in lines)


def render_many(statuses: Sequence[Mapping[str, Any]]) -> str:
    rows = [["POLLER", "CURSOR", "LAST COMMIT", "LEASE", "LAG ROWS", "FAILING", "WINDOW"]]
    for s in statuses:
        if "error" in s:
            rows.append([s["poller"], f"error: {s['error']}", "", "", "", "", ""])
            continue
        window = s.get("window")
        window_text = "-"
        if window is not None:
            window_text = f"{window['events']} ({window['pending']} retrying)"
            if window["pressure"]:
                window_text += " AT PRESSURE"
        cp, lease, failure = s["checkpoint"], s["lease"], s["failure"]
        lease_text = "-"
        if lease:
            gone = lease.get("holder_gone")  # its process is gone from this host: not "live"
            lease_text = f"{'HOLDER GONE' if gone else lease['state']} t{lease['fencing_token']}"
            if lease["state"] == "not_renewed" and not gone:
                lease_text = (
                    f"NOT RENEWED {human_duration(lease['renewed_seconds_ago'])} "
                    f"t{lease['fencing_token']}"
                )
            hung = lease.get("held_without_commit_seconds")  # renewed, no commit past its TTL
            if lease["state"] == "live" and not gone and hung is not None:
                lease_text = f"live, HUNG {human_duration(hung)} t{lease['fencing_token']}"
        rows.append(
            [
                s["poller"],
                cp["display"] if cp else "(beginning)",
                cp["updated_at"] if cp else "-",
                lease_text,
                "?" if s["lag"]["rows"] is None else str(s["lag"]["rows"]),
                f"{failure['attempts']}x {failure['batch_id']}" if failure else "-",
                window_text,
            ]
        )
    return text_table(rows)


__all__ = ["render_many", "render_one"]
