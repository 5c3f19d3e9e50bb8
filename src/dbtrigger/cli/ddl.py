"""The DDL commands' common steps (``dbtrigger changelog`` and ``dbtrigger wake``).

Anything that changes the database is a dry run unless ``--yes`` is given:
the DDL is printed first, so it can be reviewed, or copied into a migration
instead, and applied only when asked.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import sqlalchemy as sa

from dbtrigger.errors import ConfigurationError
from dbtrigger.settings import resolve_setting


def url_engine(args: argparse.Namespace) -> sa.Engine:
    """An engine for ``--url`` (a ``%SETTING%`` reference resolved); the caller disposes it."""
    try:
        return sa.create_engine(resolve_setting(args.url))
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
        raise ConfigurationError(f"cannot use --url: {exc}") from None


def print_then_apply(
    args: argparse.Namespace,
    statements: Sequence[str],
    apply: Callable[[], None],
    *,
    end: str = ";",
) -> bool:
    """Print ``statements`` (each followed by ``end``); with ``--yes`` run ``apply``
    and return True, otherwise say that this was a dry run and return False."""
    for statement in statements:
        print(statement + end)
    if not args.yes:
        print("-- dry run: nothing was changed; add --yes to apply")
        return False
    apply()
    return True


__all__ = ["print_then_apply", "url_engine"]
