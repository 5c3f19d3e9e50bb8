"""Resolution of ``%APP_SETTING%`` references, the Azure Functions convention.

This module and the CLI are the only places dbtrigger reads the environment:
library objects take plain values in their constructors, and a value written as
``%NAME%`` is looked up here so configuration can be shared with
``local.settings.json`` and App Settings without code changes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from dbtrigger.errors import ConfigurationError

_REFERENCE = re.compile(r"%([A-Za-z_][A-Za-z0-9_:.-]*)%")


def resolve_setting(value: str, environ: Mapping[str, str] | None = None) -> str:
    """Replace each ``%NAME%`` in ``value`` with that environment variable.

    Raises:
        ConfigurationError: naming the missing setting (never its value).
    """
    env = os.environ if environ is None else environ

    def lookup(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise ConfigurationError(f"app setting {name!r} is referenced but not set")
        return env[name]

    return _REFERENCE.sub(lookup, value)
