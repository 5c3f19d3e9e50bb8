"""What ``dbtrigger cdc`` asks of a log-based source, whatever its database.

A log source's server objects (PostgreSQL: publication, replication slot,
control table; a binlog source: its checks and position bookkeeping) are
installed, inspected and repaired through one small protocol, so the CLI
(:mod:`dbtrigger.cli.cdc`) has one code path for every database:

* ``plan`` / ``install``: what would be created (SQL, in order), findings to
  read first, and statements offered but not run by default (``full_images``:
  whole before images, PostgreSQL's ``REPLICA IDENTITY FULL``);
* ``status``: JSON-able health (``healthy``, ``warnings``, snapshot progress);
* ``drop``, ``recreate(snapshot=...)`` (after a lost position, never implicit);
* ``request_snapshot(table, where)``: re-read a table or key range while
  streaming; ``schema_changes`` / ``accept_schema``: a column type change the
  source holds delivery back for.

A source offers it through :class:`AdministeredLogSource` (``source.admin()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable


@dataclass
class Plan:
    """SQL ``install`` runs (in order), findings to read first, and statements
    offered but only run when asked (``optional``)."""

    statements: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    optional: list[str] = field(default_factory=list)


class LogSourceAdmin(Protocol):
    def plan(self, *, full_images: bool = False) -> Plan: ...

    def install(self, *, full_images: bool = False) -> list[str]: ...

    def status(self) -> dict[str, Any]: ...

    def drop(self, *, keep_publication: bool = False) -> list[str]: ...

    def recreate(self, *, snapshot: bool) -> list[str]: ...

    def request_snapshot(self, table: str, where: str | None = None) -> dict[str, Any]: ...

    def schema_changes(self) -> list[str]: ...

    def accept_schema(self) -> list[str]: ...


S = TypeVar("S")


class SourceAdmin(Generic[S]):
    """A :class:`LogSourceAdmin` of one source; each call opens a short-lived connection."""

    def __init__(self, source: S) -> None:
        self.source = source


@runtime_checkable
class AdministeredLogSource(Protocol):
    """A log source ``dbtrigger cdc`` can install, inspect and repair."""

    def admin(self) -> LogSourceAdmin: ...


__all__ = ["AdministeredLogSource", "LogSourceAdmin", "Plan", "SourceAdmin"]
