"""A PgLogicalSource's health: its slot, the server's settings, for check, status and metrics.

What can go wrong with a slot goes wrong slowly and then all at once: a poller
that stops reading makes the server keep WAL (``retained``) until either the
disk fills (``max_slot_wal_keep_size`` unlimited, the default) or the server
invalidates the slot (``wal_status`` becomes ``lost``: the changes are gone).
So the source reports, now and then while it runs (:mod:`dbtrigger.cdc.health`),
the gauges ``cdc_retained_bytes``, ``cdc_safe_wal_bytes`` and ``cdc_slot_lost``,
and :func:`self_check` turns the same facts into ``dbtrigger check`` findings.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dbtrigger.cdc import pg_admin as admin
from dbtrigger.cdc import pg_control as control
from dbtrigger.cdc import pg_setup as setup
from dbtrigger.cdc.health import ERROR, OK, WARNING, HealthReporter
from dbtrigger.cdc.pg_connection import connect
from dbtrigger.cdc.pg_context import PgSourceParts
from dbtrigger.errors import DbTriggerError, OperatorError, SourceDefinitionError
from dbtrigger.sources.base import SourceFinding

if TYPE_CHECKING:
    from dbtrigger.cdc.position import LogPosition
    from dbtrigger.metrics import MetricsCollector

log = logging.getLogger("dbtrigger.cdc")


class SlotReporter(HealthReporter[PgSourceParts]):
    """Sets ``cdc_slot_lost``, ``cdc_retained_bytes`` and ``cdc_safe_wal_bytes``; warns
    once when ``max_slot_wal_keep_size`` is unlimited, and in the worker's log when
    the slot retains more than :data:`~dbtrigger.cdc.pg_admin.RETAINED_WARNING` or
    is ``unreserved`` (about to be invalidated): once each, again after it cleared.
    Those were told by ``dbtrigger check`` and the gauges only, so a worker that
    came back after a long stop, or fell behind, said nothing until the slot was lost."""

    def __init__(self, source: PgSourceParts) -> None:
        super().__init__(source)
        self._warned_unlimited = False
        self._warned: set[str] = set()

    def _warn_slot(self, state: setup.SlotState, facts: setup.ServerFacts) -> None:
        found = {
            "cdc_slot_unreserved": state.wal_status == "unreserved",
            "cdc_wal_retained": (state.retained_bytes or 0) > admin.RETAINED_WARNING,
        }
        self._warned &= {kind for kind, now in found.items() if now}
        for kind in [k for k, now in found.items() if now and k not in self._warned]:
            self._warned.add(kind)
            keep = admin.wal_keep_notes(facts)  # warned about on their own
            notes = [n for n in admin.slot_warnings(state, facts) if n not in keep]
            log.warning(
                "replication slot %s: %s",
                self.source.slot,
                "; ".join(notes),
                extra={"event": kind, "poller": self.source.poller, "slot": self.source.slot},
            )

    def measure(self, metrics: MetricsCollector, after: LogPosition | None) -> None:
        s = self.source
        conn = s.connection()
        state = setup.slot_state(conn, s.slot)
        facts = setup.server_facts(conn)
        metrics.set_gauge("cdc_slot_lost", 1.0 if state is None or state.lost else 0.0)
        if state is not None and state.retained_bytes is not None:
            metrics.set_gauge("cdc_retained_bytes", float(state.retained_bytes))
        if state is not None and state.safe_wal_size is not None:
            metrics.set_gauge("cdc_safe_wal_bytes", float(state.safe_wal_size))
        if state is not None and not state.lost:
            self._warn_slot(state, facts)
        if facts.max_slot_wal_keep_size_mb < 0 and not self._warned_unlimited:
            self._warned_unlimited = True
            log.warning(
                "%s",
                admin.wal_keep_notes(facts)[0],
                extra={"event": "cdc_wal_keep_unlimited", "poller": s.poller, "slot": s.slot},
            )


def self_check(source: PgSourceParts) -> list[SourceFinding]:
    """What ``dbtrigger check`` reports for a PgLogicalSource (never raises for a finding)."""
    findings: list[SourceFinding] = []
    try:
        with connect(source.url) as conn:
            facts = setup.server_facts(conn)
            try:
                setup.check_server(facts, stream=source.mode == "stream")
                findings.append(
                    SourceFinding(
                        "server",
                        OK,
                        f"PostgreSQL {facts.version // 10000}, wal_level=logical, role "
                        f"{facts.user} may use replication slots",
                    )
                )
            except OperatorError as exc:
                return [SourceFinding("server", ERROR, str(exc))]
            try:
                infos = setup.table_infos(conn, source.tables)
            except SourceDefinitionError as exc:  # a watched table that is not there
                return [*findings, SourceFinding("tables", ERROR, str(exc))]
            state = setup.slot_state(conn, source.slot)
            published = setup.publication_tables(conn, source.publication)
            actions = setup.publication_actions(conn, source.publication)
            installed = control.read_installed(conn, source.control_schema, source.slot)
    except OperatorError as exc:
        return [*findings, SourceFinding("source_access", ERROR, str(exc))]
    except DbTriggerError as exc:
        return [*findings, SourceFinding("source_access", ERROR, f"cannot reach the source: {exc}")]
    for info in infos.values():
        note = info.before_image_note()
        if info.replica_identity == "n" or not info.key_columns:
            findings.append(SourceFinding("replica_identity", ERROR, note or ""))
        else:
            findings.append(
                SourceFinding(
                    "replica_identity",
                    OK,
                    f"{info.table.qualified}: REPLICA IDENTITY {info.identity_label}"
                    + (f" ({note})" if note else ""),
                )
            )
    missing = [
        t.qualified for t in source.tables if published is None or t.qualified not in published
    ]
    lacks = [f"lacks {', '.join(missing)}"] if missing else []
    if actions is not None:  # made by hand without truncate: a TRUNCATE would be lost
        lacks.append(
            f"publishes {', '.join(actions) or 'nothing'} but not truncate, so a TRUNCATE "
            "of a watched table would reach no consumer"
        )
    findings.append(
        SourceFinding(
            "publication",
            OK if not lacks else WARNING,
            f"publication {source.publication} lists every table and publishes truncates"
            if not lacks
            else f"publication {source.publication} {'; '.join(lacks)} (created or extended "
            "at the first read if this role owns the tables, or refused with create=False)",
            None if not lacks else "dbtrigger cdc install MODULE:TRIGGER --yes",
        )
    )
    if state is None and installed:  # created for this poller, then dropped
        findings.append(
            SourceFinding(
                "slot",
                ERROR,
                admin.lost_slot_text(source),
                "dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes",
            )
        )
    elif state is None:
        findings.append(
            SourceFinding(
                "slot",
                WARNING,
                f"replication slot {source.slot} does not exist: it is created at the first "
                "read (a poller with a checkpoint refuses: the changes since are gone)",
                "dbtrigger cdc install MODULE:TRIGGER --yes",
            )
        )
    elif state.lost:
        findings.append(
            SourceFinding(
                "slot",
                ERROR,
                f"replication slot {source.slot} is invalidated "
                f"({state.invalidation or state.wal_status}): changes since the checkpoint "
                "are lost",
                "dbtrigger cdc recreate MODULE:TRIGGER --snapshot --yes",
            )
        )
    else:
        retained = (state.retained_bytes or 0) / 2**20
        warnings = [w for w in admin.slot_warnings(state, facts) if "max_slot_wal_keep" not in w]
        findings.append(
            SourceFinding(
                "slot",
                WARNING if warnings else OK,
                "; ".join(warnings)
                or f"replication slot {source.slot}: wal_status {state.wal_status}, retains "
                f"{retained:.1f} MB",
            )
        )
    for note in admin.wal_keep_notes(facts):
        findings.append(
            SourceFinding(
                "max_slot_wal_keep_size",
                WARNING,
                note,
                "ALTER SYSTEM SET max_slot_wal_keep_size = '50GB'; SELECT pg_reload_conf();",
            )
        )
    return findings


__all__ = ["SlotReporter", "self_check"]
