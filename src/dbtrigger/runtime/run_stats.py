"""What ``dbtrigger run`` counted while it ran: the figures of its stop line and
of the totals it prints at exit, in one place so both say them the same way."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunStats:
    ticks: int = 0
    rows: int = 0
    failures: int = 0

    def summary(self) -> str:
        """``7 ticks, 30 rows (0 failed ticks)``: the stop line's words."""
        return (
            f"{_counted(self.ticks, 'tick')}, {_counted(self.rows, 'row')} "
            f"({_counted(self.failures, 'failed tick')})"
        )

    def totals(self) -> str:
        """``30 rows in 7 ticks (0 failed ticks)``: what ``dbtrigger run`` prints at exit."""
        return (
            f"{_counted(self.rows, 'row')} in {_counted(self.ticks, 'tick')} "
            f"({_counted(self.failures, 'failed tick')})"
        )


def _counted(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


__all__ = ["RunStats"]
