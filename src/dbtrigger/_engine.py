"""One SQLAlchemy engine per adapter: created once on first use, or shared by the caller.

The source, the output binding and the SQL-backed stores all take either a URL
(they then own a connection pool) or an existing engine (the caller's pool,
e.g. so state and data share one). :class:`LazyEngine` holds that choice in one
place, with two invariants:

* an engine made from the URL is created at most once, even when several
  threads ask for it at the same time, and with ``pool_pre_ping`` so a
  connection the database dropped while idle is replaced instead of failing a
  tick;
* :meth:`LazyEngine.dispose` closes only a pool this object created. A shared
  engine belongs to whoever passed it in and may still be serving others.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine


class LazyEngine:
    """An engine created from ``url`` when first asked for, unless ``engine`` is shared.

    Args:
        url: where to connect when no engine is shared (ignored otherwise).
        engine_kwargs: passed to :func:`sqlalchemy.create_engine` after the
            default ``pool_pre_ping=True``, so they may override it.
        engine: an existing engine to use as it is; never disposed here.
    """

    def __init__(
        self,
        url: URL | str,
        engine_kwargs: Mapping[str, Any] | None = None,
        engine: Engine | None = None,
    ) -> None:
        self._url = url
        self._kwargs: dict[str, Any] = {"pool_pre_ping": True, **(engine_kwargs or {})}
        self._engine = engine
        self._owned = False
        self._lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        """The engine, creating it on the first call if none was shared."""
        engine = self._engine
        if engine is None:
            with self._lock:
                if self._engine is None:
                    self._engine = sa.create_engine(self._url, **self._kwargs)
                    self._owned = True
                engine = self._engine
        return engine

    def dispose(self) -> None:
        """Close the pooled connections of an engine created here (it stays usable).

        Does nothing for a shared engine, or when no engine was created yet.
        """
        with self._lock:
            engine = self._engine if self._owned else None
        if engine is not None:
            engine.dispose()


__all__ = ["LazyEngine"]
