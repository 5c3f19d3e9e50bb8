"""Where a change sits in a database's commit log, and how a checkpoint writes it.

A log-based source delivers changes in commit order. Several changes share one
commit (a multi-row ``INSERT``, a ``COPY``, any transaction), so the commit's
position alone cannot say how far a poller got: a checkpoint written after the
third row of a ten-row ``INSERT`` and read back as "that commit" would skip the
other seven on a restart (the bug Debezium fixed as DBZ-1554). A position is
therefore the pair

    (commit, ordinal)

``commit`` is the transaction's commit position in the log, written as a
*fixed-width token* so that text order is log order within one source
(PostgreSQL: the commit LSN as ``XXXXXXXX/XXXXXXXX``; a binlog source its own
zero-padded form); ``ordinal`` counts the transaction's changes from 1.

The runtime checkpoints ``Position(cursor, pk)`` (:mod:`dbtrigger.cursor`) and
knows nothing of logs: a log source puts the text of its :class:`LogPosition`
in each event's ``cursor`` (kind ``str`` in the state document), and the row's
key in ``pk`` as every source does. The ordinal is zero-padded too, so the
cursor text of every change of one source sorts exactly as the changes were
committed, and a checkpoint in a ``dbtrigger status`` output reads as
"commit X, change n of it".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dbtrigger.cursor import Position
from dbtrigger.errors import CorruptStateError

#: Digits of the ordinal in the cursor text: up to 9,999,999,999 changes in one
#: transaction, far beyond what any server commits at once.
ORDINAL_DIGITS = 10
_SEPARATOR = "#"


@dataclass(frozen=True, order=True)
class LogPosition:
    """Change number ``ordinal`` (from 1) of the transaction committed at ``commit``.

    Ordered as the log is, provided ``commit`` tokens of one source have a
    fixed width (see the module docstring). ``LogPosition(commit, 0)`` sits
    just before the first change of that transaction.
    """

    commit: str
    ordinal: int

    def __post_init__(self) -> None:
        if not self.commit or _SEPARATOR in self.commit:
            raise ValueError(f"a commit token must be non-empty without {_SEPARATOR!r}")
        if not 0 <= self.ordinal < 10**ORDINAL_DIGITS:
            raise ValueError(f"ordinal {self.ordinal} out of range")

    @property
    def text(self) -> str:
        """The cursor text: ``commit#0000000003``."""
        return f"{self.commit}{_SEPARATOR}{self.ordinal:0{ORDINAL_DIGITS}d}"

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: Any) -> LogPosition:
        """The position a cursor text names.

        Raises:
            CorruptStateError: the text is not a log position (a checkpoint
                written by another kind of source, or edited by hand).
        """
        if not isinstance(text, str):
            raise CorruptStateError(
                f"checkpoint cursor {text!r} is not a log position (commit#ordinal text); "
                "was the state written by another kind of source?"
            )
        commit, sep, ordinal = text.rpartition(_SEPARATOR)
        if not sep or not commit or not ordinal.isdigit() or len(ordinal) != ORDINAL_DIGITS:
            raise CorruptStateError(
                f"checkpoint cursor {text!r} is not a log position: expected "
                f"commit{_SEPARATOR}{'0' * ORDINAL_DIGITS}"
            )
        return cls(commit, int(ordinal))

    @classmethod
    def of(cls, position: Position) -> LogPosition | None:
        """The log position of a checkpoint; None at the beginning (nothing delivered)."""
        if position.cursor is None:
            return None
        return cls.parse(position.cursor)


__all__ = ["ORDINAL_DIGITS", "LogPosition"]
