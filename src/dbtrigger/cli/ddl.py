"""The DDL commands' engine for ``--url`` (``dbtrigger changelog`` and ``dbtrigger
wake``; their dry run unless ``--yes`` is :func:`~dbtrigger._argparse.print_then_apply`,
which ``dbtrigger queue`` shares)."""

from __future__ import annotations

import argparse

import sqlalchemy as sa

from dbtrigger.errors import ConfigurationError
from dbtrigger.settings import resolve_setting


def url_engine(args: argparse.Namespace) -> sa.Engine:
    """An engine for ``--url`` (a ``%SETTING%`` reference resolved); the caller disposes it."""
    try:
        return sa.create_engine(resolve_setting(args.url))
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
        raise ConfigurationError(f"cannot use --url: {exc}") from None


__all__ = ["url_engine"]
