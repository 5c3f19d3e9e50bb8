"""``dbtrigger check`` for a claim queue: the table, its claim columns and index, the backlog.

A queue has no checkpoint or store to probe; what can go wrong is the table:
missing or mistyped claim columns, a key no unique index covers, a server
without ``SKIP LOCKED`` (each an error: the queue cannot start), no claim
index (a warning: every claim scans the table). The checks are the ones a
``ClaimSource`` makes at its first use, so ``check`` says exactly what a
worker would stop on, plus the backlog as ``queue status`` counts it.
"""

from __future__ import annotations

from typing import Any

from dbtrigger.checks import ERROR, OK, WARNING, CheckReport, Finding
from dbtrigger.errors import DbTriggerError, FetchError, OperatorError
from dbtrigger.queue.schema import PRIORITY, VISIBLE_AT


def check_queue(source: Any, name: str | None = None) -> CheckReport:
    """Every check for the queue table of ``source`` (a ``ClaimSource``)."""
    findings: list[Finding] = []
    label = name or source.queue_name
    try:
        target = source.target
    except OperatorError as exc:
        findings.append(Finding("queue_table", ERROR, str(exc), cause=exc))
        return CheckReport(label, source.name, tuple(findings))
    except (FetchError, DbTriggerError) as exc:
        findings.append(Finding("source_access", ERROR, f"cannot reach the queue: {exc}"))
        return CheckReport(label, source.name, tuple(findings))
    findings.append(
        Finding(
            "queue_table",
            OK,
            "claim columns present with usable types; the key is unique"
            + ("; claims take higher dbt_priority first" if target.priority else ""),
        )
    )
    if source.layout.claims_table is None:
        user = source.queue_table.user
        lead = [PRIORITY, VISIBLE_AT] if target.priority else [VISIBLE_AT]
        if any([c.name for c in i.columns][: len(lead)] == lead for i in user.indexes):
            findings.append(Finding("claim_index", OK, f"index on ({', '.join(lead)})"))
        else:
            findings.append(
                Finding(
                    "claim_index",
                    WARNING,
                    f"no index starts with ({', '.join(lead)}): every claim scans the table",
                    f"{source.install_hint()}{' --priority' if target.priority else ''} --yes",
                )
            )
    try:
        counts = source.counts()
    except DbTriggerError as exc:
        findings.append(Finding("backlog", WARNING, f"could not be counted: {exc}"))
    else:
        by = counts.by_status
        findings.append(
            Finding(
                "backlog",
                WARNING if counts.expired_claims or by.get("dead") else OK,
                f"{counts.claimable_now} claimable now, {counts.delayed} waiting for a retry, "
                f"{counts.scheduled} scheduled, {counts.expired_claims} expired claim(s), "
                f"{by.get('dead', 0)} dead",
                "dbtrigger queue status shows the detail; queue retry --dead re-drives dead rows"
                if by.get("dead")
                else None,
            )
        )
    return CheckReport(label, source.name, tuple(findings))


__all__ = ["check_queue"]
