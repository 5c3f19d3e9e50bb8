"""Where an object connects: a database URL now, or at its first use (internal).

Sources, the queue's claim source, ``db.output`` and the reader and writer
bindings all take ``url=`` (which may hold ``%SETTING%`` references) or a
shared ``engine=``. One rule holds for each of them: a missing app setting is
reported when the URL is first needed, not when the object is made, because in
a Function App one missing (or malformed) setting must not stop every function
from indexing; a malformed literal URL still fails at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from sqlalchemy.engine import URL, Engine

from dbtrigger._engine import parse_database_url
from dbtrigger.errors import ConfigurationError
from dbtrigger.redaction import remember_url_secrets
from dbtrigger.settings import references_setting


class DatabaseUrl:
    """The URL of ``url=`` (resolved when first possible) or of a shared ``engine=``.

    Args:
        url: a SQLAlchemy URL, ``%SETTING%`` references allowed; None with ``engine``.
        engine: the shared engine whose URL this is when ``url`` is None.
        what: how errors name the URL (``"db.output url"``).
        check: called with the URL once it is known (a dialect the object refuses
            raises there), now or at the first use.
    """

    def __init__(
        self,
        url: str | None,
        engine: Engine | None,
        what: str = "database URL",
        check: Callable[[URL], None] | None = None,
    ) -> None:
        self.spec = url
        self._what = what
        self._check = check
        self._value: URL | None = None
        if not url:
            if engine is not None:
                remember_url_secrets(engine.url)
                self._known(engine.url)
            return
        if not (isinstance(url, str) and references_setting(url)):
            self._known(parse_database_url(url, what))  # a malformed literal fails now
            return
        # A setting missing, malformed or of a dialect refused here fails the
        # functions using it, at each use, until it is fixed; not the import.
        with contextlib.suppress(ConfigurationError):
            self._known(parse_database_url(url, what))

    def _known(self, url: URL) -> URL:
        if self._check is not None:
            self._check(url)
        self._value = url
        return url

    @property
    def value(self) -> URL:
        """The URL, its app settings read now if they could not be before.

        Raises:
            ConfigurationError: a setting is missing or the URL is malformed.
        """
        if self._value is not None:
            return self._value
        return self._known(parse_database_url(self.spec or "", self._what))


__all__ = ["DatabaseUrl"]
