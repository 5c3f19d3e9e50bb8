"""A MariaDB/MySQL reader's commit tokens: where in the binary log a transaction
committed (file index, offset, GTID) and which reader generation wrote it, as text
that sorts like the log. Below the reader, the look-ahead, the snapshots and the
control rows, which all write or read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dbtrigger.errors import CorruptStateError

FILE_DIGITS = 10
OFFSET_DIGITS = 12
#: Digits of a reader's generation (microseconds since 1970, see
#: :func:`~dbtrigger.cdc.binlog_control.next_generation`).
GENERATION_DIGITS = 16
_GENERATION = "."


def commit_token(
    file_index: int, offset: int, gtid: str | None, generation: int | None = None
) -> str:
    token = f"{file_index:0{FILE_DIGITS}d}:{offset:0{OFFSET_DIGITS}d}"
    if generation is not None:
        token = f"{generation:0{GENERATION_DIGITS}d}{_GENERATION}{token}"
    return f"{token}:{gtid}" if gtid else token


@dataclass(frozen=True)
class Where:
    """A commit token read back: file index, offset, GTID (or None), and the generation
    of the reader that wrote it (None: written before readers had one)."""

    file_index: int
    offset: int
    gtid: str | None
    generation: int | None = None

    @classmethod
    def parse(cls, token: str) -> Where:
        generation: int | None = None
        head, dot, rest = token.partition(_GENERATION)
        if dot and ":" not in head:
            if len(head) != GENERATION_DIGITS or not head.isdigit():
                raise CorruptStateError(
                    f"checkpoint commit {token!r} is not a binlog position "
                    "(generation.file:offset[:gtid])"
                )
            generation, token = int(head), rest
        parts = token.split(":", 2)
        if (
            len(parts) < 2
            or len(parts[0]) != FILE_DIGITS
            or len(parts[1]) != OFFSET_DIGITS
            or not (parts[0].isdigit() and parts[1].isdigit())
        ):
            raise CorruptStateError(
                f"checkpoint commit {token!r} is not a binlog position (file:offset[:gtid]); "
                "was the state written by another kind of source?"
            )
        gtid = parts[2] if len(parts) == 3 else None
        return cls(int(parts[0]), int(parts[1]), gtid, generation)


__all__ = ["FILE_DIGITS", "GENERATION_DIGITS", "OFFSET_DIGITS", "Where", "commit_token"]
