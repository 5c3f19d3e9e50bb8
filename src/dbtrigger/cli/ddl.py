"""The DDL commands' engine for ``--url`` (``dbtrigger changelog`` and ``dbtrigger
wake``; their dry run unless ``--yes`` is :func:`~dbtrigger._argparse.print_then_apply`,
which ``dbtrigger queue`` shares)."""

from __future__ import annotations

import argparse

import sqlalchemy as sa

from dbtrigger._engine import create_engine, parse_database_url


def url_engine(args: argparse.Namespace) -> sa.Engine:
    """An engine for ``--url``; the caller disposes it.

    The URL is read as every adapter reads one (:func:`~dbtrigger._engine.parse_database_url`:
    a ``%SETTING%`` resolved, its password masked wherever it is echoed, a malformed one
    a ``ConfigurationError`` that does not repeat it), and a missing dialect or driver
    is a ``ConfigurationError`` naming what to install.
    """
    return create_engine(parse_database_url(args.url, "--url"))


__all__ = ["url_engine"]
