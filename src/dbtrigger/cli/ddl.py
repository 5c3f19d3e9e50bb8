"""The DDL commands' engine for ``--url`` (``dbtrigger changelog`` and ``dbtrigger
wake``: :func:`open_url_engine` for the length of a command; their dry run unless
``--yes`` is :func:`~dbtrigger._argparse.print_then_apply`, which ``dbtrigger queue``
shares)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

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


@contextlib.contextmanager
def open_url_engine(args: argparse.Namespace) -> Iterator[sa.Engine]:
    """:func:`url_engine` for the block, disposed when it ends (however it ends)."""
    engine = url_engine(args)
    try:
        yield engine
    finally:
        engine.dispose()


__all__ = ["open_url_engine", "url_engine"]
