"""Source adapters: where rows come from.

Public here: :class:`SourceAdapter`, the port a source implements (checked by
:class:`dbtrigger.testing.SourceContract`), and :class:`SqlAlchemySource`;
:mod:`dbtrigger.sources.visibility` is the public module of the late-commit
guards. The other modules of this package are internal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dbtrigger import _lazy

if TYPE_CHECKING:
    from dbtrigger.sources.base import SourceAdapter
    from dbtrigger.sources.sqlalchemy import SqlAlchemySource

__getattr__, __dir__ = _lazy.exports(
    __name__,
    {"SourceAdapter": "dbtrigger.sources.base", "SqlAlchemySource": "dbtrigger.sources.sqlalchemy"},
)

__all__ = ["SourceAdapter", "SqlAlchemySource"]
