"""The scale signal: how far behind a partitioned poller is, for autoscalers you already run.

dbtrigger does not scale anything itself. It says how much work is waiting, in
the shapes existing engines read:

* :func:`measure_backlog` counts, per partition, the rows after its checkpoint
  and the age of the oldest (when the source can tell: a timestamp cursor or a
  ``lag_column``), and totals them for the poller;
* :meth:`Backlog.desired_replicas` turns that into a worker count for a target
  backlog per worker: ``min(partitions, ceil(rows / target))`` - never more
  workers than partitions, since a member without a partition has no work;
* :meth:`Backlog.to_json` is what ``dbtrigger partitions backlog --json``
  prints and the HTTP endpoint (:mod:`dbtrigger.partitions.endpoint`) serves,
  the JSON KEDA's ``metrics-api`` scaler reads (``valueLocation:
  desired_replicas``, ``targetValue: "1"``);
* :meth:`Backlog.report` sets gauges on a
  :class:`~dbtrigger.metrics.MetricsCollector`, and :meth:`Backlog.prometheus`
  renders them in the Prometheus text format (the endpoint's ``/metrics``).

A measurement reads the membership document and each partition's state
document, and runs one count and one single-row fetch per partition on the
source; the endpoint caches it for a few seconds, so a scaler polling often
costs the database no more than that.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

from dbtrigger.errors import ConfigurationError
from dbtrigger.metrics import MetricsCollector, SafeMetrics
from dbtrigger.partitions.inspect import GroupState
from dbtrigger.partitions.member import PartitionedPoller
from dbtrigger.state import document as docmod

#: Rows behind per worker a scaler aims at when no target is given.
DEFAULT_TARGET_ROWS = 1000


@dataclass(frozen=True)
class PartitionBacklog:
    """One partition's share: rows after its checkpoint, age of the oldest, owner."""

    id: str
    rows: int | None
    oldest_seconds: float | None
    owner: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "rows": self.rows,
            "oldest_seconds": _rounded(self.oldest_seconds),
            "owner": self.owner,
        }


@dataclass(frozen=True)
class Backlog:
    """A partitioned poller's backlog at ``measured_at``.

    ``rows`` totals the partitions that could be counted; ``unknown`` names
    those that could not (their source failed), so a scaler is never told
    "nothing to do" because a count failed.
    """

    poller: str
    measured_at: dt.datetime
    members: int
    partitions: tuple[PartitionBacklog, ...]

    @classmethod
    def of(cls, group: GroupState) -> Backlog:
        return cls(
            poller=group.poller,
            measured_at=group.checked_at,
            members=len(group.members),
            partitions=tuple(
                PartitionBacklog(p.id, p.lag_rows, p.lag_seconds, p.owner) for p in group.partitions
            ),
        )

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.partitions if p.rows is not None)

    @property
    def unknown(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.partitions if p.rows is None)

    @property
    def oldest_seconds(self) -> float | None:
        ages = [p.oldest_seconds for p in self.partitions if p.oldest_seconds is not None]
        return max(ages) if ages else None

    def desired_replicas(self, target_rows: int = DEFAULT_TARGET_ROWS) -> int:
        """Workers for ``target_rows`` rows behind each: ``min(partitions, ceil(rows /
        target))``; 0 when nothing is behind. A partition that could not be
        counted counts as one worker's worth, so a failing count never scales to 0."""
        if target_rows < 1:
            raise ConfigurationError(
                f"the target backlog per replica must be at least 1 row, got {target_rows}"
            )
        rows = self.rows + target_rows * len(self.unknown)
        return min(len(self.partitions), math.ceil(rows / target_rows))

    def to_json(self, target_rows: int = DEFAULT_TARGET_ROWS) -> dict[str, Any]:
        """The endpoint's and ``partitions backlog --json``'s document."""
        return {
            "poller": self.poller,
            "measured_at": docmod.format_time(self.measured_at),
            "partition_count": len(self.partitions),
            "members": self.members,
            "backlog_rows": self.rows,
            "oldest_seconds": _rounded(self.oldest_seconds),
            "unknown_partitions": list(self.unknown),
            "target_rows_per_replica": target_rows,
            "desired_replicas": self.desired_replicas(target_rows),
            "partitions": [p.to_json() for p in self.partitions],
        }

    def report(self, metrics: MetricsCollector | None, target_rows: int) -> None:
        """Set the backlog gauges (``backlog_rows``, ``backlog_oldest_seconds``,
        ``backlog_desired_replicas``, and per partition ``partition_backlog_rows``
        and ``partition_backlog_oldest_seconds``)."""
        safe = SafeMetrics(metrics, self.poller)
        safe.set_gauge("backlog_rows", self.rows)
        safe.set_gauge("backlog_desired_replicas", self.desired_replicas(target_rows))
        if self.oldest_seconds is not None:
            safe.set_gauge("backlog_oldest_seconds", self.oldest_seconds)
        for p in self.partitions:
            labels = {"partition": p.id}
            if p.rows is not None:
                safe.set_gauge("partition_backlog_rows", p.rows, labels=labels)
            if p.oldest_seconds is not None:
                safe.set_gauge("partition_backlog_oldest_seconds", p.oldest_seconds, labels=labels)

    def prometheus(self, target_rows: int, namespace: str = "dbtrigger") -> str:
        """The same gauges in the Prometheus text exposition format."""
        poller = _label(self.poller)
        lines: list[str] = []

        def gauge(name: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            full = f"{namespace}_{name}"
            lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} gauge"])
            lines.extend(f"{full}{{{labels}}} {value:g}" for labels, value in samples)

        base = f'poller="{poller}"'
        gauge("backlog_rows", "Rows after the checkpoints of all partitions", [(base, self.rows)])
        gauge(
            "backlog_desired_replicas",
            f"min(partitions, ceil(backlog_rows / {target_rows}))",
            [(base, self.desired_replicas(target_rows))],
        )
        if self.oldest_seconds is not None:
            gauge(
                "backlog_oldest_seconds",
                "Age of the oldest row behind any checkpoint",
                [(base, self.oldest_seconds)],
            )
        gauge(
            "partition_backlog_rows",
            "Rows after one partition's checkpoint",
            [(f'{base},partition="{p.id}"', p.rows) for p in self.partitions if p.rows is not None],
        )
        aged = [p for p in self.partitions if p.oldest_seconds is not None]
        if aged:
            gauge(
                "partition_backlog_oldest_seconds",
                "Age of the oldest row behind one partition's checkpoint",
                [(f'{base},partition="{p.id}"', p.oldest_seconds or 0.0) for p in aged],
            )
        return "\n".join(lines) + "\n"


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def measure_backlog(poller: PartitionedPoller) -> Backlog:
    """Count every partition's rows behind its checkpoint, and age the oldest."""
    return Backlog.of(poller.group_state(lag=True))
